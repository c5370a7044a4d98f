"""`CublasGemm` (``sparsecore/backends/_cublas_gemm.py``) against a recorded, executable fake of cuBLAS.

No GPU here, and CuPy's cuBLAS module cannot even load without the library, so
`CublasGemm` gets a fake ``library``: it records every call and *executes*
``gemmStridedBatchedEx`` with an independent NumPy model of cuBLAS's
column-major semantics (``op(A)`` is ``m x k``, element ``(i, j)`` of a stored
matrix at ``i + j * ld``, batch ``b`` at ``b * stride``), reading and writing
the NumPy arrays behind the pointers it is handed, and checking cuBLAS's own
argument rules (``lda >= max(1, rows stored)``...). So the arguments are
asserted by value, and their numerics against ``np.matmul`` in float64: a wrong
leading dimension, stride or transpose flag fails here. (The kernel backend's
conv passes no longer multiply through the backend's GEMM: they are the fused
kernels of ``kernels_cu/implicit_gemm.cu``, tested in test_implicit_gemm.py.)
"""

from __future__ import annotations

import ctypes
import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from sparsecore import _conv_products
from sparsecore.backends import _cublas_gemm as gemm_module
from sparsecore.backends._cublas_gemm import CublasGemm, operand_layout, tf32_from_environment

try:
    from kernel_targets import rng_for
except ImportError:  # tests/ imported as a package
    from tests.kernel_targets import rng_for

# cuBLAS / CUDA enumeration values, from cublas_api.h and library_types.h (restated, not imported).
OP_N, OP_T = 0, 1
COMPUTE_32F, COMPUTE_32F_FAST_TF32, COMPUTE_64F = 68, 77, 70
R_32F, R_64F, R_16F = 0, 1, 2
GEMM_DEFAULT_TENSOR_OP = 99
NUMPY_OF_DATA_TYPE = {R_32F: np.float32, R_64F: np.float64, R_16F: np.float16}
SCALAR_OF_COMPUTE = {COMPUTE_32F: np.float32, COMPUTE_32F_FAST_TF32: np.float32, COMPUTE_64F: np.float64}
GEMM_ARGUMENTS = ("handle", "transa", "transb", "m", "n", "k", "alpha", "A", "Atype", "lda", "strideA", "B",
                  "Btype", "ldb", "strideB", "beta", "C", "Ctype", "ldc", "strideC", "batchCount",
                  "computeType", "algo")


def _stored_view(pointer: int, dtype, rows: int, cols: int, ld: int, stride: int, batch: int,
                 writable: bool = False) -> np.ndarray:
    """``[batch, rows, cols]`` view of column-major matrices at ``pointer`` (leading dimension ``ld``)."""
    assert ld >= max(1, rows), f"cuBLAS needs ld >= max(1, {rows}), got {ld}"
    assert stride >= 0
    itemsize = np.dtype(dtype).itemsize
    extent = (batch - 1) * stride + (cols - 1) * ld + rows
    buffer = (ctypes.c_char * (extent * itemsize)).from_address(pointer)
    flat = np.frombuffer(buffer, dtype=dtype)
    return np.lib.stride_tricks.as_strided(flat, (batch, rows, cols), (stride * itemsize, itemsize, ld * itemsize),
                                           writeable=writable)


@dataclasses.dataclass
class ModelCublas:
    """A fake ``cupy_backends.cuda.libs.cublas``: records calls, and runs GEMMs with a NumPy model."""

    calls: list = dataclasses.field(default_factory=list)
    gemms: list = dataclasses.field(default_factory=list)
    pointer_mode: int = 1  # starts in device mode, so the backend must switch to host mode and back

    def setStream(self, handle, stream):  # noqa: N802 - cuBLAS's spelling
        self.calls.append(("setStream", handle, stream))

    def getPointerMode(self, handle):  # noqa: N802
        self.calls.append(("getPointerMode", handle))
        return self.pointer_mode

    def setPointerMode(self, handle, mode):  # noqa: N802
        self.calls.append(("setPointerMode", handle, mode))
        self.pointer_mode = mode

    def gemmStridedBatchedEx(self, *arguments):  # noqa: N802
        assert len(arguments) == len(GEMM_ARGUMENTS)
        call = dict(zip(GEMM_ARGUMENTS, arguments))
        self.calls.append(("gemmStridedBatchedEx", call))
        self.gemms.append(call)
        assert self.pointer_mode == 0, "alpha and beta are host pointers: the handle must be in host mode"
        assert call["Atype"] == call["Btype"] == call["Ctype"]
        dtype = NUMPY_OF_DATA_TYPE[call["Atype"]]
        scalar = SCALAR_OF_COMPUTE[call["computeType"]]
        alpha = np.frombuffer((ctypes.c_char * 8).from_address(call["alpha"]), dtype=scalar, count=1)[0]
        beta = np.frombuffer((ctypes.c_char * 8).from_address(call["beta"]), dtype=scalar, count=1)[0]
        m, n, k, batch = call["m"], call["n"], call["k"], call["batchCount"]
        a_rows, a_cols = (m, k) if call["transa"] == OP_N else (k, m)
        b_rows, b_cols = (k, n) if call["transb"] == OP_N else (n, k)
        a = _stored_view(call["A"], dtype, a_rows, a_cols, call["lda"], call["strideA"], batch)
        b = _stored_view(call["B"], dtype, b_rows, b_cols, call["ldb"], call["strideB"], batch)
        c = _stored_view(call["C"], dtype, m, n, call["ldc"], call["strideC"], batch, writable=True)
        op_a = a if call["transa"] == OP_N else a.transpose(0, 2, 1)
        op_b = b if call["transb"] == OP_N else b.transpose(0, 2, 1)
        result = float(alpha) * np.matmul(op_a.astype(np.float64), op_b.astype(np.float64))
        if beta != 0:  # cuBLAS does not read C when beta is 0
            result += float(beta) * c.astype(np.float64)
        c[...] = result.astype(dtype)


