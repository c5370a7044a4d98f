"""`sparsecore.jax.layout`: the one padded form of a rulebook in a plan.

The oracle is the core's rulebook (itself tested against naive pairs and dense
convolutions): each stored offset row must hold exactly that offset's pairs,
then -1 (the kernels' "no pair"), for every kind of layer, the subm centre
included, before and after re-padding to other capacities; the padded
neighbour map made from them (`map_arrays`) must hold the same pairs per row.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

from sparsecore.jax.layout import NO_PAIR, map_arrays, pair_layout

try:
    from .test_jax_padded import GEOMETRIES, _layout
except ImportError:
    from test_jax_padded import GEOMETRIES, _layout  # type: ignore[no-redef]


@pytest.mark.parametrize("count", [0, 70])
@pytest.mark.parametrize("kind", sorted(GEOMETRIES))
def test_each_offset_row_holds_its_pairs_then_no_pair(kind, count):
    rulebook, padded, capacity_in, capacity_out = _layout(kind, count, len(kind) + count)
    for stored in (padded, padded.repad(capacity_in + 40, capacity_out + 17)):
        pair_input, pair_output = np.asarray(stored.pair_input), np.asarray(stored.pair_output)
        assert pair_input.shape == pair_output.shape == (rulebook.kernel_volume, stored.info.pair_capacity)
        assert pair_input.dtype == np.int32 and stored.info.pair_capacity % stored.info.chunk == 0
        np.testing.assert_array_equal(stored.counts, rulebook.offset_counts)
        for offset in range(rulebook.kernel_volume):
            rows_in, rows_out = rulebook.pairs(offset)
            used = rows_in.shape[0]
            np.testing.assert_array_equal(pair_input[offset, :used], rows_in)
            np.testing.assert_array_equal(pair_output[offset, :used], rows_out)
            assert (pair_input[offset, used:] == NO_PAIR).all() and (pair_output[offset, used:] == NO_PAIR).all()
        if rulebook.identity_offset >= 0:  # the subm centre is stored: i -> i for the true rows
            centre = rulebook.identity_offset
            np.testing.assert_array_equal(pair_input[centre, :count], np.arange(count))
            np.testing.assert_array_equal(pair_output[centre, :count], np.arange(count))


@pytest.mark.parametrize("capacities", [(1, 1), (7, 300), (300, 7), (5000, 4096), (9000, 9001)])
def test_pair_capacity_bounds_an_offsets_pairs_and_is_whole_chunks(capacities):
    pairs, chunk = pair_layout(*capacities)
    assert pairs >= min(capacities) and pairs % chunk == 0 and chunk % 8 == 0
    assert pairs - min(capacities) < chunk  # at most one chunk of slack


@pytest.mark.parametrize("count", [0, 70])
@pytest.mark.parametrize("kind", sorted(GEOMETRIES))
def test_map_arrays_are_the_rulebooks_rows_padded_with_no_neighbour(kind, count):
    """The padded neighbour map XLA computes from the stored rows: each true row's neighbours (from the core's
    pairs, read by a loop), -1 and mask 0 on padding rows, and rows stably sorted by mask."""
    rulebook, padded, capacity_in, capacity_out = _layout(kind, count, 3 * len(kind) + count)
    symmetric = rulebook.identity_offset >= 0
    arrays = [np.asarray(array) for array in jax.jit(map_arrays, static_argnums=(2, 3, 4))(
        padded.pair_input, padded.pair_output, capacity_in, capacity_out, symmetric)]
    assert len(arrays) == (3 if symmetric else 6)
    volume = rulebook.kernel_volume
    sides = [(capacity_out, rulebook.num_output, 1), (capacity_in, rulebook.num_input, 0)][: len(arrays) // 3]
    for (capacity, true_rows, keyed_by_output), side in zip(sides, (arrays[:3], arrays[3:])):
        table, masks, order = side
        expected = np.full((capacity, volume), NO_PAIR, np.int64)
        for offset in range(volume):
            rows_in, rows_out = (np.asarray(rows) for rows in rulebook.pairs(offset))
            keys, values = (rows_out, rows_in) if keyed_by_output else (rows_in, rows_out)
            for key, value in zip(keys.tolist(), values.tolist()):
                expected[key, offset] = value
        np.testing.assert_array_equal(table, expected)
        assert table.dtype == np.int32 and masks.dtype == np.uint32 and (table[true_rows:] == NO_PAIR).all()
        bits = [sum(1 << (k % 32) for k in range(volume) if k // 32 == word and expected[row, k] >= 0)
                for row in range(capacity) for word in range(masks.shape[1])]
        np.testing.assert_array_equal(masks.reshape(-1), np.asarray(bits, dtype=np.uint64).astype(np.uint32))
        keys = [tuple(masks[row].tolist()) + (row,) for row in range(capacity)]  # stable: ties by row
        np.testing.assert_array_equal(order, [key[-1] for key in sorted(keys)])
    if symmetric:  # the input side it leaves out is the output side with the offsets reversed
        np.testing.assert_array_equal(arrays[0][:, ::-1][: rulebook.num_input],
                                      _inverse_table(rulebook, capacity_in)[: rulebook.num_input])


def _inverse_table(rulebook, capacity):
    table = np.full((capacity, rulebook.kernel_volume), NO_PAIR, np.int64)
    for offset in range(rulebook.kernel_volume):
        rows_in, rows_out = (np.asarray(rows) for rows in rulebook.pairs(offset))
        table[rows_in, offset] = rows_out
    return table
