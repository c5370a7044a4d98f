"""Feature passes on a plan's padded arrays as they are: the callback's GPU path, without host reads.

On the CPU the ``buffer_callback`` bridge reads a rulebook's true counts and
cuts the padded ``[K, Q]`` pair arrays to them (`callback._pair_map`): a host
read is free there. On a GPU that read would synchronise XLA's stream inside
the callback, so this module runs the core on the padded layout directly:

- padding pair entries (out-of-range rows ``capacity + j``) become -1, which
  every GPU kernel skips (gathers read zeros, scatters and groupings drop the
  entry), giving a `sparsecore.PairMap` with ``padded=True`` and static
  offset starts (``k * Q``) that never need the counts;
- the identity offset of a submanifold rulebook (not stored in the plan) is
  ``i -> i`` for the rows below the true count, -1 above;
- the true row counts stay on the device as 0-d arrays: padding rows of the
  features and gradients are masked to zero with them, so a padded row holding
  anything (a bias, a batch norm's shift) contributes nothing, and padding rows
  of every result are zero.

Every function takes core arrays (NumPy or CuPy) and the backend to run on;
the backend must skip negative rows (``skips_negative_rows``): the GPU backend,
or in tests the kernel backend under the CPU emulation of CUDA.
"""

from __future__ import annotations

from typing import Any

import sparsecore as sc
from sparsecore._dispatch import array_module
from sparsecore.backends import ArrayBackend

__all__ = [
    "row_mask",
    "padded_pair_map",
    "conv_forward",
    "conv_backward",
    "max_pool_forward",
    "max_pool_backward",
    "avg_pool_forward",
    "avg_pool_backward",
]


def row_mask(xp: Any, capacity: int, count: Any) -> Any:
    """bool ``[capacity, 1]``: True for the rows below ``count`` (a 0-d device array or an int)."""
    return (xp.arange(capacity, dtype=xp.int32) < count)[:, None]


def _masked(rows: Any, count: Any) -> Any:
    xp = array_module(rows)
    return xp.where(row_mask(xp, rows.shape[0], count), rows, rows.dtype.type(0))


def padded_pair_map(pair_input: Any, pair_output: Any, capacity_in: int, capacity_out: int, n_in: Any,
                    kernel_size: tuple[int, ...], identity: int) -> sc.PairMap:
    """The padded ``[K, Q]`` pairs as a padded `sparsecore.PairMap` (see the module docstring).

    Args:
        pair_input, pair_output: int32 ``[K, Q]`` from a `PaddedRulebook`.
        capacity_in, capacity_out: row capacities of the input and output site sets.
        n_in: true input rows (0-d array, stays on the device).
        kernel_size: the rulebook's kernel size.
        identity: the identity (centre) offset, or -1.
    """
    xp = array_module(pair_input)
    volume, per_offset = (int(size) for size in pair_input.shape)
    # every row in [-1, capacity) by construction, so the maps are trusted: no min/max read back to the host
    rows_in = xp.where((pair_input >= 0) & (pair_input < capacity_in), pair_input, -1).astype(xp.int32)
    rows_out = xp.where((pair_output >= 0) & (pair_output < capacity_out), pair_output, -1).astype(xp.int32)
    starts = [per_offset * offset for offset in range(volume + 1)]
    if identity < 0:
        return sc.PairMap(rows_in.reshape(-1), rows_out.reshape(-1), tuple(starts), capacity_in, capacity_out,
                          tuple(kernel_size), -1, padded=True, trusted=True)
    rows = xp.arange(capacity_in, dtype=xp.int32)
    centre = xp.where(rows < n_in, rows, -1).astype(xp.int32)
    flat_in = xp.concatenate([rows_in[:identity].reshape(-1), centre, rows_in[identity + 1:].reshape(-1)])
    flat_out = xp.concatenate([rows_out[:identity].reshape(-1), centre, rows_out[identity + 1:].reshape(-1)])
    starts = starts[: identity + 1] + [start - per_offset + capacity_in for start in starts[identity + 1:]]
    return sc.PairMap(flat_in, flat_out, tuple(starts), capacity_in, capacity_out, tuple(kernel_size), identity,
                      padded=True, trusted=True)


def conv_forward(backend: ArrayBackend, features: Any, weight: Any, pairs: sc.PairMap, n_in: Any, n_out: Any,
                 groups: int) -> Any:
    """``[capacity_out, C_out]`` conv output, padding rows zero (the bias is added by the caller)."""
    out = sc.conv_forward(_masked(features, n_in), weight, pairs, groups=groups, backend=backend)
    return _masked(out, n_out)


def conv_backward(backend: ArrayBackend, grad_output: Any, features: Any, weight: Any, pairs: sc.PairMap,
                  n_in: Any, n_out: Any, groups: int) -> tuple[Any, Any]:
    """``(grad_features [capacity_in, C_in], grad_weight)``; padding rows of both inputs count as zero."""
    grad_features, grad_weight = sc.conv_backward(_masked(grad_output, n_out), _masked(features, n_in), weight,
                                                  pairs, groups=groups, backend=backend)
    return _masked(grad_features, n_in), grad_weight


def max_pool_forward(backend: ArrayBackend, features: Any, pairs: sc.PairMap) -> tuple[Any, Any]:
    """``(out, argmax)`` ``[capacity_out, C]``; padding rows have no pairs: 0 and -1."""
    return sc.max_pool_forward(features, pairs, backend=backend)


def max_pool_backward(backend: ArrayBackend, grad_output: Any, argmax: Any, pairs: sc.PairMap) -> Any:
    """``[capacity_in, C]``: each output's gradient to its argmax row, summed per input over its pairs."""
    return sc.max_pool_backward(grad_output, argmax, pairs.num_input, rulebook=pairs, backend=backend)


def avg_pool_forward(backend: ArrayBackend, features: Any, pairs: sc.PairMap) -> Any:
    """``[capacity_out, C]`` window means over the true pairs; padding rows zero."""
    return sc.avg_pool_forward(features, pairs, backend=backend)


def avg_pool_backward(backend: ArrayBackend, grad_output: Any, pairs: sc.PairMap) -> Any:
    """``[capacity_in, C]``; padding rows of ``grad_output`` are read by no pair."""
    return sc.avg_pool_backward(grad_output, pairs, backend=backend)