@dataclasses.dataclass(frozen=True)
class FakeContext:
    def handle(self) -> int:
        return 4242

    def stream_pointer(self) -> int:
        return 777


def _gemm(tf32: bool = False) -> tuple[CublasGemm, ModelCublas]:
    library = ModelCublas()
    return CublasGemm(tf32=tf32, library=library, context=FakeContext()), library


def _pointer(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


TOLERANCE = {"float16": 2e-3, "float32": 1e-5, "float64": 1e-12}


def _assert_matches_matmul(actual: np.ndarray, left: np.ndarray, right: np.ndarray) -> None:
    expected = np.matmul(left.astype(np.float64), right.astype(np.float64))
    assert actual.shape == expected.shape and actual.dtype == left.dtype
    tolerance = TOLERANCE[left.dtype.name]
    np.testing.assert_allclose(actual.astype(np.float64), expected, rtol=tolerance,
                               atol=tolerance * max(1.0, float(np.abs(expected).max(initial=0))))


# ================================================================ the arguments handed to cuBLAS


@pytest.mark.parametrize("dtype_name, tf32, data_type, compute_type", [
    ("float16", False, R_16F, COMPUTE_32F),
    ("float16", True, R_16F, COMPUTE_32F),  # TF32 concerns float32 only
    ("float32", False, R_32F, COMPUTE_32F),
    ("float32", True, R_32F, COMPUTE_32F_FAST_TF32),
    ("float64", False, R_64F, COMPUTE_64F),
    ("float64", True, R_64F, COMPUTE_64F),
])
def test_batched_product_arguments(dtype_name, tf32, data_type, compute_type):
    rng = rng_for(31, len(dtype_name), tf32)
    batch, rows, inner, cols = 5, 7, 3, 4  # the [m, W, a] @ [m, a, b] of a chunk of offsets
    left = rng.uniform(-2, 2, (batch, rows, inner)).astype(dtype_name)
    right = rng.uniform(-2, 2, (batch, inner, cols)).astype(dtype_name)
    engine, library = _gemm(tf32)
    out = engine.matmul(np, left, right)
    assert [call[0] for call in library.calls] == ["setStream", "getPointerMode", "setPointerMode",
                                                   "gemmStridedBatchedEx", "setPointerMode"]
    assert library.calls[0] == ("setStream", 4242, 777)
    assert library.calls[-1] == ("setPointerMode", 4242, 1)  # the handle's mode restored
    (call,) = library.gemms
    expected = dict(handle=4242, transa=OP_N, transb=OP_N, m=cols, n=rows, k=inner,
                    A=_pointer(right), Atype=data_type, lda=cols, strideA=inner * cols,
                    B=_pointer(left), Btype=data_type, ldb=inner, strideB=rows * inner,
                    C=_pointer(out), Ctype=data_type, ldc=cols, strideC=rows * cols,
                    batchCount=batch, computeType=compute_type, algo=GEMM_DEFAULT_TENSOR_OP)
    assert {name: call[name] for name in expected} == expected
    _assert_matches_matmul(out, left, right)


def test_transposed_operands_go_as_transpose_flags_without_copies():
    rng = rng_for(32)
    gathered = rng.uniform(-2, 2, (4, 9, 3)).astype(np.float32)  # [m, W, a]
    grads = rng.uniform(-2, 2, (4, 9, 5)).astype(np.float32)  # [m, W, b]
    engine, library = _gemm()
    # the weight gradient's left.transpose(0, 2, 1) @ right: [m, a, W] @ [m, W, b]
    out = engine.matmul(np, gathered.transpose(0, 2, 1), grads)
    (call,) = library.gemms
    assert (call["transa"], call["transb"]) == (OP_N, OP_T)
    assert (call["m"], call["n"], call["k"]) == (5, 3, 9)
    assert (call["B"], call["ldb"], call["strideB"]) == (_pointer(gathered), 3, 27)  # the gathered rows, in place
    assert (call["A"], call["lda"], call["strideA"]) == (_pointer(grads), 5, 45)
    _assert_matches_matmul(out, gathered.transpose(0, 2, 1), grads)


def test_weight_views_of_the_conv_are_read_in_place():
    rng = rng_for(33)
    out_channels, volume, in_channels = 6, 27, 4
    weight = rng.uniform(-2, 2, (out_channels, 3, 3, 3, in_channels)).astype(np.float32)
    matrices = _conv_products.offset_matrices(weight, 1, np.float32)[:, 0]  # [K, in, out], a strided view
    transposed = matrices.transpose(0, 2, 1)  # [K, out, in], the backward's
    rows = rng.uniform(-2, 2, (volume, 5, in_channels)).astype(np.float32)
    grads = rng.uniform(-2, 2, (volume, 5, out_channels)).astype(np.float32)
    engine, library = _gemm()
    forward = engine.matmul(np, rows, matrices)
    backward = engine.matmul(np, grads, transposed)
    first, second = library.gemms
    # [in, out] per offset: element (i, o) at i + o * volume * in: column-major, ld = volume * in, stride in
    assert (first["transa"], first["A"], first["lda"], first["strideA"]) == (
        OP_T, _pointer(weight), volume * in_channels, in_channels)
    assert (second["transa"], second["A"], second["lda"], second["strideA"]) == (
        OP_N, _pointer(weight), volume * in_channels, in_channels)
    _assert_matches_matmul(forward, rows, matrices)
    _assert_matches_matmul(backward, grads, transposed)


@pytest.mark.parametrize("case", [
    "2d", "2d-left-transposed", "2d-both-transposed", "broadcast-right", "broadcast-left", "4d-grouped",
    "sliced-rows", "non-collapsible-batch", "single-column", "single-row",
])
@pytest.mark.parametrize("dtype_name", ["float16", "float32", "float64"])
def test_numerics_of_the_argument_mapping(case, dtype_name):
    rng = rng_for(34, len(case), len(dtype_name))

    def draw(*shape):
        return rng.uniform(-2, 2, shape).astype(dtype_name)

    left, right = {
        "2d": lambda: (draw(6, 5), draw(5, 3)),
        "2d-left-transposed": lambda: (draw(5, 6).T, draw(5, 3)),
        "2d-both-transposed": lambda: (draw(5, 6).T, draw(3, 5).T),
        "broadcast-right": lambda: (draw(4, 6, 5), draw(5, 3)),
        "broadcast-left": lambda: (draw(6, 5), draw(4, 5, 3)),
        "4d-grouped": lambda: (draw(3, 7, 2, 4).transpose(0, 2, 1, 3), draw(3, 2, 4, 5)),
        "sliced-rows": lambda: (draw(4, 9, 6)[:, ::2, 1:5], draw(4, 4, 3)),
        "non-collapsible-batch": lambda: (draw(3, 4, 6, 5).transpose(1, 0, 2, 3), draw(4, 3, 5, 2)),
        "single-column": lambda: (draw(4, 6, 5), draw(4, 5, 1)),
        "single-row": lambda: (draw(4, 1, 5), draw(4, 5, 3)),
    }[case]()
    engine, library = _gemm()
    out = engine.matmul(np, left, right)
    assert out.flags.c_contiguous
    assert len(library.gemms) == 1
    _assert_matches_matmul(out, left, right)


def test_strided_views_that_cublas_cannot_read_are_copied_first():
    rng = rng_for(35)
    left = rng.uniform(-2, 2, (4, 9, 6)).astype(np.float32)[:, ::2, ::2]  # neither row- nor column-major
    right = rng.uniform(-2, 2, (4, 3, 2)).astype(np.float32)
    engine, library = _gemm()
    out = engine.matmul(np, left, right)
    (call,) = library.gemms
    assert call["B"] != _pointer(left) and (call["transb"], call["ldb"], call["strideB"]) == (OP_N, 3, 15)
    _assert_matches_matmul(out, left, right)


def test_the_model_catches_a_wrong_leading_dimension_or_flag(monkeypatch):
    """The check is sharp: a plan with a flipped flag or a wrong ld does not pass as a product."""
    rng = rng_for(36)
    left = rng.uniform(-2, 2, (3, 4, 4)).astype(np.float64)
    right = rng.uniform(-2, 2, (3, 4, 4)).astype(np.float64)
    original = gemm_module.plan_gemm
    for broken in (lambda plan: dataclasses.replace(plan, transa=OP_T),
                   lambda plan: dataclasses.replace(plan, transb=OP_T),
                   lambda plan: dataclasses.replace(plan, lda=plan.lda + 1, stride_a=plan.stride_a)):
        monkeypatch.setattr(gemm_module, "plan_gemm", lambda *args, broken=broken: broken(original(*args)))
        engine, _ = _gemm()
        with pytest.raises(AssertionError):
            # a wrong lda reads past the batch's last matrix, a wrong flag transposes: either fails
            out = engine.matmul(np, left[:2], right[:2])
            _assert_matches_matmul(out, left[:2], right[:2])


@pytest.mark.parametrize("shapes", [((0, 4, 3), (0, 3, 2)), ((2, 0, 3), (2, 3, 2)), ((2, 4, 0), (2, 0, 2)),
                                    ((2, 4, 3), (2, 3, 0))])
def test_empty_products_make_no_call(shapes):
    engine, library = _gemm()
    left, right = (np.ones(shape, np.float32) for shape in shapes)
    out = engine.matmul(np, left, right)
    np.testing.assert_array_equal(out, np.matmul(left, right))
    assert library.gemms == []


def test_other_dtypes_and_mismatched_shapes():
    engine, library = _gemm()
    integers = np.arange(12, dtype=np.int64).reshape(3, 4)
    np.testing.assert_array_equal(engine.matmul(np, integers, integers.T), integers @ integers.T)
    assert library.gemms == []
    with pytest.raises(ValueError, match=r"last axis of left \(4\) must equal .* right \(3\)"):
        engine.matmul(np, np.ones((2, 4), np.float32), np.ones((3, 2), np.float32))


# ===================================================================== the TF32 rule


@pytest.mark.parametrize("value, expected", [(None, False), ("0", False), ("1", True), ("2", True)])
def test_tf32_follows_cupy_tf32(value, expected):
    environment = {} if value is None else {"CUPY_TF32": value}
    assert tf32_from_environment(environment) is expected


def test_tf32_rejects_a_non_integer():
    with pytest.raises(ValueError, match=r"CUPY_TF32 must be an integer .* got 'yes'"):
        tf32_from_environment({"CUPY_TF32": "yes"})


@pytest.mark.parametrize("value, expected", [("0", "False"), ("1", "True")])
def test_the_cupy_backend_reads_cupy_tf32_at_import(value, expected):
    code = ("from sparsecore.backends.cupy_backend import CUPY_BACKEND as b; "
            "print(type(b.gemm).__name__, b.gemm.tf32)")
    environment = {**__import__("os").environ, "CUPY_TF32": value}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["CublasGemm", expected]


def test_the_default_wiring_is_cupys_cublas_module_handle_and_current_stream(monkeypatch):
    """With no library or context given: ``cupy_backends.cuda.libs.cublas``, CuPy's handle, CuPy's current stream."""
    import cupy
    import cupy_backends.cuda.libs as libs

    library = ModelCublas()
    monkeypatch.setitem(vars(libs), "cublas", library)  # CuPy's module cannot load without libcublas
    monkeypatch.setattr(cupy.cuda.device, "get_cublas_handle", lambda: 31337)
    monkeypatch.setattr(cupy.cuda, "get_current_stream", lambda: type("Stream", (), {"ptr": 2468})())
    from sparsecore.backends.cupy_backend import CUPY_BACKEND

    rng = rng_for(38)
    left = rng.uniform(-2, 2, (3, 5, 4)).astype(np.float16)
    right = rng.uniform(-2, 2, (3, 4, 2)).astype(np.float16)
    out = dataclasses.replace(CUPY_BACKEND, xp=np).matmul(left, right)  # NumPy arrays stand in for CuPy's
    assert library.calls[0] == ("setStream", 31337, 2468)
    (call,) = library.gemms
    assert (call["handle"], call["Atype"], call["computeType"], call["algo"]) == (31337, R_16F, COMPUTE_32F,
                                                                                 GEMM_DEFAULT_TENSOR_OP)
    _assert_matches_matmul(out, left, right)


def test_operand_layout_rules():
    assert operand_layout((3, 4), (4, 1)).transposed is False
    assert operand_layout((3, 4), (1, 3)) == gemm_module.OperandLayout(True, 3, 0)
    assert operand_layout((2, 3, 4), (20, 5, 1)) == gemm_module.OperandLayout(False, 5, 20)
    assert operand_layout((3, 4), (8, 2)) is None  # every other column
    assert operand_layout((2, 3, 3, 4), (7, 36, 12, 1)) is None  # batch axes that do not collapse
