"""Plain NumPy twins of the CUDA kernels: the oracles of the emulation tests.

(The pool twins over CSR groupings are the oracles of the NumPy backend's pair
pools, `NumpyBackend.max_pool_pairs` and friends; the fused kernels' twins are
in ``fused_twins.py``.)

Each twin computes what its kernel's contract (the comment block in
``kernels_cu/*.cu``) promises, in the same arithmetic: sums in float32 (float64
for double) in the documented order, one rounding to the storage type at the
end. So integer results and float results alike are compared exactly.

16-bit storage: ``float16`` arrays for __half; bfloat16 travels as its uint16
bit pattern (NumPy has no bfloat16), converted here with round-to-nearest-even.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = [
    "STORAGE_DTYPES",
    "widen",
    "narrow",
    "random_features",
    "hash_lookup",
    "segment_sum_rows",
    "max_pool_forward",
    "max_pool_backward",
    "avg_pool_forward",
    "avg_pool_backward",
    "compact",
    "conv_candidates",
]

# Test dtype name -> (storage dtype, accumulator dtype, C++ element type).
STORAGE_DTYPES = {
    "float32": (np.float32, np.float32, "float"),
    "float64": (np.float64, np.float64, "double"),
    "float16": (np.float16, np.float32, "__half"),
    "bfloat16": (np.uint16, np.float32, "__nv_bfloat16"),
}


def widen(array: np.ndarray, dtype_name: str) -> np.ndarray:
    """Storage values to the accumulator type, exactly."""
    if dtype_name == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array.astype(STORAGE_DTYPES[dtype_name][1])


def narrow(array: np.ndarray, dtype_name: str) -> np.ndarray:
    """Accumulator values to storage, rounding to nearest even."""
    if dtype_name == "bfloat16":
        bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32).astype(np.uint64)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return rounded.astype(np.uint16)
    with np.errstate(over="ignore"):  # overflow to inf is the expected rounding
        return array.astype(STORAGE_DTYPES[dtype_name][0])


def random_features(rng: np.random.Generator, shape: Sequence[int], dtype_name: str) -> np.ndarray:
    """Random storage values in [-2, 2)."""
    return narrow(rng.uniform(-2.0, 2.0, size=shape).astype(STORAGE_DTYPES[dtype_name][1]), dtype_name)


def hash_lookup(keys: np.ndarray, values: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """The value of each query in a table of ``keys -> values`` keeping minimum values, -1 if absent."""
    out = np.full(queries.shape, -1, dtype=values.dtype)
    if keys.shape[0] == 0:
        return out
    order = np.lexsort((values, keys))
    sorted_keys, sorted_values = keys[order], values[order]
    first = np.ones(sorted_keys.shape[0], dtype=bool)
    first[1:] = sorted_keys[1:] != sorted_keys[:-1]
    unique_keys, minimum_values = sorted_keys[first], sorted_values[first]
    position = np.clip(np.searchsorted(unique_keys, queries), 0, unique_keys.shape[0] - 1)
    found = (unique_keys[position] == queries) & (queries >= 0)
    out[found] = minimum_values[position[found]]
    return out


def pack_keys(indices: np.ndarray, strides, addends) -> np.ndarray:
    """``sc_pack_keys``: one Python integer sum per site (no int64 wrap-around to hide an error)."""
    keys = [sum((int(value) + int(addend)) * int(stride) for value, addend, stride in zip(row, addends, strides))
            for row in np.asarray(indices).tolist()]
    return np.array(keys, dtype=np.int64)


def unpack_keys(keys: np.ndarray, strides, addends) -> np.ndarray:
    """``sc_unpack_keys``: the mixed-radix digits of each key, minus the addends."""
    rows = []
    for key in np.asarray(keys).tolist():
        row = []
        for stride, addend in zip(strides, addends):
            row.append(key // int(stride) - int(addend))
            key %= int(stride)
        rows.append(row)
    return np.array(rows, dtype=np.int32).reshape(len(rows), len(strides))


def _ordered_group_sums(values: np.ndarray, members: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """``out[g] = sum of values[members[p]] for p in group g``, added one member at a time, in order.

    Args:
        values: ``[M, C]`` accumulator-typed rows.
        members: ``[P]`` row numbers into ``values``, grouped; -1 (padding) is skipped.
        starts: ``[G + 1]`` group boundaries into ``members``.
    """
    lengths = np.diff(starts)
    acc = np.zeros((lengths.shape[0], values.shape[1]), dtype=values.dtype)
    with np.errstate(over="ignore"):  # overflow to inf is the expected result
        for step in range(int(lengths.max(initial=0))):
            groups = np.flatnonzero(lengths > step)
            rows = members[starts[groups] + step]
            present = rows >= 0
            acc[groups[present]] += values[rows[present]]
    return acc


def _valid_counts(members: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Members that are not -1 in each group ``[G]``."""
    running = np.concatenate([[0], np.cumsum(members >= 0)])
    return running[starts[1:]] - running[starts[:-1]]


