"""The numba kernels of the tiled CPU dataflow, behind `sparsecore.backends._cpu_kernels` (imported on first use).

A work item is a fixed block of ``capacity`` consecutive destination rows
(``items * ROW_BLOCK``, a power of two). A tile plan (`count_plan`,
`fill_plan`, built once per rulebook) groups the pairs by work item, then by
kernel offset, so each item's pairs of one offset are one run of the plan's
arrays. For every offset in order, the item copies the source rows of its run
into a small tile (a few hundred rows: it stays in the core's cache),
multiplies the tile by the offset's matrix on BLAS (``np.dot``, which numba
hands to SciPy's BLAS; in slices, see below) and adds the products into its own rows of
the output, which no other item writes. Each destination row is thus read
once and written once, the gathered rows never reach main memory, and the
arithmetic runs on BLAS's packed kernels (at 64 channels about 1.5x the
compiled row loops of `_cpu_kernel_sources`). Until 2026-12-03 19:40 the
kernels listed each item's pairs from the neighbour table on every pass
(16 -> 16 on the real scan, one thread: forward 24.9 -> 17.9 ms, backward
33.5 -> 22.5 ms with the plan; building the plan takes 6 ms, the table 13).

The backward runs input-stationary over the reversed pairs' plan: per item and
offset, one product adds the d-features, and a second one writes the item's share
of the offset's d-weights into a partial buffer; `sum_partials` then adds the
items' shares in item order. Work items are fixed by the sizes alone and every
sum has a fixed order, so results are bitwise identical at every thread count
(BLAS runs on one thread inside a pass, `sparsecore.cpu_dataflow.cpu_blas_threads`).

Threads claim the work items in row order from a shared counter
(`_work_queue`): the scan's rows are not uniform (the first half of the
64 -> 64 layer's items holds 55% of its pairs), and a thread slowed by another
process claims fewer items. Neighbouring items share source rows in cache.
The items are independent, so which thread runs one changes no result.

Rows are copied with software prefetches `PREFETCH_AHEAD` rows ahead (a
gather of 788,888 rows of 64 floats: 37 -> 26 ms on the test machine).

Every GEMM runs in slices of at most ``chunk`` rows (`sparsecore.backends._cpu_kernels.gemm_chunk_rows`,
from the channel counts alone): OpenBLAS hands products of at most 10^6
multiply-adds to its small-matrix kernels where it has them (the test
machine's AVX-512 build does), which ran the backward's d-weights product
(64 x 470 by 470 x 64) at 114 GFLOP/s against 74 for the whole product in
one call, and the 470 x 64 by 64 x 64 forward product at 114 against 94. The
d-weights slices are summed in slice order, so results stay independent of
the thread count.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._work_queue import claim, new_counter  # new_counter: no parallel region of its own

__all__ = ["count_plan", "fill_plan", "tiled_forward_kernel", "tiled_backward_kernel", "sum_partials", "PREFETCH_AHEAD"]

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
def _product_rows(tile: Any, matrix: Any, count: int, chunk: int, products: Any) -> None:
    """``products[:count] = tile[:count] @ matrix``, one BLAS GEMM per slice of ``chunk`` rows."""
    for start in range(0, count, chunk):
        stop = min(count, start + chunk)
        np.dot(tile[start:stop], matrix, products[start:stop])


@njit(inline="always")
def _reduce_rows(left: Any, right: Any, count: int, chunk: int, out: Any, scratch: Any) -> None:
    """``out = left[:count].T @ right[:count]``, one BLAS GEMM per slice of ``chunk`` rows, the slices
    added in order (``scratch`` has ``out``'s shape)."""
    first = min(count, chunk)
    np.dot(left[:first].T, right[:first], out)
    for start in range(chunk, count, chunk):
        stop = min(count, start + chunk)
        np.dot(left[start:stop].T, right[start:stop], scratch)
        for channel in range(out.shape[0]):
            for column in range(out.shape[1]):
                out[channel, column] += scratch[channel, column]


@njit(inline="always")
def _multiply_into(rows_source: Any, rows: Any, count: int, tile: Any, matrix: Any, chunk: int, products: Any,
                   locals_: Any, accumulator: Any) -> None:
    """``accumulator[locals_[p]] += rows_source[rows[p]] @ matrix`` for the ``count`` listed pairs.

    The rows are copied into ``tile`` (left filled, for the backward's d-weights), multiplied on BLAS
    into ``products`` (`_product_rows`) and added into the work item's own rows.
    """
    _copy_rows(rows_source, rows, count, tile)
    _product_rows(tile, matrix, count, chunk, products)
    for position in range(count):
        row = locals_[position]
        for column in range(products.shape[1]):
            accumulator[row, column] += products[position, column]


@njit(**_OPTIONS)
def count_plan(keys: Any, offset_starts: Any, shift: int, counts: Any, lanes: int) -> None:
    """``counts[k, w]``: how many of offset ``k``'s pairs have a key in work item ``w`` (``key >> shift``).

    ``keys`` int32 ``[P]`` in ``[0, rows)``, ``offset_starts`` int64 ``[K + 1]``, ``counts`` int64
    ``[K, W]`` zeros; ``lanes`` threads claim the offsets.
    """
    volume = counts.shape[0]
    counter = new_counter()
    for lane in prange(min(lanes, volume)):  # noqa: B007 (one iteration per thread)
        offset = claim(counter)
        while offset < volume:
            for pair in range(offset_starts[offset], offset_starts[offset + 1]):
                counts[offset, keys[pair] >> shift] += 1
            offset = claim(counter)


@njit(**_OPTIONS)
def fill_plan(keys: Any, values: Any, offset_starts: Any, shift: int, starts: Any, sources: Any, locals_: Any,
              lanes: int) -> None:
    """Each pair's value into ``sources`` and its key's row within its work item into ``locals_``, at the
    next free position of its ``(work item, offset)`` range ``starts[w * K + k]:starts[w * K + k + 1]``
    (pairs keep their order within a range); ``lanes`` threads claim the offsets."""
    volume = offset_starts.shape[0] - 1
    works = (starts.shape[0] - 1) // volume
    mask = (1 << shift) - 1
    counter = new_counter()
    for lane in prange(min(lanes, volume)):  # noqa: B007 (one iteration per thread)
        offset = claim(counter)
        while offset < volume:
            cursors = np.empty(works, dtype=np.int64)
            for work in range(works):
                cursors[work] = starts[work * volume + offset]
            for pair in range(offset_starts[offset], offset_starts[offset + 1]):
                key = keys[pair]
                work = key >> shift
                position = cursors[work]
                cursors[work] = position + 1
                sources[position] = values[pair]
                locals_[position] = key & mask
            offset = claim(counter)


@njit(inline="always")
def _work_rows(work: int, capacity: int, rows: int) -> tuple[int, int]:
    """Work item ``work``'s ``(first_row, count_rows)``."""
    first_row = work * capacity
    return first_row, min(rows, first_row + capacity) - first_row


@njit(**_OPTIONS)
def tiled_forward_kernel(source: Any, starts: Any, sources: Any, locals_: Any, matrices: Any, out: Any,
                         capacity: int, most: int, chunk: int, lanes: int) -> None:
    """``out[d] += sum_k source[s] @ matrices[k]`` over the plan's pairs ``(s, d)``, one work item per
    ``capacity`` destination rows.

    ``source [N_src, a]``, the plan (``starts`` int64 ``[W * K + 1]``, ``sources`` / ``locals_`` int32
    ``[P]``, at most ``most`` pairs per range), ``matrices [K, a, b]``, ``out [N_dst, b]`` holding the
    initial values; all C-contiguous, one float dtype. GEMMs of at most ``chunk`` rows; ``lanes`` threads
    claim the work items.
    """
    volume, rows = matrices.shape[0], out.shape[0]
    in_channels, out_channels = source.shape[1], out.shape[1]
    works = (starts.shape[0] - 1) // volume
    counter = new_counter()
    for lane in prange(min(lanes, works)):  # noqa: B007 (one iteration per thread)
        work = claim(counter)
        while work < works:
            tile = np.empty((most, in_channels), dtype=out.dtype)
            products = np.empty((most, out_channels), dtype=out.dtype)
            first_row, count_rows = _work_rows(work, capacity, rows)
            accumulator = out[first_row:first_row + count_rows]  # the item's own rows: sums in place
            for offset in range(volume):
                start, stop = starts[work * volume + offset], starts[work * volume + offset + 1]
                if stop > start:
                    _multiply_into(source, sources[start:stop], stop - start, tile, matrices[offset], chunk,
                                   products, locals_[start:stop], accumulator)
            work = claim(counter)


@njit(**_OPTIONS)
def tiled_backward_kernel(source: Any, grad: Any, starts: Any, destinations: Any, locals_: Any, transposed: Any,
                          grad_source: Any, partial: Any, capacity: int, most: int, chunk: int, lanes: int) -> None:
    """d-features into ``grad_source``, each work item's d-weights into ``partial[item]``.

    ``source [N_src, a]`` the forward's input, ``grad [N_dst, b]``, the backward plan (keys: source
    rows, ``destinations``: destination rows), ``transposed [K, b, a]``, ``grad_source [N_src, a]``
    (every row written), ``partial [W, K, a, b]`` (every entry written); ``chunk`` and ``lanes`` as for
    `tiled_forward_kernel`.
    """
    volume, rows = transposed.shape[0], source.shape[0]
    in_channels, out_channels = source.shape[1], grad.shape[1]
    works = (starts.shape[0] - 1) // volume
    counter = new_counter()
    for lane in prange(min(lanes, works)):  # noqa: B007 (one iteration per thread)
        work = claim(counter)
        while work < works:
            grad_tile = np.empty((most, out_channels), dtype=source.dtype)
            source_tile = np.empty((most, in_channels), dtype=source.dtype)
            products = np.empty((most, in_channels), dtype=source.dtype)
            scratch = np.empty((in_channels, out_channels), dtype=source.dtype)
            first_row, count_rows = _work_rows(work, capacity, rows)
            accumulator = grad_source[first_row:first_row + count_rows]  # the item's own rows: sums in place
            accumulator[:] = 0
            local_source = source[first_row:first_row + count_rows]
            for offset in range(volume):
                start, stop = starts[work * volume + offset], starts[work * volume + offset + 1]
                count = stop - start
                if count == 0:
                    partial[work, offset] = 0
                    continue
                _multiply_into(grad, destinations[start:stop], count, grad_tile, transposed[offset], chunk,
                               products, locals_[start:stop], accumulator)
                _copy_rows(local_source, locals_[start:stop], count, source_tile)
                _reduce_rows(source_tile, grad_tile, count, chunk, partial[work, offset], scratch)
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
