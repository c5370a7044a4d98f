"""Feature passes on padded rulebooks: ``jax.custom_vjp`` functions that run under jit and grad.

Every pass takes features ``[capacity_in, C]``, a `PaddedRulebook`'s arrays and
the true row counts, and returns ``[capacity_out, C']`` with zero padding rows.
Two implementations of the rulebook passes (conv, max pool, avg pool):

- ``"jnp"``: a ``lax.scan`` over the kernel offsets (10x faster to compile
  than unrolled, and faster to run on CPU); per offset, a loop over chunks of
  its true pairs (the trip count is data: padding pairs cost no arithmetic), each
  a gather (``mode="fill"``), a GEMM and a scatter-add (``mode="drop"``, unique
  indices). The subm centre offset is one dense GEMM. Any XLA backend.
- ``"callback"``: ``jax.experimental.buffer_callback`` into the core's NumPy
  passes (see `callback`), zero-copy.

`default_impl` picks one (``set_default_impl`` / ``SPARSECORE_JAX_IMPL`` override);
the choice is read when a function is traced. Pools are in `pooling`;
``to_dense`` is jnp in both (one scatter; nothing to gain from a callback).
"""

from __future__ import annotations

import math
import os
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["IMPLS", "default_impl", "set_default_impl", "resolve_impl", "conv", "to_dense"]

IMPLS = ("jnp", "callback")
_DEFAULT: dict[str, str | None] = {"impl": None}
# docs/benchmarks_jax.md: on the project's 2-vCPU machine the two are within about 1.5x of each
# other either way, and the callback path (OpenBLAS inside XLA's callback) has multi-second tail
# latencies with OpenBLAS's default threading on a loaded machine; jnp is predictable, supports
# vmap and jax.export, and is the faster one by median in the default configuration.
_CPU_DEFAULT = "jnp"


def set_default_impl(impl: str | None) -> None:
    """Sets the feature-pass implementation used when an op gets ``impl=None``.

    ``None`` restores the automatic choice. Functions already traced keep theirs.
    """
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    _DEFAULT["impl"] = impl


def default_impl() -> str:
    """The implementation for ``impl=None``: `set_default_impl`, else ``SPARSECORE_JAX_IMPL``,
    else the measured CPU winner on CPU and ``"jnp"`` elsewhere (the core's GPU backend is
    not there yet, so the callback path only runs on the CPU today)."""
    if _DEFAULT["impl"] is not None:
        return _DEFAULT["impl"]
    env = os.environ.get("SPARSECORE_JAX_IMPL")
    if env:
        if env not in IMPLS:
            raise ValueError(f"SPARSECORE_JAX_IMPL must be one of {IMPLS}, got {env!r}")
        return env
    return _CPU_DEFAULT if jax.default_backend() == "cpu" else "jnp"


def resolve_impl(impl: str | None) -> str:
    if impl is None:
        return default_impl()
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    return impl


def compute_dtype(dtype: Any) -> Any:
    """float32 for half-precision inputs, else the dtype itself."""
    return jnp.float32 if jnp.dtype(dtype).itemsize < 4 else dtype


def _rows_mask(capacity: int, count: Any) -> Any:
    return jnp.arange(capacity) < count


def _varying_like(value: Any, *references: Any) -> Any:
    """``value`` marked as varying over the ``shard_map`` axes its references vary over.

    Loop carries start as fresh zeros, which inside ``shard_map`` are replicated while
    the loop body's results vary per device; JAX requires both to match.
    """
    axes: set = set()
    for reference in references:
        axes |= _varying_axes(reference)
    missing = axes - _varying_axes(value)
    return jax.lax.pcast(value, tuple(sorted(missing)), to="varying") if missing else value


def _common_varying(*values: Any) -> tuple:
    """The differentiable inputs (all but the last two references) cast to the union of varying axes.

    Inside ``shard_map`` a replicated weight meeting per-device features must become
    per-device before a ``custom_vjp``; its cast's transpose then sums the weight's
    gradient across devices, as JAX does for built-in ops.
    """
    differentiable, references = values[:-2], values
    return tuple(_varying_like(value, *references) for value in differentiable)


def _varying_axes(value: Any) -> set:
    aval = jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)  # JAX 0.10
    if manual is not None:
        return set(getattr(manual, "varying", ()) or ())
    return set(getattr(aval, "vma", None) or ())  # JAX 0.7 - 0.9


