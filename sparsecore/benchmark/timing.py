"""Timing helpers and a description of the machine, for the benchmark's header.

Times are medians over several repeats of ``time.perf_counter`` intervals,
after one untimed warm-up call.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

__all__ = [
    "THREAD_VARIABLES",
    "median_seconds",
    "median_seconds_with_setup",
    "time_alternating",
    "VariantTiming",
    "summarize_times",
    "add_scan_suite_parser",
    "cpu_model",
    "blas_thread_count",
    "machine_description",
    "MachinePeaks",
    "measure_peaks",
    "busy_process",
]

THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def median_seconds(function: Callable[[], Any], repeat: int, warmup: int = 1) -> float:
    """Median wall time of calling ``function`` with no arguments.

    Args:
        function: the work to time.
        repeat: number of timed calls (at least 1).
        warmup: untimed calls made first.

    Returns:
        The median duration in seconds.
    """
    return median_seconds_with_setup(lambda: None, lambda _: function(), repeat, warmup)


def median_seconds_with_setup(
    setup: Callable[[], Any], function: Callable[[Any], Any], repeat: int, warmup: int = 1
) -> float:
    """Median wall time of ``function(setup())``, timing only ``function``.

    Used where each timed call needs fresh state, such as a backward pass that
    needs a new autograd graph.

    Args:
        setup: builds the argument for one call (not timed).
        function: the work to time, given what ``setup`` returned.
        repeat: number of timed calls (at least 1).
        warmup: untimed calls made first.

    Returns:
        The median duration in seconds.

    Raises:
        ValueError: when ``repeat`` is below 1.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    for _ in range(warmup):
        function(setup())
    durations = []
    for _ in range(repeat):
        argument = setup()
        start = time.perf_counter()
        function(argument)
        durations.append(time.perf_counter() - start)
    return statistics.median(durations)


def time_alternating(functions: dict[str, Callable[[], Any]], repeat: int, synchronize: Callable[[], None]
                     ) -> dict[str, list[float]]:
    """Milliseconds of each function over ``repeat`` rounds, the functions taking turns; one warm-up round.

    Taking turns spreads the load of a machine shared with other work over every variant alike.

    Args:
        functions: the variants by name, each called with no arguments.
        repeat: timed rounds.
        synchronize: waits for queued device work (``lambda: None`` on the CPU), before and after each call.

    Returns:
        Per name, ``repeat`` durations in milliseconds, in round order.
    """
    times: dict[str, list[float]] = {name: [] for name in functions}
    for round_index in range(repeat + 1):  # round 0 warms up
        for name, function in functions.items():
            synchronize()
            start = time.perf_counter()
            function()
            synchronize()
            if round_index:
                times[name].append((time.perf_counter() - start) * 1e3)
    return times


@dataclass(frozen=True)
class VariantTiming:
    """One variant's times over `time_alternating`'s rounds (a suite's row adds its own fields).

    Attributes:
        variant: the variant's name.
        median_ms: median over the timed rounds.
        min_ms: fastest round.
    """

    variant: str
    median_ms: float
    min_ms: float


def summarize_times(times: dict[str, list[float]], baseline: str) -> dict[str, tuple[float, float, float]]:
    """Per variant of `time_alternating`'s result: median ms, minimum ms, and the baseline's median over the
    variant's median (> 1: faster than the baseline)."""
    reference = statistics.median(times[baseline])
    return {name: (statistics.median(values), min(values), reference / statistics.median(values))
            for name, values in times.items()}


def add_scan_suite_parser(suites: Any, name: str, help_text: str, description: str, repeat: int,
                          voxels_file_name: str) -> Any:
    """Registers a sub-command whose variants take turns on the voxelized scan; returns its parser.

    The parser has ``--device`` (cpu / cuda), ``--repeat`` (timed rounds, default ``repeat``),
    ``--voxels`` (the scan, default ``voxels_file_name`` in the data directories) and ``--json``;
    the suite adds its own options.
    """
    parser = suites.add_parser(name, help=help_text, description=description)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeat", type=int, default=repeat, help="timed runs per variant (alternating)")
    parser.add_argument("--voxels", metavar="PATH", help=f"voxelized scan (default: {voxels_file_name})")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    return parser


