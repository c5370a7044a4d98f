"""The numba kernels of the tiled CPU dataflow, behind `sparsecore.backends._cpu_kernels` (imported on first use).

A work item is a fixed block of destination rows (``items`` consecutive blocks
of a neighbour table, ``ROW_BLOCK`` rows each). For every kernel offset in
order, the item copies the source rows paired with its rows into a small tile
(a few hundred rows: it stays in the core's cache), multiplies the tile by the
offset's matrix with one BLAS GEMM (``np.dot``, which numba hands to SciPy's
BLAS) and adds the products into its own rows of the output, which no other
item writes. Each
destination row is thus read once and written once, the gathered rows never
reach main memory, and the arithmetic runs on BLAS's packed kernels (at 64
channels about 1.5x the compiled row loops of `_cpu_kernel_sources`).

The backward runs input-stationary over the transposed table: per item and
offset, one GEMM adds the d-features, and a second one writes the item's share
of the offset's d-weights into a partial buffer; `sum_partials` then adds the
items' shares in item order. Work items are fixed by the sizes alone and every
sum has a fixed order, so results are bitwise identical at every thread count
(BLAS runs on one thread inside a pass, `sparsecore.cpu_dataflow.cpu_blas_threads`).

Threads claim the work items in table order from a shared counter
(`_work_queue`): the scan's rows are not uniform (the first half of the
64 -> 64 layer's items holds 55% of its pairs), and a thread slowed by another
process claims fewer items. Neighbouring items share source rows in cache.
The items are independent, so which thread runs one changes no result.

Rows are copied with software prefetches `PREFETCH_AHEAD` rows ahead (a
gather of 788,888 rows of 64 floats: 37 -> 26 ms on the test machine).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._work_queue import claim, new_counter

__all__ = ["tiled_forward_kernel", "tiled_backward_kernel", "sum_partials", "PREFETCH_AHEAD"]

_OPTIONS = {"parallel": True, "cache": True, "fastmath": {"contract"}, "nogil": True}

PREFETCH_AHEAD = 8
"""How many rows ahead of the copy the gathers prefetch."""

_CACHE_LINE = 64


@intrinsic
def _prefetch(typing_context: Any, array: Any, row: Any, byte: Any) -> Any:
    """``llvm.prefetch`` (read, keep in all levels) of ``array``'s row ``row`` at byte ``byte`` (2-D array)."""
    signature = types.void(array, row, byte)

    def codegen(context: Any, builder: Any, signature: Any, arguments: Any) -> Any:
        view = context.make_array(signature.args[0])(context, builder, arguments[0])
        row_index = context.cast(builder, arguments[1], signature.args[1], types.intp)
        byte_index = context.cast(builder, arguments[2], signature.args[2], types.intp)
        offset = builder.add(builder.mul(row_index, builder.extract_value(view.strides, 0)), byte_index)
        byte_pointer = ir.IntType(8).as_pointer()
        address = builder.gep(builder.bitcast(view.data, byte_pointer), [offset])
        int32 = ir.IntType(32)
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte_pointer, int32, int32, int32]), "llvm.prefetch.p0i8")
        builder.call(function, [address, ir.Constant(int32, 0), ir.Constant(int32, 3), ir.Constant(int32, 1)])
        return context.get_dummy_value()

    return signature, codegen


@njit(inline="always")
def _paired_rows(table: Any, first_item: int, last_item: int, offset: int, sources: Any, locals_: Any) -> int:
    """Lists offset ``offset``'s pairs of table items ``[first_item, last_item)``; returns their count."""
    block = table.shape[2]
    count = 0
    for item in range(first_item, last_item):
        base = (item - first_item) * block
        for row in range(block):  # branchless: write always, advance on a pair (a branch: 8.0 -> 5.7 ms)
            source_row = table[item, offset, row]
            sources[count] = source_row
            locals_[count] = base + row
            count += source_row >= 0
    return count


@njit(inline="always")
def _copy_rows(source: Any, rows: Any, count: int, tile: Any) -> None:
    """``tile[:count] = source[rows[:count]]``, prefetching `PREFETCH_AHEAD` rows ahead."""
    width = source.shape[1]
    row_bytes = width * source.itemsize
    for ahead in range(min(PREFETCH_AHEAD, count)):
        for byte in range(0, row_bytes, _CACHE_LINE):
            _prefetch(source, rows[ahead], byte)
    for position in range(count):
        if position + PREFETCH_AHEAD < count:
            for byte in range(0, row_bytes, _CACHE_LINE):
                _prefetch(source, rows[position + PREFETCH_AHEAD], byte)
        row = rows[position]
        for column in range(width):
            tile[position, column] = source[row, column]


@njit(inline="always")
def _multiply_into(rows_source: Any, rows: Any, count: int, tile: Any, matrix: Any, products: Any, locals_: Any,
                   accumulator: Any) -> None:
    """``accumulator[locals_[p]] += rows_source[rows[p]] @ matrix`` for the ``count`` listed pairs.

    The rows are copied into ``tile`` (left filled, for the backward's d-weights), multiplied with one
    BLAS GEMM into ``products`` and added into the work item's own rows.
    """
    _copy_rows(rows_source, rows, count, tile)
    np.dot(tile[:count], matrix, products[:count])
    for position in range(count):
        row = locals_[position]
        for column in range(products.shape[1]):
            accumulator[row, column] += products[position, column]


