"""``python -m sparsecore.demo --frontend jax``: the demo through `sparsecore.jax`.

The same scan (synthetic 64-beam, or ``--points FILE.npz``), the same
voxelization (0.1 m, at most 5 points per voxel, features the mean point), and
a small sparse U-Net of the same shape as the torch demo's (submanifold convs,
strided convs down, inverse convs up, skip concatenation, `sparsecore.jax.batch_norm`
in training mode, ReLU), run forward and backward under ``jax.jit`` /
``jax.value_and_grad``. Then the first submanifold layer and the first strided
layer are checked in float64 against dense ``jax.lax.conv_general_dilated`` on
a 32-voxel crop of the scan, as in the torch demo.

The table has the torch demo's rows; what the times measure in JAX:

* ``rulebooks (new cloud: recipe.apply)``: the geometry of a scan once the
  network is known: the core's rulebook builds (the torch demo's rulebook row
  times the same builds), their padding to the plan's capacities and the
  transfer to the device; what every cloud of a stream pays;
* ``plan (first cloud: sj.plan)``: `sparsecore.jax.plan` of the network: an
  abstract trace of the network (no feature arithmetic) plus the same builds;
  paid once per network (later clouds use the recipe);
* ``forward (with rulebooks)``: the recipe's rulebooks plus one jitted forward
  (compiled beforehand);
* ``backward``: one jitted ``value_and_grad`` minus one jitted forward.

Initialisation (`sparsecore.jax.init_conv`, NumPy from the key: nothing
compiles per weight shape), the plan and the jit compilation of the forward
and the gradient are timed separately, each in its own row.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparsecore.demo import (CROP, TOLERANCE, COORDINATE_RANGE, VOXEL_SIZE, CropCheck, DemoResult, _load,
                             _pick_crop, format_table)

from .functional import inverse_conv, sparse_conv, subm_conv
from .norm import batch_norm, init_batch_norm
from .ops import IMPLS
from .params import _generator, init_conv, uniform_from_key
from .planner import plan
from .voxelize import voxelize

__all__ = ["build_params", "unet", "check_against_dense", "run_demo", "main"]


def build_params(key: Any, in_channels: int, num_classes: int = 3) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(params, state)`` of `unet`: conv weights ``[out, 3, 3, 3, in]``, batch norms, a linear head."""
    layers = {"stem": (in_channels, 16), "enc1": (16, 16), "down1": (16, 32), "enc2": (32, 32),
              "down2": (32, 64), "bottom": (64, 64), "up2": (64, 32), "dec2": (64, 32),
              "up1": (32, 16), "dec1": (32, 16)}
    # child keys and values drawn with NumPy from the key (sj.init_conv): nothing compiles per weight shape
    keys = _generator(key).integers(0, 2**32, size=(len(layers) + 1, 2), dtype=np.uint32)
    params: dict[str, Any] = {}
    state: dict[str, Any] = {}
    for k, (name, (cin, cout)) in zip(keys, layers.items()):
        norm, state[name] = init_batch_norm(cout)
        params[name] = {"weight": init_conv(k, cin, cout, 3)["weight"], "norm": norm}
    bound = 1.0 / np.sqrt(16)
    params["head"] = {"weight": uniform_from_key(keys[-1], (16, num_classes), bound),
                      "bias": jax.device_put(np.zeros((num_classes,), np.float32))}
    return params, state


def unet(params: dict[str, Any], state: dict[str, Any], x: Any) -> tuple[Any, dict[str, Any]]:
    """The two-level U-Net in training mode: ``([capacity, num_classes] logits on the input sites, new state)``."""
    new_state: dict[str, Any] = {}

    def norm_relu(y: Any, name: str) -> Any:
        y, new_state[name] = batch_norm(params[name]["norm"], state[name], y, train=True)
        return y.replace(jax.nn.relu(y.features))

    def subm(x: Any, name: str) -> Any:
        return norm_relu(subm_conv(x, params[name]["weight"]), name)

    def down(x: Any, name: str) -> Any:
        return norm_relu(sparse_conv(x, params[name]["weight"], stride=2, padding=1), name)

    def up(x: Any, name: str) -> Any:
        return norm_relu(inverse_conv(x, params[name]["weight"]), name)

    def cat(y: Any, skip: Any) -> Any:  # inverse convs restore the paired layer's input sites in order
        return y.replace(jnp.concatenate([y.features, skip.features], axis=1))

    skip1 = subm(subm(x, "stem"), "enc1")
    skip2 = subm(down(skip1, "down1"), "enc2")
    y = up(subm(down(skip2, "down2"), "bottom"), "up2")
    y = up(subm(cat(y, skip2), "dec2"), "up1")
    y = subm(cat(y, skip1), "dec1")
    return y.features @ params["head"]["weight"] + params["head"]["bias"], new_state


