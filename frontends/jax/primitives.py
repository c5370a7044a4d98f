"""The jnp building blocks of the feature passes: pair gathers and scatters, offset loops, shard_map casts.

Pair rows follow the kernels' convention: a row of -1 is no pair. The gathers
and scatters here call ``jax.lax`` directly with ``FILL_OR_DROP``, which treats
a negative row as out of range (a gather reads the fill value, a scatter drops
the update); ``jnp.take`` and ``.at[]`` would wrap -1 to the last row instead.
Scatters declare ``unique_indices``: within one kernel offset every true
output row appears once, and the repeated -1 entries write nothing.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "compute_dtype",
    "rows_mask",
    "common_varying",
    "varying_like",
    "gather_rows",
    "scatter_rows",
    "offset_matrices",
    "grouped_product",
    "grouped_outer",
    "without_offset",
    "chunked",
]

_ROWS = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))
_TO_ROWS = lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                       scatter_dims_to_operand_dims=(0,))
_FILL_OR_DROP = lax.GatherScatterMode.FILL_OR_DROP


def compute_dtype(dtype: Any) -> Any:
    """float32 for half-precision inputs, else the dtype itself."""
    return jnp.float32 if jnp.dtype(dtype).itemsize < 4 else dtype


def rows_mask(capacity: int, count: Any) -> Any:
    """bool ``[capacity]``: True for the rows below ``count`` (an int32 scalar)."""
    return jnp.arange(capacity) < count


def varying_like(value: Any, *references: Any) -> Any:
    """``value`` made to vary over the ``shard_map`` axes any of ``references`` varies over.

    Loop carries start as fresh constants, which inside ``shard_map`` are
    replicated while the loop body's results vary per device; JAX requires both
    to match. Adding a zero made from each reference (``lax.full_like`` keeps
    its reference's varying axes) casts ``value`` to their union, and the
    transpose of that cast sums a replicated input's gradient across devices,
    as JAX does for its own ops. Outside ``shard_map`` it returns ``value``.
    """
    if not jax.sharding.get_abstract_mesh().manual_axes:
        return value
    for reference in references:
        value = value + lax.full_like(reference, 0, dtype=value.dtype, shape=())
    return value


def common_varying(*values: Any) -> tuple:
    """The differentiable inputs (all but the last two values) cast to the union of all values' varying axes.

    Inside ``shard_map`` a replicated weight meeting per-device features must
    become per-device before a ``custom_vjp``.
    """
    return tuple(varying_like(value, *values) for value in values[:-2])


def gather_rows(source: Any, rows: Any, fill: float = 0) -> Any:
    """``source[rows]`` ``[P, C]``; a row of -1 (or beyond ``source``) reads ``fill``."""
    return lax.gather(source, rows[:, None], _ROWS, (1,) + tuple(source.shape[1:]), mode=_FILL_OR_DROP,
                      fill_value=fill)


def scatter_rows(target: Any, rows: Any, values: Any, add: bool = True) -> Any:
    """``target[rows] += values`` (``add=False``: ``=``); rows of -1 are dropped; true rows unique."""
    scatter = lax.scatter_add if add else lax.scatter
    return scatter(target, rows[:, None], values.astype(target.dtype), _TO_ROWS, unique_indices=True,
                   mode=_FILL_OR_DROP)


def offset_matrices(weight: Any, groups: int) -> Any:
    """``[out, *k, in/g]`` -> ``[K, g, in/g, out/g]``."""
    out_channels, in_per_group = weight.shape[0], weight.shape[-1]
    volume = math.prod(weight.shape[1:-1])
    return weight.reshape(groups, out_channels // groups, volume, in_per_group).transpose(2, 0, 3, 1)


def grouped_product(rows: Any, matrices: Any) -> Any:
    """``rows [P, g*a] @ blockdiag(matrices [g, a, b]) -> [P, g*b]``."""
    groups, a, b = matrices.shape
    if groups == 1:
        return rows @ matrices[0]
    split = rows.reshape(rows.shape[0], groups, a)
    return jnp.einsum("pga,gab->pgb", split, matrices).reshape(rows.shape[0], groups * b)


def grouped_outer(left: Any, right: Any, groups: int) -> Any:
    """``[g, a, b]`` per-group ``left_g^T @ right_g``."""
    if groups == 1:
        return (left.T @ right)[None]
    count = left.shape[0]
    return jnp.einsum("pga,pgb->gab", left.reshape(count, groups, -1), right.reshape(count, groups, -1))


def without_offset(counts: Any, offset: int) -> Any:
    """``counts`` with ``counts[offset] = 0`` (``offset < 0``: unchanged): that offset's loop does nothing."""
    if offset < 0:
        return counts
    return lax.dynamic_update_slice(counts, jnp.zeros((1,), counts.dtype), (offset,), allow_negative_indices=False)


def chunked(fn: Callable[..., Any], carry: Any, rows_in: Any, rows_out: Any, count: Any, chunk: int) -> Any:
    """``carry = fn(carry, rows_in[c], rows_out[c])`` over the ``chunk``-sized pieces holding the first
    ``count`` pairs of one offset (a loop with a data-dependent trip count: padding costs nothing)."""

    def step(index: Any, carry: Any) -> Any:
        start = (index * chunk,)
        return fn(carry, lax.dynamic_slice(rows_in, start, (chunk,), allow_negative_indices=False),
                  lax.dynamic_slice(rows_out, start, (chunk,), allow_negative_indices=False))

    # counts are never negative: truncating division is the ceiling's floor
    return lax.fori_loop(0, lax.div(count + (chunk - 1), lax.convert_element_type(chunk, count.dtype)), step, carry)
