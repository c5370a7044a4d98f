"""The numba kernels of the int8 conv on AVX-512 VNNI, behind `sparsecore.backends._int8_vnni_kernels`.

Imported on first use, and only where `sparsecore.backends.x86_features` selects
``avx512_vnni`` (the code holds ``vpdpbusd``, which faults on other CPUs).

`conv_kernel` is output-stationary over the float32 dataflow's forward tile
plan (`sparsecore.cpu_dataflow.tile_plan`): a work item is a fixed block of
``capacity`` destination rows; for each kernel offset in order it walks the
item's pairs of that offset six at a time (`ROWS`; twelve, `NARROW_ROWS`,
where each group has 16 outputs or fewer), and for each block of up to 64
output channels `_dot_block` keeps the 6 x (up to) 4 (or 12 x 1) int32 vectors
of those destination rows in registers while it runs over the input channels
four at a time: one ``vpdpbusd`` per (row, vector, quad), the quad of the source row
broadcast to the sixteen lanes straight from the source (no gathered copy).
The sums go into the item's int32 block (``capacity x groups * padded_out``,
in cache), which the fused epilogue (`_epilogue_row`: the float32 steps of
`_cpu_kernel_sources.int8_epilogue_row`, the other int8 routes' epilogue, in
the same order and roundings, written so that LLVM vectorises it) turns into
output rows.

Signed values: ``vpdpbusd`` multiplies unsigned by signed bytes. The
activations are read as ``x + 128`` (unsigned: a copy of the source with its
sign bits flipped, made by the kernel's threads together before the items; NumPy twin
`_int8_vnni_kernels.unsigned_source`) and the weights stay
signed, so each pair adds ``x . w + 128 * sum_i w[c, k, i]``; the block
subtracts that second term, a vector per offset (``corrections``), when it
loads its accumulators. ``vpdpbusd`` wraps modulo ``2^32`` and the true sum
fits in int32 (`sparsecore.int8` checks), so the result is the exact integer
sum whatever the order: bitwise the same at every thread count and on every
route. Padded input lanes hold weight 0, so whatever bytes they read add
nothing.

The last run of an offset that is not a whole block is completed with dummy
pairs (source row 0, the block's spare row ``capacity``), so `_dot_block`'s
row count, like its vector count (1 to 4), is a compile-time constant.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._tile_kernel_sources import _work_rows
from ._work_queue import acquired, claim, new_counter, release  # new_counter: no parallel region of its own
from ._x86_intrinsics import LANES, prefetch, vpdpbusd_ir

__all__ = ["ROWS", "NARROW_ROWS", "FLIP_WORDS", "MOST_VECTORS", "PREFETCH_BLOCKS", "PREFETCH_MIN_ROW_BYTES",
           "conv_kernel"]

ROWS = 6
"""Pairs (destination rows) whose sums `_dot_block` keeps in registers at once (up to 4 vectors each)."""

NARROW_ROWS = 12
"""Pairs per block where each group has one output vector (``padded_out == 16``): 12 accumulators.
Real scan, subm 16 -> 16, one thread, CPU time: 6 rows and prefetches 5.5 ms, 12 rows without 4.4 ms
(2026-12-07, shared machine, load 11)."""

PREFETCH_MIN_ROW_BYTES = 64
"""The kernel prefetches source rows of at least this many bytes (shorter rows ran as fast or faster
without: 16 bytes 5.1 against 5.5 ms)."""

MOST_VECTORS = 4
"""Most 16-lane output vectors per row in one `_dot_block` (6 x 4 accumulators of the 32 zmm registers)."""

PREFETCH_BLOCKS = 2
"""How many blocks of pairs ahead the kernel prefetches the source rows."""

FLIP_WORDS = 1 << 14
"""Four-byte words of the source per claimed piece of the in-kernel sign flip (``x + 128``), before the conv items."""

_VI32 = ir.VectorType(ir.IntType(32), LANES)


def _item(context: Any, builder: Any, array_type: Any, array: Any, indices: list[Any]) -> Any:
    """A pointer to ``array[indices]`` (no bounds check)."""
    view = context.make_array(array_type)(context, builder, array)
    return cgutils.get_item_pointer(context, builder, array_type, view, indices)


@intrinsic(prefer_literal=True)
def _dot_block(typing_context: Any, accumulator: Any, local_rows: Any, source_rows: Any, first: Any, source: Any,
               group_byte: Any, quads: Any, weights: Any, weight_index: Any, quad_bytes: Any, column: Any,
               corrections: Any, correction_index: Any, rows: Any, vectors: Any) -> Any:
    """For ``r < rows`` and ``v < vectors``, with ``d = local_rows[first + r]``, ``s = source_rows[first + r]``:
    ``accumulator[d, column + 16 v : + 16] += sum_q vpdpbusd(source[s, group_byte + 4 q : + 4] broadcast,
    weights quad q, vector v) - corrections[correction_index + 16 v : + 16]``.

    ``accumulator`` int32 ``[R, W]``, ``local_rows`` / ``source_rows`` int32 ``[P]``, ``source`` uint8
    ``[N, C]``, ``weights`` int8 flat, quad ``q``'s vector ``v`` at byte ``weight_index + q * quad_bytes + 64 v``,
    ``corrections`` int32 flat; all C-contiguous. ``rows`` and ``vectors`` are literal ints.
    """
    if not isinstance(vectors, types.IntegerLiteral) or not isinstance(rows, types.IntegerLiteral):
        return None
    count, block_rows = vectors.literal_value, rows.literal_value
    signature = types.void(accumulator, local_rows, source_rows, first, source, group_byte, quads, weights,
                           weight_index, quad_bytes, column, corrections, correction_index, rows, vectors)

    def codegen(context: Any, builder: Any, signature: Any, arguments: Any) -> Any:
        (accumulator_type, locals_type, sources_type, first_type, source_type, group_type, quads_type,
         weights_type, index_type, stride_type, column_type, corrections_type, correction_type, _, _) = signature.args
        intp = context.get_value_type(types.intp)

        def as_intp(value: Any, value_type: Any) -> Any:
            return context.cast(builder, value, value_type, types.intp)

        first_pair = as_intp(arguments[3], first_type)
        correction_pointer = _item(context, builder, corrections_type, arguments[11],
                                   [as_intp(arguments[12], correction_type)])
        shifts = [builder.load(builder.bitcast(builder.gep(correction_pointer, [ir.Constant(intp, LANES * vector)]),
                                               _VI32.as_pointer()), align=4) for vector in range(count)]
        column_index = as_intp(arguments[10], column_type)
        group_offset = as_intp(arguments[5], group_type)
        slots, source_pointers, vector_pointers = [], [], []
        for row in range(block_rows):
            pair = builder.add(first_pair, ir.Constant(intp, row))
            local = as_intp(builder.load(_item(context, builder, locals_type, arguments[1], [pair])), types.int32)
            source_row = as_intp(builder.load(_item(context, builder, sources_type, arguments[2], [pair])),
                                 types.int32)
            source_pointers.append(_item(context, builder, source_type, arguments[4], [source_row, group_offset]))
            row_pointers = []
            for vector in range(count):
                lane = builder.add(column_index, ir.Constant(intp, LANES * vector))
                pointer = _item(context, builder, accumulator_type, arguments[0], [local, lane])
                row_pointers.append(builder.bitcast(pointer, _VI32.as_pointer()))
            vector_pointers.append(row_pointers)
            row_slots = []
            for vector in range(count):
                slot = cgutils.alloca_once(builder, _VI32)
                builder.store(builder.sub(builder.load(row_pointers[vector], align=4), shifts[vector]), slot)
                row_slots.append(slot)
            slots.append(row_slots)
        weight_base = _item(context, builder, weights_type, arguments[7], [as_intp(arguments[8], index_type)])
        quad_bytes = as_intp(arguments[9], stride_type)
        int32_pointer = ir.IntType(32).as_pointer()
        with cgutils.for_range(builder, as_intp(arguments[6], quads_type)) as loop:
            quad_weights = builder.gep(weight_base, [builder.mul(loop.index, quad_bytes)])
            weight_vectors = [builder.load(builder.bitcast(builder.gep(quad_weights, [ir.Constant(intp, 64 * vector)]),
                                                           _VI32.as_pointer()), align=1) for vector in range(count)]
            quad_offset = builder.mul(loop.index, ir.Constant(intp, 4))
            for row in range(block_rows):
                scalar = builder.load(builder.bitcast(builder.gep(source_pointers[row], [quad_offset]), int32_pointer),
                                      align=1)
                broadcast = builder.insert_element(ir.Constant(_VI32, ir.Undefined), scalar,
                                                   ir.Constant(ir.IntType(32), 0))
                broadcast = builder.shuffle_vector(broadcast, ir.Constant(_VI32, ir.Undefined),
                                                   ir.Constant(_VI32, [0] * LANES))
                for vector in range(count):
                    slot = slots[row][vector]
                    builder.store(vpdpbusd_ir(builder, builder.load(slot), broadcast, weight_vectors[vector]), slot)
        for row in range(block_rows):
            for vector in range(count):
                builder.store(builder.load(slots[row][vector]), vector_pointers[row][vector], align=4)
        return context.get_dummy_value()

    return signature, codegen


@njit(inline="always")
def _dot_vectors(accumulator: Any, local_rows: Any, source_rows: Any, first: int, source: Any, group_byte: int,
                 quads: int, weights: Any, weight_index: int, quad_bytes: int, column: int, corrections: Any,
                 correction_index: int, rows: int, vectors: int) -> None:
    """`_dot_block` with ``rows`` (`ROWS`, or `NARROW_ROWS` with one vector) and ``vectors`` (1 to
    `MOST_VECTORS`) made compile-time constants."""
    if rows == NARROW_ROWS:
        _dot_block(accumulator, local_rows, source_rows, first, source, group_byte, quads, weights, weight_index,
                   quad_bytes, column, corrections, correction_index, NARROW_ROWS, 1)
    elif vectors >= 4:
        _dot_block(accumulator, local_rows, source_rows, first, source, group_byte, quads, weights, weight_index,
                   quad_bytes, column, corrections, correction_index, ROWS, 4)
    elif vectors == 3:
        _dot_block(accumulator, local_rows, source_rows, first, source, group_byte, quads, weights, weight_index,
                   quad_bytes, column, corrections, correction_index, ROWS, 3)
    elif vectors == 2:
        _dot_block(accumulator, local_rows, source_rows, first, source, group_byte, quads, weights, weight_index,
                   quad_bytes, column, corrections, correction_index, ROWS, 2)
    else:
        _dot_block(accumulator, local_rows, source_rows, first, source, group_byte, quads, weights, weight_index,
                   quad_bytes, column, corrections, correction_index, ROWS, 1)


@njit(inline="always")
def _dot_groups(accumulator: Any, local_rows: Any, source_rows: Any, first: int, source: Any, offset: int,
                groups: int, quads: int, padded_out: int, weights: Any, corrections: Any, rows: int) -> None:
    """`_dot_block` over every group and block of up to `MOST_VECTORS` output vectors, for offset ``offset``."""
    quad_bytes = 4 * padded_out
    for group in range(groups):
        for column in range(0, padded_out, LANES * MOST_VECTORS):
            weight_index = ((offset * groups + group) * quads) * quad_bytes + 4 * column
            _dot_vectors(accumulator, local_rows, source_rows, first, source, group * 4 * quads, quads, weights,
                         weight_index, quad_bytes, group * padded_out + column, corrections,
                         (offset * groups + group) * padded_out + column, rows,
                         min(MOST_VECTORS, (padded_out - column) // LANES))


@njit(inline="always")
def _prefetch_rows(source: Any, source_rows: Any, first: int, stop: int, row_bytes: int, count: int) -> None:
    if row_bytes < PREFETCH_MIN_ROW_BYTES:
        return
    for pair in range(first, min(stop, first + count)):
        for byte in range(0, row_bytes, 64):
            prefetch(source, source_rows[pair] * row_bytes + byte)


@njit(inline="always")
def _epilogue_value(accumulator: Any, local: int, sum_column: int, row: int, column: int, multiplier: Any, bias: Any,
                    has_bias: bool, residual: Any, has_residual: bool, residual_scale: Any, relu: bool,
                    output_scale: Any, quantize: bool, out: Any) -> None:
    """``out[row, column] = epilogue(accumulator[local, sum_column])``: the steps of
    `_cpu_kernel_sources.int8_epilogue_row` for one value.

    The same float32 operations in the same order, each rounded once (no fast-math, so no FMA
    contraction); the clip as ``min(max(q, -128), 127)``, the same for every value ``q = rint(y / s)``
    can take (never NaN).
    """
    y = np.float32(accumulator[local, sum_column]) * multiplier[column]
    if has_bias:
        y = y + bias[column]
    if has_residual:
        y = y + np.float32(residual[row, column]) * residual_scale
    if relu:
        y = np.float32(0) if y < np.float32(0) else y
    if quantize:
        q = np.rint(y / output_scale)
        out[row, column] = np.int8(min(max(q, np.float32(-128)), np.float32(127)))
    else:
        out[row, column] = y


@njit(inline="always")
def _epilogue_row(accumulator: Any, local: int, row: int, groups: int, out_per_group: int, padded_out: int,
                  multiplier: Any, bias: Any, has_bias: bool, residual: Any, has_residual: bool, residual_scale: Any,
                  relu: bool, output_scale: Any, quantize: bool, out: Any) -> None:
    """``out[row] = epilogue(accumulator[local])``, value by value (`_epilogue_value`).

    Without groups the columns are the loop's own index, which LLVM sees is never negative, so it
    drops the negative-index wraparound and vectorises the loop; the grouped loop's columns
    (``group * padded_out + channel``) keep it scalar (subm 16 -> 16 on the real scan: the epilogue
    took 1.4 of the layer's 4.4 ms before, 0.55 ms alone in a loop like this one).
    """
    if groups == 1 and has_bias and not has_residual and relu and quantize:  # the usual layer, branch-free
        for channel in range(out_per_group):
            _epilogue_value(accumulator, local, channel, row, channel, multiplier, bias, True, residual, False,
                            residual_scale, True, output_scale, True, out)
        return
    if groups == 1:
        for channel in range(out_per_group):
            _epilogue_value(accumulator, local, channel, row, channel, multiplier, bias, has_bias, residual,
                            has_residual, residual_scale, relu, output_scale, quantize, out)
        return
    for group in range(groups):
        for channel in range(out_per_group):
            _epilogue_value(accumulator, local, group * padded_out + channel, row, group * out_per_group + channel,
                            multiplier, bias, has_bias, residual, has_residual, residual_scale, relu, output_scale,
                            quantize, out)


@njit(parallel=True, cache=True, nogil=True)
def conv_kernel(features: Any, starts: Any, source_rows: Any, local_rows: Any, weights: Any, corrections: Any,
                volume: int, groups: int, quads: int, out_per_group: int, padded_out: int, capacity: int,
                multiplier: Any, bias: Any, has_bias: bool, residual: Any, has_residual: bool, residual_scale: Any,
                relu: bool, output_scale: Any, quantize: bool, out: Any, lanes: int) -> None:
    """The int8 conv of every output row over a forward tile plan, int32 sums on ``vpdpbusd``, epilogue fused.

    Args:
        features: int8 ``[N_in, groups * 4 * quads]`` C-contiguous: ``x``, each group's channels padded
            to whole quads (padded lanes: any value). The lanes first flip its sign bits into a uint8 copy
            (``x + 128``, `FLIP_WORDS` words a claim), each waiting until every piece is done, then run the items.
        starts, source_rows, local_rows: the tile plan (`_cpu_kernels.TilePlan`): int64 ``[W * K + 1]``,
            int32 ``[P]``, int32 ``[P]``.
        weights: int8 ``[K, groups, quads, padded_out, 4]`` flat, 0 in padded lanes.
        corrections: int32 ``[K, groups, padded_out]`` flat: ``128 * sum_i w[c, k, i]``.
        volume: K; groups, quads (``ceil(in_per_group / 4)``), out_per_group, padded_out (a multiple
            of 16), capacity (destination rows per work item): the layer's sizes.
        multiplier, bias, has_bias, residual, has_residual, residual_scale, relu, output_scale, quantize:
            the epilogue (`_epilogue_row`).
        out: int8 or float32 ``[N_out, groups * out_per_group]``, every row written.
        lanes: threads claiming the work items (`_work_queue`).
    """
    rows = out.shape[0]
    works = (starts.shape[0] - 1) // volume
    row_bytes = features.shape[1]
    width = groups * padded_out
    rows_per_block = NARROW_ROWS if padded_out == LANES else ROWS
    source = np.empty(features.shape, dtype=np.uint8)
    signed_words, unsigned_words = features.reshape(-1).view(np.uint32), source.reshape(-1).view(np.uint32)
    total = signed_words.shape[0]  # rows of whole quads: 4 bytes a word
    pieces = (total + FLIP_WORDS - 1) // FLIP_WORDS
    piece_counter, flipped, counter = new_counter(), new_counter(), new_counter()
    for lane in prange(min(lanes, works)):  # noqa: B007 (one iteration per thread)
        piece = claim(piece_counter)
        while piece < pieces:
            for word in range(piece * FLIP_WORDS, min(total, piece * FLIP_WORDS + FLIP_WORDS)):
                unsigned_words[word] = signed_words[word] ^ np.uint32(0x80808080)
            release(flipped)
            piece = claim(piece_counter)
        while acquired(flipped) < pieces:  # a claimed piece is finished by the lane that claimed it
            pass
        work = claim(counter)
        while work < works:
            accumulator = np.zeros((capacity + 1, width), dtype=np.int32)  # row `capacity`: the dummy pairs'
            tail_sources = np.zeros(NARROW_ROWS, dtype=np.int32)
            tail_locals = np.full(NARROW_ROWS, capacity, dtype=np.int32)
            first_row, count_rows = _work_rows(work, capacity, rows)
            for offset in range(volume):
                start, stop = starts[work * volume + offset], starts[work * volume + offset + 1]
                full = start + (stop - start) // rows_per_block * rows_per_block
                for first in range(start, stop, rows_per_block):
                    _prefetch_rows(source, source_rows, first + PREFETCH_BLOCKS * rows_per_block, stop, row_bytes,
                                   rows_per_block)
                    if first < full:
                        _dot_groups(accumulator, local_rows, source_rows, first, source, offset, groups, quads,
                                    padded_out, weights, corrections, rows_per_block)
                        continue
                    for position in range(rows_per_block):  # the last, partial block: dummy pairs complete it
                        in_run = first + position < stop
                        tail_sources[position] = source_rows[first + position] if in_run else 0
                        tail_locals[position] = local_rows[first + position] if in_run else capacity
                    _dot_groups(accumulator, tail_locals, tail_sources, 0, source, offset, groups, quads, padded_out,
                                weights, corrections, rows_per_block)
            for local in range(count_rows):
                _epilogue_row(accumulator, local, first_row + local, groups, out_per_group, padded_out, multiplier,
                              bias, has_bias, residual, has_residual, residual_scale, relu, output_scale, quantize,
                              out)
            work = claim(counter)
