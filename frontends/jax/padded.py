"""Feature passes on a plan's padded arrays, and the core rulebooks over them.

A plan stores each rulebook once, as ``[K, Q]`` pair rows in the kernels'
convention (-1 = no pair; see `plan`), the subm centre offset included. The
callback passes read it as:

- `neighbour_map`: a `sparsecore.neighbour_map.NeighbourMap` over the padded
  tables `layout.map_arrays` made inside the compiled program (views, no array
  operation, nothing read back): what the GPU's fused kernels read. Rows past
  the true counts are all -1 with masks 0; the map claims no identity offset
  (its padding rows are paired with nothing).
- `pair_map`: a `sparsecore.PairMap` with ``padded=True`` over the flattened
  arrays (a reshape, no array operation) with static offset starts ``k * Q``:
  no true count is read back to the host. For backends that skip -1 rows.
- `true_pair_map`: the true pairs joined into one flat map (one copy per pair
  array), for the NumPy backend, which cannot skip -1 rows; it reads the
  per-offset counts (free on the host).

All span the full padded rows (``num_input = capacity_in``,
``num_output = capacity_out``). The passes below mask the features and
gradients to their true rows with the row counts (0-d arrays, left on the
device on a GPU), so a padding row holding anything (a bias, a batch norm's
shift) contributes nothing, and padding rows of every result are zero.
"""

from __future__ import annotations

from typing import Any, Union

import sparsecore as sc
from sparsecore.backends import ArrayBackend
from sparsecore.interop import array_module
from sparsecore.neighbour_map import NeighbourMap

#: What the passes below hand the core: a padded pair map or a padded neighbour map.
CoreRulebook = Union[sc.PairMap, NeighbourMap]

__all__ = [
    "row_mask",
    "neighbour_map",
    "pair_map",
    "true_pair_map",
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


def neighbour_map(tables: tuple[Any, ...], capacity_in: int, capacity_out: int,
                  kernel_size: tuple[int, ...]) -> NeighbourMap:
    """The padded tables of `layout.map_arrays` as a `sparsecore.neighbour_map.NeighbourMap` (no array operation).

    Args:
        tables: ``(output_neighbours, output_masks, output_order)``, plus the input side's three
            for a map that is not symmetric (core views of the callback's buffers).
        capacity_in, capacity_out: row capacities of the input and output site sets.
        kernel_size: the rulebook's kernel size.
    """
    symmetric = len(tables) == 3
    input_side = (None, None, None) if symmetric else tables[3:]
    return NeighbourMap(*tables[:3], *input_side, int(capacity_in), int(capacity_out),
                        tuple(int(k) for k in kernel_size), -1, symmetric)


def pair_map(pair_input: Any, pair_output: Any, capacity_in: int, capacity_out: int, kernel_size: tuple[int, ...],
             identity: int) -> sc.PairMap:
    """The stored ``[K, Q]`` pairs as a padded `sparsecore.PairMap` (no array operation, no host read).

    Args:
        pair_input, pair_output: int32 ``[K, Q]`` rows from a `PaddedRulebook` (-1 = no pair).
        capacity_in, capacity_out: row capacities of the input and output site sets.
        kernel_size: the rulebook's kernel size.
        identity: the identity (centre) offset, or -1.
    """
    volume, per_offset = (int(size) for size in pair_input.shape)
    starts = tuple(per_offset * offset for offset in range(volume + 1))
    # every row in [-1, capacity) by construction, so the map is trusted: no min/max read back to the host
    return sc.PairMap(pair_input.reshape(-1), pair_output.reshape(-1), starts, capacity_in, capacity_out,
                      tuple(kernel_size), identity, padded=True, trusted=True)


def true_pair_map(pair_input: Any, pair_output: Any, counts: Any, capacity_in: int, capacity_out: int,
                  kernel_size: tuple[int, ...], identity: int) -> sc.PairMap:
    """The true pairs of the stored ``[K, Q]`` rows as a flat `sparsecore.PairMap` (host arrays).

    Offset ``k``'s pairs are the first ``counts[k]`` entries of row ``k``; they are
    joined in offset order (one concatenation per pair array).
    """
    xp = array_module(pair_input)
    per_offset = [int(count) for count in counts.tolist()]
    starts = [0]
    for count in per_offset:
        starts.append(starts[-1] + count)
    rows_in = xp.concatenate([pair_input[k, :count] for k, count in enumerate(per_offset)])
    rows_out = xp.concatenate([pair_output[k, :count] for k, count in enumerate(per_offset)])
    return sc.PairMap(rows_in, rows_out, tuple(starts), capacity_in, capacity_out, tuple(kernel_size), identity,
                      trusted=True)


def conv_forward(backend: ArrayBackend, features: Any, weight: Any, pairs: CoreRulebook, n_in: Any, n_out: Any,
                 groups: int) -> Any:
    """``[capacity_out, C_out]`` conv output, padding rows zero (the bias is added by the caller)."""
    out = sc.conv_forward(_masked(features, n_in), weight, pairs, groups=groups, backend=backend)
    return _masked(out, n_out)


def conv_backward(backend: ArrayBackend, grad_output: Any, features: Any, weight: Any, pairs: CoreRulebook,
                  n_in: Any, n_out: Any, groups: int) -> tuple[Any, Any]:
    """``(grad_features [capacity_in, C_in], grad_weight)``; padding rows of both inputs count as zero."""
    grad_features, grad_weight = sc.conv_backward(_masked(grad_output, n_out), _masked(features, n_in), weight,
                                                  pairs, groups=groups, backend=backend)
    return _masked(grad_features, n_in), grad_weight


def max_pool_forward(backend: ArrayBackend, features: Any, pairs: CoreRulebook) -> tuple[Any, Any]:
    """``(out, argmax)`` ``[capacity_out, C]``; padding rows have no pairs: 0 and -1."""
    return sc.max_pool_forward(features, pairs, backend=backend)


def max_pool_backward(backend: ArrayBackend, grad_output: Any, argmax: Any, pairs: CoreRulebook) -> Any:
    """``[capacity_in, C]``: each output's gradient to its argmax row, summed per input over its pairs."""
    return sc.max_pool_backward(grad_output, argmax, pairs.num_input, rulebook=pairs, backend=backend)


def avg_pool_forward(backend: ArrayBackend, features: Any, pairs: CoreRulebook) -> Any:
    """``[capacity_out, C]`` window means over the true pairs; padding rows zero."""
    return sc.avg_pool_forward(features, pairs, backend=backend)


def avg_pool_backward(backend: ArrayBackend, grad_output: Any, pairs: CoreRulebook) -> Any:
    """``[capacity_in, C]``; padding rows of ``grad_output`` are read by no pair."""
    return sc.avg_pool_backward(grad_output, pairs, backend=backend)
