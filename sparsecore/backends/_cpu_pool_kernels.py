"""Compiled CPU max pooling over a pool rulebook's pairs (numba, compiled on first use).

The NumPy backend's `max_pool_pairs` and `max_pool_backward_pairs` run here:
one pass over the pairs in their order instead of a gather, a comparison and a
scatter per kernel offset (the basic network's six SparseMaxPool3d layers on
the real scan, forward: 241 -> 32 ms at one thread, docs/performance_history.md). The
backend passes its compute dtype: float16 is compared and summed in float32
(exact for the maximum; the gradient's sums are float32, as the NumPy loop's
were). The kernels themselves are in `_pool_kernel_sources`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._cpu_kernels import kernel_threads
from .._compile_notice import numba_for_kernels

__all__ = ["max_pool_forward", "max_pool_backward"]


def _sources() -> Any:
    numba_for_kernels()
    from . import _pool_kernel_sources

    return _pool_kernel_sources


def max_pool_forward(features: np.ndarray, pair_input: np.ndarray, pair_output: np.ndarray, num_output: int,
                     compute_dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """Each output's maximum over its pairs and the input row it came from.

    Args:
        features: ``[N_in, C]`` float16/32/64.
        pair_input: integer ``[P]`` input rows, in pair order.
        pair_output: integer ``[P]`` output rows.
        num_output: ``N_out``.
        compute_dtype: the dtype compared in (the backend's ``compute_dtype``: float32 for float16).

    Returns:
        ``(out [N_out, C] in the features' dtype, argmax [N_out, C] int32)``: 0 and -1 where an
        output has no pair; ties go to the earliest pair.
    """
    source = np.ascontiguousarray(features, dtype=compute_dtype)
    out = np.zeros((num_output, features.shape[1]), dtype=source.dtype)
    argmax = np.full((num_output, features.shape[1]), -1, dtype=np.int32)
    if len(pair_input) and features.shape[1]:
        with kernel_threads(len(pair_input) * features.shape[1]) as lanes:
            _sources().max_pool_forward_kernel(source, np.ascontiguousarray(pair_input),
                                               np.ascontiguousarray(pair_output), out, argmax, lanes)
    return out.astype(features.dtype, copy=False), argmax


def max_pool_backward(grad_output: np.ndarray, argmax: np.ndarray, pair_input: np.ndarray,
                      pair_output: np.ndarray, num_input: int, compute_dtype: np.dtype) -> np.ndarray:
    """The gradient of `max_pool_forward`: each output's gradient added to its argmax row, in pair order.

    Args:
        grad_output: ``[N_out, C]`` float16/32/64.
        argmax: ``[N_out, C]`` int32 from the forward.
        pair_input: integer ``[P]`` input rows.
        pair_output: integer ``[P]`` output rows.
        num_input: ``N_in``.
        compute_dtype: the dtype summed in (the backend's ``compute_dtype``: float32 for float16).

    Returns:
        ``[N_in, C]`` in ``grad_output``'s dtype.
    """
    grad_source = np.ascontiguousarray(grad_output, dtype=compute_dtype)
    grad = np.zeros((num_input, grad_output.shape[1]), dtype=grad_source.dtype)
    if len(pair_input) and grad_output.shape[1]:
        with kernel_threads(len(pair_input) * grad_output.shape[1]) as lanes:
            _sources().max_pool_backward_kernel(grad_source, np.ascontiguousarray(argmax, dtype=np.int32),
                                                np.ascontiguousarray(pair_input), np.ascontiguousarray(pair_output),
                                                grad, lanes)
    return grad.astype(grad_output.dtype, copy=False)
