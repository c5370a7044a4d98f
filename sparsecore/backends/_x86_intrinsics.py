"""AVX-512 dot-product instructions for numba kernels: ``vpdpbusd`` (VNNI, int8) and ``vdpbf16ps`` (BF16).

LLVM never forms these instructions from ordinary loops, so the kernels ask for
them explicitly: each function here is a numba ``@intrinsic`` that emits one
LLVM intrinsic (or a vector load, store or broadcast around it). Call them only
from code that runs where `sparsecore.backends.x86_features` says the CPU has
the feature (numba compiles for the host CPU; on a CPU without it the
instruction faults).

Vectors are numba values of type ``UniTuple(int32, 16)`` (sixteen int32 lanes,
or 64 packed bytes, or 32 packed bfloat16 values) and ``UniTuple(float32, 16)``:
ordinary tuples to numba, converted to LLVM vectors inside each intrinsic;
LLVM's optimiser removes the conversions, so a chain of these calls keeps its
values in ``zmm`` registers. `load_i32x16`, `load_f32x16` and `broadcast_i32`
read a C-contiguous array at a flat element index of its own dtype (an int8
array: a byte index), unaligned; `store_i32x16` and `store_f32x16` write one.

The instruction intrinsics use the older operand forms, which LLVM 14 (numba
0.60, the project's minimum) accepts and later LLVMs upgrade automatically:

- ``<16 x i32> @llvm.x86.avx512.vpdpbusd.512(<16 x i32> acc, <16 x i32> a, <16 x i32> b)``:
  for each lane, ``acc + sum_{j<4} uint8(a byte j) * int8(b byte j)`` in int32,
  wrapping (no saturation), so sums are exact modulo ``2^32``;
- ``<16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> acc, <16 x i32> a, <16 x i32> b)``:
  for each lane, ``acc + a.lo * b.lo + a.hi * b.hi`` where ``lo`` / ``hi`` are the
  two bfloat16 values packed in the lane (products exact in float32, the
  additions rounded with the instruction's own rules: round to nearest even,
  denormal inputs and outputs flushed to zero).

The ``*_ir`` functions emit the same instructions on LLVM vector values, for
other intrinsics' code generators.
"""

from __future__ import annotations

from typing import Any

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["LANES", "I32X16", "F32X16", "load_i32x16", "load_f32x16", "broadcast_i32", "store_i32x16",
           "store_f32x16", "vpdpbusd", "dpbf16ps", "prefetch", "vpdpbusd_ir", "dpbf16ps_ir", "VPDPBUSD_NAME",
           "DPBF16PS_NAME"]

LANES = 16
"""32-bit lanes of one 512-bit vector."""

I32X16 = types.UniTuple(types.int32, LANES)
"""numba's type of an int32 (or packed byte / bfloat16) vector."""

F32X16 = types.UniTuple(types.float32, LANES)
"""numba's type of a float32 vector."""

VPDPBUSD_NAME = "llvm.x86.avx512.vpdpbusd.512"
DPBF16PS_NAME = "llvm.x86.avx512bf16.dpbf16ps.512"

_I32 = ir.IntType(32)
_F32 = ir.FloatType()
_VI32 = ir.VectorType(_I32, LANES)
_VF32 = ir.VectorType(_F32, LANES)


def vpdpbusd_ir(builder: ir.IRBuilder, accumulator: ir.Value, unsigned_bytes: ir.Value,
                signed_bytes: ir.Value) -> ir.Value:
    """``vpdpbusd`` on LLVM ``<16 x i32>`` values: ``accumulator`` plus four ``uint8 x int8`` products per lane."""
    function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VI32, [_VI32, _VI32, _VI32]),
                                              VPDPBUSD_NAME)
    return builder.call(function, [accumulator, unsigned_bytes, signed_bytes])


def dpbf16ps_ir(builder: ir.IRBuilder, accumulator: ir.Value, first_pairs: ir.Value,
                second_pairs: ir.Value) -> ir.Value:
    """``vdpbf16ps`` on LLVM values: ``<16 x float>`` plus two bfloat16 products per lane (pairs as ``<16 x i32>``)."""
    function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VF32, [_VF32, _VI32, _VI32]),
                                              DPBF16PS_NAME)
    return builder.call(function, [accumulator, first_pairs, second_pairs])


