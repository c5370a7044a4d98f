"""Pooling feature passes (``jax.custom_vjp``): max and average over rulebook windows, global pools.

Same conventions as `ops`: padded features in, padded outputs with zero
padding rows out, ``impl`` choosing the jnp loops or the core through
``buffer_callback`` for the windowed pools. Max pools take the maximum over the
*active* inputs of a window (ties: the earliest kernel offset, as the core);
average pools divide by the number of active inputs. Global pools are jnp
segment reductions in both implementations.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from .ops import (
    _chunked,
    _common_varying,
    _gather,
    _rows_mask,
    _scan_offsets,
    _scatter_add,
    _varying_like,
    compute_dtype,
    resolve_impl,
)

__all__ = ["max_pool", "avg_pool", "global_max_pool", "global_avg_pool", "scatter_by_argmax"]


# ---------------------------------------------------------------------------- windowed pools


def _identity_rows(capacity_in: int, n_in: Any) -> Any:
    rows = jnp.arange(capacity_in, dtype=jnp.int32)
    return jnp.where(rows < n_in, rows, capacity_in + rows)  # padding rows -> out of range


def _max_pool_forward(static, features, pair_input, pair_output, counts, n_in, n_out):
    capacity_in, capacity_out, identity, chunk = static
    channels = features.shape[1]

    def step(carry, rows_in, rows_out):
        out, argmax = carry
        values = _gather(features, rows_in, -jnp.inf)
        current = _gather(out, rows_out)
        current_arg = jnp.take(argmax, rows_out, axis=0, mode="fill", fill_value=0)
        better = (values > current) | (current_arg < 0)
        out = out.at[rows_out].set(jnp.where(better, values, current), mode="drop", unique_indices=True)
        argmax = argmax.at[rows_out].set(jnp.where(better, rows_in[:, None], current_arg), mode="drop",
                                         unique_indices=True)
        return out, argmax

    def body(carry, slices):
        rows_in, rows_out, count = slices
        return _chunked(step, carry, rows_in, rows_out, count, chunk), None

    def identity_step(carry):
        rows = _identity_rows(capacity_in, n_in)
        return step(carry, rows, rows), None

    references = (features, pair_input, pair_output, counts, n_in)
    carry = (_varying_like(jnp.full((capacity_out, channels), -jnp.inf, features.dtype), *references),
             _varying_like(jnp.full((capacity_out, channels), -1, jnp.int32), *references))
    (out, argmax), _ = _scan_offsets(body, carry, (pair_input, pair_output, counts), identity, identity_step)
    return jnp.where(argmax >= 0, out, 0).astype(features.dtype), argmax


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _max_pool_jnp(static, features, pair_input, pair_output, counts, n_in, n_out):
    return _max_pool_forward(static, features, pair_input, pair_output, counts, n_in, n_out)[0]


def _max_pool_jnp_fwd(static, features, pair_input, pair_output, counts, n_in, n_out):
    return _max_pool_forward(static, features, pair_input, pair_output, counts, n_in, n_out)


def scatter_by_argmax(grad_out: Any, argmax: Any, capacity_in: int) -> Any:
    """``[capacity_in, C]``: each output gradient added to the input row in ``argmax`` (-1: none)."""
    rows = jnp.where(argmax >= 0, argmax, capacity_in)  # out of range: dropped
    columns = jnp.broadcast_to(jnp.arange(grad_out.shape[1], dtype=rows.dtype), rows.shape)
    dtype = compute_dtype(grad_out.dtype)
    summed = jnp.zeros((capacity_in, grad_out.shape[1]), dtype).at[rows, columns].add(
        grad_out.astype(dtype), mode="drop")
    return summed.astype(grad_out.dtype)


def _max_pool_jnp_bwd(static, argmax, grad_out):
    return scatter_by_argmax(grad_out, argmax, static[0]), None, None, None, None, None


_max_pool_jnp.defvjp(_max_pool_jnp_fwd, _max_pool_jnp_bwd)


def _window_counts(pair_output, identity, n_out, capacity_out, dtype):
    counts = jnp.zeros(capacity_out, dtype).at[pair_output.reshape(-1)].add(1, mode="drop")
    if identity >= 0:  # the centre of a subm window: every true row counts itself
        counts = counts + _rows_mask(capacity_out, n_out).astype(dtype)
    return jnp.maximum(counts, 1)[:, None]


def _sum_pairs(static, source, pair_input, pair_output, counts, n_in, capacity_target, transpose):
    """Sums ``source`` rows over the pairs (``transpose``: from outputs back to inputs)."""
    capacity_in, capacity_out, identity, chunk = static

    def add(total, chunk_in, chunk_out):
        if transpose:
            return _scatter_add(total, chunk_in, _gather(source, chunk_out))
        return _scatter_add(total, chunk_out, _gather(source, chunk_in))

    def body(total, slices):
        rows_in, rows_out, count = slices
        return _chunked(add, total, rows_in, rows_out, count, chunk), None

    total = _varying_like(jnp.zeros((capacity_target, source.shape[1]), source.dtype), source, pair_input,
                          pair_output, counts, n_in)
    if identity >= 0:
        total = total + jnp.where(_rows_mask(capacity_in, n_in)[:, None], source, 0)
    total, _ = _scan_offsets(body, total, (pair_input, pair_output, counts), identity)
    return total


def _avg_pool_forward(static, features, pair_input, pair_output, counts, n_in, n_out):
    capacity_in, capacity_out, identity, chunk = static
    dtype = compute_dtype(features.dtype)
    source = jnp.where(_rows_mask(capacity_in, n_in)[:, None], features, 0).astype(dtype)
    total = _sum_pairs(static, source, pair_input, pair_output, counts, n_in, capacity_out, False)
    window = _window_counts(pair_output, identity, n_out, capacity_out, dtype)
    return (total / window).astype(features.dtype), window


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _avg_pool_jnp(static, features, pair_input, pair_output, counts, n_in, n_out):
    return _avg_pool_forward(static, features, pair_input, pair_output, counts, n_in, n_out)[0]


def _avg_pool_jnp_fwd(static, features, pair_input, pair_output, counts, n_in, n_out):
    out, window = _avg_pool_forward(static, features, pair_input, pair_output, counts, n_in, n_out)
    return out, (window, pair_input, pair_output, counts, n_in, n_out)


def _avg_pool_jnp_bwd(static, residuals, grad_out):
    capacity_in, capacity_out, identity, chunk = static
    window, pair_input, pair_output, counts, n_in, n_out = residuals
    dtype = compute_dtype(grad_out.dtype)
    scaled = jnp.where(_rows_mask(capacity_out, n_out)[:, None], grad_out.astype(dtype) / window, 0)
    grad = _sum_pairs(static, scaled, pair_input, pair_output, counts, n_in, capacity_in, True)
    return grad.astype(grad_out.dtype), None, None, None, None, None


_avg_pool_jnp.defvjp(_avg_pool_jnp_fwd, _avg_pool_jnp_bwd)


def max_pool(features: Any, pair_input: Any, pair_output: Any, counts: Any, n_in: Any, n_out: Any, *,
             capacity_out: int, identity_offset: int, kernel_size: tuple[int, ...], chunk: int,
             impl: str | None = None) -> Any:
    """Max over each output's active inputs (ties: earliest kernel offset); padding rows 0."""
    (features,) = _common_varying(features, pair_input, counts)
    if resolve_impl(impl) == "callback":
        from . import callback

        return callback.max_pool(features, pair_input, pair_output, counts, n_in, n_out,
                                 capacity_out=capacity_out, identity_offset=identity_offset,
                                 kernel_size=kernel_size)
    return _max_pool_jnp((features.shape[0], capacity_out, identity_offset, chunk), features, pair_input,
                         pair_output, counts, n_in, n_out)


