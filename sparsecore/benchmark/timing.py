"""Timing helpers and a description of the machine, for the benchmark's header.

Times are medians over several repeats of ``time.perf_counter`` intervals,
after one untimed warm-up call.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

__all__ = [
    "THREAD_VARIABLES",
    "median_seconds",
    "median_seconds_with_setup",
    "cpu_model",
    "blas_thread_count",
    "machine_description",
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
