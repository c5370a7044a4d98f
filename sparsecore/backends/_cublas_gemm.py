"""Matrix products as one cuBLAS strided-batched GEMM (``cublasGemmStridedBatchedEx``).

The GPU backend's `KernelBackend.matmul` runs here instead of ``cupy.matmul``,
whose batched path converts float16 to float32, copies both operands
contiguous and ignores ``CUPY_TF32``. One call multiplies every matrix of a
batch:

- **dtypes**: float16 and bfloat16 inputs and outputs with float32 compute
  (``CUBLAS_COMPUTE_32F``); float32 in FP32 (``CUBLAS_COMPUTE_32F``), or in
  TF32 (``CUBLAS_COMPUTE_32F_FAST_TF32``) when `CublasGemm.tf32` is set;
  float64 in FP64 (``CUBLAS_COMPUTE_64F``). Algorithm
  ``CUBLAS_GEMM_DEFAULT_TENSOR_OP``.
- **no copies of strided operands**: an operand whose matrices are row-major
  or column-major with some leading dimension (a transposed view such as the
  backward's ``transpose(0, 2, 1)``, a weight sliced along the kernel axis)
  goes to cuBLAS as it lies, with a transpose flag; batch axes that collapse to
  one stride (broadcast axes as stride 0) are the batch. Only an operand that
  fits neither is copied contiguous.
- **row-major results through a column-major library**: the result ``C [M, N]``
  is row-major, which cuBLAS sees as ``C^T [N, M]``; since ``C^T = B^T A^T``,
  cuBLAS's first operand is our right operand and its second our left one,
  ``m = N``, ``n = M``, ``ldc = N``.

Everything that decides the call (`plan_gemm`) is plain Python on shapes and
strides, so the tests check the arguments handed to cuBLAS, and their
numerics through a NumPy model of the column-major call, without a GPU.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._launch import INT32_MAX, data_pointer

__all__ = [
    "CublasGemm",
    "CupyCublasContext",
    "GemmPlan",
    "OperandLayout",
    "operand_layout",
    "plan_gemm",
    "tf32_from_environment",
    "CUBLAS_OP_N",
    "CUBLAS_OP_T",
    "CUBLAS_COMPUTE_32F",
    "CUBLAS_COMPUTE_32F_FAST_TF32",
    "CUBLAS_COMPUTE_64F",
    "CUBLAS_GEMM_DEFAULT_TENSOR_OP",
    "CUBLAS_POINTER_MODE_HOST",
    "CUDA_R_16F",
    "CUDA_R_16BF",
    "CUDA_R_32F",
    "CUDA_R_64F",
]

# Enumerations of cublas_api.h and library_types.h (fixed by the CUDA ABI).
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
CUBLAS_POINTER_MODE_HOST = 0
CUBLAS_COMPUTE_32F = 68
CUBLAS_COMPUTE_32F_FAST_TF32 = 77
CUBLAS_COMPUTE_64F = 70
CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99
CUDA_R_32F = 0
CUDA_R_64F = 1
CUDA_R_16F = 2
CUDA_R_16BF = 14

# dtype name -> (cudaDataType of A, B and C, scalar dtype of alpha and beta)
_DATA_TYPES = {
    "float16": (CUDA_R_16F, np.float32),
    "bfloat16": (CUDA_R_16BF, np.float32),
    "float32": (CUDA_R_32F, np.float32),
    "float64": (CUDA_R_64F, np.float64),
}


def _read_only(value: float, dtype: Any) -> np.ndarray:
    scalar = np.full(1, value, dtype=dtype)
    scalar.setflags(write=False)
    return scalar


# alpha = 1 and beta = 0 as host scalars of each scalar type, made once (read only): cuBLAS
# reads them before gemmStridedBatchedEx returns
_ALPHA_BETA = {np.dtype(dtype): (_read_only(1.0, dtype), _read_only(0.0, dtype)) for dtype in (np.float32, np.float64)}


def tf32_from_environment(environment: Any = None) -> bool:
    """Whether ``CUPY_TF32`` asks for TF32, read as CuPy reads it: an integer > 0.

    Args:
        environment: a mapping (default ``os.environ``).

    Raises:
        ValueError: when ``CUPY_TF32`` is set but is not an integer.
    """
    value = (os.environ if environment is None else environment).get("CUPY_TF32", "0")
    try:
        return int(value) > 0
    except ValueError:
        raise ValueError(
            f"CUPY_TF32 must be an integer (1 allows TF32 for float32 products, 0 forbids it), got {value!r}"
        ) from None


@dataclass(frozen=True)
class OperandLayout:
    """How cuBLAS reads one batched operand ``[batch, rows, cols]`` (row-major maths) in place.

    Attributes:
        transposed: True when each matrix is stored column-major (the
            transpose of a row-major matrix), so cuBLAS is given ``CUBLAS_OP_T``.
        leading: the leading dimension in elements (row stride of a row-major
            matrix, column stride of a column-major one).
        batch_stride: elements from one matrix of the batch to the next (0 for
            a broadcast operand or a batch of one).
    """

    transposed: bool
    leading: int
    batch_stride: int


def _batch_stride(shape: tuple[int, ...], strides: tuple[int, ...]) -> int | None:
    """One stride for the collapsed batch axes, or None when they do not collapse."""
    axes = [(size, stride) for size, stride in zip(shape, strides) if size != 1]
    for (_, outer), (inner_size, inner) in zip(axes[:-1], axes[1:]):
        if outer != inner * inner_size:
            return None
    return axes[-1][1] if axes else 0


def operand_layout(shape: tuple[int, ...], strides: tuple[int, ...]) -> OperandLayout | None:
    """The in-place cuBLAS layout of a ``[..., rows, cols]`` operand, or None when it needs a copy.

    Args:
        shape: the operand's shape, at least 2 axes.
        strides: its strides in elements (not bytes).
    """
    *batch_shape, rows, cols = shape
    *batch_strides, row_stride, col_stride = strides
    if min(strides, default=0) < 0:
        return None
    batch_stride = _batch_stride(tuple(batch_shape), tuple(batch_strides))
    if batch_stride is None:
        return None
    if (cols == 1 or col_stride == 1) and (rows == 1 or row_stride >= max(cols, 1)):
        return OperandLayout(False, row_stride if rows > 1 else max(cols, 1), batch_stride)
    if (rows == 1 or row_stride == 1) and (cols == 1 or col_stride >= max(rows, 1)):
        return OperandLayout(True, col_stride if cols > 1 else max(rows, 1), batch_stride)
    return None


@dataclass(frozen=True)
class GemmPlan:
    """The integer arguments of one ``cublasGemmStridedBatchedEx`` call for ``left @ right``.

    cuBLAS's ``A`` is the right operand and its ``B`` the left one (see the
    module docstring); ``C`` is the row-major result ``[batch, M, N]``.

    Attributes:
        transa, transb: ``CUBLAS_OP_N`` or ``CUBLAS_OP_T`` for cuBLAS's A (right) and B (left).
        m, n, k: ``N``, ``M`` and ``K`` of ``[M, K] @ [K, N]``.
        lda, ldb, ldc: leading dimensions of A (right), B (left) and C.
        stride_a, stride_b, stride_c: batch strides in elements.
        batch_count: matrices in the batch.
        data_type: the ``cudaDataType`` of A, B and C.
        compute_type: the ``cublasComputeType_t``.
        algo: the ``cublasGemmAlgo_t``.
    """

    transa: int
    transb: int
    m: int
    n: int
    k: int
    lda: int
    ldb: int
    ldc: int
    stride_a: int
    stride_b: int
    stride_c: int
    batch_count: int
    data_type: int
    compute_type: int
    algo: int


def _compute_type(dtype_name: str, tf32: bool) -> int:
    if dtype_name == "float64":
        return CUBLAS_COMPUTE_64F
    if dtype_name == "float32" and tf32:
        return CUBLAS_COMPUTE_32F_FAST_TF32
    return CUBLAS_COMPUTE_32F


def plan_gemm(left: OperandLayout, right: OperandLayout, batch_count: int, rows: int, inner: int, cols: int,
              dtype_name: str, tf32: bool) -> GemmPlan:
    """The cuBLAS call computing ``left [batch, rows, inner] @ right [batch, inner, cols]`` row-major.

    Args:
        left, right: the operands' layouts (`operand_layout`).
        batch_count: matrices in the batch.
        rows, inner, cols: ``M``, ``K``, ``N``.
        dtype_name: ``"float16"``, ``"bfloat16"``, ``"float32"`` or ``"float64"``.
        tf32: allow TF32 for float32.
    """
    return GemmPlan(
        transa=CUBLAS_OP_T if right.transposed else CUBLAS_OP_N,
        transb=CUBLAS_OP_T if left.transposed else CUBLAS_OP_N,
        m=cols, n=rows, k=inner,
        lda=right.leading, ldb=left.leading, ldc=max(cols, 1),
        stride_a=right.batch_stride, stride_b=left.batch_stride, stride_c=rows * cols,
        batch_count=batch_count,
        data_type=_DATA_TYPES[dtype_name][0],
        compute_type=_compute_type(dtype_name, tf32),
        algo=CUBLAS_GEMM_DEFAULT_TENSOR_OP,
    )


@dataclass(frozen=True)
class CupyCublasContext:
    """CuPy's cuBLAS handle of the current device and its current stream."""

    def handle(self) -> int:
        """The cuBLAS handle of the current device (``cupy.cuda.device.get_cublas_handle``)."""
        import cupy

        return int(cupy.cuda.device.get_cublas_handle())

    def stream_pointer(self) -> int:
        """CuPy's current stream (the stream a frontend made current, e.g. XLA's or torch's)."""
        import cupy

        return int(cupy.cuda.get_current_stream().ptr)