def _to_vector(builder: ir.IRBuilder, value: ir.Value, vector_type: ir.VectorType) -> ir.Value:
    vector = ir.Constant(vector_type, ir.Undefined)
    for lane in range(LANES):
        vector = builder.insert_element(vector, builder.extract_value(value, lane), ir.Constant(_I32, lane))
    return vector


def _to_tuple(context: Any, builder: ir.IRBuilder, vector: ir.Value, tuple_type: Any) -> ir.Value:
    value = ir.Constant(context.get_value_type(tuple_type), ir.Undefined)
    for lane in range(LANES):
        value = builder.insert_value(value, builder.extract_element(vector, ir.Constant(_I32, lane)), lane)
    return value


def _check_array(array: Any, name: str) -> None:
    if not isinstance(array, types.Array) or array.layout != "C":
        raise TypeError(f"{name} must be a C-contiguous array, got {array}")


def _address(context: Any, builder: ir.IRBuilder, array_type: Any, array: ir.Value, index_type: Any,
             index: ir.Value, pointee: ir.Type) -> ir.Value:
    """A pointer to element ``index`` (flat, in the array's own dtype) of a C-contiguous array."""
    view = context.make_array(array_type)(context, builder, array)
    offset = context.cast(builder, index, index_type, types.intp)
    element = builder.gep(view.data, [offset])
    return builder.bitcast(element, pointee.as_pointer())


def _load(context: Any, builder: ir.IRBuilder, array_type: Any, array: ir.Value, index_type: Any, index: ir.Value,
          vector_type: ir.VectorType) -> ir.Value:
    pointer = _address(context, builder, array_type, array, index_type, index, vector_type)
    return builder.load(pointer, align=1)


@intrinsic
def load_i32x16(typing_context: Any, array: Any, index: Any) -> Any:
    """64 bytes from ``array``'s flat element ``index`` (C-contiguous, any dtype), as an ``I32X16`` vector."""
    _check_array(array, "array")
    signature = I32X16(array, index)

    def codegen(context: Any, builder: Any, signature: Any, arguments: Any) -> Any:
        vector = _load(context, builder, signature.args[0], arguments[0], signature.args[1], arguments[1], _VI32)
        return _to_tuple(context, builder, vector, I32X16)

    return signature, codegen


@intrinsic
def load_f32x16(typing_context: Any, array: Any, index: Any) -> Any:
    """16 float32 from ``array``'s flat element ``index`` (a C-contiguous float32 array), as an ``F32X16`` vector."""
    _check_array(array, "array")
    signature = F32X16(array, index)

    def codegen(context: Any, builder: Any, signature: Any, arguments: Any) -> Any:
        vector = _load(context, builder, signature.args[0], arguments[0], signature.args[1], arguments[1], _VF32)
        return _to_tuple(context, builder, vector, F32X16)

    return signature, codegen


@intrinsic
def broadcast_i32(typing_context: Any, array: Any, index: Any) -> Any:
    """The 4 bytes at ``array``'s flat element ``index`` (C-contiguous, any dtype) in all 16 lanes (``I32X16``).

    For an int8 array: the 4 consecutive values from byte ``index`` (one quad of a row), or, for a
    bfloat16 array stored as uint16, 2 consecutive values.
    """
    _check_array(array, "array")
    signature = I32X16(array, index)

    def codegen(context: Any, builder: Any, signature: Any, arguments: Any) -> Any:
        pointer = _address(context, builder, signature.args[0], arguments[0], signature.args[1], arguments[1], _I32)
        scalar = builder.load(pointer, align=1)
        vector = builder.insert_element(ir.Constant(_VI32, ir.Undefined), scalar, ir.Constant(_I32, 0))
        vector = builder.shuffle_vector(vector, ir.Constant(_VI32, ir.Undefined), ir.Constant(_VI32, [0] * LANES))
        return _to_tuple(context, builder, vector, I32X16)

    return signature, codegen


