"""The bfloat16 CPU conv passes on AMX tiles (``tdpbf16ps``), behind `sparsecore.backends._bf16_cpu_kernels`.

Imported on first use, only where the CPU has AMX-BF16 and the process was granted the tile state
(`_bf16_cpu_kernels.amx_available`). One ``tdpbf16ps`` multiplies a 16 x 32 bfloat16 tile by a 32 x 16
one (stored as 16 rows of 16 pairs: the packed matrices' layout, `_bf16_cpu_kernels.pack_matrices`)
into a 16 x 16 float32 tile: 8,192 products summed in float32 per instruction (flushing denormals,
rounding to nearest even), 16 times the work of a ``vdpbf16ps``. LLVM's AMX intrinsics
(``llvm.x86.ldtilecfg``, ``tilezero``, ``tileloadd64``, ``tdpbf16ps``, ``tilestored64``, ``tilerelease``)
are asked for explicitly; every kernel loads the tile configuration on each of its threads (tiles 0-7:
16 rows of 64 bytes each) and releases it at the end.

`amx_rows_kernel` (the forward; the input gradient runs in `_bf16_amx_backward`) has the dataflow of the
float32 tiled kernels (`_tile_kernel_sources`): per work item and offset, the paired source rows are
copied into a tile buffer (their channels padded to 32), each 16-row block times up to four 16-column
blocks of the offset's matrix is one group of tile products (`_tile_products`: the source tile loaded
once for the group), and the products are added into the item's float32 sums as vector adds
(`_add_vector`; numba's own loop stayed scalar, 21 of 47 ms of a 64 -> 64 forward on the real scan),
written once as bfloat16. Work items are fixed by the sizes and write only their own rows: results are
bitwise the same at every thread count. `_transpose_words` (16 x 16 words in registers) serves the
weight gradient's tiles.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._bf16_kernel_sources import _round_row
from ._tile_kernel_sources import _copy_rows, _work_rows
from ._work_queue import claim, new_counter  # new_counter: no parallel region of its own

__all__ = ["TILE_CONFIG", "amx_rows_kernel"]

_OPTIONS = {"parallel": True, "cache": True, "nogil": True}

TILE_CONFIG = np.zeros(64, dtype=np.uint8)
"""The ``ldtilecfg`` block: palette 1, tiles 0-7 of 16 rows x 64 bytes (read only)."""
TILE_CONFIG[0] = 1
TILE_CONFIG[16:32] = np.full(8, 64, dtype=np.uint16).view(np.uint8)
TILE_CONFIG[48:56] = 16
TILE_CONFIG.setflags(write=False)

_I8, _I64 = ir.IntType(8), ir.IntType(64)
_BYTE_POINTER = _I8.as_pointer()


def _function(builder: Any, name: str, arguments: list) -> Any:
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), arguments), name)


def _byte_address(context: Any, builder: Any, array_type: Any, array: Any, offset_type: Any, offset: Any) -> Any:
    """``array``'s data pointer plus ``offset`` bytes."""
    view = context.make_array(array_type)(context, builder, array)
    return builder.gep(builder.bitcast(view.data, _BYTE_POINTER), [context.cast(builder, offset, offset_type,
                                                                                types.intp)])


@intrinsic
def _tile_start(typing_context: Any, config: Any) -> Any:
    """``ldtilecfg`` of ``config`` (`TILE_CONFIG`) on the calling thread."""
    signature = types.void(config)

    def codegen(context: Any, builder: Any, signature: Any, arguments: Any) -> Any:
        view = context.make_array(signature.args[0])(context, builder, arguments[0])
        builder.call(_function(builder, "llvm.x86.ldtilecfg", [_BYTE_POINTER]),
                     [builder.bitcast(view.data, _BYTE_POINTER)])
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def _tile_end(typing_context: Any) -> Any:
    """``tilerelease`` on the calling thread."""
    signature = types.void()

    def codegen(context: Any, builder: Any, signature: Any, arguments: Any) -> Any:
        builder.call(_function(builder, "llvm.x86.tilerelease", []), [])
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def _add_vector(typing_context: Any, target: Any, target_index: Any, source: Any, source_index: Any) -> Any:
    """``target.flat[t : t + 16] += source.flat[s : s + 16]`` (C-contiguous float32 arrays) as one vector add:
    numba's loops leave this scalar (the arrays may alias)."""
    signature = types.void(target, target_index, source, source_index)

    def codegen(context: Any, builder: Any, signature: Any, arguments: Any) -> Any:
        args = signature.args
        vector = ir.VectorType(ir.FloatType(), 16).as_pointer()
        addresses = []
        for array, index, array_type, index_type in ((arguments[0], arguments[1], args[0], args[1]),
                                                     (arguments[2], arguments[3], args[2], args[3])):
            view = context.make_array(array_type)(context, builder, array)
            element = builder.gep(view.data, [context.cast(builder, index, index_type, types.intp)])
            addresses.append(builder.bitcast(element, vector))
        total = builder.fadd(builder.load(addresses[0], align=4), builder.load(addresses[1], align=4))
        builder.store(total, addresses[0], align=4)
        return context.get_dummy_value()

    return signature, codegen


