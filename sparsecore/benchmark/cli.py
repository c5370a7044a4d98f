"""Command line of the benchmark: ``python -m sparsecore.benchmark {cpu,network,gpu,int8,contention} [options]``.

``cpu`` times single layers on the NumPy engine; ``network`` times spconv's
reference network (``--device cpu`` or ``cuda``); ``gpu`` is ``network
--device cuda`` on both reference scenes in float32, float16 and TF32, with the
peak memory of one layer; ``int8`` compares int8 and float sparse convolution on one layer
(`sparsecore.benchmark.int8`); ``targets`` judges a ``gpu`` run's JSON against
issue 28's device targets (`sparsecore.benchmark.device_targets`); ``contention``
times a training step and the core network beside busy processes
(`sparsecore.benchmark.contention`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any, Sequence

from sparsecore.benchmark import int8 as int8_suite, scenes
from sparsecore.benchmark import contention as contention_suite
from sparsecore.benchmark import runtime as runtime_suite
from sparsecore.benchmark.thread_control import sparsecore_threads, thread_limit

__all__ = ["build_parser", "load_inputs", "thread_limit", "main"]

DEFAULT_REPEAT = 5


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, with one sub-command per benchmark suite."""
    parser = argparse.ArgumentParser(
        prog="python -m sparsecore.benchmark",
        description="Time sparsecore's stages and compare them with spconv where it is installed.",
    )
    suites = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    cpu = suites.add_parser(
        "cpu",
        help="the NumPy engine on the CPU, beside spconv's CPU build",
        description=(
            "Rulebook build, forward and backward of SubMConv3d 16->16 and 64->64 and of "
            "SparseConv3d 64->64 (k3 s2 p1) on a LiDAR scan, and voxelization of its first "
            f"120,000 points. The real scan is read from the repository's data/ folder (or "
            f"${scenes.DATA_DIRECTORY_VARIABLE}); a missing file is an error. --synthetic uses a "
            "synthetic scene instead."
        ),
    )
    cpu.add_argument("--voxels", metavar="PATH", help=f"voxelized scan (default: {scenes.VOXELS_FILE_NAME})")
    cpu.add_argument("--points", metavar="PATH", help=f"raw points (default: {scenes.POINTS_FILE_NAME})")
    cpu.add_argument("--synthetic", action="store_true", help="use a synthetic scene instead of the real scan")
    cpu.add_argument(
        "--scale",
        choices=sorted(scenes.SYNTHETIC_SCALES),
        default="full",
        help="size of the synthetic scene (default: full, about a scan's size)",
    )
    cpu.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help="timed repeats per stage (median)")
    cpu.add_argument("--threads", type=int, default=1,
                     help="threads of sparsecore's CPU passes (sparsecore.set_num_threads) and of NumPy's BLAS "
                     "(default 1, the thread count spconv is compared at; 0 leaves both at their defaults)")
    cpu.add_argument("--busy", action="store_true",
                     help="run one spinning process beside the benchmark (the machine under load)")
    cpu.add_argument("--no-spconv", action="store_true", help="skip the comparison with spconv")
    cpu.add_argument("--seed", type=int, default=0, help="random seed for features and weights")
    cpu.add_argument("--json", metavar="PATH", help="also write the header and rows as JSON to PATH")
    cpu.add_argument("--plot", metavar="PATH",
                     help="also draw the rows as a PNG at PATH: bars per case and stage, sparsecore vs spconv "
                     "(needs matplotlib)")
    network_parser = suites.add_parser(
        "network",
        help="spconv's reference network (14 SubMConv3d, 6 SparseMaxPool3d) on the CPU or the GPU",
        description=(
            "Forward (rulebook builds included) and backward of spconv's reference network, per stage "
            "(rulebooks, gather, GEMM, scatter, pooling) and per layer, beside spconv where it is "
            "importable. Scenes: basic (lidar_voxels_125k.npz), large (913,903 voxels from "
            "lidar_points_198k.npz), or synthetic (--scale)."
        ),
    )
    _add_network_arguments(network_parser, gpu_suite=False)
    gpu = suites.add_parser(
        "gpu",
        help="the network on the GPU: both scenes, float32, float16 and TF32, and peak memory",
        description=(
            "network --device cuda on the basic and large scenes in float32, float16 and TF32 "
            "(TF32 runs in a child process with CUPY_TF32=1), with the peak memory of a "
            "SubMConv3d 64->64 on the basic scan, beside spconv where it is importable."
        ),
    )
    _add_network_arguments(gpu, gpu_suite=True)
    int8_suite.add_parser(suites)
    targets = suites.add_parser(
        "targets",
        help="judge a gpu run's JSON against issue 28's device targets: one PASS/FAIL line each",
        description=("Reads the JSON of `gpu` / `network --device cuda` runs and prints one line per device "
                     "target (sparsecore >= 1.5x spconv implicit GEMM per scene, dtype and direction; the "
                     "64->64 peak memory <= spconv's; two runs bitwise equal). Exit status 0 only when every "
                     "target passes."),
    )
    targets.add_argument("json", nargs="+", metavar="JSON", help="benchmark JSON files (their rows are merged)")
    runtime_suite.add_parser(suites)
    contention_suite.add_parser(suites)
    return parser


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _add_network_arguments(parser: argparse.ArgumentParser, gpu_suite: bool) -> None:
    """The options of ``network`` and ``gpu`` (defaults of None are resolved per device)."""
    if not gpu_suite:
        parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                            help="cpu: NumPy arrays; cuda: CuPy arrays and the kernel backend (default cpu)")
    parser.add_argument("--scene", type=_comma_list, default=("basic", "large") if gpu_suite else None,
                        help="comma-separated scenes: basic, large, synthetic (default: "
                        + ("basic,large" if gpu_suite else "basic, or synthetic when --scale is given") + ")")
    parser.add_argument("--scale", choices=sorted(scenes.SYNTHETIC_SCALES), default=None,
                        help="size of the synthetic scene; alone, it selects the synthetic scene (default small)")
    parser.add_argument("--dtype", type=_comma_list, default=None,
                        help="comma-separated: float32, float16, tf32 (default: float32 on cpu, all three on cuda)")
    parser.add_argument("--repeat", type=int, default=None, help="timed runs per measurement, at most (cpu 3, cuda 30)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed runs first (cpu 1, cuda 3)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="time budget per measurement; fewer runs (at least 3) beyond it (cpu 60, cuda 6)")
    parser.add_argument("--profile-runs", type=int, default=None,
                        help="instrumented runs for the stage and layer rows (cpu 1, cuda 3)")
    parser.add_argument("--spconv-algo", type=_comma_list, default=None,
                        help="spconv algorithms: native, implicit_gemm (default: native on cpu, both on cuda)")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads for NumPy on the cpu (default 1)")
    parser.add_argument("--no-spconv", action="store_true", help="skip the comparison with spconv")
    parser.add_argument("--no-layers", action="store_true", help="leave out the per-layer rows")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory row (cuda)")
    parser.add_argument("--bitwise", action=argparse.BooleanOptionalAction, default=None,
                        help="run the forward and backward twice more and compare every bit "
                        "(default: on for cuda, off for cpu)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for weights, gradients, synthetic scene")
    parser.add_argument("--child-timeout", type=float, default=300.0,
                        help="seconds for the child process that runs the other TF32 setting (default 300)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds after which no further case starts; the rest are listed as skipped")
    parser.add_argument("--json", metavar="PATH", help="also write the header and rows as JSON to PATH "
                        "(rewritten after every case, so a stopped run leaves its finished cases)")
    parser.add_argument("--markdown", metavar="PATH", help="also write a short Markdown table (no layer rows) to PATH")
    parser.add_argument("--plot", metavar="PATH", help="also draw a PNG at PATH: the network's totals and the "
                        "per-layer forward and backward times, sparsecore vs spconv (needs matplotlib)")


def load_inputs(arguments: argparse.Namespace) -> Any:
    """Finds or makes the scene and the points named by the arguments.

    Args:
        arguments: the parsed ``cpu`` arguments.

    Returns:
        ``cpu.BenchmarkInputs``.
    """
    from sparsecore.benchmark.cpu import BenchmarkInputs

    scale = scenes.SYNTHETIC_SCALES[arguments.scale]
    voxels_path = None if arguments.synthetic else scenes.require_data_file(arguments.voxels, scenes.VOXELS_FILE_NAME)
    points_path = None if arguments.synthetic else scenes.require_data_file(arguments.points, scenes.POINTS_FILE_NAME)
    if voxels_path is not None:
        scene = scenes.load_voxel_scene(voxels_path)
    else:
        scene = scenes.synthetic_voxel_scene(scale, arguments.seed)
    if points_path is not None:
        points, points_source = scenes.load_points(points_path), str(points_path)
    else:
        points = scenes.synthetic_points(scale, arguments.seed)
        points_source = f"synthetic ({scale.name}, seed {arguments.seed})"
    return BenchmarkInputs(scene, points, points_source)


def main(argv: Sequence[str] | None = None, allow_reexec: bool = False) -> int:
    """Runs the benchmark and prints its table.

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).
        allow_reexec: let ``--threads`` restart the process with the thread
            variables set when threadpoolctl is missing.

    Returns:
        The exit status: 0, or 1 when sparsecore and spconv disagree somewhere.
    """
    from sparsecore.benchmark import report
    from sparsecore.benchmark.cpu import run_cpu_benchmark
    from sparsecore.benchmark.timing import machine_description

    argv = list(sys.argv[1:] if argv is None else argv)
    arguments = build_parser().parse_args(argv)
    if arguments.suite == "targets":
        from sparsecore.benchmark.device_targets import format_verdicts, judge
        from sparsecore.benchmark.network_suite import rows_from_json

        rows = []
        for path in arguments.json:
            try:
                rows += rows_from_json(path)[1]
            except (OSError, ValueError, KeyError, TypeError) as error:  # judge what there is; say what is not
                print(f"no benchmark table from {path}: {type(error).__name__}: {error}")
        verdicts = judge(rows)
        print(format_verdicts(verdicts), end="")
        return 0 if all(verdict.outcome == "PASS" for verdict in verdicts) else 1
    if arguments.suite == "int8":
        return int8_suite.run_int8_command(arguments)
    if arguments.suite == "runtime":
        return runtime_suite.run_runtime_command(arguments)
    if arguments.suite == "contention":
        return contention_suite.run_contention_command(arguments)
    if arguments.suite in ("network", "gpu"):
        from sparsecore.benchmark.network_command import run_network_command

        return run_network_command(arguments, argv, allow_reexec)
    if arguments.repeat < 1:
        raise SystemExit(f"--repeat must be at least 1, got {arguments.repeat}")
    from sparsecore.benchmark.timing import busy_process, measure_peaks

    with contextlib.ExitStack() as stack:
        threads_applied = stack.enter_context(thread_limit(arguments.threads, argv, allow_reexec))
        threads = sparsecore_threads(stack, arguments.threads)
        load = stack.enter_context(busy_process()) if arguments.busy else "none added"
        try:
            inputs = load_inputs(arguments)
        except (OSError, ValueError) as error:
            raise SystemExit(f"error: {error}") from None
        peaks = measure_peaks(threads)
        rows, spconv_status = run_cpu_benchmark(inputs, arguments.repeat, not arguments.no_spconv, peaks)
        header = machine_description()
    scene = inputs.scene
    header.update(
        {
            "threads requested": f"{threads_applied}; sparsecore passes {threads}",
            "load": f"{load}; 1-minute load average {os.getloadavg()[0]:.1f} at the end (a shared machine: "
            "compare ratios within one run, not times across runs)",
            "peaks": f"{peaks.gflops:.0f} GFLOP/s (float32 1024^3 matmul, {peaks.threads} BLAS threads), "
            f"{peaks.gigabytes_per_second:.1f} GB/s (256 MB copy), measured in this process",
            "spconv": f"{header['spconv']}, {spconv_status}",
            "scene": f"{scene.source}: {len(scene.indices)} voxels, spatial shape {scene.spatial_shape}, "
            f"batch {scene.batch_size}",
            "points": f"{inputs.points_source}: {len(inputs.points)} points",
            "timing": (f"median of {arguments.repeat} after 1 warm-up, time.perf_counter, float32; sparsecore and "
                       "spconv taking turns run by run"),
        }
    )
    print(report.format_table(header, rows), end="")
    if arguments.json:
        report.write_json(arguments.json, header, rows)
    if arguments.plot:
        from sparsecore.benchmark.plots import plot_cpu

        plot_cpu(header, rows, arguments.plot)
    disagreements = [row for row in rows if row.agreement.startswith("MISMATCH")]
    return 1 if disagreements else 0