def segment_sum_rows(target, source, order, segment_starts, segment_rows, dtype_name):
    out = target.copy()
    acc = _ordered_group_sums(widen(source, dtype_name), order, segment_starts)
    out[segment_rows] = narrow(widen(target[segment_rows], dtype_name) + acc, dtype_name)
    return out


def max_pool_forward(features, input_rows, output_starts, dtype_name):
    wide = widen(features, dtype_name)
    lengths = np.diff(output_starts)
    best = np.zeros((lengths.shape[0], features.shape[1]), dtype=wide.dtype)
    argmax = np.full(best.shape, -1, dtype=np.int32)
    for step in range(int(lengths.max(initial=0))):
        groups = np.flatnonzero(lengths > step)
        rows = input_rows[output_starts[groups] + step]
        groups, rows = groups[rows >= 0], rows[rows >= 0]  # -1: padding, no input
        candidate = wide[rows]
        better = (argmax[groups] < 0) | (candidate > best[groups])
        best[groups] = np.where(better, candidate, best[groups])
        argmax[groups] = np.where(better, rows[:, None], argmax[groups])
    return narrow(best, dtype_name), argmax


def max_pool_backward(grad_out, argmax, output_rows, input_starts, dtype_name):
    wide = widen(grad_out, dtype_name)
    lengths = np.diff(input_starts)
    acc = np.zeros((lengths.shape[0], grad_out.shape[1]), dtype=wide.dtype)
    for step in range(int(lengths.max(initial=0))):
        inputs = np.flatnonzero(lengths > step)
        outputs = output_rows[input_starts[inputs] + step]
        inputs, outputs = inputs[outputs >= 0], outputs[outputs >= 0]  # -1: padding, no output
        chosen = argmax[outputs] == inputs[:, None]
        acc[inputs] += np.where(chosen, wide[outputs], wide.dtype.type(0))
    return narrow(acc, dtype_name)


def avg_pool_forward(features, input_rows, output_starts, dtype_name):
    acc = _ordered_group_sums(widen(features, dtype_name), input_rows, output_starts)
    counts = _valid_counts(input_rows, output_starts).astype(acc.dtype)[:, None]
    mean = np.divide(acc, counts, out=np.zeros_like(acc), where=counts > 0)
    return narrow(mean, dtype_name)


def avg_pool_backward(grad_out, output_rows, input_starts, output_starts, dtype_name):
    wide = widen(grad_out, dtype_name)
    counts = np.maximum(np.diff(output_starts), 1).astype(wide.dtype)[:, None]
    shares = wide / counts
    return narrow(_ordered_group_sums(shares, output_rows, input_starts), dtype_name)


def compact(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rows, columns = np.nonzero(values >= 0)  # row-major order
    counts = np.bincount(rows, minlength=values.shape[0])
    return columns.astype(np.int32), values[rows, columns].astype(np.int32), counts


def conv_candidates(indices, kernel_positions, stride, padding, dilation, output_shape, transposed):
    """Output keys ``[K, N]`` of every (offset, input site), straight from the dense formulas."""
    stride, padding, dilation, output_shape = (
        np.asarray(value, dtype=np.int64) for value in (stride, padding, dilation, output_shape)
    )
    coordinates = indices[None, :, 1:].astype(np.int64)
    reach = kernel_positions[:, None, :].astype(np.int64) * dilation
    if transposed:
        out = coordinates * stride - padding + reach
        valid = np.ones(out.shape, dtype=bool)
    else:
        shifted = coordinates + padding - reach
        valid = (shifted >= 0) & (shifted % stride == 0)
        out = shifted // stride
    valid &= (out >= 0) & (out < output_shape)
    keys = np.broadcast_to(indices[None, :, 0].astype(np.int64), valid.shape[:2]).copy()
    for axis in range(indices.shape[1] - 1):
        keys = keys * output_shape[axis] + out[..., axis]
    keys[~valid.all(axis=2) | (indices[None, :, 0] < 0)] = -1
    return keys
