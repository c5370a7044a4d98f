"""sparsecore.backends._x86_intrinsics: vpdpbusd and vdpbf16ps against their NumPy twins, bit for bit.

Each intrinsic runs in a small numba function on random operands (the extremes
of each byte range included, accumulators near the int32 limits so the sums
wrap); the twins are the instructions' definitions written out in NumPy.
Skipped where the CPU (or numba) lacks the feature.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparsecore.backends import x86_features

numba = pytest.importorskip("numba")

from sparsecore.backends import _x86_intrinsics as x86  # noqa: E402  (imports llvmlite)

FEATURES = x86_features.available_features()


@numba.njit(cache=False)
def _dot_bytes(accumulator, unsigned_bytes, signed_bytes, out):
    """out = accumulator + vpdpbusd over every 64-byte block, the signed quad broadcast from signed_bytes."""
    vector = x86.load_i32x16(accumulator, 0)
    for block in range(unsigned_bytes.shape[0] // 64):
        vector = x86.vpdpbusd(vector, x86.load_i32x16(unsigned_bytes, 64 * block),
                              x86.broadcast_i32(signed_bytes, 4 * block))
    x86.store_i32x16(out, 0, vector)


@numba.njit(cache=False)
def _dot_bfloat16(accumulator, first, second, out):
    vector = x86.dpbf16ps(x86.load_f32x16(accumulator, 0), x86.load_i32x16(first, 0), x86.load_i32x16(second, 0))
    x86.store_f32x16(out, 0, vector)


@pytest.mark.skipif(not FEATURES.avx512_vnni, reason="needs avx512_vnni")
def test_vpdpbusd_is_four_unsigned_by_signed_byte_products_per_lane_wrapping() -> None:
    rng = np.random.default_rng(3810)
    blocks = 5
    unsigned_bytes = rng.integers(0, 256, 64 * blocks).astype(np.uint8)
    signed_bytes = rng.integers(-128, 128, 4 * blocks).astype(np.int8)
    unsigned_bytes[:64] = 255  # the extremes: 255 x -128 in every lane of the first block
    signed_bytes[:4] = -128
    accumulator = rng.integers(-(2**31), 2**31, 16, dtype=np.int64).astype(np.int32)
    accumulator[:4] = [-(2**31), -(2**31) + 5, 2**31 - 1, 0]  # sums that wrap
    out = np.empty(16, np.int32)
    _dot_bytes(accumulator, unsigned_bytes, signed_bytes, out)
    products = unsigned_bytes.reshape(blocks, 16, 4).astype(np.int64) * signed_bytes.reshape(blocks, 1, 4)
    expected = (accumulator.astype(np.int64) + products.sum(axis=(0, 2))) % 2**32
    np.testing.assert_array_equal(out.view(np.uint32).astype(np.int64), expected)


def _bfloat16(values: np.ndarray) -> np.ndarray:
    return (np.asarray(values, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _widen(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.skipif(not FEATURES.avx512_bf16, reason="needs avx512_bf16")
def test_dpbf16ps_adds_two_exact_bfloat16_products_per_lane() -> None:
    """Products of bfloat16 values are exact in float32; the instruction adds the odd (upper) pair's product,
    then the even one's, each sum rounded to nearest even (normal values: no flush to zero)."""
    rng = np.random.default_rng(3811)
    for _ in range(20):
        first, second = (_bfloat16(rng.standard_normal(32) * 4) for _ in range(2))
        accumulator = rng.standard_normal(16).astype(np.float32)
        out = np.empty(16, np.float32)
        _dot_bfloat16(accumulator, first, second, out)
        a, b = _widen(first).reshape(16, 2), _widen(second).reshape(16, 2)
        expected = (accumulator + a[:, 1] * b[:, 1]) + a[:, 0] * b[:, 0]  # float32 steps, products exact
        np.testing.assert_array_equal(out.view(np.uint32), expected.astype(np.float32).view(np.uint32))


def test_vector_types_are_checked_at_compile_time() -> None:
    @numba.njit(cache=False)
    def wrong(values):
        vector = x86.load_f32x16(values, 0)
        return x86.vpdpbusd(vector, vector, vector)

    with pytest.raises((TypeError, numba.core.errors.TypingError), match="vpdpbusd takes three"):
        wrong(np.zeros(16, np.float32))
