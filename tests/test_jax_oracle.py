"""Dense JAX oracles (float64) for the sparsecore.jax tests, and checks of the oracles themselves.

Every expected value in the sparsecore.jax tests comes from these dense
``jax.lax`` computations on the densified input, never from sparsecore:

* `random_sites`: unique random sites in random row order; `random_features`:
  values bounded away from zero (never zeros);
* `densify`: ``[B, C, *S]`` by a differentiable scatter (``fill`` elsewhere);
* `dense_conv` / `dense_conv_transpose`: ``lax.conv_general_dilated`` with the
  sparsecore weight ``[out, *k, in // groups]`` mapped onto OIHW (the transposed
  one as an input-dilated correlation with the kernel flipped);
* `active_sites`: output sites from the same dense op on the occupancy mask
  with a ones kernel (> 0 where some input is in reach);
* `dense_max_pool` / `dense_avg_pool`: ``lax.reduce_window`` with ``-inf`` at
  inactive sites for the max, and sum over active / count active for the mean.

The tests at the bottom check the oracles against plain Python loops.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest



@pytest.fixture(scope="module")
def x64():
    """float64 for one test module (the oracles compute in float64); restored afterwards."""
    previous = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


pytestmark = pytest.mark.usefixtures("x64")


def as_tuple(value: int | Sequence[int], ndim: int) -> tuple[int, ...]:
    return (int(value),) * ndim if isinstance(value, (int, np.integer)) else tuple(int(v) for v in value)


def random_sites(rng: np.random.Generator, spatial_shape: Sequence[int], batch_size: int, num: int,
                 empty_batches: Sequence[int] = ()) -> np.ndarray:
    """``num`` unique sites ``[num, 1 + D]`` int32 in random order (none in ``empty_batches``)."""
    batches = [b for b in range(batch_size) if b not in empty_batches]
    cells = len(batches) * int(np.prod(spatial_shape))
    num = min(num, cells)
    flat = rng.choice(cells, num, replace=False)
    unravelled = np.unravel_index(flat, (len(batches),) + tuple(spatial_shape))
    indices = np.stack(unravelled, axis=1).astype(np.int32)
    indices[:, 0] = np.asarray(batches, dtype=np.int32)[indices[:, 0]]
    return indices


def random_features(rng: np.random.Generator, rows: int, channels: int) -> np.ndarray:
    """float64 values with ``|v|`` in [0.5, 1.5]."""
    return rng.uniform(0.5, 1.5, (rows, channels)) * rng.choice([-1.0, 1.0], (rows, channels))


def densify(features, indices, spatial_shape, batch_size, fill=0.0):
    """``[B, C, *S]`` with the features at the sites and ``fill`` elsewhere (differentiable)."""
    channels = features.shape[1]
    dense = jnp.full((batch_size,) + tuple(spatial_shape) + (channels,), fill, features.dtype)
    index = tuple(jnp.asarray(indices[:, a]) for a in range(indices.shape[1]))
    dense = dense.at[index].set(features)
    return jnp.moveaxis(dense, -1, 1)


def read_sites(dense, indices):
    """``[N, C]``: the dense ``[B, C, *S]`` values at the sites."""
    moved = jnp.moveaxis(dense, 1, -1)
    return moved[tuple(jnp.asarray(indices[:, a]) for a in range(indices.shape[1]))]


def _dimension_numbers(ndim: int):
    spatial = "DHW"[-ndim:] if ndim <= 3 else None
    return ("NC" + spatial, "OI" + spatial, "NC" + spatial)


def oihw(weight):
    """sparsecore ``[out, *k, in // groups]`` -> lax ``[out, in // groups, *k]``."""
    return jnp.moveaxis(weight, -1, 1)


def dense_conv(dense, weight, stride, padding, dilation, groups=1):
    ndim = dense.ndim - 2
    return jax.lax.conv_general_dilated(
        dense, oihw(weight), window_strides=as_tuple(stride, ndim),
        padding=[(p, p) for p in as_tuple(padding, ndim)], rhs_dilation=as_tuple(dilation, ndim),
        dimension_numbers=_dimension_numbers(ndim), feature_group_count=groups,
        precision=jax.lax.Precision.HIGHEST)


def dense_conv_transpose(dense, weight, stride, padding, dilation, output_padding=0, groups=1, out_shape=None):
    """``out[x*s - p + k*d] += W_k in[x]`` as a correlation of the stride-dilated input with the flipped kernel.

    ``out_shape`` (optional) fixes the output size (for inverse convs) instead of ``output_padding``.
    """
    ndim = dense.ndim - 2
    k = weight.shape[1:-1]
    s, p, d = as_tuple(stride, ndim), as_tuple(padding, ndim), as_tuple(dilation, ndim)
    op = as_tuple(output_padding, ndim)
    flipped = jnp.flip(oihw(weight), axis=tuple(range(2, 2 + ndim)))
    pads = []
    for axis in range(ndim):
        low = d[axis] * (k[axis] - 1) - p[axis]
        size = (dense.shape[2 + axis] - 1) * s[axis] + 1 + low
        if out_shape is None:
            high = low + op[axis]
        else:  # output = (in-1)*s + 1 + low + high - d(k-1)
            high = out_shape[axis] - size + d[axis] * (k[axis] - 1)
        pads.append((low, high))
    return jax.lax.conv_general_dilated(
        dense, flipped, window_strides=(1,) * ndim, padding=pads, lhs_dilation=s, rhs_dilation=d,
        dimension_numbers=_dimension_numbers(ndim), feature_group_count=groups,
        precision=jax.lax.Precision.HIGHEST)


def mask_of(indices, spatial_shape, batch_size):
    ones = jnp.ones((indices.shape[0], 1), jnp.float64)
    return densify(ones, indices, spatial_shape, batch_size)


def active_sites(mask_out) -> np.ndarray:
    """Sites (sorted by batch, coordinates) where a ``[B, 1, *S]`` count is > 0."""
    occupied = np.asarray(mask_out)[:, 0] > 0.5
    return np.argwhere(occupied).astype(np.int32)


def ones_kernel(ndim: int, kernel_size) -> jnp.ndarray:
    return jnp.ones((1,) + as_tuple(kernel_size, ndim) + (1,), jnp.float64)


def _window(dense, op, init, kernel, stride, padding, dilation):
    ndim = dense.ndim - 2
    return jax.lax.reduce_window(
        dense, init, op, (1, 1) + as_tuple(kernel, ndim), (1, 1) + as_tuple(stride, ndim),
        [(0, 0), (0, 0)] + [(p, p) for p in as_tuple(padding, ndim)],
        window_dilation=(1, 1) + as_tuple(dilation, ndim))


def dense_max_pool(dense_neg_inf, kernel, stride, padding, dilation):
    """Max over each window of a grid with ``-inf`` at inactive sites.

    With dilation, ``reduce_window`` has no VJP in JAX, so the windows are cut out with
    ``conv_general_dilated_patches`` (exact: each patch entry is one input times 1, the rest
    times 0) on the grid padded with a finite stand-in for ``-inf``.
    """
    ndim = dense_neg_inf.ndim - 2
    if all(d == 1 for d in as_tuple(dilation, ndim)):
        return _window(dense_neg_inf, jax.lax.max, -jnp.inf, kernel, stride, padding, dilation)
    low = -1e30
    finite = jnp.where(jnp.isneginf(dense_neg_inf), low, dense_neg_inf)
    finite = jnp.pad(finite, [(0, 0), (0, 0)] + [(p, p) for p in as_tuple(padding, ndim)], constant_values=low)
    k = as_tuple(kernel, ndim)
    patches = jax.lax.conv_general_dilated_patches(
        finite, k, as_tuple(stride, ndim), [(0, 0)] * ndim, rhs_dilation=as_tuple(dilation, ndim),
        precision=jax.lax.Precision.HIGHEST)
    batch, channels = dense_neg_inf.shape[:2]
    best = patches.reshape((batch, channels, int(np.prod(k))) + patches.shape[2:]).max(axis=2)
    return jnp.where(best <= low / 2, -jnp.inf, best)


def dense_avg_pool(dense, mask, kernel, stride, padding, dilation):
    total = _window(dense, jax.lax.add, 0.0, kernel, stride, padding, dilation)
    count = _window(mask, jax.lax.add, 0.0, kernel, stride, padding, dilation)
    return total / jnp.maximum(count, 1.0)


# ---------------------------------------------------------------------------- checks of the oracles


def _naive_conv(features, indices, weight, spatial_shape, batch_size, stride, padding, dilation, out_shape):
    """Plain loops: out[b, o] = sum_k W_k in[b, o*s - p + k*d]."""
    ndim = len(spatial_shape)
    k = weight.shape[1:-1]
    table = {tuple(int(v) for v in row): n for n, row in enumerate(indices)}
    out = np.zeros((batch_size, weight.shape[0]) + tuple(out_shape))
    for b in range(batch_size):
        for position in itertools.product(*[range(n) for n in out_shape]):
            for offset in itertools.product(*[range(n) for n in k]):
                source = tuple(position[a] * stride - padding + offset[a] * dilation for a in range(ndim))
                row = table.get((b,) + source)
                if row is not None:
                    out[(b, slice(None)) + position] += weight[(slice(None),) + offset + (slice(None),)] @ features[row]
    return out


@pytest.mark.parametrize("ndim", [1, 2])
def test_dense_conv_oracle_matches_loops(ndim):
    rng = np.random.default_rng(ndim)
    shape = (7,) * ndim
    indices = random_sites(rng, shape, 2, 10 * ndim)
    features = random_features(rng, indices.shape[0], 3)
    weight = rng.standard_normal((2,) + (3,) * ndim + (3,))
    got = dense_conv(densify(jnp.asarray(features), indices, shape, 2), jnp.asarray(weight), 2, 1, 1)
    expected = _naive_conv(features, indices, weight, shape, 2, 2, 1, 1, got.shape[2:])
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-12, atol=1e-12)


