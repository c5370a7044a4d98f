"""Feature passes on padded rulebooks: ``jax.custom_vjp`` functions that run under jit and grad.

Every pass takes features ``[capacity_in, C]``, a `PaddedRulebook`'s arrays
(``[K, Q]`` pair rows, -1 = no pair) and the true row counts, and returns
``[capacity_out, C']`` with zero padding rows. Two implementations of the
rulebook passes (conv, max pool, avg pool), chosen per call by ``impl``:

- ``"jnp"``: a ``lax.scan`` over the kernel offsets (10x faster to compile
  than unrolled, and faster to run on CPU); per offset, a loop over chunks of
  its true pairs (the trip count is data: padding pairs cost no arithmetic), each
  a gather, a GEMM and a scatter-add (`primitives`: -1 rows read zeros and
  write nothing). The subm centre offset is one dense GEMM. Any XLA backend.
- ``"callback"``: ``jax.experimental.buffer_callback`` into the core's passes
  (see `callback`), zero-copy.

The choice is explicit: an op's ``impl`` argument, else the plan's
(`Plan.with_impl`), else `default_impl` (``"jnp"``). Nothing is read from module
state or the environment. Pools are in `pooling`; ``to_dense`` is jnp in both
(one scatter; nothing to gain from a callback).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from sparsecore.interop import check_dense_size

from . import callback
from .primitives import (
    chunked,
    common_varying,
    compute_dtype,
    gather_rows,
    grouped_outer,
    grouped_product,
    offset_matrices,
    rows_mask,
    scatter_rows,
    varying_like,
    without_offset,
)

__all__ = ["IMPLS", "default_impl", "set_default_impl", "resolve_impl", "conv", "to_dense"]

IMPLS = ("jnp", "callback")
# docs/benchmarks_jax.md: jnp supports vmap and jax.export and runs on every XLA backend, so it is
# the default. On the CPU the callback path became the faster one once the core's passes were tiled
# and threaded (2026-12-05: jnp / callback 1.4x forward, 1.6x forward+backward by geometric mean on
# the project's 2-vCPU machine); choose impl="callback" there for speed. The core's GPU backend
# serves the callback path on GPUs.
DEFAULT_IMPL = "jnp"


def default_impl() -> str:
    """The implementation used when neither the op's ``impl`` nor the plan's names one: ``"jnp"``.

    A constant: sparsecore.jax keeps no module state and reads no environment
    variable, so a traced function's implementation follows from its arguments.
    """
    return DEFAULT_IMPL


def set_default_impl(impl: str | None) -> None:
    """Deprecated: sparsecore.jax has no module-level default to set.

    ``set_default_impl(None)`` (the automatic choice) is accepted and does
    nothing, since the automatic choice is what holds. Any other value raises,
    naming the explicit ways to choose: ``impl=`` on each layer, or the plan's
    static configuration ``x.with_plan(x.plan.with_impl(impl))`` (kept by
    ``plan.recipe.apply`` for the next clouds).

    Raises:
        ValueError: for a name not in `IMPLS`.
        RuntimeError: for a valid name (the choice must be passed explicitly).
    """
    if impl is None:
        return
    resolve_impl(impl)
    raise RuntimeError(
        f"sparsecore.jax.set_default_impl({impl!r}): sparsecore.jax keeps no module state, so there is "
        "no global default to change. Choose the implementation explicitly: per layer with "
        f"sj.subm_conv(x, w, impl={impl!r}), or for every layer of a plan with "
        f"x = x.with_plan(x.plan.with_impl({impl!r})) (plan.recipe.apply keeps it for the next clouds)"
    )


def resolve_impl(impl: str | None, plan_impl: str | None = None) -> str:
    """``impl``, else ``plan_impl``, else `default_impl`; validated.

    Raises:
        ValueError: for a name not in `IMPLS`.
    """
    chosen = impl if impl is not None else plan_impl if plan_impl is not None else default_impl()
    if chosen not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {chosen!r}")
    return chosen


# ---------------------------------------------------------------------------- conv


def _conv_jnp_forward(static, features, weight, pair_input, pair_output, counts, n_in, n_out):
    capacity_out, identity, groups, chunk = static
    dtype = compute_dtype(features.dtype)
    source = jnp.where(rows_mask(features.shape[0], n_in)[:, None], features, 0).astype(dtype)
    matrices = offset_matrices(weight.astype(dtype), groups)

    def body(out, slices):
        rows_in, rows_out, count, matrix = slices

        def accumulate(out, chunk_in, chunk_out):
            return scatter_rows(out, chunk_out, grouped_product(gather_rows(source, chunk_in), matrix))

        return chunked(accumulate, out, rows_in, rows_out, count, chunk), None

    if identity >= 0:  # the subm centre (i -> i): one dense GEMM; its loop is given no pairs
        out = varying_like(grouped_product(source, matrices[identity]), source)
    else:
        out = varying_like(jnp.zeros((capacity_out, weight.shape[0]), dtype), source)
    out, _ = jax.lax.scan(body, out, (pair_input, pair_output, without_offset(counts, identity), matrices))
    # padding rows are zero even for non-finite weights (the centre GEMM gives 0 * inf = nan there)
    return jnp.where(rows_mask(capacity_out, n_out)[:, None], out, 0).astype(features.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv_jnp(static, features, weight, pair_input, pair_output, counts, n_in, n_out):
    return _conv_jnp_forward(static, features, weight, pair_input, pair_output, counts, n_in, n_out)


def _conv_jnp_fwd(static, features, weight, pair_input, pair_output, counts, n_in, n_out):
    out = _conv_jnp_forward(static, features, weight, pair_input, pair_output, counts, n_in, n_out)
    return out, (features, weight, pair_input, pair_output, counts, n_in, n_out)


def _conv_jnp_bwd(static, residuals, grad_out):
    capacity_out, identity, groups, chunk = static
    features, weight, pair_input, pair_output, counts, n_in, n_out = residuals
    dtype = compute_dtype(features.dtype)
    source = jnp.where(rows_mask(features.shape[0], n_in)[:, None], features, 0).astype(dtype)
    grad = jnp.where(rows_mask(capacity_out, n_out)[:, None], grad_out, 0).astype(dtype)
    matrices = offset_matrices(weight.astype(dtype), groups)
    transposed = matrices.transpose(0, 1, 3, 2)

    def body(grad_features, slices):
        rows_in, rows_out, count, matrix = slices

        def accumulate(carry, chunk_in, chunk_out):
            grad_features, grad_matrix = carry
            gathered = gather_rows(grad, chunk_out)
            grad_features = scatter_rows(grad_features, chunk_in, grouped_product(gathered, matrix))
            return grad_features, grad_matrix + grouped_outer(gather_rows(source, chunk_in), gathered, groups)

        zero = varying_like(jnp.zeros(matrix.shape[:1] + matrix.shape[:0:-1], dtype), source)  # [g, in/g, out/g]
        return chunked(accumulate, (grad_features, zero), rows_in, rows_out, count, chunk)

    if identity >= 0:  # the subm centre: dense products; its loop is given no pairs
        grad_features = varying_like(grouped_product(grad, transposed[identity]), source, grad)
    else:
        grad_features = varying_like(jnp.zeros(source.shape, dtype), source, grad)
    grad_features, grad_matrices = jax.lax.scan(
        body, grad_features, (pair_input, pair_output, without_offset(counts, identity), transposed))
    if identity >= 0:
        grad_matrices = grad_matrices.at[identity].add(grouped_outer(source, grad, groups))
    grad_features = jnp.where(rows_mask(features.shape[0], n_in)[:, None], grad_features, 0)
    grad_weight = grad_matrices.transpose(1, 3, 0, 2).reshape(weight.shape)  # [K, g, a, b] -> weight
    return (grad_features.astype(features.dtype), grad_weight.astype(weight.dtype), None, None, None, None, None)


_conv_jnp.defvjp(_conv_jnp_fwd, _conv_jnp_bwd)


def conv(features: Any, weight: Any, pair_input: Any, pair_output: Any, counts: Any, n_in: Any, n_out: Any, *,
         capacity_out: int, identity_offset: int, groups: int, chunk: int, impl: str | None = None) -> Any:
    """Sparse conv feature pass (no bias): ``[capacity_in, C_in] -> [capacity_out, C_out]``.

    Args:
        features: ``[capacity_in, C_in]``; rows past ``n_in`` are ignored.
        weight: ``[C_out, *kernel_size, C_in // groups]``.
        pair_input, pair_output: int32 ``[K, Q]`` pair rows (-1 = no pair).
        counts: int32 ``[K]`` true pairs per offset.
        n_in, n_out: int32 scalars, the true input and output rows.
        capacity_out: output rows.
        identity_offset: the subm centre offset (computed as one dense GEMM), or -1.
        groups: channel groups.
        chunk: pairs per step of the jnp loops (divides ``Q``).
        impl: ``"jnp"``, ``"callback"`` or None (`default_impl`).
    """
    impl = resolve_impl(impl)
    features, weight = common_varying(features, weight, pair_input, counts)
    if impl == "callback":
        return callback.conv(features, weight, pair_input, pair_output, counts, n_in, n_out,
                             capacity_out=capacity_out, identity_offset=identity_offset, groups=groups)
    return _conv_jnp((capacity_out, identity_offset, groups, chunk), features, weight, pair_input, pair_output,
                     counts, n_in, n_out)


def to_dense(features: Any, indices: Any, spatial_shape: tuple[int, ...], batch_size: int,
             channels_first: bool = True) -> Any:
    """Scatters padded features into ``[B, C, *spatial]`` (or ``[B, *spatial, C]``); padding rows dropped."""
    shape = (batch_size,) + tuple(spatial_shape) + (features.shape[1],)
    try:  # XLA aborts the process on a shape whose byte size overflows: refuse it first (the core's check)
        check_dense_size(batch_size, spatial_shape, features.shape[1], jnp.dtype(features.dtype).itemsize,
                         limit_bytes=2 ** 62 - 1)
    except ValueError as error:
        raise ValueError(f"to_dense: {error}") from None
    index = tuple(indices[:, axis] for axis in range(indices.shape[1]))
    dense = jnp.zeros(shape, features.dtype).at[index].add(features, mode="drop")
    return jnp.moveaxis(dense, -1, 1) if channels_first else dense
