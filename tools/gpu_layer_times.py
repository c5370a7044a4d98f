"""Per-layer device time of the fused conv kernels on spconv's basic network, beside the estimate (needs a GPU).

    python tools/gpu_layer_times.py [--scene basic] [--dtypes float32,float16,tf32] [--repeats 5]
        [--estimate-json PATH] [--old-kernels DIR] [--json PATH] [--time-limit SECONDS]

The network's maps are built on the GPU (the kernel backend's builders); each
of its 14 SubMConv3d layers then runs its forward and backward on seeded random
features, weights and output gradients, and every ``sc_*`` launch is timed
between two CUDA events: the forward's launches are its time, the backward's
split into the input gradient and the weight gradient (by kernel name). Each
pass's time is the median of ``--repeats`` runs after one warm-up.

``--old-kernels DIR`` also times issue 28's kernels (``kernels_cu/`` of commit
3ed261f, e.g. ``git archive 3ed261f kernels_cu | tar -x -C DIR``): its
``implicit_gemm.cu`` compiled by CuPy and launched the way that commit's
`_kernel_fused` launched it (64 x 64 tiles, the old weight-gradient splits),
on the same maps and inputs, so the table shows old and new side by side.

Beside each measured time it prints `gpu_layer_estimate`'s modelled time, new
and old (``--estimate-json`` from ``gpu_layer_estimate.py --json``, else
computed here on the CPU), and measured over modelled: the first device run
calibrates the model. Without a GPU it says so and exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

__all__ = ["PassTiming", "MeasureDevice", "cuda_device", "OLD_EXPRESSIONS", "pass_of", "measure", "format_times",
           "main"]

PASSES = ("forward", "input gradient", "weight gradient")
OLD_EXPRESSIONS = tuple(f"{kernel}<{storage}, sc::{math}>" for kernel in ("sc_implicit_gemm", "sc_weight_gradient")
                        for storage, math in (("float", "Simt"), ("double", "Simt"), ("float", "Wmma"),
                                              ("__half", "Wmma"), ("__nv_bfloat16", "Wmma")))


@dataclass(frozen=True)
class PassTiming:
    """One pass of one layer: measured and modelled milliseconds (None: not measured / no estimate).

    Attributes:
        layer: the layer's label.
        dtype: ``"float32"``, ``"float16"`` or ``"tf32"``.
        pass_name: one of `PASSES`.
        new_ms: the current kernels' median device time.
        old_ms: issue 28's kernels' median device time (``--old-kernels``).
        estimate_new_ms: the model's time of the current kernels.
        estimate_old_ms: the model's time of issue 28's kernels.
    """

    layer: str
    dtype: str
    pass_name: str
    new_ms: float | None = None
    old_ms: float | None = None
    estimate_new_ms: float | None = None
    estimate_old_ms: float | None = None


@dataclass(frozen=True)
class MeasureDevice:
    """Where the layers run and how a launch is timed.

    Attributes:
        xp: the array module (``cupy``; NumPy under the CPU emulation).
        backend: the `KernelBackend` (its launcher gets wrapped).
        event: makes a marker with ``record()`` and ``synchronize()`` (``cupy.cuda.Event``).
        elapsed: milliseconds between two recorded markers (``cupy.cuda.get_elapsed_time``).
    """

    xp: Any
    backend: Any
    event: Any
    elapsed: Any


def cuda_device() -> MeasureDevice:
    """The GPU: CuPy's arrays, the CuPy kernel backend, CUDA events."""
    import cupy

    from sparsecore.backends.cupy_backend import CUPY_BACKEND

    return MeasureDevice(cupy, CUPY_BACKEND, cupy.cuda.Event, cupy.cuda.get_elapsed_time)


def pass_of(expression: str, phase: str) -> str:
    """The pass a launch belongs to: the forward's launches, else the input or weight gradient by kernel name."""
    if phase == "forward":
        return "forward"
    return "weight gradient" if "weight" in expression else "input gradient"


@dataclass
class _TimedLauncher:
    """A `KernelLauncher` recording a pair of the device's markers around every launch."""

    inner: Any
    device: MeasureDevice
    records: list = dataclasses.field(default_factory=list)

    def launch(self, expression: str, grid: int, block: int, args: tuple[Any, ...]) -> None:
        start, stop = self.device.event(), self.device.event()
        start.record()
        self.inner.launch(expression, grid, block, args)
        stop.record()
        self.records.append((expression, start, stop))

    def drain(self) -> list[tuple[str, float]]:
        """``(expression, milliseconds)`` of the launches since the last drain (synchronises)."""
        if self.records:
            self.records[-1][2].synchronize()
        done = [(expression, float(self.device.elapsed(start, stop))) for expression, start, stop in self.records]
        self.records.clear()
        return done


