"""CPU benchmark of the two feature-pass implementations: ``python -m sparsecore.jax.benchmark``.

Times a jitted submanifold 3x3x3 conv (forward, and forward + backward for the
features and the weight) through the public API with ``impl="jnp"`` and
``impl="callback"``, on crops of the real LiDAR scan (``lidar_voxels_125k.npz``,
the ``n`` voxels nearest the sensor) or, without it, a synthetic scene.
Repetitions of the two implementations are interleaved and the minimum and the
median are reported; the plan is built once, outside the timing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import sparsecore as sc

from . import functional as F
from .planner import plan as make_plan
from .tensor import SparseTensor


def _scene(num_voxels: int) -> tuple[np.ndarray, tuple[int, ...]]:
    from sparsecore.benchmark import scenes

    scene = scenes.load_voxel_scene(scenes.require_data_file(None, scenes.VOXELS_FILE_NAME))
    indices = scene.indices
    centre = np.asarray(scene.spatial_shape) // 2
    distance = np.abs(indices[:, 2] - centre[1]) + np.abs(indices[:, 3] - centre[2])
    order = np.argsort(distance, kind="stable")[:num_voxels]
    return np.ascontiguousarray(indices[order]), tuple(scene.spatial_shape)


def _time(fn: Any, args: tuple, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append((time.perf_counter() - start) * 1e3)
    return out


def run_case(num_voxels: int, channels: int, reps: int, seed: int = 0) -> dict[str, Any]:
    """Times one (voxels, channels) case; returns min / median milliseconds per impl and pass."""
    indices, shape = _scene(num_voxels)
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((indices.shape[0], channels)).astype(np.float32)
    weight = jnp.asarray(rng.uniform(-0.1, 0.1, (channels, 3, 3, 3, channels)).astype(np.float32))
    x = SparseTensor.from_arrays(features, indices, shape, 1)
    x = x.with_plan(make_plan(lambda w, t: F.subm_conv(t, w), weight, x))
    cotangent = jnp.asarray(rng.standard_normal((x.capacity, channels)).astype(np.float32))
    functions = {}
    for impl in ("jnp", "callback"):
        def forward(w, t, impl=impl):
            return F.subm_conv(t, w, impl=impl).features

        def loss(w, t, impl=impl):
            return jnp.vdot(F.subm_conv(t, w, impl=impl).features, cotangent)

        functions[impl, "forward"] = jax.jit(forward)
        functions[impl, "forward+backward"] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), allow_int=True))

    samples: dict[tuple[str, str], list[float]] = {key: [] for key in functions}
    compile_s = {}
    for key, fn in functions.items():  # compile and warm up
        start = time.perf_counter()
        jax.block_until_ready(fn(weight, x))
        compile_s[key] = time.perf_counter() - start
    for _ in range(reps):
        for key, fn in functions.items():
            samples[key] += _time(fn, (weight, x), 1)
    rulebook = sc.build_rulebook(indices, shape, 1, sc.ConvGeometry.create(3, 3, kind="subm"))
    result: dict[str, Any] = {"voxels": int(indices.shape[0]), "channels": channels, "pairs": rulebook.num_pairs,
                              "capacity": x.capacity}
    for (impl, which), values in samples.items():
        result[f"{impl} {which} min"] = min(values)
        result[f"{impl} {which} median"] = statistics.median(values)
        result[f"{impl} {which} compile"] = compile_s[impl, which]
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--voxels", type=int, nargs="+", default=[20_000, 50_000, 100_000])
    parser.add_argument("--channels", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"# sparsecore.jax CPU benchmark, {datetime.date.today().isoformat()}")
    print(f"# jax {jax.__version__}, numpy {np.__version__}, python {platform.python_version()}, "
          f"{platform.machine()}, {os.cpu_count()} CPUs (affinity {len(os.sched_getaffinity(0))}), "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}")
    print("| voxels | C | pairs | pass | jnp ms (min / median) | callback ms (min / median) | jnp / callback "
          "(min) | first call s (jnp / callback) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    ratios: dict[str, list[tuple[float, float]]] = {"forward": [], "forward+backward": []}
    for voxels in args.voxels:
        for channels in args.channels:
            r = run_case(voxels, channels, args.reps)
            for which in ("forward", "forward+backward"):
                a, b = r[f"jnp {which} min"], r[f"callback {which} min"]
                ratios[which].append((a / b, r[f"jnp {which} median"] / r[f"callback {which} median"]))
                print(f"| {r['voxels']} | {channels} | {r['pairs']} | {which} | {a:.1f} / "
                      f"{r[f'jnp {which} median']:.1f} | {b:.1f} / {r[f'callback {which} median']:.1f} | "
                      f"{a / b:.2f} | {r[f'jnp {which} compile']:.2f} / {r[f'callback {which} compile']:.2f} |",
                      flush=True)
    for which, values in ratios.items():
        mins = [v[0] for v in values]
        geo_min = statistics.geometric_mean(mins)
        geo_median = statistics.geometric_mean([v[1] for v in values])
        print(f"# {which}: jnp time / callback time, geometric mean {geo_min:.2f} (min) / {geo_median:.2f} "
              f"(median), range {min(mins):.2f} - {max(mins):.2f} (min)")


if __name__ == "__main__":
    main()