def _densify(features: np.ndarray, indices: np.ndarray, origin: np.ndarray,
             size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Scatters the sites inside ``[origin, origin + size)^3`` into float64 ``[1, C, size, size, size]``."""
    local = indices[:, 1:] - origin
    inside = np.all((local >= 0) & (local < size), axis=1)
    dense = np.zeros((1, features.shape[1], size, size, size), np.float64)
    z, y, x = (local[inside, axis] for axis in range(3))
    dense[0][:, z, y, x] = features[inside].astype(np.float64).T  # dense[0][:, ...]: channels first
    return dense, inside, local


def _dense_conv(dense: np.ndarray, weight: Any, stride: int) -> np.ndarray:
    """Dense float64 3-D cross-correlation, padding 1; weight ``[out, kz, ky, kx, in]``."""
    w = jnp.transpose(jnp.asarray(weight, jnp.float64), (0, 4, 1, 2, 3))  # -> OIDHW
    out = jax.lax.conv_general_dilated(jnp.asarray(dense), w, (stride,) * 3, [(1, 1)] * 3,
                                       dimension_numbers=("NCDHW", "OIDHW", "NCDHW"),
                                       precision=jax.lax.Precision.HIGHEST)
    return np.asarray(out)


def check_against_dense(params: dict[str, Any], x: Any, seed: int = 0) -> CropCheck:
    """Compares the first submanifold and first strided layers with dense ``conv_general_dilated``.

    Both sparse layers run on the whole input in float64 (the weights cast); the
    dense reference convolves the densified crop. The submanifold layer is compared
    at active sites one cell or more inside the crop; the strided layer at every
    output cell of the crop's interior (zero where the sparse output has no site).
    """
    indices = x.valid_indices()
    origin = _pick_crop(indices, CROP, np.random.default_rng(seed))
    w_subm = jnp.asarray(params["stem"]["weight"], jnp.float64)
    w_down = jnp.asarray(params["down1"]["weight"], jnp.float64)
    x64 = x.replace(x.features.astype(jnp.float64))
    subm_out = subm_conv(x64, w_subm)
    h = subm_out.replace(jax.nn.relu(subm_out.features))  # any tensor on the same sites
    out = sparse_conv(h, w_down, stride=2, padding=1)

    dense_x, _, _ = _densify(x64.valid_features(), indices, origin, CROP)
    dense_subm = _dense_conv(dense_x, w_subm, 1)
    sub_features, sub_indices = subm_out.valid_features(), subm_out.valid_indices()
    _, inside, local = _densify(sub_features, sub_indices, origin, CROP)
    interior = inside & np.all((local >= 1) & (local < CROP - 1), axis=1)
    l_int = local[interior]
    expected = dense_subm[0][:, l_int[:, 0], l_int[:, 1], l_int[:, 2]].T
    got = sub_features[interior]
    errors = [float(np.abs(got - expected).max()) if len(l_int) else 0.0]
    scales = [float(np.abs(expected).max()) if len(l_int) else 0.0]
    compared = int(interior.sum())

    dense_h, _, _ = _densify(h.valid_features(), h.valid_indices(), origin, CROP)
    dense_strided = _dense_conv(dense_h, w_down, 2)
    sparse_strided, _, _ = _densify(out.valid_features(), out.valid_indices(), origin // 2, CROP // 2)
    keep = slice(1, CROP // 2 - 1)
    a = dense_strided[..., keep, keep, keep]
    b = sparse_strided[..., keep, keep, keep]
    errors.append(float(np.abs(a - b).max()))
    scales.append(float(np.abs(a).max()))
    compared += int((np.abs(b).sum(axis=1) > 0).sum())
    max_error, scale = max(errors), max(scales)
    passed = compared > 0 and max_error <= TOLERANCE * max(1.0, scale)
    return CropCheck(tuple(int(v) for v in origin), compared, max_error, scale, passed)  # type: ignore[arg-type]


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = jax.block_until_ready(fn(*args))
    return result, time.perf_counter() - start


def run_demo(points_file: str | None = None, seed: int = 0, impl: str | None = None) -> tuple[DemoResult, float]:
    """Voxelizes a scan, plans and runs the U-Net forward and backward under jit, and checks it.

    ``impl`` is the plan's feature-pass implementation (`Plan.with_impl`; None: the default).

    Returns:
        ``(result, compile_s)``: the measurements (as the torch demo's `DemoResult`) and the
        seconds spent compiling the forward and the gradient.
    """
    points, source = _load(points_file, seed)
    x, _ = voxelize(points, VOXEL_SIZE, COORDINATE_RANGE, max_num_points_per_voxel=5, max_num_voxels=500_000)
    x = x.replace(x.features.astype(jnp.float32))
    start = time.perf_counter()
    params, state = build_params(jax.random.PRNGKey(seed), x.num_channels)
    init_s = time.perf_counter() - start

    start = time.perf_counter()
    planned = plan(unet, params, state, x).with_impl(impl)  # first cloud: trace the network, build its rulebooks
    plan_s = time.perf_counter() - start
    recipe = planned.recipe
    x = x.with_plan(planned)
    fresh = voxelize(points, VOXEL_SIZE, COORDINATE_RANGE, max_num_points_per_voxel=5, max_num_voxels=500_000)[0]
    fresh = fresh.replace(fresh.features.astype(jnp.float32))
    start = time.perf_counter()
    recipe.apply(fresh)  # a new cloud of a stream: the same builds, no trace
    rulebook_s = time.perf_counter() - start

    def loss(p: Any, x: Any) -> Any:
        logits, _ = unet(p, state, x)
        mask = x.mask[:, None].astype(logits.dtype)
        return jnp.sum(jnp.square(logits) * mask) / (x.num_active * logits.shape[1])

    forward = jax.jit(unet)
    gradient = jax.jit(jax.value_and_grad(loss))
    start = time.perf_counter()
    forward.lower(params, state, x).compile()
    gradient.lower(params, x).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(forward(params, state, x))  # one untimed call of each warms up
    jax.block_until_ready(gradient(params, x))
    _, forward_s = _timed(forward, params, state, x)
    (_, grads), both_s = _timed(gradient, params, x)
    finite = all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(grads))
    check = check_against_dense(params, x, seed)
    if not finite:
        check = CropCheck(check.origin, check.sites_compared, check.max_error, check.scale, False)
    result = DemoResult(source, int(points.shape[0]), int(x.num_active), rulebook_s, rulebook_s + forward_s,
                        max(both_s - forward_s, 0.0), check,
                        rulebook_label="rulebooks (new cloud: recipe.apply)",
                        extra_rows=(("initialise parameters (NumPy, once)", f"{init_s * 1e3:.1f} ms"),
                                    ("plan (first cloud: sj.plan)", f"{plan_s * 1e3:.1f} ms"),
                                    ("jit compile (forward + gradient, once)", f"{compile_s:.1f} s")))
    return result, compile_s


def main(argv: Sequence[str] | None = None) -> int:
    """The ``--frontend jax`` path of ``python -m sparsecore.demo``; 0 when the check passed."""
    parser = argparse.ArgumentParser(prog="python -m sparsecore.demo --frontend jax",
                                     description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--points", metavar="FILE.npz",
                        help="a real scan: .npz with points [P, 3+] (x y z first, metres); None: a synthetic "
                        "64-beam scan, no download")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda / gpu (JAX's GPU backend)")
    parser.add_argument("--frontend", default="jax", choices=("jax",), help="this demo's frontend (jax)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic scan and the parameters")
    parser.add_argument("--threads", type=int, default=None, help="ignored here (the torch demo's option)")
    parser.add_argument("--impl", choices=IMPLS, default=None,
                        help="sparsecore.jax feature passes (Plan.with_impl); None: the plan's default")
    args = parser.parse_args(argv)
    jax.config.update("jax_enable_x64", True)  # for the float64 check; the network itself runs in float32
    platform = "gpu" if args.device.startswith(("cuda", "gpu")) else "cpu"
    try:
        device = jax.devices(platform)[0]
    except RuntimeError:
        print(f"--device {args.device}: JAX sees no {platform} device here.", file=sys.stderr)
        return 2
    with jax.default_device(device):
        result, compile_s = run_demo(args.points, args.seed, args.impl)
    print(format_table(result, f"{args.device} (jax {jax.__version__}, {device.platform})"))
    print("(initialisation, plan and jit compile are paid once, before the first step; forward and backward "
          "are the times of one step after them)")
    return 0 if result.check.passed else 1


if __name__ == "__main__":
    sys.exit(main())