def _conv_layers(scene: Any, xp: Any) -> list[tuple[Any, Any]]:
    """``(layer, rulebook)`` of every conv layer, the maps built where ``xp``'s arrays live."""
    import sparsecore as sc
    from sparsecore.benchmark.network import REFERENCE_NETWORK

    subm = sc.ConvGeometry.create(3, 3, kind="subm")
    sites, shape = xp.asarray(np.asarray(scene.indices, dtype=np.int32)), tuple(scene.spatial_shape)
    result, rulebook = [], None
    for layer in REFERENCE_NETWORK:
        if layer.kind == "maxpool":
            pooled = sc.build_pool_rulebook(sites, shape, 1, 2, 2, assume_unique=True)
            sites, shape = pooled.output_indices, tuple(pooled.output_spatial_shape)
            continue
        if layer.builds_rulebook or rulebook is None:
            rulebook = sc.build_rulebook(sites, shape, 1, subm, assume_unique=layer.index > 0)
        result.append((layer, rulebook))
    return result


class _OldKernels:
    """Issue 28's ``implicit_gemm.cu`` (commit 3ed261f) on CuPy, launched as that commit's `_kernel_fused` did."""

    def __init__(self, folder: Path) -> None:
        import cupy

        from gpu_kernel_report import kernel_source
        from sparsecore.backends import kernel_registry

        self.cupy = cupy
        self.module = cupy.RawModule(code=kernel_source("implicit_gemm.cu", folder),
                                     options=kernel_registry.nvrtc_options(tensor_cores=True),
                                     name_expressions=OLD_EXPRESSIONS)
        self.module.compile()

    def run(self, dtype_name: str, features: Any, weight: Any, grad: Any,
            neighbour_map: Any) -> list[tuple[str, float]]:
        """The old forward, input gradient and weight gradient of one layer: ``(pass, milliseconds)`` each."""
        from gpu_layer_estimate import old_weight_gradient_splits

        cupy = self.cupy
        storage = {"float32": "float", "tf32": "float", "float16": "__half"}[dtype_name]
        math, threads = ("sc::Wmma", 128) if dtype_name in ("float16", "tf32") else ("sc::Simt", 256)
        table, masks, order = neighbour_map.output_neighbours, neighbour_map.output_masks, neighbour_map.output_order
        rows, volume, words = int(table.shape[0]), int(table.shape[1]), int(masks.shape[1])
        b, a = int(weight.shape[0]), int(weight.shape[-1])
        scalars = (np.int64(rows), np.int32(volume), np.int32(words), np.int32(1), np.int32(a), np.int32(b))
        events = []
        # the forward; the input gradient reads the symmetric map's output side reversed (flags 2 | 1)
        for name, source, width, flags, result in (("forward", features, b, 0, cupy.empty((rows, b), features.dtype)),
                                                   ("input gradient", grad, a, 3, cupy.empty_like(features))):
            events.append((name, *self._timed(f"sc_implicit_gemm<{storage}, {math}>",
                                              -(-rows // 64) * -(-width // 64), threads,
                                              (source, weight, weight, table, masks, order, *scalars,
                                               np.int32(flags), result))))
        tiles = volume * -(-a // 64) * -(-b // 64)
        splits = old_weight_gradient_splits(rows, tiles, 4, int(grad.nbytes))
        scratch = cupy.zeros(tiles * splits * 4096 + tiles if splits > 1 else 1, dtype=cupy.float32)
        events.append(("weight gradient", *self._timed(
            f"sc_weight_gradient<{storage}, {math}>", tiles * splits, threads,
            (features, grad, table, order, np.int64(rows), np.int32(volume), np.int32(1), np.int32(a), np.int32(b),
             np.int32(splits), scratch, cupy.empty(weight.shape, dtype=features.dtype)))))
        events[-1][2].synchronize()
        return [(name, cupy.cuda.get_elapsed_time(start, stop)) for name, start, stop in events]

    def _timed(self, expression: str, items: int, threads: int, args: tuple) -> tuple[Any, Any]:
        start, stop = self.cupy.cuda.Event(), self.cupy.cuda.Event()
        start.record()
        self.module.get_function(expression)((max(1, min(items, 4096)),), (threads,), args)
        stop.record()
        return start, stop


def measure(scene: Any, dtypes: tuple[str, ...], repeats: int, device: MeasureDevice, old: _OldKernels | None = None,
            deadline: float = float("inf"), log: Any = sys.stderr, layer_count: int | None = None
            ) -> dict[tuple[str, str, str], dict[str, float]]:
    """``(layer, dtype, pass) -> {"new": ms, "old": ms}``: each conv layer's passes, medians over ``repeats`` runs.

    Args:
        scene: a `scenes.VoxelScene` (its sites).
        dtypes: ``"float32"``, ``"float16"``, ``"tf32"``.
        repeats: timed runs per pass after one warm-up.
        device: where to run (`cuda_device`).
        old: issue 28's kernels, timed on the same inputs (GPU only).
        deadline: ``time.perf_counter()`` after which no further layer starts.
        log: where each layer's line goes.
        layer_count: only the first this many conv layers.
    """
    import sparsecore as sc
    from sparsecore.neighbour_map import neighbour_map_of

    xp = device.xp
    layers = _conv_layers(scene, xp)[:layer_count]
    results: dict[tuple[str, str, str], dict[str, float]] = {}
    rng = np.random.default_rng(0)
    for dtype_name in dtypes:
        timed = _TimedLauncher(device.backend.launcher, device)
        backend = dataclasses.replace(device.backend, launcher=timed, tf32=dtype_name == "tf32")
        storage = np.float16 if dtype_name == "float16" else np.float32
        for layer, rulebook in layers:
            if time.perf_counter() > deadline:
                print(f"time limit reached: {dtype_name} stops before {layer.name}", file=log, flush=True)
                return results
            rows_in, rows_out = int(rulebook.num_input), int(rulebook.num_output)
            features = xp.asarray(rng.standard_normal((rows_in, layer.in_channels)).astype(storage))
            weight = xp.asarray((rng.standard_normal((layer.out_channels, 3, 3, 3, layer.in_channels))
                                 / np.sqrt(27 * layer.in_channels)).astype(storage))
            grad = xp.asarray(rng.standard_normal((rows_out, layer.out_channels)).astype(storage))
            samples: dict[tuple[str, str], list[float]] = {}
            for run in range(repeats + 1):  # run 0 warms up (compiles, allocates)
                for phase in ("forward", "backward"):
                    if phase == "forward":
                        sc.conv_forward(features, weight, rulebook, backend=backend)
                    else:
                        sc.conv_backward(grad, features, weight, rulebook, backend=backend)
                    spent: dict[str, float] = {}
                    for expression, milliseconds in timed.drain():
                        name = pass_of(expression, phase)
                        spent[name] = spent.get(name, 0.0) + milliseconds
                    if run:
                        for name, milliseconds in spent.items():
                            samples.setdefault(("new", name), []).append(milliseconds)
                if old is not None:
                    try:
                        for name, milliseconds in old.run(dtype_name, features, weight, grad,
                                                          neighbour_map_of(rulebook, xp)):
                            if run:
                                samples.setdefault(("old", name), []).append(milliseconds)
                    except Exception as error:  # keep the new kernels' times
                        print(f"old kernels on {layer.name} {dtype_name}: {type(error).__name__}: {error}",
                              file=log, flush=True)
                        old = None
            for (column, name), values in samples.items():
                results.setdefault((layer.name, dtype_name, name), {})[column] = statistics.median(values)
            print(f"{dtype_name} {layer.name}: " + ", ".join(
                f"{name} {results.get((layer.name, dtype_name, name), {}).get('new', float('nan')):.3f} ms"
                for name in PASSES), file=log, flush=True)
    return results


def _estimates(path: Path | None, scene_name: str, dtypes: tuple[str, ...]) -> dict[tuple[str, str, str], tuple]:
    """``(layer, dtype, pass) -> (new ms, old ms)`` of the estimate: read from ``path``'s JSON (none when that
    file is missing), else computed here."""
    if path is not None:
        if not path.is_file():
            print(f"no estimate beside the times: {path} is missing", file=sys.stderr)
            return {}
        entries = json.loads(path.read_text())["estimates"]
    else:
        import gpu_layer_estimate as estimate
        from sparsecore.benchmark.network import network_scene

        scene = network_scene(scene_name)
        maps = estimate.network_maps(np.asarray(scene.indices), tuple(scene.spatial_shape))
        entries = [dataclasses.asdict(item) for item in estimate.estimate_network(maps, dtypes)]
    table = {}
    for entry in entries:
        for new, old in zip(entry["new"], entry["old"]):
            table[(entry["layer"], entry["dtype"], new["pass_name"])] = (new["seconds"] * 1e3, old["seconds"] * 1e3)
    return table


def _cell(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _share(measured: float | None, modelled: float | None) -> str:
    return "-" if not measured or not modelled else f"{measured / modelled:.2f}"


def format_times(timings: list[PassTiming]) -> str:
    """A table per dtype: per layer and pass the measured and modelled times, new then old; totals per pass."""
    lines = ["Per-layer device time (median of CUDA events around each launch) beside the estimate "
             "(gpu_layer_estimate); meas/est calibrates it"]
    for dtype in dict.fromkeys(item.dtype for item in timings):
        rows = [item for item in timings if item.dtype == dtype]
        lines += ["", f"== {dtype}",
                  f"{'layer':<30} {'pass':<6} {'new ms':>8} {'est':>8} {'meas/est':>8} | {'old ms':>8} {'est':>8} "
                  f"{'meas/est':>8} | {'old/new':>7}"]
        short = {"forward": "fwd", "input gradient": "dgrad", "weight gradient": "wgrad"}
        for item in rows:
            speedup = _share(item.old_ms, item.new_ms)
            lines.append(f"{item.layer[:30]:<30} {short[item.pass_name]:<6} {_cell(item.new_ms):>8} "
                         f"{_cell(item.estimate_new_ms):>8} {_share(item.new_ms, item.estimate_new_ms):>8} | "
                         f"{_cell(item.old_ms):>8} {_cell(item.estimate_old_ms):>8} "
                         f"{_share(item.old_ms, item.estimate_old_ms):>8} | {speedup:>7}")
        for name in PASSES:
            chosen = [item for item in rows if item.pass_name == name]

            def total(field: str) -> float | None:
                values = [getattr(item, field) for item in chosen]
                return None if not values or any(value is None for value in values) else sum(values)

            new, old = total("new_ms"), total("old_ms")
            lines.append(f"{'total ' + name:<37} {_cell(new):>8} {_cell(total('estimate_new_ms')):>8} "
                         f"{_share(new, total('estimate_new_ms')):>8} | {_cell(old):>8} "
                         f"{_cell(total('estimate_old_ms')):>8} {_share(old, total('estimate_old_ms')):>8} | "
                         f"{_share(old, new):>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scene", choices=("basic", "synthetic"), default="basic")
    parser.add_argument("--dtypes", default="float32,float16,tf32", help="comma-separated: float32, float16, tf32")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per pass after one warm-up")
    parser.add_argument("--estimate-json", type=Path, help="gpu_layer_estimate.py --json output (without this "
                        "option the estimate is computed here, on the CPU)")
    parser.add_argument("--old-kernels", type=Path, help="a kernels_cu/ folder of commit 3ed261f: time issue 28's "
                        "kernels too")
    parser.add_argument("--json", type=Path, help="write the timings as JSON")
    parser.add_argument("--time-limit", type=float, default=120.0, help="stop measuring after this many seconds")
    args = parser.parse_args(argv)
    dtypes = tuple(name for name in args.dtypes.split(",") if name)
    if not dtypes or any(name not in ("float32", "float16", "tf32") for name in dtypes):
        parser.error(f"--dtypes takes float32, float16, tf32; got {args.dtypes!r}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.old_kernels is not None and not (args.old_kernels / "implicit_gemm.cu").is_file():
        parser.error(f"--old-kernels must be a kernels_cu/ folder holding implicit_gemm.cu, got {args.old_kernels}")
    from gpu_kernel_report import gpu_visible

    if not gpu_visible():
        print("gpu_layer_times: needs a CUDA GPU (CuPy sees none); the estimate alone: "
              "python tools/gpu_layer_estimate.py", file=sys.stderr)
        return 1
    from sparsecore.benchmark.network import network_scene

    started = time.perf_counter()
    scene = network_scene(args.scene)
    old = None
    if args.old_kernels is not None:
        try:
            old = _OldKernels(args.old_kernels)
        except Exception as error:  # time the new kernels anyway
            print(f"old kernels not compiled: {type(error).__name__}: {error}", file=sys.stderr)
    measured = measure(scene, dtypes, args.repeats, cuda_device(), old, started + args.time_limit)
    modelled = _estimates(args.estimate_json, args.scene, dtypes)
    timings = []
    for (layer, dtype, name), value in measured.items():
        estimate_new, estimate_old = modelled.get((layer, dtype, name), (None, None))
        timings.append(PassTiming(layer, dtype, name, value.get("new"), value.get("old"), estimate_new, estimate_old))
    print(format_times(timings))
    if args.json:
        args.json.write_text(json.dumps({"scene": args.scene, "timings": [dataclasses.asdict(item)
                                                                          for item in timings]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
