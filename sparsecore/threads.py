"""How many CPU threads sparsecore's feature passes use: its compiled kernels and NumPy's BLAS.

The CPU feature passes (`sparsecore.conv`) run compiled kernels on numba's
thread pool and matrix products on NumPy's BLAS. Inside each call the library
runs both on the same number of threads, so the BLAS pool never adds its own
threads on top of the kernels' (or of the caller's).

Where the setting lives: in numba, which holds it per calling thread
(``numba.set_num_threads``); this module keeps no state of its own. The
default, fixed when numba loads on the first CPU feature pass, is the first of
``NUMBA_NUM_THREADS``, ``SPARSECORE_NUM_THREADS``, ``OMP_NUM_THREADS`` that is
set, else the number of usable cores; it is also the most threads a process
can ask for later (numba sizes its pool once). The result of every pass is
bitwise identical at every thread count.

Threading layers: numba runs its parallel kernels on the first layer that
loads of TBB, OpenMP and its own ``workqueue`` (or the one
``NUMBA_THREADING_LAYER`` names). TBB and OpenMP accept parallel kernels
launched from several Python threads at once; ``workqueue`` does not (it aborts
the process: "Concurrent access has been detected"). Under ``workqueue`` the
library's entry points that launch compiled kernels (`sparsecore.build_rulebook`,
`sparsecore.conv_forward`, `sparsecore.conv_backward`, a
`sparsecore.runtime.Session` run) take one process-wide lock
(`serialised_kernels`), so threads sharing them queue instead of crashing;
under the other layers nothing is locked.

Waiting threads on a shared machine: an OpenMP runtime (libgomp, which
numba's ``omp`` layer and torch's CPU build share) keeps an idle thread
spinning for a while after every parallel region (libgomp: 300,000 spins
unless ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` say otherwise). On a quiet
machine that saves a wake-up; beside other busy processes the spinning
threads take the CPU the working ones need, and every barrier waits for a
thread the scheduler has parked (a sparsecore.torch training step beside 2
busy processes on 2 cores: 7.2x its time alone, 2026-12-07). So when
sparsecore is imported before any OpenMP runtime is loaded and none of
`WAIT_VARIABLES` is set, it sets ``OMP_WAIT_POLICY=PASSIVE`` for the runtime
that loads later (waiting threads sleep). ``OMP_WAIT_POLICY=ACTIVE`` keeps
the spinning; a runtime loaded before sparsecore (``import torch`` first)
keeps its own setting: `openmp_wait_policy` says which happened.

Example:
    >>> import sparsecore as sc
    >>> sc.set_num_threads(1)          # this thread, from now on
    >>> with sc.num_threads(2):        # only inside the block
    ...     out = sc.conv_forward(features, weight, rulebook)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys
import threading
import warnings
from typing import Any, Iterator, Optional

__all__ = [
    "THREAD_VARIABLES",
    "default_num_threads",
    "get_num_threads",
    "set_num_threads",
    "num_threads",
    "blas_threads",
    "numba_module",
    "threading_layer",
    "THREAD_SAFE_LAYERS",
    "serialised_kernels",
    "WAIT_VARIABLES",
    "openmp_wait_policy",
    "SharedMachineWarning",
    "warn_if_spinning_under_load",
]

THREAD_SAFE_LAYERS = ("tbb", "omp")
"""numba threading layers that accept parallel kernels launched from several threads at once."""

THREAD_VARIABLES = ("NUMBA_NUM_THREADS", "SPARSECORE_NUM_THREADS", "OMP_NUM_THREADS")
"""Environment variables read, in this order, for the default thread count."""


WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
"""Variables that set how an OpenMP runtime's idle threads wait; sparsecore sets none when one is set."""


def _loaded_openmp_paths() -> tuple[str, ...]:
    """Paths of the OpenMP runtimes (libgomp, libomp, libiomp5) loaded in this process (Linux; else none)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:
        return ()
    return tuple(sorted(path for path in paths if os.path.basename(path).startswith(("libgomp", "libomp", "libiomp"))))


@dataclasses.dataclass(frozen=True)
class _WaitDecision:
    """How the OpenMP runtime's idle threads wait, decided at import.

    Attributes:
        text: what was decided and by whom (`openmp_wait_policy`).
        spinning_runtime: the runtime loaded before sparsecore with its default (spinning) waits, e.g.
            ``"libgomp.so.1"``; empty where the waits are passive or chosen in the environment.
    """

    text: str
    spinning_runtime: str = ""


def _prefer_passive_openmp_waits() -> _WaitDecision:
    """Sets ``OMP_WAIT_POLICY=PASSIVE`` when no OpenMP runtime is loaded yet and no `WAIT_VARIABLES` is set.

    Returns:
        What was decided, for `openmp_wait_policy` and `warn_if_spinning_under_load`.
    """
    chosen = [f"{variable}={os.environ[variable]}" for variable in WAIT_VARIABLES if os.environ.get(variable)]
    if chosen:
        return _WaitDecision(f"as set in the environment ({', '.join(chosen)})")
    loaded = _loaded_openmp_paths()
    if loaded:
        runtime = os.path.basename(loaded[0])
        return _WaitDecision(f"the runtime's default (active spinning): {runtime} was loaded before sparsecore (e.g. "
                             "by torch); set OMP_WAIT_POLICY=PASSIVE before starting Python on a shared machine", runtime)
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return _WaitDecision("PASSIVE (set by sparsecore: no OpenMP runtime was loaded and no wait variable was set)")


_WAIT_DECISION = _prefer_passive_openmp_waits()  # decided once, at import, before numba or torch loads a runtime


def openmp_wait_policy() -> str:
    """How the OpenMP runtime's idle threads wait in this process, and who decided it (see the module's notes)."""
    return _WAIT_DECISION.text


class SharedMachineWarning(RuntimeWarning):
    """CPU passes on a busy machine while the OpenMP runtime's idle threads spin (see `warn_if_spinning_under_load`)."""