def _make_tile_products(blocks: int) -> Any:
    """An intrinsic ``products(left, left_offset, left_stride, right, right_offset, right_stride, steps, result,
    result_offset, result_stride, accumulate)`` over ``blocks`` (1-4) adjacent 16-column blocks.

    For each block ``j``: the 16 x 16 float32 at ``result`` (+ ``result_offset + 64 j`` bytes, rows
    ``result_stride`` bytes apart) = (its values if ``accumulate`` else 0) + ``sum_s left_s @ right_sj`` over
    ``s < steps``, on tiles. ``left_s``: 16 rows x 32 bfloat16 at byte ``left_offset + 64 s`` of ``left`` (rows
    ``left_stride`` bytes apart), loaded once (tile 4) for every block; ``right_sj``: 16 rows of 16 bfloat16
    pairs at byte ``right_offset + 64 j + 16 s right_stride`` (tiles 5-7, the fourth block reusing tile 5).
    Results live in tiles 0-3. Byte offsets and strides are int64; arrays C-contiguous.
    """

    @intrinsic
    def products(typing_context: Any, left: Any, left_offset: Any, left_stride: Any, right: Any, right_offset: Any,
                 right_stride: Any, steps: Any, result: Any, result_offset: Any, result_stride: Any,
                 accumulate: Any) -> Any:
        signature = types.void(left, left_offset, left_stride, right, right_offset, right_stride, steps, result,
                               result_offset, result_stride, accumulate)

        def codegen(context: Any, builder: Any, signature: Any, arguments: Any) -> Any:
            args = signature.args
            left_base = _byte_address(context, builder, args[0], arguments[0], args[1], arguments[1])
            right_base = _byte_address(context, builder, args[3], arguments[3], args[4], arguments[4])
            result_base = _byte_address(context, builder, args[7], arguments[7], args[8], arguments[8])
            left_stride_value = context.cast(builder, arguments[2], args[2], types.int64)
            right_stride_value = context.cast(builder, arguments[5], args[5], types.int64)
            result_stride_value = context.cast(builder, arguments[9], args[9], types.int64)
            steps_value = context.cast(builder, arguments[6], args[6], types.intp)
            accumulate_value = context.cast(builder, arguments[10], args[10], types.boolean)
            load = _function(builder, "llvm.x86.tileloadd64", [_I8, _BYTE_POINTER, _I64])
            tile = [ir.Constant(_I8, index) for index in range(8)]
            right_tiles = [tile[5], tile[6], tile[7], tile[5]]
            results = [builder.gep(result_base, [ir.Constant(_I64, 64 * block)]) for block in range(blocks)]
            with builder.if_else(accumulate_value) as (then, otherwise):
                with then:
                    for block in range(blocks):
                        builder.call(load, [tile[block], results[block], result_stride_value])
                with otherwise:
                    for block in range(blocks):
                        builder.call(_function(builder, "llvm.x86.tilezero", [_I8]), [tile[block]])
            right_step = builder.mul(right_stride_value, ir.Constant(_I64, 16))
            product = _function(builder, "llvm.x86.tdpbf16ps", [_I8, _I8, _I8])
            with cgutils.for_range(builder, steps_value) as loop:
                builder.call(load, [tile[4], builder.gep(left_base, [builder.mul(loop.index, ir.Constant(_I64, 64))]),
                                    left_stride_value])
                right_row = builder.gep(right_base, [builder.mul(loop.index, right_step)])
                for block in range(blocks):
                    builder.call(load, [right_tiles[block], builder.gep(right_row, [ir.Constant(_I64, 64 * block)]),
                                        right_stride_value])
                    builder.call(product, [tile[block], tile[4], right_tiles[block]])
            store = _function(builder, "llvm.x86.tilestored64", [_I8, _BYTE_POINTER, _I64])
            for block in range(blocks):
                builder.call(store, [tile[block], results[block], result_stride_value])
            return context.get_dummy_value()

        return signature, codegen

    return products


_PRODUCTS_1, _PRODUCTS_2, _PRODUCTS_3, _PRODUCTS_4 = (_make_tile_products(blocks) for blocks in (1, 2, 3, 4))


@njit(inline="always")
def _tile_products(left: Any, left_offset: int, left_stride: int, right: Any, right_offset: int, right_stride: int,
                   steps: int, blocks: int, result: Any, result_offset: int, result_stride: int,
                   accumulate: bool) -> None:
    """`_make_tile_products` of ``blocks`` (1-4) blocks."""
    if blocks == 4:
        _PRODUCTS_4(left, left_offset, left_stride, right, right_offset, right_stride, steps, result, result_offset,
                    result_stride, accumulate)
    elif blocks == 3:
        _PRODUCTS_3(left, left_offset, left_stride, right, right_offset, right_stride, steps, result, result_offset,
                    result_stride, accumulate)
    elif blocks == 2:
        _PRODUCTS_2(left, left_offset, left_stride, right, right_offset, right_stride, steps, result, result_offset,
                    result_stride, accumulate)
    else:
        _PRODUCTS_1(left, left_offset, left_stride, right, right_offset, right_stride, steps, result, result_offset,
                    result_stride, accumulate)