def cpu_model() -> str:
    """The CPU's model name, from ``/proc/cpuinfo`` where it exists."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def blas_thread_count() -> str:
    """How many threads NumPy's BLAS uses, as well as can be told.

    Returns:
        The thread count reported by threadpoolctl when it is installed, else the
        first thread variable set in the environment, else ``"default"``.
    """
    try:
        import threadpoolctl
    except ImportError:
        threadpoolctl = None
    if threadpoolctl is not None:
        counts = sorted(
            {str(pool["num_threads"]) for pool in threadpoolctl.threadpool_info() if pool.get("user_api") == "blas"}
        )
        if counts:
            return "/".join(counts)
    for variable in THREAD_VARIABLES:
        if os.environ.get(variable):
            return os.environ[variable]
    return "default"


def _version_of(module_name: str) -> str:
    module = sys.modules.get(module_name)
    if module is None:
        return "not imported"
    return str(getattr(module, "__version__", "unknown"))


def machine_description() -> dict[str, str]:
    """Machine, library versions, thread counts and date, for the table's header.

    Returns:
        An ordered mapping of labels to values. Versions are read only from
        modules already imported (torch and spconv are imported by the spconv
        comparison, not here).
    """
    try:
        usable_cores = len(os.sched_getaffinity(0))
    except AttributeError:
        usable_cores = os.cpu_count() or 0
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": cpu_model(),
        "cores": f"{usable_cores} usable of {os.cpu_count()}",
        "python": platform.python_version(),
        "numpy": _version_of("numpy"),
        "torch": _version_of("torch"),
        "spconv": _version_of("spconv"),
        "blas threads": blas_thread_count(),
    }


@dataclass(frozen=True)
class MachinePeaks:
    """What this process reaches on this machine, for the rows' "% of peak".

    Attributes:
        gflops: float32 GEMM rate (a 1024^3 NumPy ``matmul``, BLAS on ``threads`` threads), GFLOP/s.
        gigabytes_per_second: memory rate of a 256 MB ``numpy.copyto`` (bytes read plus written), GB/s.
        threads: the thread count both were measured at.
    """

    gflops: float
    gigabytes_per_second: float
    threads: int


def measure_peaks(threads: int, repeat: int = 3) -> MachinePeaks:
    """Measures `MachinePeaks` in this process (medians of ``repeat`` runs, after a warm-up).

    Args:
        threads: BLAS threads for the GEMM (limited with threadpoolctl where installed).
        repeat: timed runs of each.
    """
    import numpy as np

    generator = np.random.default_rng(0)
    size = 1024
    left = generator.standard_normal((size, size), dtype=np.float32)
    right = generator.standard_normal((size, size), dtype=np.float32)
    try:
        import threadpoolctl

        limit: Any = threadpoolctl.threadpool_limits(limits=threads, user_api="blas")
    except ImportError:  # pragma: no cover - threadpoolctl is an install requirement
        limit = contextlib.nullcontext()
    with limit:
        gemm_seconds = median_seconds(lambda: np.matmul(left, right), repeat)
    source = np.ones(64 * 1024 * 1024, dtype=np.float32)
    target = np.empty_like(source)
    copy_seconds = median_seconds(lambda: np.copyto(target, source), repeat)
    return MachinePeaks(2.0 * size**3 / gemm_seconds / 1e9, 2.0 * source.nbytes / copy_seconds / 1e9, threads)


@contextlib.contextmanager
def busy_process() -> Iterator[str]:
    """Runs one spinning Python process beside the block (``--busy``), and stops it after.

    Yields:
        A description for the table's header.
    """
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"one spinning process beside the run (pid {process.pid})"
    finally:
        process.terminate()
        process.wait(timeout=30)
