"""How the benchmark commands apply ``--threads``: NumPy's BLAS threads and sparsecore's own.

Shared by the ``cpu`` command (`sparsecore.benchmark.cli`) and the ``network``
command (`sparsecore.benchmark.network_command`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator, Sequence

from sparsecore.benchmark.timing import THREAD_VARIABLES

__all__ = ["thread_limit", "sparsecore_threads"]


@contextlib.contextmanager
def thread_limit(threads: int | None, argv: Sequence[str], allow_reexec: bool) -> Iterator[str]:
    """Limits NumPy's BLAS threads for the duration of the benchmark.

    NumPy reads the thread variables when it loads its BLAS, which has already
    happened by the time this package runs. So: threadpoolctl when it is
    installed; otherwise, when allowed, the process starts itself again with
    the variables set (``os.execv``); otherwise a warning.

    Args:
        threads: the thread count wanted, or None to leave it alone.
        argv: the command-line arguments, to start again with.
        allow_reexec: whether replacing the process is acceptable (only when
            run as ``python -m sparsecore.benchmark``).

    Yields:
        How the thread count was applied, for the header.
    """
    if threads is None or threads == 0:
        yield "as configured"
        return
    if threads < 1:
        raise SystemExit(f"--threads must be at least 1, got {threads}")
    wanted = str(threads)
    if all(os.environ.get(variable) == wanted for variable in THREAD_VARIABLES):
        yield f"{threads} (environment)"
        return
    try:
        import threadpoolctl
    except ImportError:
        threadpoolctl = None
    if threadpoolctl is not None:
        with threadpoolctl.threadpool_limits(limits=threads):
            yield f"{threads} (threadpoolctl)"
        return
    if allow_reexec:
        environment = dict(os.environ)
        environment.update({variable: wanted for variable in THREAD_VARIABLES})
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "sparsecore.benchmark", *argv], environment)
    print(
        f"warning: --threads {threads} not applied: install threadpoolctl, or set "
        f"{', '.join(THREAD_VARIABLES)} before starting Python",
        file=sys.stderr,
    )
    yield "as configured (--threads not applied)"


def sparsecore_threads(stack: contextlib.ExitStack, threads: int | None) -> int:
    """Runs sparsecore's CPU passes on ``threads`` for the rest of ``stack`` (0 or None: its default)."""
    import sparsecore

    if threads:
        try:
            stack.enter_context(sparsecore.num_threads(threads))
        except ValueError as error:
            raise SystemExit(f"error: --threads {threads}: {error}") from None
    return sparsecore.get_num_threads()