def test_dense_conv_transpose_oracle_matches_scatter_loops():
    rng = np.random.default_rng(5)
    shape, s, p, d = (5, 4), 2, 1, 1
    indices = random_sites(rng, shape, 1, 8)
    features = random_features(rng, 8, 2)
    weight = rng.standard_normal((3, 3, 2, 2))
    got = np.asarray(dense_conv_transpose(densify(jnp.asarray(features), indices, shape, 1), jnp.asarray(weight),
                                          s, p, d, output_padding=1))
    out_shape = tuple((n - 1) * s - 2 * p + d * (k - 1) + 1 + 1 for n, k in zip(shape, (3, 2)))
    expected = np.zeros((1, 3) + out_shape)
    for row, (b, y, x) in enumerate(indices):
        for ky, kx in itertools.product(range(3), range(2)):
            oy, ox = y * s - p + ky * d, x * s - p + kx * d
            if 0 <= oy < out_shape[0] and 0 <= ox < out_shape[1]:
                expected[b, :, oy, ox] += weight[:, ky, kx, :] @ features[row]
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_dense_pools_oracle_match_loops():
    rng = np.random.default_rng(9)
    shape = (6,)
    indices = random_sites(rng, shape, 1, 4)
    features = random_features(rng, 4, 1)
    neg = densify(jnp.asarray(features), indices, shape, 1, fill=-jnp.inf)
    mask = mask_of(indices, shape, 1)
    dense = densify(jnp.asarray(features), indices, shape, 1)
    got_max = np.asarray(dense_max_pool(neg, 3, 2, 1, 1))[0, 0]
    got_avg = np.asarray(dense_avg_pool(dense, mask, 3, 2, 1, 1))[0, 0]
    values = {int(x): float(features[r, 0]) for r, (_, x) in enumerate(indices)}
    for o in range(got_max.shape[0]):
        window = [values[x] for x in range(2 * o - 1, 2 * o + 2) if x in values]
        assert got_max[o] == (max(window) if window else -np.inf)
        assert got_avg[o] == pytest.approx(np.mean(window) if window else 0.0)
