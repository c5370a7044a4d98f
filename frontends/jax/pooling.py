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

from . import callback
from .ops import resolve_impl
from .primitives import (
    chunked,
    common_varying,
    compute_dtype,
    gather_rows,
    rows_mask,
    scatter_rows,
    varying_like,
)

__all__ = ["max_pool", "avg_pool", "global_max_pool", "global_avg_pool", "scatter_by_argmax"]


# ---------------------------------------------------------------------------- windowed pools
# Every offset, a subm window's centre included, is read from the stored pairs (-1 = no pair).


def _max_pool_forward(static, features, pair_input, pair_output, counts, n_in, n_out):
    capacity_in, capacity_out, chunk = static
    channels = features.shape[1]

    def step(carry, rows_in, rows_out):
        out, argmax = carry
        values = gather_rows(features, rows_in, -jnp.inf)
        current = gather_rows(out, rows_out)
        current_arg = gather_rows(argmax, rows_out)
        better = (values > current) | (current_arg < 0)
        out = scatter_rows(out, rows_out, jnp.where(better, values, current), add=False)
        argmax = scatter_rows(argmax, rows_out, jnp.where(better, rows_in[:, None], current_arg), add=False)
        return out, argmax

    def body(carry, slices):
        rows_in, rows_out, count = slices
        return chunked(step, carry, rows_in, rows_out, count, chunk), None

    carry = (varying_like(jnp.full((capacity_out, channels), -jnp.inf, features.dtype), features),
             varying_like(jnp.full((capacity_out, channels), -1, jnp.int32), features))
    (out, argmax), _ = jax.lax.scan(body, carry, (pair_input, pair_output, counts))
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


def _window_counts(pair_output, capacity_out, dtype):
    """``[capacity_out, 1]`` active inputs per window (at least 1)."""
    rows = pair_output.reshape(-1)
    counts = scatter_rows(jnp.zeros((capacity_out, 1), dtype), rows, jnp.ones((rows.shape[0], 1), dtype))
    return jnp.maximum(counts, 1)


def _sum_pairs(static, source, pair_input, pair_output, counts, capacity_target, transpose):
    """Sums ``source`` rows over the pairs (``transpose``: from outputs back to inputs)."""
    chunk = static[-1]

    def add(total, chunk_in, chunk_out):
        if transpose:
            return scatter_rows(total, chunk_in, gather_rows(source, chunk_out))
        return scatter_rows(total, chunk_out, gather_rows(source, chunk_in))

    def body(total, slices):
        rows_in, rows_out, count = slices
        return chunked(add, total, rows_in, rows_out, count, chunk), None

    total = varying_like(jnp.zeros((capacity_target, source.shape[1]), source.dtype), source)
    total, _ = jax.lax.scan(body, total, (pair_input, pair_output, counts))
    return total


def _avg_pool_forward(static, features, pair_input, pair_output, counts, n_in, n_out):
    capacity_in, capacity_out, chunk = static
    dtype = compute_dtype(features.dtype)
    source = jnp.where(rows_mask(capacity_in, n_in)[:, None], features, 0).astype(dtype)
    total = _sum_pairs(static, source, pair_input, pair_output, counts, capacity_out, False)
    window = _window_counts(pair_output, capacity_out, dtype)
    return (total / window).astype(features.dtype), window


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _avg_pool_jnp(static, features, pair_input, pair_output, counts, n_in, n_out):
    return _avg_pool_forward(static, features, pair_input, pair_output, counts, n_in, n_out)[0]


def _avg_pool_jnp_fwd(static, features, pair_input, pair_output, counts, n_in, n_out):
    out, window = _avg_pool_forward(static, features, pair_input, pair_output, counts, n_in, n_out)
    return out, (window, pair_input, pair_output, counts, n_in, n_out)


def _avg_pool_jnp_bwd(static, residuals, grad_out):
    capacity_in, capacity_out, chunk = static
    window, pair_input, pair_output, counts, n_in, n_out = residuals
    dtype = compute_dtype(grad_out.dtype)
    scaled = jnp.where(rows_mask(capacity_out, n_out)[:, None], grad_out.astype(dtype) / window, 0)
    grad = _sum_pairs(static, scaled, pair_input, pair_output, counts, capacity_in, True)
    return grad.astype(grad_out.dtype), None, None, None, None, None


_avg_pool_jnp.defvjp(_avg_pool_jnp_fwd, _avg_pool_jnp_bwd)

_JNP = {"max": _max_pool_jnp, "avg": _avg_pool_jnp}
_CALLBACK = {"max": callback.max_pool, "avg": callback.avg_pool}


def _windowed(which: str, features: Any, rulebook: tuple, capacity_out: int, identity_offset: int,
              kernel_size: tuple[int, ...], chunk: int, impl: str | None) -> Any:
    pair_input, pair_output, counts, n_in, n_out = rulebook
    (features,) = common_varying(features, pair_input, counts)
    if resolve_impl(impl) == "callback":
        return _CALLBACK[which](features, pair_input, pair_output, counts, n_in, n_out, capacity_out=capacity_out,
                                identity_offset=identity_offset, kernel_size=kernel_size)
    return _JNP[which]((features.shape[0], capacity_out, chunk), features, pair_input, pair_output, counts, n_in,
                       n_out)


def max_pool(features: Any, pair_input: Any, pair_output: Any, counts: Any, n_in: Any, n_out: Any, *,
             capacity_out: int, identity_offset: int, kernel_size: tuple[int, ...], chunk: int,
             impl: str | None = None) -> Any:
    """Max over each output's active inputs (ties: earliest kernel offset); padding rows 0.

    Arguments as `sparsecore.jax.ops.conv` (the pair rows include a subm window's centre).
    """
    return _windowed("max", features, (pair_input, pair_output, counts, n_in, n_out), capacity_out,
                     identity_offset, kernel_size, chunk, impl)


def avg_pool(features: Any, pair_input: Any, pair_output: Any, counts: Any, n_in: Any, n_out: Any, *,
             capacity_out: int, identity_offset: int, kernel_size: tuple[int, ...], chunk: int,
             impl: str | None = None) -> Any:
    """Mean over each output's active inputs (not the kernel volume); padding rows 0."""
    return _windowed("avg", features, (pair_input, pair_output, counts, n_in, n_out), capacity_out,
                     identity_offset, kernel_size, chunk, impl)


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
    reached = gather_rows(best, batch, jnp.inf)  # padding rows: +inf, never equal
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
    return _global_max(batch_size, varying_like(features, batch), batch)


