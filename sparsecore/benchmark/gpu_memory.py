"""Peak GPU memory of one sparsecore layer, read from CuPy's memory pool.

A CuPy memory hook sees every block the pool hands out and takes back; the
peak of (handed out - taken back) while the layer runs is the layer's peak
working memory. Inputs allocated before the hook starts are not counted.
The pool's own reservation (``total_bytes``) is reported beside it: CuPy
keeps freed blocks for reuse, so its growth is what the layer costs the
process in device memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["PoolPeak", "measure_pool_peak"]


@dataclass(frozen=True)
class PoolPeak:
    """Device memory one run used.

    Attributes:
        peak_bytes: peak of the bytes handed out by the pool and not yet freed.
        reserved_growth_bytes: growth of the pool's reservation during the run.
        blocks: number of pool allocations made.
    """

    peak_bytes: int
    reserved_growth_bytes: int
    blocks: int


def _peak_hook_class(cupy: Any) -> type:
    """A `cupy.cuda.MemoryHook` subclass that follows the bytes in use (made lazily: needs CuPy)."""

    class PeakHook(cupy.cuda.MemoryHook):
        name = "sparsecore_benchmark_peak"

        def __init__(self) -> None:
            self.in_use = 0
            self.peak = 0
            self.blocks = 0
            self.sizes: dict[int, int] = {}

        def malloc_postprocess(self, **kwargs: Any) -> None:
            pointer, size = int(kwargs["mem_ptr"]), int(kwargs["mem_size"])
            if pointer == 0:
                return
            self.sizes[pointer] = size
            self.in_use += size
            self.blocks += 1
            self.peak = max(self.peak, self.in_use)

        def free_postprocess(self, **kwargs: Any) -> None:
            # blocks allocated before the hook started are not in ``sizes``
            self.in_use -= self.sizes.pop(int(kwargs["mem_ptr"]), 0)

    return PeakHook


def measure_pool_peak(cupy: Any, work: Callable[[], Any]) -> PoolPeak:
    """Runs ``work()`` once under a memory hook and reports its device memory.

    Args:
        cupy: the ``cupy`` module.
        work: the run to measure (its result is dropped before the peak is read).

    Returns:
        The peak, the pool's growth and the allocation count.
    """
    pool = cupy.get_default_memory_pool()
    cupy.cuda.get_current_stream().synchronize()
    reserved_before = pool.total_bytes()
    hook = _peak_hook_class(cupy)()
    with hook:
        result = work()
        cupy.cuda.get_current_stream().synchronize()
        del result
    return PoolPeak(hook.peak, int(pool.total_bytes() - reserved_before), hook.blocks)
