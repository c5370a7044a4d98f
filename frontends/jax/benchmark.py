"""Benchmarks of sparsecore.jax: ``python -m sparsecore.jax.benchmark [--plan | --streaming]``.

They run on JAX's default device: the CPU here, the GPU where JAX sees one
(there ``impl="callback"`` runs the core's CUDA kernels on XLA's stream); the
header names the device.

Default: the two feature-pass implementations (below). ``--plan``: the geometry
cost of the demo's U-Net on the 125k-voxel scan: `sparsecore.jax.plan` (trace +
builds), ``plan.recipe.apply`` (builds + padding + transfer: what each cloud of
a stream pays), the core's builds alone, and the torch frontend's rulebook time
on the same scan (when torch is installed), interleaved, minimum of the
repetitions. ``--streaming``: resident memory and XLA compilations while 300
clouds of distinct sizes stream through a jitted step (from_arrays,
recipe.apply, the step), the measurement behind issue 16's leak.

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


def _voxel_scan() -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    from sparsecore.benchmark import scenes

    path = scenes.require_data_file(None, scenes.VOXELS_FILE_NAME)
    with np.load(path) as data:
        return (np.asarray(data["features"], np.float32), np.asarray(data["indices"], np.int32),
                tuple(int(v) for v in data["spatial_shape"]))


def _torch_rulebook_s(features: np.ndarray, indices: np.ndarray, shape: tuple[int, ...]) -> float | None:
    """The torch demo's rulebook time (``indice_gen_time`` of a benchmark-mode forward) on this scan."""
    try:
        import torch

        import sparsecore.torch as spconv
        from sparsecore.demo import build_unet
    except ImportError:
        return None
    model = build_unet(features.shape[1])
    for name, module in model.named_modules():
        if isinstance(module, spconv.SparseConvolution):
            module.name = name
    x = spconv.SparseConvTensor(torch.from_numpy(features), torch.from_numpy(indices), list(shape), 1,
                                benchmark=True)
    with torch.no_grad():
        model(x)
    return sum(sum(entry["indice_gen_time"]) for entry in x.benchmark_record.values())


def plan_cost(reps: int) -> dict[str, float]:
    """Minimum seconds over ``reps`` of each geometry path on the 125k-voxel scan (see the module docstring)."""
    from .demo import build_params, unet

    features, indices, shape = _voxel_scan()
    x = SparseTensor.from_arrays(features, indices, shape, 1)
    params, state = build_params(jax.random.PRNGKey(0), features.shape[1])
    recipe = make_plan(unet, params, state, x).recipe  # warm-up (first trace)
    times: dict[str, list[float]] = {"sj.plan": [], "recipe.apply": [], "core builds": [], "torch rulebooks": []}
    for _ in range(reps):
        start = time.perf_counter()
        make_plan(unet, params, state, x)
        times["sj.plan"].append(time.perf_counter() - start)
        fresh = SparseTensor.from_arrays(features, indices, shape, 1)
        start = time.perf_counter()
        recipe.apply(fresh)
        times["recipe.apply"].append(time.perf_counter() - start)
        times["core builds"].append(_core_builds(recipe, indices, shape))
        torch_s = _torch_rulebook_s(features, indices, shape)
        if torch_s is not None:
            times["torch rulebooks"].append(torch_s)
    result = {key: min(values) for key, values in times.items() if values}
    result["voxels"] = float(indices.shape[0])
    return result


def _core_builds(recipe: Any, indices: np.ndarray, shape: tuple[int, ...]) -> float:
    """Seconds of the core's ``build_rulebook`` calls alone for the recipe's layers."""
    from .plan import child_sites_name

    sites: dict[str, tuple[np.ndarray, tuple[int, ...]]] = {"input": (indices, shape)}
    start = time.perf_counter()
    for name, geometry in recipe.layers:
        source, grid = sites[name]
        rulebook = sc.build_rulebook(source, grid, 1, geometry, assume_unique=True)
        if geometry.kind != "subm":
            sites[child_sites_name(name, geometry)] = (np.asarray(rulebook.output_indices),
                                                       tuple(rulebook.output_spatial_shape))
    return time.perf_counter() - start