def _store_intrinsic(vector_type: ir.VectorType, tuple_type: Any) -> Any:
    def typer(typing_context: Any, array: Any, index: Any, vector: Any) -> Any:
        _check_array(array, "array")
        if vector != tuple_type:
            raise TypeError(f"vector must be {tuple_type}, got {vector}")
        signature = types.void(array, index, vector)

        def codegen(context: Any, builder: Any, signature: Any, arguments: Any) -> Any:
            pointer = _address(context, builder, signature.args[0], arguments[0], signature.args[1], arguments[1],
                               vector_type)
            builder.store(_to_vector(builder, arguments[2], vector_type), pointer, align=1)
            return context.get_dummy_value()

        return signature, codegen

    return typer


def _store_i32x16(typing_context: Any, array: Any, index: Any, vector: Any) -> Any:
    """Writes an ``I32X16`` vector's 64 bytes at ``array``'s flat element ``index`` (C-contiguous, any dtype)."""
    return _store_intrinsic(_VI32, I32X16)(typing_context, array, index, vector)


def _store_f32x16(typing_context: Any, array: Any, index: Any, vector: Any) -> Any:
    """Writes an ``F32X16`` vector at ``array``'s flat element ``index`` (a C-contiguous float32 array)."""
    return _store_intrinsic(_VF32, F32X16)(typing_context, array, index, vector)


store_i32x16 = intrinsic(_store_i32x16)
store_f32x16 = intrinsic(_store_f32x16)


@intrinsic
def vpdpbusd(typing_context: Any, accumulator: Any, unsigned_bytes: Any, signed_bytes: Any) -> Any:
    """``accumulator + sum_{j<4} uint8(unsigned_bytes[., j]) * int8(signed_bytes[., j])`` per lane (``I32X16``s).

    int32, wrapping (exact modulo ``2^32``). Needs ``avx512_vnni``.
    """
    if (accumulator, unsigned_bytes, signed_bytes) != (I32X16,) * 3:
        raise TypeError(f"vpdpbusd takes three {I32X16} vectors, got {accumulator}, {unsigned_bytes}, {signed_bytes}")
    signature = I32X16(I32X16, I32X16, I32X16)

    def codegen(context: Any, builder: Any, signature: Any, arguments: Any) -> Any:
        vectors = [_to_vector(builder, argument, _VI32) for argument in arguments]
        return _to_tuple(context, builder, vpdpbusd_ir(builder, *vectors), I32X16)

    return signature, codegen


@intrinsic
def dpbf16ps(typing_context: Any, accumulator: Any, first_pairs: Any, second_pairs: Any) -> Any:
    """``accumulator + a.lo * b.lo + a.hi * b.hi`` per lane: ``F32X16`` plus two bfloat16 pairs (``I32X16``s).

    Each lane of ``first_pairs`` / ``second_pairs`` packs two bfloat16 values (the lower
    16 bits first). Needs ``avx512_bf16``.
    """
    if (accumulator, first_pairs, second_pairs) != (F32X16, I32X16, I32X16):
        raise TypeError(f"dpbf16ps takes ({F32X16}, {I32X16}, {I32X16}), got {accumulator}, {first_pairs}, "
                        f"{second_pairs}")
    signature = F32X16(F32X16, I32X16, I32X16)

    def codegen(context: Any, builder: Any, signature: Any, arguments: Any) -> Any:
        accumulator_vector = _to_vector(builder, arguments[0], _VF32)
        first, second = (_to_vector(builder, argument, _VI32) for argument in arguments[1:])
        return _to_tuple(context, builder, dpbf16ps_ir(builder, accumulator_vector, first, second), F32X16)

    return signature, codegen


@intrinsic
def prefetch(typing_context: Any, array: Any, index: Any) -> Any:
    """``llvm.prefetch`` (read, all cache levels) of the line holding ``array``'s flat element ``index``."""
    _check_array(array, "array")
    signature = types.void(array, index)

    def codegen(context: Any, builder: Any, signature: Any, arguments: Any) -> Any:
        byte = ir.IntType(8)
        pointer = _address(context, builder, signature.args[0], arguments[0], signature.args[1], arguments[1], byte)
        function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [byte.as_pointer(), _I32, _I32, _I32]),
            "llvm.prefetch.p0i8")
        builder.call(function, [pointer, ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])
        return context.get_dummy_value()

    return signature, codegen
