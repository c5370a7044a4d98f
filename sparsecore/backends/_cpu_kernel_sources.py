"""The numba kernels behind `sparsecore.backends._cpu_kernels` and `_int8_cpu_kernels` (imported on first use).

Plain loops that numba compiles (``parallel=True``, ``cache=True``; the only
fast-math flag is ``contract``, multiply-add fusion, which is the same for
every row whatever the thread count). The float kernels run one ``prange``
iteration per thread, each claiming fixed work items from a shared counter
(`_work_queue`: a thread slowed by another process claims fewer); items write
disjoint outputs, so results do not depend on the number of threads or their
scheduling (the int8 kernel has no fast-math at all: its
float32 epilogue rounds every step). The float and int8 row kernels are made
by factories (`make_rows_kernel`, `make_int8_rows_kernel`, both sizing
through `layer_sizes`): their size arguments, when non-zero, are closure
constants that numba compiles in (and its on-disk cache keys on); zero reads
the sizes from the arrays.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from numba import njit, prange

from ._work_queue import claim, new_counter  # new_counter: no parallel region of its own

__all__ = ["fill_table", "layer_sizes", "make_rows_kernel", "make_int8_rows_kernel",
           "int8_epilogue_row"]

_OPTIONS = {"parallel": True, "cache": True, "fastmath": {"contract"}, "nogil": True}


@njit(**_OPTIONS)
def fill_table(keys: Any, values: Any, starts: Any, table: Any, collisions: Any, lanes: int) -> None:
    """``table[key // B, k, key % B] = value`` for offset ``k``'s pairs (``B = table.shape[2]``);
    ``collisions[k]``: keys seen twice within offset ``k``. Work items are offsets, claimed by ``lanes``
    threads (`_work_queue`)."""
    block, volume = table.shape[2], table.shape[1]
    counter = new_counter()
    for lane in prange(min(lanes, volume)):  # noqa: B007 (one iteration per thread)
        offset = claim(counter)
        while offset < volume:
            count = 0
            for pair in range(starts[offset], starts[offset + 1]):
                key = keys[pair]
                if table[key // block, offset, key % block] >= 0:
                    count += 1
                table[key // block, offset, key % block] = values[pair]
            collisions[offset] = count
            offset = claim(counter)


@njit(inline="always")
def layer_sizes(groups_constant: int, in_constant: int, out_constant: int, table: Any, matrices: Any,
                out: Any) -> tuple[int, int, int, int, int]:
    """``(groups, in_per_group, out_per_group, volume, rows)`` of a row kernel's arrays, inlined into it.

    A row kernel passes its closure constants (non-zero: compiled in, so LLVM sees them
    once this is inlined; zero: read the size from ``matrices [K, groups, a, b]``).
    ``volume`` is ``table.shape[1]`` (the kernel offsets), ``rows`` is ``out.shape[0]``.
    Shared by the float and the int8 row kernels.
    """
    groups = groups_constant if groups_constant else matrices.shape[1]
    in_per_group = in_constant if in_constant else matrices.shape[2]
    out_per_group = out_constant if out_constant else matrices.shape[3]
    return groups, in_per_group, out_per_group, table.shape[1], out.shape[0]


def make_rows_kernel(groups_constant: int, in_constant: int, out_constant: int,
                     block: int) -> Callable[..., None]:
    """``kernel(source, table, matrices, out)``: ``out[d] += sum_k source[table[k, d]] @ matrices[k]``.

    Args:
        groups_constant: channel groups compiled in, or 0 to read them from ``matrices``.
        in_constant: input channels per group compiled in, or 0.
        out_constant: output channels per group compiled in, or 0.
        block: destination rows per work item.
    """

    def accumulate(source: Any, table: Any, matrices: Any, out: Any, lanes: int) -> None:
        groups, in_per_group, out_per_group, volume, rows = layer_sizes(groups_constant, in_constant, out_constant,
                                                                        table, matrices, out)
        width, items = groups * out_per_group, table.shape[0]
        counter = new_counter()
        for lane in prange(min(lanes, items)):  # noqa: B007 (one iteration per thread)
            item = claim(counter)
            while item < items:
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
                item = claim(counter)

    return njit(**_OPTIONS)(accumulate)


def make_int8_rows_kernel(groups_constant: int, in_constant: int, out_constant: int, block: int,
                          quantize: bool) -> Callable[..., None]:
    """The int8 row kernel of `sparsecore.backends._int8_cpu_kernels` (int32 sums, the float32 epilogue).

    The sizes and ``block`` are as for `make_rows_kernel` (here ``table`` is ``[rows, K]``);
    ``quantize`` requantizes the output to int8, else it is float32.
    """

    def accumulate(source: Any, table: Any, matrices: Any, multiplier: Any, bias: Any, has_bias: bool,
                   residual: Any, has_residual: bool, residual_scale: Any, relu: bool, output_scale: Any,
                   out: Any, lanes: int) -> None:
        groups, in_per_group, out_per_group, volume, rows = layer_sizes(groups_constant, in_constant, out_constant,
                                                                        table, matrices, out)
        width, items = groups * out_per_group, (rows + block - 1) // block
        counter = new_counter()
        for lane in prange(min(lanes, items)):  # noqa: B007 (one iteration per thread)
            item = claim(counter)
            while item < items:
                accumulator = np.empty(width, dtype=np.int32)
                for row in range(item * block, min(rows, (item + 1) * block)):
                    for column in range(width):
                        accumulator[column] = 0
                    for offset in range(volume):
                        neighbour = table[row, offset]
                        if neighbour < 0:
                            continue
                        for group in range(groups):
                            for channel in range(in_per_group):
                                value = np.int32(source[neighbour, group * in_per_group + channel])
                                for column in range(out_per_group):
                                    accumulator[group * out_per_group + column] += (
                                        value * np.int32(matrices[offset, group, channel, column]))
                    int8_epilogue_row(accumulator, row, multiplier, bias, has_bias, residual, has_residual,
                                      residual_scale, relu, output_scale, quantize, out)
                item = claim(counter)

    return njit(parallel=True, cache=True, nogil=True)(accumulate)


@njit(inline="always")
def int8_epilogue_row(sums: Any, row: int, multiplier: Any, bias: Any, has_bias: bool, residual: Any,
                      has_residual: bool, residual_scale: Any, relu: bool, output_scale: Any, quantize: bool,
                      out: Any) -> None:
    """The epilogue of `sparsecore.int8` on one row's sums (int32 or exact float32), written to ``out[row]``.

    Float32 steps each rounded once: its callers compile without fast-math, so no FMA contraction.
    Inlined into the int8 row kernel and into `_int8_cpu_kernels`' stand-alone epilogue.
    """
    zero = np.float32(0)
    for column in range(out.shape[1]):
        y = np.float32(sums[column]) * multiplier[column]
        if has_bias:
            y = y + bias[column]
        if has_residual:
            y = y + np.float32(residual[row, column]) * residual_scale
        if relu and y < zero:
            y = zero
        if quantize:
            q = np.rint(y / output_scale)
            if q < -128:
                q = -128
            elif q > 127:
                q = 127
            out[row, column] = np.int8(q)
        else:
            out[row, column] = y
