"""``python -m sparsecore.benchmark int8``: int8 against float sparse convolution, one layer.

SubMConv3d 64->64 (3x3x3, bias, ReLU) forward on the real scan: on the CPU,
`sparsecore.int8_conv_forward` (int8 in, int8 out, and int8 in, float32 out)
against float32 `sparsecore.conv_forward` at 1 and 2 BLAS threads; on the
GPU (``--device cuda``), the ``sc_int8_conv`` kernel against float16
``conv_forward`` (cuBLAS). The rulebook is built once, outside the timings.

The CPU thread count must be fixed before NumPy loads its BLAS (and numba its
thread pool), so each thread count runs in a child process started with the
thread variables (and ``NUMBA_NUM_THREADS``) set.
The variants are timed in alternation (float, int8, float, ...), so a machine
shared with other work loads them alike; the table gives the median and the
minimum of the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import numpy as np

from sparsecore.benchmark import scenes
from sparsecore.benchmark.timing import (THREAD_VARIABLES, VariantTiming, add_scan_suite_parser,
                                         machine_description, summarize_times, time_alternating)

__all__ = ["Int8Timing", "add_parser", "run_int8_command", "time_alternating", "layer_inputs", "cpu_timings"]

CHANNELS = 64


@dataclass(frozen=True)
class Int8Timing(VariantTiming):
    """One variant's times (`VariantTiming`: variant, median_ms, min_ms) on one device.

    Attributes:
        device: ``"cpu"`` or ``"cuda"``.
        threads: BLAS threads (CPU), 0 on the GPU.
        relative_to_float: the float baseline's median over this variant's (> 1: faster than float).
    """

    device: str
    threads: int
    relative_to_float: float


def add_parser(suites: Any) -> None:
    """Registers the ``int8`` sub-command on the benchmark's sub-parsers."""
    parser = add_scan_suite_parser(
        suites, "int8", "int8 vs float SubMConv3d 64->64 forward on the real scan (CPU: 1 and 2 threads; GPU: "
        "float16)", __doc__.split("\n\n")[1], 7, scenes.VOXELS_FILE_NAME)
    parser.add_argument("--threads", type=str, default="1,2", help="comma-separated BLAS thread counts (cpu)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)  # one thread count, JSON out


def layer_inputs(voxels_path: str | None, seed: int, xp: Any = np) -> dict[str, Any]:
    """The scan's rulebook, float features and weight, and their int8 quantization (per-channel weights)."""
    import sparsecore as sc

    scene = scenes.load_voxel_scene(scenes.require_data_file(voxels_path, scenes.VOXELS_FILE_NAME))
    generator = np.random.default_rng(seed)
    count = len(scene.indices)
    features = generator.standard_normal((count, CHANNELS)).astype(np.float32)
    weight = (generator.standard_normal((CHANNELS, 3, 3, 3, CHANNELS)) / np.sqrt(27 * CHANNELS)).astype(np.float32)
    bias = (0.1 * generator.standard_normal(CHANNELS)).astype(np.float32)
    input_scale = float(np.abs(features).max() / 127)
    weight_scales = (np.abs(weight).reshape(CHANNELS, -1).max(axis=1) / 127).astype(np.float32)
    indices = xp.asarray(scene.indices)
    rulebook = sc.build_rulebook(indices, scene.spatial_shape, scene.batch_size,
                                 sc.ConvGeometry.create(3, 3, kind="subm"))
    features, weight, bias = xp.asarray(features), xp.asarray(weight), xp.asarray(bias)
    return dict(
        scene=f"{scene.source}: {count} voxels, {rulebook.num_pairs} pairs", rulebook=rulebook, features=features,
        weight=weight, bias=bias, input_scale=input_scale, weight_scales=xp.asarray(weight_scales),
        features_int8=sc.quantize(features, input_scale), weight_int8=sc.quantize(weight, weight_scales, axis=0))


def _variants(inputs: dict[str, Any], float_dtype: Any) -> dict[str, Callable[[], Any]]:
    import sparsecore as sc

    rulebook = inputs["rulebook"]
    features, weight, bias = (inputs[name].astype(float_dtype) for name in ("features", "weight", "bias"))
    common = dict(input_scale=inputs["input_scale"], weight_scales=inputs["weight_scales"], bias=inputs["bias"],
                  relu=True)
    xp = sc.backends.backend_for(features).xp

    def float_layer() -> Any:
        return xp.maximum(sc.conv_forward(features, weight, rulebook, bias), 0)

    return {
        np.dtype(float_dtype).name: float_layer,
        "int8 -> int8": lambda: sc.int8_conv_forward(inputs["features_int8"], inputs["weight_int8"], rulebook,
                                                     output_scale=0.05, **common),
        "int8 -> float32": lambda: sc.int8_conv_forward(inputs["features_int8"], inputs["weight_int8"], rulebook,
                                                        **common),
    }


def _rows(device: str, threads: int, times: dict[str, list[float]]) -> list[Int8Timing]:
    summary = summarize_times(times, baseline=next(iter(times)))  # the float variant comes first
    return [Int8Timing(variant=name, median_ms=median, min_ms=fastest, device=device, threads=threads,
                       relative_to_float=relative) for name, (median, fastest, relative) in summary.items()]


def cpu_timings(voxels_path: str | None, seed: int, repeat: int, threads: int) -> list[Int8Timing]:
    """Times the CPU variants in this process (its BLAS thread count already set)."""
    inputs = layer_inputs(voxels_path, seed)
    return _rows("cpu", threads, time_alternating(_variants(inputs, np.float32), repeat, lambda: None))


def _gpu_timings(voxels_path: str | None, seed: int, repeat: int) -> tuple[list[Int8Timing], str]:
    import cupy

    inputs = layer_inputs(voxels_path, seed, cupy)
    times = time_alternating(_variants(inputs, np.float16), repeat, cupy.cuda.Device().synchronize)
    return _rows("cuda", 0, times), inputs["scene"]


def _child_rows(arguments: argparse.Namespace, threads: int) -> list[Int8Timing]:
    environment = dict(os.environ)
    environment.update({variable: str(threads) for variable in (*THREAD_VARIABLES, "NUMBA_NUM_THREADS")})
    command = [sys.executable, "-m", "sparsecore.benchmark", "int8", "--child", str(threads),
               "--repeat", str(arguments.repeat), "--seed", str(arguments.seed)]
    if arguments.voxels:
        command += ["--voxels", arguments.voxels]
    finished = subprocess.run(command, env=environment, capture_output=True, text=True, check=False)
    if finished.returncode != 0:
        raise SystemExit(f"error: the {threads}-thread run failed:\n{finished.stderr}")
    return [Int8Timing(**row) for row in json.loads(finished.stdout)]


def format_rows(rows: Sequence[Int8Timing]) -> str:
    """An aligned text table of the rows."""
    titles = ("device", "threads", "variant", "median ms", "min ms", "float / this")
    cells = [(row.device, str(row.threads) if row.device == "cpu" else "-", row.variant, f"{row.median_ms:.1f}",
              f"{row.min_ms:.1f}", f"{row.relative_to_float:.2f}x") for row in rows]
    widths = [max([len(title)] + [len(cell[column]) for cell in cells]) for column, title in enumerate(titles)]
    lines = ["  ".join(value.ljust(width) if column < 3 else value.rjust(width)
                       for column, (value, width) in enumerate(zip(line, widths))).rstrip()
             for line in [titles] + cells]
    return "\n".join(lines) + "\n"


def run_int8_command(arguments: argparse.Namespace) -> int:
    """Runs the ``int8`` suite and prints its table (or, as a child, one thread count's rows as JSON)."""
    if arguments.repeat < 1:
        raise SystemExit(f"--repeat must be at least 1, got {arguments.repeat}")
    try:
        if arguments.child is not None:
            rows = cpu_timings(arguments.voxels, arguments.seed, arguments.repeat, arguments.child)
            print(json.dumps([asdict(row) for row in rows]))
            return 0
        if arguments.device == "cuda":
            rows, scene = _gpu_timings(arguments.voxels, arguments.seed, arguments.repeat)
        else:
            thread_counts = [int(value) for value in arguments.threads.split(",") if value.strip()]
            rows = [row for threads in thread_counts for row in _child_rows(arguments, threads)]
            scene = scenes.require_data_file(arguments.voxels, scenes.VOXELS_FILE_NAME).name
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    header = machine_description()
    header["blas threads"] = "per row (a child process per thread count)" if arguments.device == "cpu" else "-"
    header.update({"layer": "SubMConv3d 64->64 k3, bias, ReLU, forward (rulebook prebuilt)", "scene": str(scene),
                   "timing": f"{arguments.repeat} alternating runs per variant after one warm-up round",
                   "load": f"1-minute load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"})
    width = max(len(label) for label in header)
    print("".join(f"{label.ljust(width)} : {value}\n" for label, value in header.items()) + "\n"
          + format_rows(rows), end="")
    if arguments.json:
        with open(arguments.json, "w", encoding="utf-8") as handle:
            json.dump({"header": header, "rows": [asdict(row) for row in rows]}, handle, indent=2)
    return 0