# ---------------------------------------------------------------------------- conv


def offset_matrices(weight: Any, groups: int) -> Any:
    """``[out, *k, in/g]`` -> ``[K, g, in/g, out/g]``."""
    out_channels, in_per_group = weight.shape[0], weight.shape[-1]
    volume = math.prod(weight.shape[1:-1])
    return weight.reshape(groups, out_channels // groups, volume, in_per_group).transpose(2, 0, 3, 1)


def _grouped_product(rows: Any, matrices: Any) -> Any:
    """``rows [P, g*a] @ blockdiag(matrices [g, a, b]) -> [P, g*b]``."""
    groups, a, b = matrices.shape
    if groups == 1:
        return rows @ matrices[0]
    split = rows.reshape(rows.shape[0], groups, a)
    return jnp.einsum("pga,gab->pgb", split, matrices).reshape(rows.shape[0], groups * b)


def _grouped_outer(left: Any, right: Any, groups: int) -> Any:
    """``[g, a, b]`` per-group ``left_g^T @ right_g``."""
    if groups == 1:
        return (left.T @ right)[None]
    count = left.shape[0]
    return jnp.einsum("pga,pgb->gab", left.reshape(count, groups, -1), right.reshape(count, groups, -1))


def _gather(source: Any, rows: Any, fill: float = 0) -> Any:
    return jnp.take(source, rows, axis=0, mode="fill", fill_value=fill)


def _scatter_add(target: Any, rows: Any, values: Any) -> Any:
    return target.at[rows].add(values, mode="drop", unique_indices=True)


def _scan_offsets(body: Any, carry: Any, per_offset: tuple, identity: int, identity_step: Any = None) -> tuple:
    """Runs ``body(carry, offset slices) -> (carry, y)`` over the kernel offsets, in order.

    The identity offset (``identity >= 0``) is not scanned: ``identity_step(carry) -> (carry, _)``
    runs in its place (nothing when ``None``). Returns the final carry and the ``y`` of the
    scanned offsets stacked in offset order (identity excluded), or None.
    """
    if identity < 0:
        return jax.lax.scan(body, carry, per_offset)
    volume, ys = per_offset[0].shape[0], []
    if identity > 0:
        carry, y = jax.lax.scan(body, carry, tuple(a[:identity] for a in per_offset))
        ys.append(y)
    if identity_step is not None:
        carry, _ = identity_step(carry)
    if identity + 1 < volume:
        carry, y = jax.lax.scan(body, carry, tuple(a[identity + 1:] for a in per_offset))
        ys.append(y)
    ys = [y for y in ys if y is not None]
    return carry, (jnp.concatenate(ys) if len(ys) > 1 else ys[0]) if ys else None


def _chunked(fn: Any, carry: Any, rows_in: Any, rows_out: Any, count: Any, chunk: int) -> Any:
    """``carry = fn(carry, rows_in[c], rows_out[c])`` over the ``chunk``-sized pieces holding the first
    ``count`` pairs of one offset (a loop with a data-dependent trip count: padding costs nothing)."""

    def step(index, carry):
        start = index * chunk
        return fn(carry, jax.lax.dynamic_slice_in_dim(rows_in, start, chunk),
                  jax.lax.dynamic_slice_in_dim(rows_out, start, chunk))

    return jax.lax.fori_loop(0, (count + chunk - 1) // chunk, step, carry)


def _conv_jnp_forward(static, features, weight, pair_input, pair_output, counts, n_in, n_out):
    capacity_out, identity, groups, chunk = static
    dtype = compute_dtype(features.dtype)
    source = jnp.where(_rows_mask(features.shape[0], n_in)[:, None], features, 0).astype(dtype)
    matrices = offset_matrices(weight.astype(dtype), groups)

    def body(out, slices):
        rows_in, rows_out, count, matrix = slices

        def accumulate(out, chunk_in, chunk_out):
            return _scatter_add(out, chunk_out, _grouped_product(_gather(source, chunk_in), matrix))

        return _chunked(accumulate, out, rows_in, rows_out, count, chunk), None

    out = _varying_like(jnp.zeros((capacity_out, weight.shape[0]), dtype), source, matrices, pair_input, counts)
    if identity >= 0:
        out = out + _grouped_product(source, matrices[identity])
    out, _ = _scan_offsets(body, out, (pair_input, pair_output, counts, matrices), identity)
    # padding rows are zero even for non-finite weights (the centre GEMM gives 0 * inf = nan there)
    return jnp.where(_rows_mask(capacity_out, n_out)[:, None], out, 0).astype(features.dtype)


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
    source = jnp.where(_rows_mask(features.shape[0], n_in)[:, None], features, 0).astype(dtype)
    grad = jnp.where(_rows_mask(capacity_out, n_out)[:, None], grad_out, 0).astype(dtype)
    matrices = offset_matrices(weight.astype(dtype), groups)
    transposed = matrices.transpose(0, 1, 3, 2)

    def body(grad_features, slices):
        rows_in, rows_out, count, matrix = slices

        def accumulate(carry, chunk_in, chunk_out):
            grad_features, grad_matrix = carry
            gathered = _gather(grad, chunk_out)
            grad_features = _scatter_add(grad_features, chunk_in, _grouped_product(gathered, matrix))
            return grad_features, grad_matrix + _grouped_outer(_gather(source, chunk_in), gathered, groups)

        zero = jnp.zeros(matrix.shape[:1] + matrix.shape[:0:-1], dtype)  # [g, in/g, out/g]
        zero = _varying_like(zero, source, grad, matrix, rows_in, count)
        return _chunked(accumulate, (grad_features, zero), rows_in, rows_out, count, chunk)

    grad_features = _varying_like(jnp.zeros(source.shape, dtype), source, grad, transposed, pair_input, counts)
    if identity >= 0:
        grad_features = grad_features + _grouped_product(grad, transposed[identity])
    grad_features, scanned = _scan_offsets(body, grad_features, (pair_input, pair_output, counts, transposed),
                                           identity)
    if identity >= 0:
        pieces = [_grouped_outer(source, grad, groups)[None]]
        if scanned is not None:
            pieces = [scanned[:identity]] + pieces + [scanned[identity:]]
        grad_matrices = jnp.concatenate(pieces)
    else:
        grad_matrices = scanned
    grad_features = jnp.where(_rows_mask(features.shape[0], n_in)[:, None], grad_features, 0)
    grad_weight = grad_matrices.transpose(1, 3, 0, 2).reshape(weight.shape)  # [K, g, a, b] -> weight
    return (grad_features.astype(features.dtype), grad_weight.astype(weight.dtype), None, None, None, None, None)


_conv_jnp.defvjp(_conv_jnp_fwd, _conv_jnp_bwd)


def conv(features: Any, weight: Any, pair_input: Any, pair_output: Any, counts: Any, n_in: Any, n_out: Any, *,
         capacity_out: int, identity_offset: int, groups: int, chunk: int, impl: str | None = None) -> Any:
    """Sparse conv feature pass (no bias): ``[capacity_in, C_in] -> [capacity_out, C_out]``."""
    impl = resolve_impl(impl)
    features, weight = _common_varying(features, weight, pair_input, counts)
    if impl == "callback":
        from . import callback

        return callback.conv(features, weight, pair_input, pair_output, counts, n_in, n_out,
                             capacity_out=capacity_out, identity_offset=identity_offset, groups=groups)
    return _conv_jnp((capacity_out, identity_offset, groups, chunk), features, weight, pair_input, pair_output,
                     counts, n_in, n_out)


def to_dense(features: Any, indices: Any, spatial_shape: tuple[int, ...], batch_size: int,
             channels_first: bool = True) -> Any:
    """Scatters padded features into ``[B, C, *spatial]`` (or ``[B, *spatial, C]``); padding rows dropped."""
    shape = (batch_size,) + tuple(spatial_shape) + (features.shape[1],)
    size = math.prod(shape) * jnp.dtype(features.dtype).itemsize
    if size >= 2 ** 62:  # XLA aborts the process on a shape whose byte size overflows
        raise ValueError(
            f"to_dense: the dense grid [batch_size, *spatial_shape, C] = {list(shape)} would hold "
            f"{math.prod(shape):.3g} elements ({size / 2 ** 40:.3g} TiB), more than any device can address; "
            "densify a crop (fewer, smaller axes) or work on the sparse rows (valid_features / valid_indices)"
        )
    index = tuple(indices[:, axis] for axis in range(indices.shape[1]))
    dense = jnp.zeros(shape, features.dtype).at[index].add(features, mode="drop")
    return jnp.moveaxis(dense, -1, 1) if channels_first else dense
