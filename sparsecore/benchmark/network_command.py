"""``python -m sparsecore.benchmark network|gpu``: options, the run, the table, JSON and Markdown."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Sequence

from sparsecore.benchmark import network, report
from sparsecore.benchmark.cases import Row
from sparsecore.benchmark.network_spconv import SPCONV_ALGORITHMS
from sparsecore.benchmark.network_suite import NetworkOptions, run_network_suite
from sparsecore.benchmark.thread_control import sparsecore_threads, thread_limit

__all__ = ["DEFAULTS", "network_options", "summary_markdown", "run_network_command"]

# per-device defaults of the options left unset: repeat, warmup, max_seconds, profile_runs
DEFAULTS = {"cpu": (5, 1, 60.0, 1), "cuda": (30, 3, 6.0, 3)}
_FAILURE_MARKS = ("MISMATCH", "FAILED")


def network_options(arguments: argparse.Namespace) -> NetworkOptions:
    """Resolves the parsed ``network`` / ``gpu`` arguments into `NetworkOptions`.

    Raises:
        SystemExit: on a bad scene, dtype, algorithm or count.
    """
    device = getattr(arguments, "device", "cuda")
    scenes = arguments.scene or (("synthetic",) if arguments.scale else ("basic",))
    for scene in scenes:
        if scene not in network.SCENE_NAMES:
            raise SystemExit(f"--scene: {scene!r} is not one of {', '.join(network.SCENE_NAMES)}")
    dtypes = arguments.dtype or (("float32",) if device == "cpu" else ("float32", "float16", "tf32"))
    for dtype in dtypes:
        if dtype not in network.DTYPE_NAMES:
            raise SystemExit(f"--dtype: {dtype!r} is not one of {', '.join(network.DTYPE_NAMES)}")
    if device == "cpu" and "tf32" in dtypes:
        raise SystemExit("--dtype tf32 is a cuBLAS mode: it needs --device cuda")
    algorithms = arguments.spconv_algo or (("native",) if device == "cpu" else ("native", "implicit_gemm"))
    for algorithm in algorithms:
        if algorithm not in SPCONV_ALGORITHMS:
            raise SystemExit(f"--spconv-algo: {algorithm!r} is not one of {', '.join(SPCONV_ALGORITHMS)}")
    if device == "cpu" and algorithms != ("native",):
        raise SystemExit("spconv's CPU build runs only --spconv-algo native")
    repeat, warmup, max_seconds, profile_runs = DEFAULTS[device]
    options = NetworkOptions(
        device=device,
        scenes=tuple(scenes),
        scale=arguments.scale or "small",
        dtypes=tuple(dtypes),
        repeat=arguments.repeat if arguments.repeat is not None else repeat,
        warmup=arguments.warmup if arguments.warmup is not None else warmup,
        max_seconds=arguments.max_seconds if arguments.max_seconds is not None else max_seconds,
        profile_runs=arguments.profile_runs if arguments.profile_runs is not None else profile_runs,
        compare_spconv=not arguments.no_spconv,
        spconv_algorithms=tuple(algorithms),
        layers=not arguments.no_layers,
        memory=not arguments.no_memory,
        seed=arguments.seed,
        child_timeout=arguments.child_timeout,
        time_limit=arguments.time_limit,
        bitwise=device == "cuda" if arguments.bitwise is None else arguments.bitwise,
    )
    for name in ("repeat", "warmup", "profile_runs"):
        if getattr(options, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {getattr(options, name)}")
    return options


def _is_layer_row(row: Row) -> bool:
    return " L" in row.case and ("SubMConv3d" in row.case or "SparseMaxPool3d" in row.case) \
        and not row.case.startswith("memory")


def summary_markdown(header: dict[str, str], rows: Sequence[Row]) -> str:
    """A short Markdown table: the header and every row but the per-layer ones.

    Args:
        header: the table's header lines.
        rows: the rows.

    Returns:
        The Markdown text.
    """
    lines = ["# sparsecore network benchmark", ""]
    lines += [f"- {label}: {value}" for label, value in header.items()]
    lines += ["", "| case | stage | sparsecore ms | spconv ms | spconv/sparsecore | agree | notes |",
              "| --- | --- | ---: | ---: | ---: | --- | --- |"]
    for row in rows:
        if _is_layer_row(row):
            continue
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}x"
        cells = [row.case, row.stage, report.format_milliseconds(row.sparsecore_ms),
                 report.format_milliseconds(row.spconv_ms), ratio, row.agreement, "; ".join(row.notes)]
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def _full_header(options: NetworkOptions, threads_applied: str, suite_header: dict[str, str]) -> dict[str, str]:
    from sparsecore.benchmark.timing import machine_description

    header = machine_description()
    clock = "CUDA events on the current stream" if options.device == "cuda" else "time.perf_counter"
    header.update({"threads requested": threads_applied, **suite_header})
    turns = ", sparsecore and spconv taking turns run by run" if options.compare_spconv else ""
    header["timing"] = (
        f"median of up to {options.repeat} runs after {options.warmup} warm-up ({clock}), at most "
        f"~{options.max_seconds:g} s per measurement{turns}; "
        f"stage and layer rows from {options.profile_runs} instrumented run(s) with a mark around every gather, "
        "GEMM and scatter"
    )
    if options.device == "cpu":  # the marks need the primitives: that run is per offset, the timed one is not
        header["timing"] += (" (on the CPU the instrumented run takes the per-offset dataflow for every layer, "
                             "so those rows describe it, not the tiled and fused passes the network rows time)")
    header["network"] = "14 SubMConv3d k3 (7 shared rulebooks) + 6 SparseMaxPool3d(2, 2), 3 -> 64 ... 256, batch 1"
    return header


def _write_files(arguments: argparse.Namespace, header: dict[str, str], rows: Sequence[Row]) -> None:
    if arguments.json:
        report.write_json(arguments.json, header, rows)
    if arguments.markdown:
        Path(arguments.markdown).write_text(summary_markdown(header, rows), encoding="utf-8")


def run_network_command(arguments: argparse.Namespace, argv: Sequence[str], allow_reexec: bool) -> int:
    """Runs the ``network`` or ``gpu`` suite and prints its table.

    Args:
        arguments: the parsed arguments.
        argv: the command line, for a restart that applies ``--threads``.
        allow_reexec: whether such a restart is allowed.

    Returns:
        0, or 1 when a case failed or sparsecore and spconv disagree.
    """
    options = network_options(arguments)
    threads = arguments.threads if options.device == "cpu" else None
    with contextlib.ExitStack() as stack:
        threads_applied = stack.enter_context(thread_limit(threads, argv, allow_reexec))
        if threads:  # sparsecore's own passes on the same count (spconv runs on one torch thread)
            threads_applied = f"{threads_applied}; sparsecore passes {sparsecore_threads(stack, threads)}"
        started = time.monotonic()

        def save_progress(suite_header: dict[str, str], rows: list[Row]) -> None:
            last = rows[-1] if rows else None
            print(f"[sparsecore.benchmark {time.monotonic() - started:.0f} s] {len(rows)} rows; last: "
                  f"{last.case if last else '-'}", file=sys.stderr, flush=True)
            _write_files(arguments, _full_header(options, threads_applied, suite_header), rows)

        try:
            suite_header, rows = run_network_suite(options, save_progress)
        except RuntimeError as error:
            raise SystemExit(f"error: {error}") from None
        header = _full_header(options, threads_applied, suite_header)
    print(report.format_table(header, rows), end="")
    _write_files(arguments, header, rows)
    if options.device == "cuda":
        from sparsecore.benchmark.device_targets import format_verdicts, judge

        print("\nissue 28's device targets:\n" + format_verdicts(judge(rows)), end="")
    if arguments.plot:
        from sparsecore.benchmark.plots import plot_network

        plot_network(header, rows, arguments.plot)
    failed = [row for row in rows if row.agreement.startswith(_FAILURE_MARKS)]
    return 1 if failed else 0