def warn_if_spinning_under_load() -> None:
    """Warns once (`SharedMachineWarning`) when the OpenMP runtime spins on a machine busier than its cores.

    Called by the CPU feature passes. Where the runtime was loaded before sparsecore with its default
    waits (``import torch`` first, no `WAIT_VARIABLES` set: `openmp_wait_policy` says so), its idle
    threads spin after every parallel region; beside other busy processes that takes the cores the
    working threads need (a sparsecore.torch training step on 2 cores beside 4 busy processes: 6.6x its
    quiet time with torch imported first, 3.1-3.9x with sparsecore first, 2026-12-07). The warning
    fires when the 1-minute load average reaches the usable cores plus this process's threads, and
    says what to set. Nothing is checked when the waits are passive or chosen in the environment.
    """
    if not _WAIT_DECISION.spinning_runtime:
        return
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # pragma: no cover - no load average on this platform
        return
    cores = _usable_cores()
    if load < cores + get_num_threads():
        return
    warnings.warn(
        f"sparsecore: this machine is busy (load average {load:.1f} on {cores} usable cores) and the OpenMP "
        f"runtime's idle threads spin after every parallel region ({_WAIT_DECISION.spinning_runtime} was loaded "
        "before sparsecore, e.g. by torch)"
        ", which takes the cores the working threads need: set OMP_WAIT_POLICY=PASSIVE in the environment before "
        "starting Python, or import sparsecore before torch (docs/performance.md, 'On a shared machine')",
        SharedMachineWarning, stacklevel=3)


def _usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


def default_num_threads() -> int:
    """The default thread count: the first valid of `THREAD_VARIABLES`, else the usable cores.

    Raises:
        ValueError: a variable that is set but is not a positive integer.
    """
    for variable in THREAD_VARIABLES:
        value = os.environ.get(variable, "").strip()
        if not value:
            continue
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{variable}={value!r} must be a positive integer (a thread count), e.g. {variable}=2")
        return int(value)
    return _usable_cores()


@functools.lru_cache(maxsize=1)
def numba_module() -> Any:
    """The ``numba`` module, imported on first use (it costs about 0.3 s).

    Its thread pool is sized when it loads: unless ``NUMBA_NUM_THREADS`` is set (or
    numba was imported already), it is set to `default_num_threads` first, so
    ``SPARSECORE_NUM_THREADS`` and ``OMP_NUM_THREADS`` are honoured.

    Raises:
        ImportError: numba does not import (it is an install requirement).
    """
    first = "numba" not in sys.modules
    if first and "NUMBA_NUM_THREADS" not in os.environ:
        os.environ["NUMBA_NUM_THREADS"] = str(default_num_threads())
    # numba's OpenMP threading layer resets the calling thread's OpenMP thread count when it
    # starts, which silently changed torch's torch.set_num_threads (torch shares the runtime);
    # start it here, once, and put back what every OpenMP runtime already loaded had
    runtimes = _loaded_openmp_runtimes() if first else ()
    before = [runtime.omp_get_max_threads() for runtime in runtimes]
    try:
        import numba
    except ImportError as error:  # pragma: no cover - numba is an install requirement
        raise ImportError(
            f"sparsecore's CPU feature passes need numba, which does not import here ({error}); "
            "install it with `pip install numba` (a requirement of sparsecore)"
        ) from None
    if first:
        numba.get_num_threads()  # starts the threading layer now
        for runtime, threads in zip(runtimes, before):
            runtime.omp_set_num_threads(threads)
    return numba


