"""numba for the CPU kernels, and the one line sparsecore writes when it compiles one of them.

Every wrapper of a compiled CPU kernel loads numba through `numba_for_kernels`
(`sparsecore.threads.numba_module`, which sizes numba's thread pool, plus a
listener on numba's compile events). numba compiles a kernel on its first call
with a new signature unless its on-disk cache already holds it; the first such
compile of a sparsecore kernel in a process logs one line on the ``sparsecore``
logger, naming the cache folder, so that a first call that takes seconds does
not look hung; it says how long a first network's compile takes
(`FIRST_COMPILE_CPU_SECONDS`, measured). Later compiles in the process, and runs that load every kernel
from the cache, log nothing.

Why the ``logging`` module, at WARNING: with no logging configured, Python's
last-resort handler writes the bare message to stderr, one line; an application
that configures logging gets it through its own handlers; anyone can silence it
with ``logging.getLogger("sparsecore").setLevel(logging.ERROR)``; and unlike
``warnings.warn`` it never becomes an exception under ``-W error`` or a test
suite's warnings-as-errors.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from .threads import numba_module

__all__ = ["LOGGER_NAME", "FIRST_COMPILE_CPU_SECONDS", "numba_for_kernels", "notice", "cache_folder"]

LOGGER_NAME = "sparsecore"
"""The logger the compile notice goes to."""

FIRST_COMPILE_CPU_SECONDS = 22
"""CPU seconds numba spent compiling the kernels of a first network: ``python -m sparsecore.demo`` with an
empty ``NUMBA_CACHE_DIR`` used 27.3 s of CPU time against 5.4 s with the cache filled (2-core AMD EPYC VM,
2026-12-07 18:53 UTC). The machine was loaded (load average 18 to 57, other users' jobs), so the
wall-clock time was 286 s against 55; on an idle machine the wall-clock time is about the CPU time."""


def cache_folder(dispatcher: Any) -> str:
    """Where numba caches ``dispatcher``'s compiled code (``NUMBA_CACHE_DIR``, the ``__pycache__`` beside the
    source, or numba's user-wide folder), or a phrase saying it is not cached."""
    cache = getattr(dispatcher, "_cache", None)
    try:
        path = str(cache._cache_path)  # numba's FunctionCache; a NullCache has none
    except AttributeError:
        return "nowhere (this kernel is compiled anew in every process)"
    import numba

    root = str(getattr(numba.config, "CACHE_DIR", "") or "")
    return root if root and path.startswith(root) else path  # NUMBA_CACHE_DIR: its root (a folder per module)


def notice(folder: str) -> str:
    """The notice's one line."""
    return (f"sparsecore: compiling CPU kernels on first use (about {FIRST_COMPILE_CPU_SECONDS} s of CPU time "
            f"for a first network, longer on a busy machine; once per machine and array type; cached in {folder})")


@functools.lru_cache(maxsize=1)
def numba_for_kernels() -> Any:
    """The ``numba`` module (`sparsecore.threads.numba_module`), with the compile listener registered once."""
    numba = numba_module()
    from numba.core import event

    class _FirstCompile(event.Listener):
        """Logs the first compile of a sparsecore kernel in this process (numba compiles under one global
        lock, so the flag needs no lock of its own)."""

        def __init__(self) -> None:
            self.logged = False

        def on_start(self, compile_event: Any) -> None:
            if self.logged:
                return
            dispatcher = compile_event.data.get("dispatcher")
            module = getattr(getattr(dispatcher, "py_func", None), "__module__", "") or ""
            if module.startswith("sparsecore."):
                self.logged = True
                logging.getLogger(LOGGER_NAME).warning(notice(cache_folder(dispatcher)))

        def on_end(self, compile_event: Any) -> None:
            pass

    event.register("numba:compile", _FirstCompile())
    return numba