@intrinsic
def _transpose_words(typing_context: Any, source: Any, source_offset: Any, source_stride: Any, target: Any,
                     target_offset: Any, target_stride: Any) -> Any:
    """A 16 x 16 block of 32-bit words transposed: ``target[j][i] = source[i][j]`` (byte offsets and row
    strides, int64), in registers (four stages of two-row shuffles that swap off-diagonal blocks)."""
    signature = types.void(source, source_offset, source_stride, target, target_offset, target_stride)

    def codegen(context: Any, builder: Any, signature: Any, arguments: Any) -> Any:
        args = signature.args
        source_base = _byte_address(context, builder, args[0], arguments[0], args[1], arguments[1])
        target_base = _byte_address(context, builder, args[3], arguments[3], args[4], arguments[4])
        source_stride_value = context.cast(builder, arguments[2], args[2], types.int64)
        target_stride_value = context.cast(builder, arguments[5], args[5], types.int64)
        vector = ir.VectorType(ir.IntType(32), 16)
        rows = []
        for row in range(16):
            address = builder.gep(source_base, [builder.mul(source_stride_value, ir.Constant(_I64, row))])
            rows.append(builder.load(builder.bitcast(address, vector.as_pointer()), align=4))
        mask_type = ir.VectorType(ir.IntType(32), 16)
        size = 8
        while size:
            for row in range(16):
                if row & size:
                    continue
                low = [e if not e & size else 16 + e - size for e in range(16)]
                high = [e + size if not e & size else 16 + e for e in range(16)]
                first, second = rows[row], rows[row + size]
                rows[row] = builder.shuffle_vector(first, second, ir.Constant(mask_type, low))
                rows[row + size] = builder.shuffle_vector(first, second, ir.Constant(mask_type, high))
            size //= 2
        for row in range(16):
            address = builder.gep(target_base, [builder.mul(target_stride_value, ir.Constant(_I64, row))])
            builder.store(rows[row], builder.bitcast(address, vector.as_pointer()), align=4)
        return context.get_dummy_value()

    return signature, codegen


@njit(**_OPTIONS)
def amx_rows_kernel(source: Any, starts: Any, sources: Any, locals_: Any, matrices: Any, initial: Any, out: Any,
                    capacity: int, most: int, config: Any, lanes: int) -> None:
    """``out[d] = bfloat16(initial + sum_k source[s] @ matrices[k])`` over a tile plan's pairs ``(s, d)``.

    ``source`` uint16 ``[N_src, a]`` (bfloat16 bits), the plan (``starts`` int64 ``[W * K + 1]``, ``sources``
    / ``locals_`` int32 ``[P]``, at most ``most`` pairs per range), ``matrices`` uint32 ``[K, w, c]`` (``w``
    a multiple of 16 words, ``2 w >= a``; ``c`` a multiple of 16; `_bf16_cpu_kernels.pack_matrices`),
    ``initial`` float32 ``[c]``, ``out`` uint16 ``[N_dst, b]`` (every row written), ``config``
    `TILE_CONFIG`; ``lanes`` threads claim the work items.
    """
    volume, words, columns = matrices.shape
    rows = out.shape[0]
    works = (starts.shape[0] - 1) // volume
    depth = 2 * words  # channels padded to 32
    steps = words // 16
    tile_rows = (most + 15) // 16 * 16
    counter = new_counter()
    for lane in prange(min(lanes, works)):  # noqa: B007 (one iteration per thread)
        _tile_start(config)
        work = claim(counter)
        while work < works:
            gathered = np.zeros((tile_rows, depth), dtype=np.uint16)  # padding channels and rows stay 0
            block = np.empty((16, 64), dtype=np.float32)
            first_row, count_rows = _work_rows(work, capacity, rows)
            acc = np.empty((count_rows, columns), dtype=np.float32)
            for row in range(count_rows):
                for column in range(columns):
                    acc[row, column] = initial[column]
            for offset in range(volume):
                start, stop = starts[work * volume + offset], starts[work * volume + offset + 1]
                count = stop - start
                if count == 0:
                    continue
                _copy_rows(source, sources[start:stop], count, gathered)
                for position in range(count, (count + 15) // 16 * 16):  # a partial block's rows: zeros
                    for channel in range(source.shape[1]):
                        gathered[position, channel] = 0
                matrix_offset = offset * words * columns * 4
                for first in range(0, count, 16):
                    taken = min(16, count - first)
                    for column in range(0, columns, 64):
                        blocks = min(4, (columns - column) // 16)
                        _tile_products(gathered, first * depth * 2, depth * 2, matrices, matrix_offset + column * 4,
                                       columns * 4, steps, blocks, block, 0, 256, False)
                        for row in range(taken):
                            local = locals_[start + first + row] * columns + column
                            for part in range(blocks):
                                _add_vector(acc, local + 16 * part, block, row * 64 + 16 * part)
            acc_bits = acc.view(np.uint32)
            for row in range(count_rows):
                _round_row(acc_bits, row, out, first_row + row)
            work = claim(counter)
        _tile_end()
