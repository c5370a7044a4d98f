"""`sparsecore.jax.layout`: the one padded form of a rulebook in a plan.

The oracle is the core's rulebook (itself tested against naive pairs and dense
convolutions): each stored offset row must hold exactly that offset's pairs,
then -1 (the kernels' "no pair"), for every kind of layer, the subm centre
included, before and after re-padding to other capacities.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparsecore.jax.layout import NO_PAIR, pair_layout

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
