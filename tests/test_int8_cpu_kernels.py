"""sparsecore.backends._int8_cpu_kernels.epilogue: the compiled epilogue gives the bits of its NumPy twin.

The twin is `_numpy_int8.apply_epilogue` (NumPy's float32 steps, each rounded
once), itself checked against the integer reference in test_int8.py; here the
float32 sums are random exact integers, with ties of the rounding, saturation
at both ends, negative values under ReLU and empty arrays.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparsecore.backends import _int8_cpu_kernels, _numpy_int8
from sparsecore.backends._numpy_int8 import Int8Epilogue

from int8_reference import same_bits

pytestmark = pytest.mark.skipif(not _int8_cpu_kernels.available(), reason="numba is not installed")


def _steps(rng: np.random.Generator, rows: int, channels: int, bias: bool, residual: bool, relu: bool,
           output_scale: float | None) -> Int8Epilogue:
    return Int8Epilogue(
        multiplier=rng.uniform(1e-4, 4e-3, channels).astype(np.float32),
        bias=rng.standard_normal(channels).astype(np.float32) if bias else None,
        residual=rng.integers(-128, 128, (rows, channels)).astype(np.int8) if residual else None,
        residual_scale=np.float32(rng.uniform(0.01, 0.1)), relu=relu,
        output_scale=None if output_scale is None else np.float32(output_scale))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("output_scale", [None, 0.0625, 0.37])
def test_epilogue_matches_its_numpy_twin(bias: bool, residual: bool, relu: bool, output_scale: float | None) -> None:
    rng = np.random.default_rng([1212, bias, residual, relu, int(1000 * (output_scale or 0))])
    rows, channels = 300, 37  # rows not a multiple of the kernel's row block
    sums = rng.integers(-(2**24), 2**24, (rows, channels)).astype(np.float32)
    sums[:, 0] = 0  # rows without pairs
    steps = _steps(rng, rows, channels, bias, residual, relu, output_scale)
    actual = _int8_cpu_kernels.epilogue(sums.copy(), steps)
    expected = _numpy_int8.apply_epilogue(np, sums.copy(), steps)
    assert actual.dtype == (np.int8 if output_scale is not None else np.float32)
    same_bits(actual, expected, f"bias={bias} residual={residual} relu={relu} output_scale={output_scale}")
    if output_scale is not None and not relu:
        assert actual.min() == -128 and actual.max() == 127, "saturation at both ends was not exercised"


def test_rounding_ties_go_to_even() -> None:
    steps = Int8Epilogue(multiplier=np.ones(1, np.float32), bias=None, residual=None, residual_scale=np.float32(1),
                         relu=False, output_scale=np.float32(2))
    sums = np.array([[1], [3], [5], [-1], [-3], [255], [-257]], np.float32)  # y / 2 = +-0.5, 1.5, 2.5, ...
    actual = _int8_cpu_kernels.epilogue(sums, steps)
    same_bits(actual, np.array([[0], [2], [2], [0], [-2], [127], [-128]], np.int8), "half to even")


def test_empty_arrays() -> None:
    rng = np.random.default_rng(1213)
    for shape in ((0, 5), (4, 0)):
        steps = _steps(rng, shape[0], shape[1], True, False, True, 0.1)
        out = _int8_cpu_kernels.epilogue(np.zeros(shape, np.float32), steps)
        assert out.shape == shape and out.dtype == np.int8