def avg_pool(features: Any, pair_input: Any, pair_output: Any, counts: Any, n_in: Any, n_out: Any, *,
             capacity_out: int, identity_offset: int, kernel_size: tuple[int, ...], chunk: int,
             impl: str | None = None) -> Any:
    """Mean over each output's active inputs (not the kernel volume); padding rows 0."""
    (features,) = _common_varying(features, pair_input, counts)
    if resolve_impl(impl) == "callback":
        from . import callback

        return callback.avg_pool(features, pair_input, pair_output, counts, n_in, n_out,
                                 capacity_out=capacity_out, identity_offset=identity_offset,
                                 kernel_size=kernel_size)
    return _avg_pool_jnp((features.shape[0], capacity_out, identity_offset, chunk), features, pair_input,
                         pair_output, counts, n_in, n_out)


# ---------------------------------------------------------------------------- global pools


def global_avg_pool(features: Any, batch: Any, batch_size: int) -> Any:
    """``[B, C]`` mean per batch element (``batch`` = indices[:, 0]; padding rows carry ``B``)."""
    dtype = compute_dtype(features.dtype)
    sums = jnp.zeros((batch_size, features.shape[1]), dtype).at[batch].add(features.astype(dtype), mode="drop")
    counts = jnp.zeros(batch_size, dtype).at[batch].add(1, mode="drop")
    return (sums / jnp.maximum(counts, 1)[:, None]).astype(features.dtype)


def _global_max_forward(batch_size, features, batch):
    capacity, channels = features.shape
    best = jnp.full((batch_size, channels), -jnp.inf, features.dtype).at[batch].max(features, mode="drop")
    reached = _gather(best, batch, jnp.inf)  # padding rows: +inf, never equal
    rows = jnp.arange(capacity, dtype=jnp.int32)[:, None]
    candidate = jnp.where(features == reached, rows, capacity)
    argmax = jnp.full((batch_size, channels), capacity, jnp.int32).at[batch].min(candidate, mode="drop")
    out = jnp.where(argmax < capacity, best, 0).astype(features.dtype)
    return out, jnp.where(argmax < capacity, argmax, -1)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _global_max(batch_size, features, batch):
    return _global_max_forward(batch_size, features, batch)[0]


def _global_max_fwd(batch_size, features, batch):
    out, argmax = _global_max_forward(batch_size, features, batch)
    return out, (argmax, features[:, :0])


def _global_max_bwd(batch_size, residuals, grad_out):
    argmax, like = residuals
    return scatter_by_argmax(grad_out, argmax, like.shape[0]), None


_global_max.defvjp(_global_max_fwd, _global_max_bwd)


def global_max_pool(features: Any, batch: Any, batch_size: int) -> Any:
    """``[B, C]`` max per batch element (0 for an empty element; ties: lowest row)."""
    return _global_max(batch_size, _varying_like(features, batch), batch)


