"""NumPy twins of the fused feature kernels (``kernels_cu/implicit_gemm.cu``, ``kernels_cu/pool_maps.cu``).

The convolution twins compute in float64 from the widened storage values: on
small-integer data every partial sum is exact in every dtype, so a kernel's
result rounded to storage must equal the twin's bitwise whatever order it sums
in; on random data they are the float64 reference of the GEMM error bound.
The pool twins follow the kernels' order exactly (offsets ascending, sums in
the accumulator type, one rounding at the end), so they are bitwise on any data.

Arrays are as the kernels take them: storage dtypes of `numpy_twins`
(bfloat16 as its uint16 bits), weights in spconv's layout ``[C_out, K, a]``
(kernel axes flattened), neighbour tables int32 ``[N, K]`` with -1 for none.
"""

from __future__ import annotations

import numpy as np

try:
    from cuda_emulation.numpy_twins import STORAGE_DTYPES, narrow, widen
except ImportError:  # tests/ imported as a package
    from tests.cuda_emulation.numpy_twins import STORAGE_DTYPES, narrow, widen

__all__ = ["implicit_gemm", "weight_gradient", "max_pool_map", "max_pool_map_backward", "avg_pool_map",
           "avg_pool_map_backward", "gemm_error_bound", "small_integers"]


def small_integers(rng: np.random.Generator, shape, dtype_name: str, low: int = -3, high: int = 4) -> np.ndarray:
    """Storage values drawn from the integers ``[low, high)``: exact in every dtype, and so are their small sums."""
    return narrow(rng.integers(low, high, size=shape).astype(np.float32), dtype_name)


def _wide(array: np.ndarray, dtype_name: str) -> np.ndarray:
    return widen(array, dtype_name).astype(np.float64)


def implicit_gemm(source, weight, bias, neighbours, groups: int, dtype_name: str, reversed_offsets: bool = False,
                  transposed: bool = False) -> np.ndarray:
    """``sc_implicit_gemm`` in float64: ``out[r] = sum_k source[neighbours[r, k]] @ M_k (+ bias)``.

    ``M_k`` is the weight's offset ``k`` (``K - 1 - k`` when reversed) as ``[a, b]``
    per group, or transposed ``[b, a]`` (the input gradient).

    Returns:
        float64 ``[N, groups * D]``.
    """
    src = _wide(source, dtype_name)
    out_channels, in_per_group = weight.shape[0], weight.shape[-1]
    w = _wide(weight, dtype_name).reshape(out_channels, -1, in_per_group)
    rows, volume = neighbours.shape
    out_per_group = out_channels // groups
    reduce, width = (out_per_group, in_per_group) if transposed else (in_per_group, out_per_group)
    out = np.zeros((rows, groups * width))
    for k in range(volume):
        weight_offset = volume - 1 - k if reversed_offsets else k
        found = neighbours[:, k]
        gathered = np.zeros((rows, src.shape[1]))
        gathered[found >= 0] = src[found[found >= 0]]
        for g in range(groups):
            block = w[g * out_per_group:(g + 1) * out_per_group, weight_offset, :]  # [b, a]
            matrix = block if transposed else block.T
            out[:, g * width:(g + 1) * width] += gathered[:, g * reduce:(g + 1) * reduce] @ matrix
    if bias is not None:
        out += _wide(bias, dtype_name)[None, :]
    return out


def weight_gradient(features, grad_out, neighbours, groups: int, weight_shape, dtype_name: str) -> np.ndarray:
    """``sc_weight_gradient`` in float64: ``dW[g * b + j, k, c] = sum_o features[nb[o, k], g * a + c] * grad_out[o, g * b + j]``.

    Returns:
        float64 of ``weight_shape`` (spconv's layout).
    """
    x = _wide(features, dtype_name)
    dy = _wide(grad_out, dtype_name)
    out_channels, in_per_group = weight_shape[0], weight_shape[-1]
    out_per_group = out_channels // groups
    volume = neighbours.shape[1]
    grad = np.zeros((out_channels, volume, in_per_group))
    for k in range(volume):
        found = neighbours[:, k]
        have = found >= 0
        rows_x, rows_dy = x[found[have]], dy[have]
        for g in range(groups):
            left = rows_x[:, g * in_per_group:(g + 1) * in_per_group]
            right = rows_dy[:, g * out_per_group:(g + 1) * out_per_group]
            grad[g * out_per_group:(g + 1) * out_per_group, k, :] = (left.T @ right).T
    return grad.reshape(weight_shape)


