"""`sparsecore.tile_order` (rows regrouped inside row tiles) and the kernel that builds it, ``sc_map_row_plan``.

Oracles: the plain-Python loops of ``row_order_oracle`` for the NumPy version;
the NumPy version (and a loop over tiles for the per-offset bit sets) for the
kernel, run on the CPU emulation through `_kernel_maps.row_plan` (grids capped
at 2 blocks, so blocks walk several 32-tile chunks). Masks are random with few
distinct values per map (many ties, so every tie-break is exercised) and
offsets of very different frequencies.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparsecore.backends._kernel_maps import PLAN_THREADS, plan_bit_sets, row_plan
from sparsecore.neighbour_map import mask_order, row_masks, row_order
from sparsecore.tile_order import TILE_ROWS, regroup_tiles

try:
    from cuda_emulation import device_arrays
    from kernel_targets import rng_for, target  # noqa: F401
    from row_order_oracle import oracle_order, slice_offsets
except ImportError:  # tests/ imported as a package
    from tests.cuda_emulation import device_arrays
    from tests.kernel_targets import rng_for, target  # noqa: F401
    from tests.row_order_oracle import oracle_order, slice_offsets


def _table(rng: np.random.Generator, rows: int, volume: int, distinct: int) -> np.ndarray:
    """int32 ``[rows, volume]`` neighbours whose masks take ``distinct`` values, offsets of varied density."""
    density = rng.uniform(0.05, 0.95, volume)
    patterns = rng.random((distinct, volume)) < density
    present = patterns[rng.integers(0, distinct, rows)]
    return np.where(present, 0, -1).astype(np.int32).reshape(rows, volume)


def _python_masks(masks: np.ndarray) -> list[int]:
    return [sum(int(word) << (32 * w) for w, word in enumerate(row)) for row in masks]


@pytest.mark.parametrize("rows, volume, distinct", [(1, 27, 1), (37, 9, 4), (64, 27, 12), (200, 27, 30),
                                                    (150, 40, 20), (130, 64, 200), (90, 81, 10)])
def test_regrouped_order_equals_the_loop_oracle(rows, volume, distinct):
    masks = row_masks(np, _table(rng_for(60, rows, volume), rows, volume, distinct))
    order = row_order(np, masks)
    assert order.dtype == np.int32
    np.testing.assert_array_equal(order, oracle_order(_python_masks(masks), masks.shape[1]))


def test_tiles_keep_their_rows_and_never_gain_offsets():
    """Each tile holds the same rows as in the mask sort, and its 8- and 16-row slices never hold more offsets."""
    for trial in range(40):
        rng = rng_for(61, trial)
        rows, volume = int(rng.integers(1, 400)), int(rng.choice([3, 9, 27, 40, 64]))
        table = _table(rng, rows, volume, int(rng.integers(1, 60)))
        masks = row_masks(np, table)
        sorted_order, order = mask_order(np, masks), row_order(np, masks)
        python = _python_masks(masks)
        for start in range(0, rows, TILE_ROWS):
            before, after = sorted_order[start:start + TILE_ROWS], order[start:start + TILE_ROWS]
            assert sorted(before.tolist()) == sorted(after.tolist()), (trial, start)
            for height in (8, 16):
                old = slice_offsets(before.tolist(), python, height)
                new = slice_offsets(after.tolist(), python, height)
                assert new <= old, (trial, start, height)
        assert sorted(order.tolist()) == list(range(rows))


def test_regrouping_reads_nothing_back_on_the_device():
    masks = row_masks(np, _table(rng_for(62), 300, 27, 25))
    expected = row_order(np, masks)
    xp = device_arrays.DEVICE_NUMPY
    with device_arrays.forbid_host_reads():
        device_masks = device_arrays.to_device(masks)
        order = regroup_tiles(xp, device_masks, mask_order(xp, device_masks))
    assert isinstance(order, device_arrays.DeviceArray)
    np.testing.assert_array_equal(np.asarray(order), expected)


def _bit_sets(table: np.ndarray, order: np.ndarray) -> np.ndarray:
    """int64 ``[K, C]`` words: bit j of word (k, c) where tile 32 c + j holds offset k (a loop over tiles)."""
    rows, volume = table.shape
    tiles = -(-rows // TILE_ROWS)
    chunks = -(-tiles // PLAN_THREADS)
    words = np.zeros((volume, chunks), np.int64)
    for tile in range(tiles):
        held = (table[order[tile * TILE_ROWS:(tile + 1) * TILE_ROWS]] >= 0).any(axis=0)
        for k in np.flatnonzero(held):
            words[k, tile // 32] |= 1 << (tile % 32)
    return words


# (rows, volume, distinct): one tile, partial tiles, several 32-tile chunks (2 blocks walk 3 and more),
# two mask words, a map too small for the bit sets (K * chunks > rows), and masks too wide to regroup
PLAN_CASES = [(1, 27, 1), (5, 27, 3), (70, 27, 9), (2100, 27, 40), (4500, 9, 60), (700, 40, 50), (20, 64, 10),
              (3000, 81, 30)]


@pytest.mark.parametrize("rows, volume, distinct", PLAN_CASES)
def test_row_plan_kernel_equals_the_numpy_order_and_bit_sets(target, rows, volume, distinct):
    table = _table(rng_for(63, rows, volume), rows, volume, distinct)
    masks = row_masks(np, table)
    plan = target.get(row_plan(target.backend.device, target.put(masks), volume))
    assert plan.dtype == np.int64 and plan.shape == (rows,)
    order = row_order(np, masks)
    np.testing.assert_array_equal(plan & 0xFFFFFFFF, order)  # the low words: the order, bitwise
    high = (plan >> 32) & 0xFFFFFFFF
    expected = np.zeros(rows, np.int64)
    if plan_bit_sets(rows, volume, masks.shape[1]):
        sets = _bit_sets(table, order).reshape(-1)
        expected[:sets.size] = sets
    else:
        assert rows < volume or masks.shape[1] > 2, (rows, volume)
    np.testing.assert_array_equal(high, expected)