@njit(inline="always")
def _layout(table: Any, items: int) -> tuple[int, int, int, int, int]:
    """A tiled pass's ``(blocks, volume, block, capacity, works)``: the table's sizes, the rows a work item
    holds (``items * block``) and the number of work items."""
    blocks, volume, block = table.shape[0], table.shape[1], table.shape[2]
    return blocks, volume, block, items * block, (blocks + items - 1) // items


@njit(inline="always")
def _work_rows(work: int, items: int, blocks: int, block: int, rows: int) -> tuple[int, int, int, int]:
    """Work item ``work``'s ``(first_item, last_item, first_row, count_rows)``."""
    first_item = work * items
    last_item = min(blocks, first_item + items)
    first_row = first_item * block
    return first_item, last_item, first_row, min(rows, last_item * block) - first_row


@njit(**_OPTIONS)
def tiled_forward_kernel(source: Any, table: Any, matrices: Any, out: Any, items: int, lanes: int) -> None:
    """``out[d] += sum_k source[table[k, d]] @ matrices[k]``, ``items`` table blocks per work item.

    ``source [N_src, a]``, ``table [B, K, R]`` int32, ``matrices [K, a, b]``, ``out [N_dst, b]`` holding the
    initial values; all C-contiguous, one float dtype. ``lanes`` threads claim the work items.
    """
    blocks, volume, block, capacity, works = _layout(table, items)
    rows, in_channels, out_channels = out.shape[0], source.shape[1], out.shape[1]
    counter = new_counter()
    for lane in prange(min(lanes, works)):  # noqa: B007 (one iteration per thread)
        work = claim(counter)
        while work < works:
            tile = np.empty((capacity, in_channels), dtype=out.dtype)
            products = np.empty((capacity, out_channels), dtype=out.dtype)
            sources = np.empty(capacity, dtype=np.int64)
            locals_ = np.empty(capacity, dtype=np.int64)
            first_item, last_item, first_row, count_rows = _work_rows(work, items, blocks, block, rows)
            accumulator = out[first_row:first_row + count_rows]  # the item's own rows: sums in place
            for offset in range(volume):
                count = _paired_rows(table, first_item, last_item, offset, sources, locals_)
                if count == 0:
                    continue
                _multiply_into(source, sources, count, tile, matrices[offset], products, locals_, accumulator)
            work = claim(counter)


@njit(**_OPTIONS)
def tiled_backward_kernel(source: Any, grad: Any, table: Any, transposed: Any, grad_source: Any, partial: Any,
                          items: int, lanes: int) -> None:
    """d-features into ``grad_source``, each work item's d-weights into ``partial[item]``.

    ``source [N_src, a]`` the forward's input, ``grad [N_dst, b]``, ``table [B, K, R]`` the backward table
    (rows: source rows, entries: destination rows), ``transposed [K, b, a]``, ``grad_source [N_src, a]``
    (every row written), ``partial [ceil(B / items), K, a, b]`` (every entry written); ``lanes`` as for
    `tiled_forward_kernel`.
    """
    blocks, volume, block, capacity, works = _layout(table, items)
    rows, in_channels, out_channels = source.shape[0], source.shape[1], grad.shape[1]
    counter = new_counter()
    for lane in prange(min(lanes, works)):  # noqa: B007 (one iteration per thread)
        work = claim(counter)
        while work < works:
            grad_tile = np.empty((capacity, out_channels), dtype=source.dtype)
            source_tile = np.empty((capacity, in_channels), dtype=source.dtype)
            products = np.empty((capacity, in_channels), dtype=source.dtype)
            destinations = np.empty(capacity, dtype=np.int64)
            locals_ = np.empty(capacity, dtype=np.int64)
            first_item, last_item, first_row, count_rows = _work_rows(work, items, blocks, block, rows)
            accumulator = grad_source[first_row:first_row + count_rows]  # the item's own rows: sums in place
            accumulator[:] = 0
            for offset in range(volume):
                count = _paired_rows(table, first_item, last_item, offset, destinations, locals_)
                if count == 0:
                    partial[work, offset] = 0
                    continue
                _multiply_into(grad, destinations, count, grad_tile, transposed[offset], products, locals_,
                               accumulator)
                for position in range(count):
                    row = first_row + locals_[position]
                    for column in range(in_channels):
                        source_tile[position, column] = source[row, column]
                np.dot(source_tile[:count].T, grad_tile[:count], partial[work, offset])
            work = claim(counter)


@njit(**_OPTIONS)
def sum_partials(partial: Any, out: Any, lanes: int) -> None:
    """``out[k] = sum_w partial[w, k]``, the work items added in order (``partial [W, K, a, b]``); offsets
    claimed by ``lanes`` threads."""
    works, volume, in_channels, out_channels = partial.shape
    counter = new_counter()
    for lane in prange(min(lanes, volume)):  # noqa: B007 (one iteration per thread)
        offset = claim(counter)
        while offset < volume:
            for channel in range(in_channels):
                for column in range(out_channels):
                    out[offset, channel, column] = partial[0, offset, channel, column]
            for work in range(1, works):
                for channel in range(in_channels):
                    for column in range(out_channels):
                        out[offset, channel, column] += partial[work, offset, channel, column]
            offset = claim(counter)