def _loaded_openmp_runtimes() -> tuple[Any, ...]:
    """The OpenMP runtimes (libgomp, libomp, libiomp5) already loaded in this process, as ctypes
    libraries (Linux: read from ``/proc/self/maps``; elsewhere none)."""
    import ctypes

    runtimes = []
    for path in _loaded_openmp_paths():
        try:
            runtime = ctypes.CDLL(path)
            runtime.omp_get_max_threads.restype = ctypes.c_int
            runtimes.append(runtime)
        except (OSError, AttributeError):
            continue
    return tuple(runtimes)


def _numba() -> Any:
    return numba_module()


def _check_count(threads: Any, name: str = "threads") -> int:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"{name} must be a positive int (a thread count), got {threads!r}")
    return threads


def get_num_threads() -> int:
    """The threads the calling thread's CPU feature passes use (kernels and BLAS alike)."""
    return int(_numba().get_num_threads())


def set_num_threads(threads: int) -> None:
    """Sets the threads of the calling thread's CPU feature passes (kernels and BLAS inside them).

    Args:
        threads: at least 1 and at most the pool size (`default_num_threads` when numba
            loaded, or ``NUMBA_NUM_THREADS``).

    Raises:
        ValueError: ``threads`` is not a positive int, or exceeds the pool size.
    """
    _check_count(threads)
    numba = _numba()
    limit = int(numba.config.NUMBA_NUM_THREADS)
    if threads > limit:
        raise ValueError(
            f"threads={threads} exceeds this process's thread pool of {limit}, sized when sparsecore first "
            f"loaded numba; start the process with SPARSECORE_NUM_THREADS={threads} (or "
            f"NUMBA_NUM_THREADS) to allow more, or ask for at most {limit}"
        )
    numba.set_num_threads(threads)


@contextlib.contextmanager
def num_threads(threads: int) -> Iterator[None]:
    """Runs the block's CPU feature passes on ``threads`` threads, then restores the previous count.

    Args:
        threads: as for `set_num_threads`.
    """
    previous = get_num_threads()
    set_num_threads(threads)
    try:
        yield
    finally:
        set_num_threads(previous)




@contextlib.contextmanager
def blas_threads(threads: int | None = None) -> Iterator[int]:
    """Limits NumPy's BLAS to ``threads`` (default: `get_num_threads`) for the block.

    Used by the CPU feature passes around their BLAS calls; without threadpoolctl
    the BLAS keeps its own setting. The limit covers the BLAS libraries loaded
    when it is first used (NumPy's always; sparsecore calls no other).

    Yields:
        The thread count in force.
    """
    count = get_num_threads() if threads is None else _check_count(threads)
    changed = []
    for library in _blas_libraries():  # set only where it differs: a threadpoolctl limiter costs ~0.1 ms a call
        previous = library.get_num_threads()
        if previous != count:
            library.set_num_threads(count)
            changed.append((library, previous))
    try:
        yield count
    finally:
        for library, previous in reversed(changed):
            library.set_num_threads(previous)


@functools.lru_cache(maxsize=1)
def _blas_libraries() -> tuple[Any, ...]:
    """threadpoolctl's controllers of the BLAS libraries loaded (NumPy's and SciPy's), or none."""
    # numba loads first: it brings in a BLAS of its own (SciPy's, for np.dot in kernels), and a
    # controller sees only the libraries loaded when it is made
    _numba()
    with contextlib.suppress(ImportError):  # SciPy's BLAS runs the tiled kernels' np.dot: load it to limit it
        import scipy.linalg.cython_blas  # noqa: F401
    try:
        import threadpoolctl
    except ImportError:  # pragma: no cover - threadpoolctl is an install requirement
        return ()
    return tuple(threadpoolctl.ThreadpoolController().select(user_api="blas").lib_controllers)


def threading_layer() -> str:
    """The threading layer numba runs parallel kernels on (``"tbb"``, ``"omp"`` or ``"workqueue"``),
    started if it was not yet."""
    numba = numba_module()
    numba.get_num_threads()  # launches the layer when numba was imported by someone else first
    return str(numba.threading_layer())


@functools.lru_cache(maxsize=1)
def _kernel_lock() -> Optional[threading.RLock]:
    """One process-wide lock when the layer is not thread-safe, else None (decided once: a process
    keeps the layer it started)."""
    return None if threading_layer() in THREAD_SAFE_LAYERS else threading.RLock()


_UNLOCKED = contextlib.nullcontext()


def serialised_kernels(like: Any = None) -> contextlib.AbstractContextManager[Any]:
    """The process-wide kernel lock when numba's layer is not thread-safe (``workqueue``), else a
    context that locks nothing (also for GPU work: ``like`` a CuPy array).

    Re-entrant: a locked entry point may call another. Taken only by entry points on their calling
    thread (never inside the worker threads of a pass), so it cannot wait on itself.

    Example:
        >>> with serialised_kernels(features):
        ...     run_compiled_kernels()
    """
    if like is not None and type(like).__module__.split(".")[0] == "cupy":
        return _UNLOCKED
    lock = _kernel_lock()
    return _UNLOCKED if lock is None else lock
