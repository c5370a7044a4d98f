"""The numba kernels of the bfloat16 CPU conv passes on ``vdpbf16ps`` (imported on first use, only where the
CPU has AVX-512 BF16: `sparsecore.backends._bf16_cpu_kernels` decides).

bfloat16 values travel as their bits (``uint16``); two input channels (or, in the weight gradient, two
pairs) are packed into one 32-bit word, the operand ``vdpbf16ps`` multiplies: each of its 16 float32
lanes adds ``a[2i] * b[2i] + a[2i + 1] * b[2i + 1]`` (products of bfloat16 values, exact in float32;
the instruction flushes denormal inputs and results to zero and rounds to nearest even). LLVM never
forms the instruction from loops, so `_make_dot_block`'s intrinsics ask for it explicitly
(`sparsecore.backends._x86_intrinsics.dpbf16ps_ir`), keeping a block of accumulators in registers.

`dot_rows_kernel` is output-stationary over a tile plan (`sparsecore.backends._cpu_kernels.TilePlan`):
a work item keeps its destination rows' float32 sums in a small block (in cache), adds every pair's
``source_row @ matrix[k]`` for each offset in order, four pairs at a time (their rows' accumulators
in registers, each 16-column weight vector loaded once for the four), and writes the block once as
bfloat16 (rounded to nearest even). It runs the forward and, over the reversed pairs with the
transposed matrices, the input gradient on machines without AMX (the one-pass backward,
`_bf16_dot_backward`, runs it through `_dot_rows` and the weight gradient through `_dot_columns` and
`_pack_pair`). Work items are fixed by the sizes and claimed from a shared counter (`_work_queue`), each
writing only its own rows: results are bitwise identical at every thread count.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._tile_kernel_sources import PREFETCH_AHEAD, _prefetch, _work_rows
from ._x86_intrinsics import dpbf16ps_ir
from ._work_queue import claim, new_counter  # new_counter: no parallel region of its own

_CACHE_LINE = 64

__all__ = ["dot_rows_kernel", "LANES", "ROWS_AT_ONCE"]

_OPTIONS = {"parallel": True, "cache": True, "nogil": True}

LANES = 16
"""float32 lanes of one ``vdpbf16ps`` (the column padding of the packed matrices)."""

ROWS_AT_ONCE = 4
"""Rows whose accumulators one `_dot_block` call holds in registers (with up to four 16-column blocks)."""


def _make_dot_block(rows: int, blocks: int, transposed: bool) -> Callable[..., Any]:
    """An intrinsic ``dot(acc, acc_rows, words, word_rows, position, matrix, count, column)``: for ``r < rows``
    and ``j < blocks``, ``acc[acc_rows[position + r], column + 16 j : +16] += sum_w
    words[word_rows[position + r], w] (two bfloat16) . matrix[w, column + 16 j : +16] (16 words of two)``
    over ``w < count``, on ``vdpbf16ps`` (``transposed``: ``words[w, word_rows[position + r]]`` instead).

    ``acc`` float32 2-D, ``words`` and ``matrix`` uint32 2-D, all C-contiguous; ``acc_rows`` and
    ``word_rows`` int32 1-D. The ``rows x blocks`` accumulators live in registers for the whole sum.
    """

    @intrinsic
    def dot(typing_context: Any, acc: Any, acc_rows: Any, words: Any, word_rows: Any, position: Any,
            matrix: Any, count: Any, column: Any) -> Any:
        signature = types.void(acc, acc_rows, words, word_rows, position, matrix, count, column)

        def codegen(context: Any, builder: Any, signature: Any, arguments: Any) -> Any:
            args = signature.args
            acc_view = context.make_array(args[0])(context, builder, arguments[0])
            acc_rows_view = context.make_array(args[1])(context, builder, arguments[1])
            words_view = context.make_array(args[2])(context, builder, arguments[2])
            word_rows_view = context.make_array(args[3])(context, builder, arguments[3])
            matrix_view = context.make_array(args[5])(context, builder, arguments[5])
            position_value = context.cast(builder, arguments[4], args[4], types.intp)
            count_value = context.cast(builder, arguments[6], args[6], types.intp)
            column_value = context.cast(builder, arguments[7], args[7], types.intp)
            int8, int32, int64 = ir.IntType(8), ir.IntType(32), ir.IntType(64)
            float_vector, int_vector = ir.VectorType(ir.FloatType(), LANES), ir.VectorType(int32, LANES)
            byte = int8.as_pointer()

            def address(view: Any, byte_offset: Any, pointee: Any) -> Any:
                return builder.bitcast(builder.gep(builder.bitcast(view.data, byte), [byte_offset]),
                                       pointee.as_pointer())

            def row_of(view: Any, index: Any) -> Any:
                pointer = builder.gep(builder.bitcast(view.data, int32.as_pointer()), [index])
                return builder.sext(builder.load(pointer), int64)

            column_bytes = builder.mul(column_value, ir.Constant(int64, 4))
            acc_stride = builder.extract_value(acc_view.strides, 0)
            words_stride = builder.extract_value(words_view.strides, 0)
            matrix_stride = builder.extract_value(matrix_view.strides, 0)
            acc_pointers, word_pointers, slots = [], [], []
            for row in range(rows):
                index = builder.add(position_value, ir.Constant(int64, row))
                acc_row = row_of(acc_rows_view, index)
                word_row = row_of(word_rows_view, index)
                acc_pointers.append(address(acc_view, builder.add(builder.mul(acc_row, acc_stride), column_bytes),
                                            float_vector))
                word_pointers.append(address(words_view, builder.mul(word_row, ir.Constant(int64, 4) if transposed
                                                                     else words_stride), int32))
                for block in range(blocks):
                    slot = cgutils.alloca_once(builder, float_vector)
                    value = builder.load(builder.gep(acc_pointers[row], [ir.Constant(int32, block)]), align=4)
                    builder.store(value, slot)
                    slots.append(slot)
            splat_mask = ir.Constant(ir.VectorType(int32, LANES), [0] * LANES)
            with cgutils.for_range(builder, count_value) as loop:
                word = loop.index
                matrix_row = builder.add(builder.mul(word, matrix_stride), column_bytes)
                vectors = [builder.load(builder.gep(address(matrix_view, matrix_row, int_vector),
                                                    [ir.Constant(int32, block)]), align=4)
                           for block in range(blocks)]
                for row in range(rows):
                    if transposed:
                        word_byte = builder.gep(builder.bitcast(word_pointers[row], byte),
                                                [builder.mul(word, words_stride)])
                        word_address = builder.bitcast(word_byte, int32.as_pointer())
                    else:
                        word_address = builder.gep(word_pointers[row], [word])
                    scalar = builder.load(word_address, align=4)
                    single = builder.insert_element(ir.Constant(int_vector, ir.Undefined), scalar,
                                                    ir.Constant(int32, 0))
                    splat = builder.shuffle_vector(single, ir.Constant(int_vector, ir.Undefined), splat_mask)
                    for block in range(blocks):
                        slot = slots[row * blocks + block]
                        builder.store(dpbf16ps_ir(builder, builder.load(slot), splat, vectors[block]), slot)
            for row in range(rows):
                for block in range(blocks):
                    builder.store(builder.load(slots[row * blocks + block]),
                                  builder.gep(acc_pointers[row], [ir.Constant(int32, block)]), align=4)
            return context.get_dummy_value()

        return signature, codegen

    return dot


_DOT_4_1, _DOT_4_2, _DOT_4_3, _DOT_4_4 = (_make_dot_block(ROWS_AT_ONCE, blocks, False) for blocks in (1, 2, 3, 4))
_DOT_1_1, _DOT_1_2, _DOT_1_3, _DOT_1_4 = (_make_dot_block(1, blocks, False) for blocks in (1, 2, 3, 4))
_TDOT_4_1, _TDOT_4_2, _TDOT_4_3, _TDOT_4_4 = (_make_dot_block(ROWS_AT_ONCE, blocks, True) for blocks in (1, 2, 3, 4))
_TDOT_1_1, _TDOT_1_2, _TDOT_1_3, _TDOT_1_4 = (_make_dot_block(1, blocks, True) for blocks in (1, 2, 3, 4))


@njit(inline="always")
def _blocks_at_once(columns: int) -> int:
    """16-column blocks per `_dot_block` call: the most of 4, 3, 2, 1 that divides the blocks."""
    blocks = columns // LANES
    for step in (4, 3, 2):
        if blocks % step == 0:
            return step
    return 1


@njit(inline="always")
def _dot_rows(acc: Any, acc_rows: Any, words: Any, word_rows: Any, count_rows: int, matrix: Any, count: int,
              step: int) -> None:
    """``acc[acc_rows[r]] += words[word_rows[r], :count] . matrix[:count]`` for ``r < count_rows``, every column
    block, ``ROWS_AT_ONCE`` rows and ``step`` blocks per call; the word rows `PREFETCH_AHEAD` rows ahead are
    prefetched (they are gathered rows, mostly not in cache)."""
    columns = matrix.shape[1]
    row_bytes = words.shape[1] * 4
    for ahead in range(min(PREFETCH_AHEAD, count_rows)):
        for byte in range(0, row_bytes, _CACHE_LINE):
            _prefetch(words, word_rows[ahead], byte)
    position = 0
    while position + ROWS_AT_ONCE <= count_rows:
        for ahead in range(position + PREFETCH_AHEAD, min(position + PREFETCH_AHEAD + ROWS_AT_ONCE, count_rows)):
            for byte in range(0, row_bytes, _CACHE_LINE):
                _prefetch(words, word_rows[ahead], byte)
        for column in range(0, columns, step * LANES):
            if step == 4:
                _DOT_4_4(acc, acc_rows, words, word_rows, position, matrix, count, column)
            elif step == 3:
                _DOT_4_3(acc, acc_rows, words, word_rows, position, matrix, count, column)
            elif step == 2:
                _DOT_4_2(acc, acc_rows, words, word_rows, position, matrix, count, column)
            else:
                _DOT_4_1(acc, acc_rows, words, word_rows, position, matrix, count, column)
        position += ROWS_AT_ONCE
    while position < count_rows:
        for column in range(0, columns, step * LANES):
            if step == 4:
                _DOT_1_4(acc, acc_rows, words, word_rows, position, matrix, count, column)
            elif step == 3:
                _DOT_1_3(acc, acc_rows, words, word_rows, position, matrix, count, column)
            elif step == 2:
                _DOT_1_2(acc, acc_rows, words, word_rows, position, matrix, count, column)
            else:
                _DOT_1_1(acc, acc_rows, words, word_rows, position, matrix, count, column)
        position += 1


@njit(inline="always")
def _dot_columns(acc: Any, channels: Any, words: Any, in_channels: int, matrix: Any, count: int, step: int) -> None:
    """``acc[c] += words[:count, c] . matrix[:count]`` for every channel ``c`` (``channels`` = 0, 1, ...):
    `_dot_rows` with the words read down a column (the weight gradient's packed pairs ``[pairs / 2, a]``)."""
    columns = matrix.shape[1]
    position = 0
    while position + ROWS_AT_ONCE <= in_channels:
        for column in range(0, columns, step * LANES):
            if step == 4:
                _TDOT_4_4(acc, channels, words, channels, position, matrix, count, column)
            elif step == 3:
                _TDOT_4_3(acc, channels, words, channels, position, matrix, count, column)
            elif step == 2:
                _TDOT_4_2(acc, channels, words, channels, position, matrix, count, column)
            else:
                _TDOT_4_1(acc, channels, words, channels, position, matrix, count, column)
        position += ROWS_AT_ONCE
    while position < in_channels:
        for column in range(0, columns, step * LANES):
            if step == 4:
                _TDOT_1_4(acc, channels, words, channels, position, matrix, count, column)
            elif step == 3:
                _TDOT_1_3(acc, channels, words, channels, position, matrix, count, column)
            elif step == 2:
                _TDOT_1_2(acc, channels, words, channels, position, matrix, count, column)
            else:
                _TDOT_1_1(acc, channels, words, channels, position, matrix, count, column)
        position += 1


@njit(inline="always")
def _bfloat16_bits(bits: int) -> int:
    """The bfloat16 bits nearest float32 ``bits`` (ties to even; NaN stays a quiet NaN)."""
    if (bits & 0x7FFFFFFF) > 0x7F800000:
        return ((bits >> 16) | 0x40) & 0xFFFF
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


@njit(inline="always")
def _round_row(acc_bits: Any, row: int, out: Any, out_row: int) -> None:
    for column in range(out.shape[1]):
        out[out_row, column] = np.uint16(_bfloat16_bits(np.int64(acc_bits[row, column])))


@njit(**_OPTIONS)
def dot_rows_kernel(words: Any, starts: Any, sources: Any, locals_: Any, matrices: Any, initial: Any, out: Any,
                    capacity: int, lanes: int) -> None:
    """``out[d] = bfloat16(initial + sum_k words[s] . matrices[k])`` over a tile plan's pairs ``(s, d)``.

    ``words`` uint32 ``[N_src, w]`` (the source rows, two bfloat16 channels a word), the plan (``starts``
    int64 ``[W * K + 1]``, ``sources`` / ``locals_`` int32 ``[P]``), ``matrices`` uint32 ``[K, w, c]``
    (``c`` a multiple of 16; two bfloat16 rows interleaved a word), ``initial`` float32 ``[c]`` (zeros or
    the bias), ``out`` uint16 ``[N_dst, b]`` (``b <= c``, every row written); ``capacity`` destination rows a
    work item; ``lanes`` threads claim the items.
    """
    volume, count, columns = matrices.shape
    rows = out.shape[0]
    works = (starts.shape[0] - 1) // volume
    step = _blocks_at_once(columns)
    counter = new_counter()
    for lane in prange(min(lanes, works)):  # noqa: B007 (one iteration per thread)
        work = claim(counter)
        while work < works:
            first_row, count_rows = _work_rows(work, capacity, rows)
            acc = np.empty((count_rows, columns), dtype=np.float32)
            for row in range(count_rows):
                for column in range(columns):
                    acc[row, column] = initial[column]
            for offset in range(volume):
                start, stop = starts[work * volume + offset], starts[work * volume + offset + 1]
                if stop > start:
                    _dot_rows(acc, locals_[start:stop], words, sources[start:stop], stop - start, matrices[offset],
                              count, step)
            acc_bits = acc.view(np.uint32)
            for row in range(count_rows):
                _round_row(acc_bits, row, out, first_row + row)
            work = claim(counter)


@intrinsic
def _pack_sixteen(typing_context: Any, words: Any, word_index: Any, values: Any, first_index: Any,
                  second_index: Any) -> Any:
    """``words.flat[w + i] = values.flat[f + i] | values.flat[s + i] << 16`` for ``i < 16`` as vector operations
    (``words`` uint32, ``values`` uint16, C-contiguous; ``s < 0``: zero upper halves)."""
    signature = types.void(words, word_index, values, first_index, second_index)

    def codegen(context: Any, builder: Any, signature: Any, arguments: Any) -> Any:
        args = signature.args
        int32 = ir.IntType(32)
        halves, wide = ir.VectorType(ir.IntType(16), LANES), ir.VectorType(int32, LANES)

        def pointer(array: Any, array_type: Any, index: Any, index_type: Any, pointee: Any) -> Any:
            view = context.make_array(array_type)(context, builder, array)
            element = builder.gep(view.data, [context.cast(builder, index, index_type, types.intp)])
            return builder.bitcast(element, pointee.as_pointer())

        second = context.cast(builder, arguments[4], args[4], types.intp)
        low = builder.zext(builder.load(pointer(arguments[2], args[2], arguments[3], args[3], halves), align=2),
                           wide)
        target = pointer(arguments[0], args[0], arguments[1], args[1], wide)
        with builder.if_else(builder.icmp_signed(">=", second, ir.Constant(second.type, 0))) as (paired, single):
            with paired:
                high = builder.zext(builder.load(pointer(arguments[2], args[2], second, types.intp, halves),
                                                 align=2), wide)
                shifted = builder.shl(high, ir.Constant(wide, [16] * LANES))
                builder.store(builder.or_(low, shifted), target, align=4)
            with single:
                builder.store(low, target, align=4)
        return context.get_dummy_value()

    return signature, codegen


@njit(inline="always")
def _pack_pair(values: Any, first: int, second: int, words: Any, word: int) -> None:
    """``words[word, c] = values[first, c] | values[second, c] << 16`` for the columns both have (``second < 0``:
    zero upper halves): 16 channels at a time as vectors, the rest one by one."""
    stride = values.shape[1]
    width = min(stride, words.shape[1])
    whole = width - width % LANES
    row = word * words.shape[1]
    for column in range(0, whole, LANES):
        _pack_sixteen(words, row + column, values, first * stride + column, second * stride + column if second >= 0
                      else -1)
    if second >= 0:
        for column in range(whole, width):
            words[word, column] = np.uint32(values[first, column]) | (np.uint32(values[second, column]) << 16)
    else:
        for column in range(whole, width):
            words[word, column] = np.uint32(values[first, column])