def gemm_error_bound(abs_product_sum: np.ndarray, dtype_name: str, tf32: bool = False) -> np.ndarray:
    """A bound on a GEMM's error against float64: ``c * eps * sum |a * b|`` per element.

    The storage rounding of the result (half an ulp of the storage type) plus the
    accumulation error, bounded generously (``2 * n * eps`` of the accumulator is
    the worst case; sums here are short, so a constant factor covers them), and
    for TF32 the operands' rounding to 10 fraction bits.
    """
    storage_eps = {"float32": 2.0 ** -24, "float64": 2.0 ** -53, "float16": 2.0 ** -11,
                   "bfloat16": 2.0 ** -8}[dtype_name]
    accumulate_eps = 2.0 ** -53 if dtype_name == "float64" else 2.0 ** -24
    operand_eps = 2.0 ** -11 if tf32 else 0.0
    return (storage_eps + 64 * accumulate_eps + 2 * operand_eps) * abs_product_sum + 1e-300


def _acc(dtype_name: str):
    return STORAGE_DTYPES[dtype_name][1]


def max_pool_map(features, neighbours, dtype_name: str) -> tuple[np.ndarray, np.ndarray]:
    """``sc_max_pool_map``: per output element, the first input kept unless a later one is strictly greater
    (a NaN replaces a number); ``(out in storage, argmax int32)``, 0 and -1 without inputs."""
    values = widen(features, dtype_name)
    rows, volume = neighbours.shape
    best = np.zeros((rows, features.shape[1]), dtype=_acc(dtype_name))
    best_row = np.full(best.shape, -1, dtype=np.int32)
    for k in range(volume):
        found = neighbours[:, k]
        have = found >= 0
        candidate = np.zeros_like(best)
        candidate[have] = values[found[have]]
        take = have[:, None] & ((best_row < 0) | (candidate > best) | (np.isnan(candidate) & ~np.isnan(best)))
        best = np.where(take, candidate, best)
        best_row = np.where(take, found[:, None], best_row).astype(np.int32)
    return narrow(best, dtype_name), best_row


def _input_columns(volume: int, reversed_offsets: bool) -> list[int]:
    return [volume - 1 - k if reversed_offsets else k for k in range(volume)]


def max_pool_map_backward(grad_out, argmax, input_neighbours, reversed_offsets: bool, dtype_name: str) -> np.ndarray:
    """``sc_max_pool_map_backward``: per input, the gradients of the outputs whose argmax it is, offsets ascending."""
    grads = widen(grad_out, dtype_name)
    rows, volume = input_neighbours.shape
    total = np.zeros((rows, grad_out.shape[1]), dtype=_acc(dtype_name))
    for column in _input_columns(volume, reversed_offsets):
        outputs = input_neighbours[:, column]
        have = outputs >= 0
        term = np.zeros_like(total)
        chosen = argmax[outputs[have]] == np.nonzero(have)[0][:, None]
        term[have] = np.where(chosen, grads[outputs[have]], 0)
        with np.errstate(over="ignore"):
            total = total + term
    return narrow(total, dtype_name)


def avg_pool_map(features, neighbours, dtype_name: str) -> np.ndarray:
    """``sc_avg_pool_map``: the window's sum (offsets ascending) over its count, in the accumulator type."""
    values = widen(features, dtype_name)
    rows, volume = neighbours.shape
    acc = _acc(dtype_name)
    total = np.zeros((rows, features.shape[1]), dtype=acc)
    for k in range(volume):
        found = neighbours[:, k]
        term = np.zeros_like(total)
        term[found >= 0] = values[found[found >= 0]]
        with np.errstate(over="ignore"):
            total = total + term
    count = (neighbours >= 0).sum(axis=1).astype(acc)[:, None]
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.where(count > 0, total / np.where(count > 0, count, 1), 0).astype(acc)
    return narrow(mean, dtype_name)


def avg_pool_map_backward(grad_out, input_neighbours, output_neighbours, reversed_offsets: bool,
                          dtype_name: str) -> np.ndarray:
    """``sc_avg_pool_map_backward``: per input, ``grad_out[o] / count(o)`` summed over its outputs, offsets ascending."""
    acc = _acc(dtype_name)
    grads = widen(grad_out, dtype_name)
    counts = (output_neighbours >= 0).sum(axis=1).astype(acc)
    rows, volume = input_neighbours.shape
    total = np.zeros((rows, grad_out.shape[1]), dtype=acc)
    for column in _input_columns(volume, reversed_offsets):
        outputs = input_neighbours[:, column]
        have = outputs >= 0
        term = np.zeros_like(total)
        term[have] = grads[outputs[have]] / counts[outputs[have]][:, None]
        with np.errstate(over="ignore"):  # overflow to inf is the kernel's rounding too
            total = total + term
    return narrow(total, dtype_name)