def _element_strides(array: Any) -> tuple[int, ...] | None:
    itemsize = array.dtype.itemsize
    if any(stride % itemsize for stride in array.strides):
        return None
    return tuple(stride // itemsize for stride in array.strides)


def _fits_int32(plan: GemmPlan) -> bool:
    return max(plan.m, plan.n, plan.k, plan.lda, plan.ldb, plan.ldc, plan.batch_count) <= INT32_MAX


@dataclass(frozen=True)
class CublasGemm:
    """Products of `KernelBackend.matmul` as cuBLAS strided-batched GEMMs.

    Attributes:
        tf32: run float32 products with ``CUBLAS_COMPUTE_32F_FAST_TF32``. The
            CuPy backend sets it from ``CUPY_TF32`` when it is imported
            (`tf32_from_environment`), the switch CuPy itself reads.
        library: a module with cuBLAS's ``gemmStridedBatchedEx``, ``setStream``,
            ``getPointerMode`` and ``setPointerMode`` (CuPy's signatures); None
            means ``cupy_backends.cuda.libs.cublas``, imported on first use.
        context: gives the handle and the stream (`CupyCublasContext` when None).
    """

    tf32: bool = False
    library: Any = None
    context: Any = None

    def matmul(self, xp: Any, left: Any, right: Any) -> Any:
        """``left @ right`` with NumPy's matmul semantics for operands of 2 or more axes.

        Args:
            xp: the array module of the operands (``cupy``; ``numpy`` in tests).
            left: ``[..., M, K]`` float16/bfloat16/float32/float64.
            right: ``[..., K, N]`` of the same dtype; batch axes broadcast.

        Returns:
            A new C-contiguous ``[..., M, N]`` array of the operands' dtype.
            Other dtypes, mixed dtypes and 1-D operands go to ``xp.matmul``.
        """
        dtype_name = left.dtype.name
        if (left.ndim < 2 or right.ndim < 2 or left.dtype != right.dtype or dtype_name not in _DATA_TYPES):
            return xp.matmul(left, right)
        rows, inner = (int(size) for size in left.shape[-2:])
        if int(right.shape[-2]) != inner:
            raise ValueError(
                f"matmul: left is {tuple(left.shape)} and right is {tuple(right.shape)}; the last axis of left "
                f"({inner}) must equal the second-to-last axis of right ({int(right.shape[-2])})"
            )
        cols = int(right.shape[-1])
        batch_shape = tuple(int(size) for size in np.broadcast_shapes(tuple(left.shape[:-2]),
                                                                       tuple(right.shape[:-2])))
        batch_count = math.prod(batch_shape)
        if rows == 0 or cols == 0 or batch_count == 0 or inner == 0:
            return xp.zeros(batch_shape + (rows, cols), dtype=left.dtype)
        if tuple(left.shape) != batch_shape + (rows, inner):
            left = xp.broadcast_to(left, batch_shape + (rows, inner))
        if tuple(right.shape) != batch_shape + (inner, cols):
            right = xp.broadcast_to(right, batch_shape + (inner, cols))
        left, left_layout = self._in_place_or_copy(xp, left)
        right, right_layout = self._in_place_or_copy(xp, right)
        plan = plan_gemm(left_layout, right_layout, batch_count, rows, inner, cols, dtype_name, self.tf32)
        if not _fits_int32(plan):
            return xp.matmul(left, right)
        out = xp.empty(batch_shape + (rows, cols), dtype=left.dtype)
        self._call(plan, data_pointer(right), data_pointer(left), data_pointer(out), _DATA_TYPES[dtype_name][1])
        return out

    @staticmethod
    def _in_place_or_copy(xp: Any, operand: Any) -> tuple[Any, OperandLayout]:
        strides = _element_strides(operand)
        layout = operand_layout(tuple(operand.shape), strides) if strides is not None else None
        if layout is None:
            operand = xp.ascontiguousarray(operand)
            layout = operand_layout(tuple(operand.shape), _element_strides(operand))
        return operand, layout

    def _call(self, plan: GemmPlan, a_pointer: int, b_pointer: int, c_pointer: int, scalar_dtype: Any) -> None:
        library = self.library
        if library is None:
            from cupy_backends.cuda.libs import cublas as library
        context = self.context if self.context is not None else CupyCublasContext()
        handle = context.handle()
        library.setStream(handle, context.stream_pointer())
        alpha, beta = _ALPHA_BETA[np.dtype(scalar_dtype)]  # host scalars: read before the call returns
        previous_mode = library.getPointerMode(handle)
        if previous_mode != CUBLAS_POINTER_MODE_HOST:
            library.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
        try:
            library.gemmStridedBatchedEx(
                handle, plan.transa, plan.transb, plan.m, plan.n, plan.k,
                alpha.ctypes.data,
                a_pointer, plan.data_type, plan.lda, plan.stride_a,
                b_pointer, plan.data_type, plan.ldb, plan.stride_b,
                beta.ctypes.data,
                c_pointer, plan.data_type, plan.ldc, plan.stride_c,
                plan.batch_count, plan.compute_type, plan.algo)
        finally:
            if previous_mode != CUBLAS_POINTER_MODE_HOST:
                library.setPointerMode(handle, previous_mode)