def streaming_memory(clouds: int, seed: int = 0) -> list[tuple[int, float, int]]:
    """``(cloud, RSS MiB, XLA compilations so far)`` every 50 clouds of a stream of distinct sizes.

    Each cloud: ``SparseTensor.from_arrays`` (4 to 6 thousand voxels on a 64^3 grid), the
    recipe of a small network (subm conv, ReLU, strided conv, global pool), a jitted step.
    """
    import resource

    compiles = [0]

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[0] += 1

    rng = np.random.default_rng(seed)
    grid = (64, 64, 64)
    weights = {"subm": jnp.asarray(rng.uniform(-0.2, 0.2, (16, 3, 3, 3, 4)).astype(np.float32)),
               "down": jnp.asarray(rng.uniform(-0.2, 0.2, (32, 3, 3, 3, 16)).astype(np.float32))}

    def net(w: Any, x: SparseTensor) -> Any:
        y = F.subm_conv(x, w["subm"])
        y = F.sparse_conv(y.replace(jax.nn.relu(y.features)), w["down"], stride=2, padding=1)
        return F.global_avg_pool(y)

    def cloud(rows: int) -> SparseTensor:
        flat = rng.choice(64 ** 3, rows, replace=False)
        indices = np.stack([np.zeros(rows, np.int64), flat // 4096, (flat // 64) % 64, flat % 64], 1)
        return SparseTensor.from_arrays(rng.standard_normal((rows, 4)).astype(np.float32),
                                        indices.astype(np.int32), grid, 1)

    sizes = rng.permutation(np.arange(4000, 6000))[:clouds]
    recipe = make_plan(net, weights, cloud(int(sizes[0]))).recipe
    step = jax.jit(net)
    jax.monitoring.register_event_duration_secs_listener(listener)
    rows = []
    try:
        for position, size in enumerate(sizes.tolist(), start=1):
            jax.block_until_ready(step(weights, recipe.apply(cloud(size))))
            if position == 1 or position % 50 == 0:
                rss = _rss_mib(resource)
                rows.append((position, rss, compiles[0]))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return rows


def _rss_mib(resource: Any) -> float:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # peak, where statm is missing


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--voxels", type=int, nargs="+", default=[20_000, 50_000, 100_000])
    parser.add_argument("--channels", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--plan", action="store_true", help="geometry cost on the 125k-voxel scan")
    parser.add_argument("--streaming", action="store_true", help="RSS and compilations over a stream of clouds")
    parser.add_argument("--clouds", type=int, default=300, help="clouds streamed by --streaming")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    print(f"# sparsecore.jax benchmark on {device.platform} ({device.device_kind}), "
          f"{datetime.date.today().isoformat()}")
    if args.plan:
        r = plan_cost(args.reps)
        torch_s = r.get("torch rulebooks")
        print(f"# demo U-Net geometry on the {int(r['voxels']):,}-voxel scan, minimum of {args.reps}")
        print("| path | ms | / torch rulebooks |")
        print("| --- | --- | --- |")
        for key in ("torch rulebooks", "core builds", "recipe.apply", "sj.plan"):
            if key in r:
                ratio = f"{r[key] / torch_s:.2f}" if torch_s else "-"
                print(f"| {key} | {r[key] * 1e3:.1f} | {ratio} |")
        return
    if args.streaming:
        print(f"# {args.clouds} clouds of distinct sizes (4,000-6,000 voxels) through a jitted step")
        print("| clouds | RSS MiB | XLA compilations |")
        print("| --- | --- | --- |")
        for position, rss, count in streaming_memory(args.clouds):
            print(f"| {position} | {rss:.0f} | {count} |", flush=True)
        return
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
