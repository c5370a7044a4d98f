"""An independent integer reference of the int8 sparse conv and max pool, for the int8 tests.

Plain loops over the rulebook's pairs with int64 accumulators (no GEMM, no
code shared with sparsecore), then the epilogue of ``sparsecore/int8.py``'s
docstring written out step by step on float32 NumPy scalars arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["integer_sums", "reference_epilogue", "reference_int8_conv", "reference_int8_max_pool", "random_int8",
           "same_bits"]


def random_int8(rng: np.random.Generator, shape: tuple[int, ...], low: int = -128, high: int = 127) -> np.ndarray:
    """Uniform int8 values in ``[low, high]``."""
    return rng.integers(low, high + 1, size=shape).astype(np.int8)


def integer_sums(features: np.ndarray, weight: np.ndarray, rulebook: Any, groups: int) -> np.ndarray:
    """int64 ``[M, C_out]``: sum over pairs (i, o) of offset k of ``W[c, k, :] . x[i, group of c]``."""
    out_channels, in_per_group = weight.shape[0], weight.shape[-1]
    out_per_group = out_channels // groups
    flat = weight.reshape(out_channels, -1, in_per_group).astype(np.int64)
    x = np.asarray(features).astype(np.int64)
    acc = np.zeros((rulebook.num_output, out_channels), dtype=np.int64)
    pair_input, pair_output = np.asarray(rulebook.pair_input), np.asarray(rulebook.pair_output)
    starts = rulebook.offset_starts
    for k in range(len(starts) - 1):
        for p in range(starts[k], starts[k + 1]):
            i, o = int(pair_input[p]), int(pair_output[p])
            if i < 0 or o < 0:
                continue
            for g in range(groups):
                outputs = slice(g * out_per_group, (g + 1) * out_per_group)
                acc[o, outputs] += flat[outputs, k, :] @ x[i, g * in_per_group:(g + 1) * in_per_group]
    return acc


def reference_epilogue(acc: np.ndarray, input_scale: float, weight_scales: np.ndarray, output_scale: float | None,
                       bias: np.ndarray | None, residual: np.ndarray | None, residual_scale: float | None,
                       relu: bool) -> np.ndarray:
    """The documented float32 steps, one rounding each."""
    assert np.abs(acc).max(initial=0) < 2**31, "the reference sum left int32"
    f32 = np.float32
    multiplier = f32(input_scale) * np.asarray(weight_scales, dtype=f32)  # float32 product
    y = acc.astype(np.int32).astype(f32) * multiplier[None, :]
    if bias is not None:
        y = y + np.asarray(bias, dtype=f32)[None, :]
    if residual is not None:
        y = y + residual.astype(f32) * f32(residual_scale)
    if relu:
        y = np.where(y < 0, f32(0), y)
    assert y.dtype == f32
    if output_scale is None:
        return y
    return np.clip(np.rint(y / f32(output_scale)), -128, 127).astype(np.int8)


def reference_int8_conv(features: np.ndarray, weight: np.ndarray, rulebook: Any, *, input_scale: float,
                        weight_scales: np.ndarray, output_scale: float | None = None, bias: np.ndarray | None = None,
                        residual: np.ndarray | None = None, residual_scale: float | None = None, relu: bool = False,
                        groups: int = 1) -> np.ndarray:
    """The int8 conv by the reference: `integer_sums`, then `reference_epilogue`."""
    acc = integer_sums(features, weight, rulebook, groups)
    return reference_epilogue(acc, input_scale, weight_scales, output_scale, bias, residual, residual_scale, relu)


def reference_int8_max_pool(features: np.ndarray, rulebook: Any) -> np.ndarray:
    """int8 ``[M, C]``: the maximum over each output's pairs, 0 where an output has none."""
    out = np.zeros((rulebook.num_output, features.shape[1]), dtype=np.int8)
    best: dict[int, np.ndarray] = {}
    for i, o in zip(np.asarray(rulebook.pair_input).tolist(), np.asarray(rulebook.pair_output).tolist()):
        if i < 0 or o < 0:
            continue
        row = features[i].astype(np.int64)
        best[o] = row if o not in best else np.maximum(best[o], row)
    for o, row in best.items():
        out[o] = row
    return out


def same_bits(actual: Any, expected: np.ndarray, what: str) -> None:
    """Asserts equal dtype, shape and bytes."""
    actual = np.asarray(actual)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    if actual.tobytes() != expected.tobytes():
        differ = np.flatnonzero(actual.reshape(-1).view(np.uint8 if actual.dtype == np.int8 else np.uint32)
                                != expected.reshape(-1).view(np.uint8 if expected.dtype == np.int8 else np.uint32))
        first = int(differ[0])
        raise AssertionError(f"{what}: {differ.size} elements differ, first at flat {first}: "
                             f"{actual.reshape(-1)[first]!r} != {expected.reshape(-1)[first]!r}")
