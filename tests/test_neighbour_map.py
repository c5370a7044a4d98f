"""`sparsecore.neighbour_map`: the per-row view of a rulebook, against plain Python oracles.

Random injective pair lists (within an offset, each input row and each output
row at most once, as in any rulebook) are turned into maps with
`neighbour_map_from_pairs`; every table entry, mask bit and row order is
checked against a loop over the pairs and the row order's loop oracle
(``row_order_oracle``: Python's stable ``sorted`` of the mask words, tiles
regrouped); `pairs_from_neighbour_map` must give the pairs back, grouped by
offset and ordered by output row. Also: orders sorted on first read (and only
then), `swapped`, `input_side`, `neighbour_map_of`'s memo, copies and the
constructor's checks.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import sparsecore as sc
from sparsecore.neighbour_map import (ROW_PLAN, NeighbourMap, mask_order, mask_words, neighbour_map_from_pairs,
                                      neighbour_map_of, pairs_from_neighbour_map, row_masks, stored_masks,
                                      stored_order)


try:
    from .cuda_emulation import device_arrays
    from .row_order_oracle import oracle_order
except ImportError:
    from cuda_emulation import device_arrays
    from row_order_oracle import oracle_order


def _rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng([20261205, *seed])


def _random_pairs(rng: np.random.Generator, num_input: int, num_output: int, volume: int):
    """Injective pairs per offset, in random order within each offset (as a builder may list them)."""
    pieces = []
    for _ in range(volume):
        count = int(rng.integers(0, min(num_input, num_output) + 1))
        pieces.append((rng.choice(num_input, count, replace=False), rng.choice(num_output, count, replace=False)))
    starts = [0]
    for input_rows, _ in pieces:
        starts.append(starts[-1] + len(input_rows))
    pair_input = np.concatenate([p[0] for p in pieces]).astype(np.int32) if pieces else np.zeros(0, np.int32)
    pair_output = np.concatenate([p[1] for p in pieces]).astype(np.int32) if pieces else np.zeros(0, np.int32)
    return pair_input, pair_output, tuple(starts)


def _oracle_side(pairs_by_offset, rows: int, volume: int, output_side: bool):
    """Table, masks (as Python int bit sets) and row order (stable mask sort, tiles regrouped), by loops."""
    table = [[-1] * volume for _ in range(rows)]
    for offset, pairs in enumerate(pairs_by_offset):
        for input_row, output_row in pairs:
            row, value = (output_row, input_row) if output_side else (input_row, output_row)
            assert table[row][offset] == -1
            table[row][offset] = value
    words = mask_words(volume)
    masks = [[sum(1 << (k % 32) for k in range(volume) if table[r][k] >= 0 and k // 32 == w) for w in range(words)]
             for r in range(rows)]
    order = oracle_order([sum(word << (32 * w) for w, word in enumerate(masks[r])) for r in range(rows)], words)
    return np.array(table, np.int32).reshape(rows, volume), np.array(masks, np.uint32).reshape(rows, words), \
        np.array(order, np.int32)


@pytest.mark.parametrize("kernel_size", [(3,), (2, 3), (3, 3, 3), (5, 1, 7), (3, 3, 3, 3)])
@pytest.mark.parametrize("num_input, num_output", [(0, 0), (1, 4), (23, 17), (40, 40)])
def test_map_from_pairs_against_loops(kernel_size, num_input, num_output):
    volume = int(np.prod(kernel_size))
    rng = _rng(1, volume, num_input, num_output)
    pair_input, pair_output, starts = _random_pairs(rng, num_input, num_output, volume)
    neighbour_map = neighbour_map_from_pairs(np, pair_input, pair_output, starts, num_input, num_output, kernel_size)
    by_offset = [list(zip(pair_input[a:b].tolist(), pair_output[a:b].tolist())) for a, b in zip(starts, starts[1:])]
    for side, rows in (("output", num_output), ("input", num_input)):
        table, masks, order = _oracle_side(by_offset, rows, volume, side == "output")
        for name, expected in (("neighbours", table), ("masks", masks), ("order", order)):
            actual = getattr(neighbour_map, f"{side}_{name}")
            assert actual.dtype == expected.dtype and actual.shape == expected.shape, (side, name)
            np.testing.assert_array_equal(actual, expected, err_msg=f"{side} {name}")
    assert neighbour_map.kernel_volume == volume and not neighbour_map.symmetric
    # the pair view: the same pairs, grouped by offset, output rows increasing within an offset
    got_input, got_output, got_starts = pairs_from_neighbour_map(np, neighbour_map)
    assert got_starts == starts and got_input.dtype == got_output.dtype == np.int32
    for offset, (start, stop) in enumerate(zip(starts, starts[1:])):
        assert np.all(np.diff(got_output[start:stop]) > 0), offset
        assert sorted(zip(got_input[start:stop].tolist(), got_output[start:stop].tolist())) == sorted(by_offset[offset])


def test_padding_rows_are_no_pairs():
    pair_input = np.array([0, -1, 2, 1, 3], np.int32)
    pair_output = np.array([1, 2, -1, 0, 3], np.int32)
    neighbour_map = neighbour_map_from_pairs(np, pair_input, pair_output, (0, 3, 5), 4, 4, (2,))
    np.testing.assert_array_equal(neighbour_map.output_neighbours, [[-1, 1], [0, -1], [-1, -1], [-1, 3]])
    np.testing.assert_array_equal(neighbour_map.input_neighbours, [[1, -1], [-1, 0], [-1, -1], [-1, 3]])


def test_padded_pairs_convert_on_the_device_without_a_read():
    """A padded pair map (a JAX callback's, on the GPU) becomes a map with no read back to the host."""
    rng = _rng(6)
    pair_input, pair_output, starts = _random_pairs(rng, 20, 16, 9)
    padded_input, padded_output, padded_starts = [], [], [0]
    for start, stop in zip(starts, starts[1:]):  # every offset padded to 16 slots with -1
        padded_input += pair_input[start:stop].tolist() + [-1] * (16 - (stop - start))
        padded_output += pair_output[start:stop].tolist() + [int(rng.integers(16))] * (16 - (stop - start))
        padded_starts.append(padded_starts[-1] + 16)
    xp = device_arrays.DEVICE_NUMPY
    with device_arrays.forbid_host_reads():
        neighbour_map = neighbour_map_from_pairs(xp, device_arrays.to_device(np.array(padded_input, np.int32)),
                                                 device_arrays.to_device(np.array(padded_output, np.int32)),
                                                 tuple(padded_starts), 20, 16, (3, 3))
        order = neighbour_map.output_order
    expected = neighbour_map_from_pairs(np, pair_input, pair_output, starts, 20, 16, (3, 3))
    for name in ("output_neighbours", "output_masks", "input_neighbours", "input_masks"):
        assert isinstance(getattr(neighbour_map, name), device_arrays.DeviceArray), name
        np.testing.assert_array_equal(np.asarray(getattr(neighbour_map, name)), getattr(expected, name), name)
    np.testing.assert_array_equal(np.asarray(order), expected.output_order)


@pytest.mark.parametrize("words", [1, 2, 5])
def test_mask_order_is_a_stable_lexicographic_sort(words):
    rng = _rng(2, words)
    masks = rng.integers(0, 4, size=(300, words)).astype(np.uint32)  # few values: many ties
    masks[::7] = np.uint32(0xFFFFFFFF)  # the top bit set: unsigned comparisons
    expected = sorted(range(300), key=lambda r: tuple(masks[r].tolist()))
    order = mask_order(np, masks)
    assert order.dtype == np.int32
    np.testing.assert_array_equal(order, expected)


def test_row_masks_set_one_bit_per_neighbour():
    table = np.full((3, 40), -1, np.int32)
    table[0, [0, 31, 32, 39]] = 5
    table[2, 33] = 0
    np.testing.assert_array_equal(row_masks(np, table), [[1 | 1 << 31, 1 | 1 << 7], [0, 0], [0, 1 << 1]])


def test_orders_are_sorted_when_first_read_and_kept():
    rng = _rng(3)
    pair_input, pair_output, starts = _random_pairs(rng, 30, 20, 27)
    neighbour_map = neighbour_map_from_pairs(np, pair_input, pair_output, starts, 30, 20, (3, 3, 3))
    assert neighbour_map.__dict__["_output_order"] is None and neighbour_map.__dict__["_input_order"] is None
    first = neighbour_map.output_order
    assert first is neighbour_map.output_order  # memoised
    assert neighbour_map.__dict__["_input_order"] is None  # the other side is not sorted with it
    np.testing.assert_array_equal(first, oracle_order([int(m) for m in neighbour_map.output_masks[:, 0]], 1))
    swapped = neighbour_map.swapped()
    assert swapped.__dict__["_input_order"] is first and swapped.__dict__["_output_order"] is None
    np.testing.assert_array_equal(swapped.output_order, neighbour_map.input_order)
    assert swapped.input_neighbours is neighbour_map.output_neighbours
    assert (swapped.num_input, swapped.num_output) == (20, 30)
    # an order given at construction is used as given
    given = np.arange(20, dtype=np.int32)[::-1].copy()
    made = NeighbourMap(neighbour_map.output_neighbours, neighbour_map.output_masks, given,
                        neighbour_map.input_neighbours, neighbour_map.input_masks, None, 30, 20, (3, 3, 3))
    assert made.output_order is given
    assert "output_order" not in repr(made)  # a repr does not sort


def test_symmetric_map_reads_its_input_side_reversed():
    table = np.array([[-1, 0, 1], [0, 1, -1]], np.int32)  # site 1 feeds site 0 through offset 2, 0 feeds 1 through 0
    masks = row_masks(np, table)
    neighbour_map = NeighbourMap(table, masks, None, None, None, None, 2, 2, (3,), 1, True)
    neighbours, side_masks, order, reversed_offsets = neighbour_map.input_side()
    assert neighbours is table and side_masks is masks and reversed_offsets
    np.testing.assert_array_equal(order, [1, 0])  # masks 0b110 = 6 and 0b011 = 3
    assert neighbour_map.input_order is None and neighbour_map.swapped() is neighbour_map
    asymmetric = neighbour_map_from_pairs(np, np.array([0, 1], np.int32), np.array([1, 0], np.int32), (0, 1, 2),
                                          2, 2, (2,))
    assert asymmetric.input_side()[3] is False and asymmetric.input_side()[0] is asymmetric.input_neighbours


def test_copies_keep_the_sorted_orders_and_empty_the_cache():
    rng = _rng(4)
    pair_input, pair_output, starts = _random_pairs(rng, 12, 12, 3)
    neighbour_map = neighbour_map_from_pairs(np, pair_input, pair_output, starts, 12, 12, (3,))
    order = neighbour_map.output_order
    neighbour_map.derived["plan"] = "kept per map"
    for clone in (copy.copy(neighbour_map), pickle.loads(pickle.dumps(neighbour_map))):
        assert clone.derived == {}
        np.testing.assert_array_equal(clone.output_order, order)
        np.testing.assert_array_equal(clone.input_neighbours, neighbour_map.input_neighbours)


def test_neighbour_map_of_a_pair_map_is_built_once():
    rng = _rng(5)
    pair_input, pair_output, starts = _random_pairs(rng, 15, 15, 9)
    pair_map = sc.PairMap(pair_input, pair_output, starts, 15, 15, (3, 3))
    first = neighbour_map_of(pair_map, np)
    assert neighbour_map_of(pair_map, np) is first and pair_map.derived["neighbour_map"] is first
    expected = neighbour_map_from_pairs(np, pair_input, pair_output, starts, 15, 15, (3, 3))
    np.testing.assert_array_equal(first.output_neighbours, expected.output_neighbours)
    np.testing.assert_array_equal(first.input_neighbours, expected.input_neighbours)


def test_a_numpy_rulebook_derives_its_map_on_request_only():
    indices = np.array([[0, 1, 1], [0, 1, 2], [0, 3, 3], [1, 1, 1]], np.int32)
    rulebook = sc.build_rulebook(indices, (5, 5), 2, sc.ConvGeometry.create(2, 3, kind="subm"))
    assert rulebook.neighbour_map is None and rulebook.stored_map is None
    derived = neighbour_map_of(rulebook, np)
    assert rulebook.neighbour_map is derived and derived.symmetric and derived.identity_offset == 4
    np.testing.assert_array_equal(derived.output_neighbours[:, 4], np.arange(4))  # the centre: every site itself
    assert derived.output_neighbours[0, 5] == 1 and derived.output_neighbours[1, 3] == 0  # (1, 1) <-> (1, 2)


def test_the_constructor_checks_shapes():
    table = np.full((3, 9), -1, np.int32)
    masks = np.zeros((3, 1), np.uint32)
    with pytest.raises(ValueError, match="output_neighbours must have shape"):
        NeighbourMap(table, masks, None, table, masks, None, 3, 3, (3, 2))
    with pytest.raises(ValueError, match="output_masks must have shape"):
        NeighbourMap(table, np.zeros((3, 2), np.uint32), None, table, masks, None, 3, 3, (3, 3))
    with pytest.raises(ValueError, match="symmetric neighbour map"):
        NeighbourMap(table, masks, None, table, masks, None, 3, 3, (3, 3), 4, True)
    with pytest.raises(ValueError, match="input_neighbours must have shape"):
        NeighbourMap(table, masks, None, table[:2], masks[:2], None, 3, 3, (3, 3))


def test_an_order_is_read_out_of_a_row_plan_and_plans_follow_a_swap():
    """A side with a row plan (built by the GPU's passes, `_kernel_maps.row_plan`) gives the plan's low 32-bit
    words as its order; `swapped` hands each side's plan to the other side."""
    rng = _rng(7)
    pair_input, pair_output, starts = _random_pairs(rng, 30, 20, 9)
    neighbour_map = neighbour_map_from_pairs(np, pair_input, pair_output, starts, 30, 20, (3, 3))
    expected = neighbour_map_from_pairs(np, pair_input, pair_output, starts, 30, 20, (3, 3)).output_order
    high = rng.integers(0, 1 << 31, 20).astype(np.int64) << 32  # bit sets in the high words
    plan = expected.astype(np.int64) | high
    neighbour_map.derived[(ROW_PLAN, "output")] = plan
    assert stored_order(neighbour_map, "output") is None
    order = neighbour_map.output_order
    assert order.dtype == np.int32 and stored_order(neighbour_map, "output") is order
    np.testing.assert_array_equal(order, expected)
    assert neighbour_map.swapped().derived[(ROW_PLAN, "input")] is plan


@pytest.mark.parametrize("kernel_size", [(3, 3), (4, 3, 3)])  # one and two mask words
def test_masks_left_out_are_made_when_first_read_bitwise_and_kept(monkeypatch, kernel_size):
    """A map made without input masks (the GPU's strided builds) makes them from its input table on first read,
    on the device without a read back, bitwise equal to the masks built with the table; once, not by a repr,
    a copy, a pickle or `swapped` (whose output masks they become, made on its first read)."""
    rng = _rng(8, len(kernel_size))
    volume = int(np.prod(kernel_size))
    pair_input, pair_output, starts = _random_pairs(rng, 40, 25, volume)
    eager = neighbour_map_from_pairs(np, pair_input, pair_output, starts, 40, 25, kernel_size)
    device_arrays.use_device_arrays(monkeypatch)  # array_module answers the device library, as for CuPy
    put = device_arrays.to_device
    lazy = NeighbourMap(put(eager.output_neighbours), put(eager.output_masks), None, put(eager.input_neighbours),
                        None, None, 40, 25, kernel_size)
    assert "input_masks" not in repr(lazy)
    swapped = lazy.swapped()
    for unmade in (lazy, copy.copy(lazy), pickle.loads(pickle.dumps(lazy))):
        assert stored_masks(unmade, "input") is None
    assert stored_masks(swapped, "output") is None and stored_masks(swapped, "input") is lazy.output_masks
    with device_arrays.forbid_host_reads():
        made = lazy.input_masks
        made_swapped = swapped.output_masks
    assert isinstance(made, device_arrays.DeviceArray) and lazy.input_masks is made
    assert stored_masks(lazy, "input") is made and stored_masks(swapped, "output") is made_swapped
    assert made.dtype == np.uint32 and made.shape == (40, mask_words(volume))
    np.testing.assert_array_equal(np.asarray(made), eager.input_masks)  # the device's xp path = NumPy's packbits
    np.testing.assert_array_equal(np.asarray(made_swapped), eager.input_masks)
    np.testing.assert_array_equal(np.asarray(lazy.input_side()[1]), eager.input_masks)
    symmetric = NeighbourMap(eager.output_neighbours[:25], eager.output_masks[:25], None, None, None, None, 25, 25,
                             kernel_size, symmetric=True)
    assert symmetric.input_masks is None and stored_masks(symmetric, "input") is None
    with pytest.raises(ValueError, match="output_masks must have shape"):
        NeighbourMap(eager.output_neighbours, eager.input_masks, None, eager.input_neighbours, None, None, 40, 25,
                     kernel_size)
