"""The numba kernels behind `sparsecore.backends._cpu_kernels` (imported only on first use).

Plain loops that numba compiles (``parallel=True``, ``cache=True``; the only
fast-math flag is ``contract``, multiply-add fusion, which is the same for
every row whatever the thread count). Every ``prange`` iterates over fixed work
items that write disjoint outputs, so results do not depend on the number of
threads or their scheduling. The row kernel is made by a factory:
their size arguments, when non-zero, are closure constants that numba compiles
in (and its on-disk cache keys on); zero reads the sizes from the arrays.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from numba import njit, prange

__all__ = ["fill_table", "make_rows_kernel"]

_OPTIONS = {"parallel": True, "cache": True, "fastmath": {"contract"}, "nogil": True}


@njit(**_OPTIONS)
def fill_table(keys: Any, values: Any, starts: Any, table: Any, collisions: Any) -> None:
    """``table[key // B, k, key % B] = value`` for offset ``k``'s pairs (``B = table.shape[2]``);
    ``collisions[k]``: keys seen twice within offset ``k``."""
    block = table.shape[2]
    for offset in prange(table.shape[1]):
        count = 0
        for pair in range(starts[offset], starts[offset + 1]):
            key = keys[pair]
            if table[key // block, offset, key % block] >= 0:
                count += 1
            table[key // block, offset, key % block] = values[pair]
        collisions[offset] = count


def make_rows_kernel(groups_constant: int, in_constant: int, out_constant: int,
                     block: int) -> Callable[..., None]:
    """``kernel(source, table, matrices, out)``: ``out[d] += sum_k source[table[k, d]] @ matrices[k]``.

    Args:
        groups_constant: channel groups compiled in, or 0 to read them from ``matrices``.
        in_constant: input channels per group compiled in, or 0.
        out_constant: output channels per group compiled in, or 0.
        block: destination rows per work item.
    """

    def accumulate(source: Any, table: Any, matrices: Any, out: Any) -> None:
        groups = groups_constant if groups_constant else matrices.shape[1]
        in_per_group = in_constant if in_constant else matrices.shape[2]
        out_per_group = out_constant if out_constant else matrices.shape[3]
        width = groups * out_per_group
        volume = table.shape[1]
        rows = out.shape[0]
        for item in prange(table.shape[0]):
            accumulator = np.empty(width, dtype=out.dtype)
            for row in range(item * block, min(rows, (item + 1) * block)):
                for column in range(width):
                    accumulator[column] = out[row, column]
                for offset in range(volume):
                    neighbour = table[item, offset, row - item * block]
                    if neighbour < 0:
                        continue
                    for group in range(groups):
                        for channel in range(in_per_group):
                            value = source[neighbour, group * in_per_group + channel]
                            for column in range(out_per_group):
                                accumulator[group * out_per_group + column] += (
                                    value * matrices[offset, group, channel, column])
                for column in range(width):
                    out[row, column] = accumulator[column]

    return njit(**_OPTIONS)(accumulate)
