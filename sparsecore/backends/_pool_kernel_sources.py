"""The numba kernels of `sparsecore.backends._cpu_pool_kernels` (imported on first use).

Both walk the pairs in their order (offset by offset, as the rulebook stores
them), so ties and sums follow the pair order exactly as the NumPy loop they
replace did. The rows they write are split into `ROW_RANGES` fixed ranges, one
work item each, claimed by the threads from a shared counter (`_work_queue`): every item reads the whole pair list and handles the pairs
whose written row falls in its range, so items write disjoint rows and results
do not depend on the number of threads. Comparisons are selects, not branches:
on random data a branch per element mispredicted half the time (8x slower).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

from ._work_queue import claim, new_counter  # new_counter: no parallel region of its own

__all__ = ["ROW_RANGES", "max_pool_forward_kernel", "max_pool_backward_kernel"]

ROW_RANGES = 8

_OPTIONS = {"parallel": True, "cache": True, "nogil": True}


@njit(inline="always")
def _row_range(part: int, rows: int) -> tuple[int, int]:
    """The rows ``[first, last)`` of work item ``part`` (of `ROW_RANGES`)."""
    span = (rows + ROW_RANGES - 1) // ROW_RANGES
    return part * span, min(rows, (part + 1) * span)


@njit(inline="always")
def _max_into(features: Any, source: int, target: int, out: Any, argmax: Any) -> None:
    """Row ``source`` of ``features`` into output row ``target``: selects, not branches."""
    for column in range(features.shape[1]):
        value = features[source, column]
        current = out[target, column]
        chosen = argmax[target, column]
        better = (value > current) | (chosen < 0) | (np.isnan(value) & ~np.isnan(current))
        out[target, column] = value if better else current
        argmax[target, column] = source if better else chosen


@njit(**_OPTIONS)
def max_pool_forward_kernel(features: Any, pair_input: Any, pair_output: Any, out: Any, argmax: Any,
                            lanes: int) -> None:
    """``out[o] = max over pairs (i, o) of features[i]``, ``argmax`` its earliest pair's input row.

    ``out`` zeros and ``argmax`` -1 on entry. A pair replaces the current value when it is
    greater, when the output has none yet, or when it is NaN and the current value is not
    (NaN propagates and stays).
    """
    counter = new_counter()
    for lane in prange(min(lanes, ROW_RANGES)):  # noqa: B007 (one iteration per thread)
        part = claim(counter)
        while part < ROW_RANGES:
            first, last = _row_range(part, out.shape[0])
            for pair in range(pair_input.shape[0]):
                source, target = pair_input[pair], pair_output[pair]
                if first <= target < last:
                    _max_into(features, source, target, out, argmax)
            part = claim(counter)


@njit(**_OPTIONS)
def max_pool_backward_kernel(grad_output: Any, argmax: Any, pair_input: Any, pair_output: Any, grad: Any,
                             lanes: int) -> None:
    """``grad[i] += grad_output[o]`` where ``argmax[o] == i``, pair by pair in order (``grad`` zeros on entry).

    Adds 0 where the pair was not chosen, as the NumPy loop did.
    """
    zero = grad.dtype.type(0)
    counter = new_counter()
    for lane in prange(min(lanes, ROW_RANGES)):  # noqa: B007 (one iteration per thread)
        part = claim(counter)
        while part < ROW_RANGES:
            first, last = _row_range(part, grad.shape[0])
            for pair in range(pair_input.shape[0]):
                source, target = pair_input[pair], pair_output[pair]
                if first <= source < last:
                    for column in range(grad_output.shape[1]):
                        chosen = argmax[target, column] == source
                        grad[source, column] += grad_output[target, column] if chosen else zero
            part = claim(counter)
