"""`sparsecore.jax.primitives`: pair gathers and scatters with -1 = no pair, chunk loops, offset masks.

Oracles are plain NumPy loops over the rows (an integer / float64 reference
written independently of ``jax.lax``), on fresh seeded inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsecore.jax import primitives

try:
    from .test_jax_oracle import x64  # noqa: F401 (fixture)
except ImportError:
    from test_jax_oracle import x64  # type: ignore[no-redef]  # noqa: F401

pytestmark = pytest.mark.usefixtures("x64")


def _rows(rng, count, capacity, holes):
    """``count`` distinct rows of ``[0, capacity)`` with ``holes`` of them replaced by -1 (no pair)."""
    rows = rng.permutation(capacity)[:count].astype(np.int32)
    rows[rng.choice(count, holes, replace=False)] = -1
    return rows


@pytest.mark.parametrize("seed", [0, 1])
def test_gather_reads_fill_for_minus_one_and_beyond(seed):
    rng = np.random.default_rng(seed)
    source = rng.standard_normal((9, 4))
    rows = np.concatenate([_rows(rng, 7, 9, 3), np.array([9, 12], np.int32)])  # -1 and out of range
    expected = np.array([source[r] if 0 <= r < 9 else np.full(4, -5.0) for r in rows])
    np.testing.assert_array_equal(np.asarray(jax.jit(primitives.gather_rows, static_argnums=2)(
        jnp.asarray(source), jnp.asarray(rows), -5.0)), expected)


@pytest.mark.parametrize("add", [True, False])
def test_scatter_drops_minus_one_rows(add):
    rng = np.random.default_rng(7 + add)
    target = rng.standard_normal((10, 3))
    rows = _rows(rng, 8, 10, 4)  # several -1 entries: repeated, yet they write nothing
    values = rng.standard_normal((8, 3))
    expected = target.copy()
    for row, value in zip(rows, values):
        if row >= 0:
            expected[row] = expected[row] + value if add else value
    result = jax.jit(primitives.scatter_rows, static_argnums=3)(jnp.asarray(target), jnp.asarray(rows),
                                                                 jnp.asarray(values), add)
    np.testing.assert_allclose(np.asarray(result), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("count", [0, 1, 5, 8, 13])
def test_chunked_visits_exactly_the_chunks_holding_the_first_count_pairs(count):
    rng = np.random.default_rng(count)
    chunk, capacity = 4, 16
    rows_in = rng.integers(0, 50, capacity).astype(np.int32)
    rows_out = rng.integers(0, 50, capacity).astype(np.int32)

    def record(carry, chunk_in, chunk_out):
        total, steps = carry
        return total + jnp.sum(chunk_in * 3 + chunk_out, dtype=jnp.int32), steps + 1

    total, steps = jax.jit(lambda a, b, c: primitives.chunked(record, (jnp.int32(0), jnp.int32(0)), a, b, c, chunk))(
        jnp.asarray(rows_in), jnp.asarray(rows_out), jnp.int32(count))
    chunks = -(-count // chunk)
    visited = slice(0, chunks * chunk)
    assert int(steps) == chunks
    assert int(total) == int(np.sum(rows_in[visited] * 3 + rows_out[visited]))


def test_without_offset_zeroes_one_count():
    counts = jnp.asarray(np.arange(1, 8, dtype=np.int32))
    np.testing.assert_array_equal(np.asarray(primitives.without_offset(counts, 3)), [1, 2, 3, 0, 5, 6, 7])
    assert primitives.without_offset(counts, -1) is counts


def test_varying_like_is_the_value_itself_outside_shard_map():
    value = jnp.ones(3)
    assert primitives.varying_like(value, jnp.zeros(2)) is value
    assert primitives.common_varying(value, jnp.zeros(2), jnp.zeros(1))[0] is value


@pytest.mark.parametrize("groups", [1, 3])
def test_grouped_products_match_block_diagonal_matmul(groups):
    rng = np.random.default_rng(groups)
    rows, matrices = rng.standard_normal((5, groups * 2)), rng.standard_normal((groups, 2, 4))
    dense = np.zeros((groups * 2, groups * 4))
    for g in range(groups):
        dense[g * 2:(g + 1) * 2, g * 4:(g + 1) * 4] = matrices[g]
    np.testing.assert_allclose(np.asarray(primitives.grouped_product(jnp.asarray(rows), jnp.asarray(matrices))),
                               rows @ dense, rtol=1e-6, atol=1e-6)
    right = rng.standard_normal((5, groups * 4))
    outer = np.stack([rows[:, g * 2:(g + 1) * 2].T @ right[:, g * 4:(g + 1) * 4] for g in range(groups)])
    np.testing.assert_allclose(np.asarray(primitives.grouped_outer(jnp.asarray(rows), jnp.asarray(right), groups)),
                               outer, rtol=1e-6, atol=1e-6)
