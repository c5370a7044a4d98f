"""The tile table and per-layer cost of the fused conv kernels (`sparsecore.backends.tile_shapes`), no GPU.

Oracles: map statistics against a direct count over every slice of rows and
offset; useful FLOPs against the pair count; issued FLOPs against the padding
rules written out by hand for tables where every row holds every offset;
splits against the two-wave and scratch-cap rules.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparsecore.backends import tile_shapes

try:
    from kernel_targets import rng_for
except ImportError:  # tests/ imported as a package
    from tests.kernel_targets import rng_for


def _table(rng, rows: int, volume: int, density: float) -> np.ndarray:
    table = np.where(rng.random((rows, volume)) < density, rng.integers(0, rows, (rows, volume)), -1)
    return table.astype(np.int32)


def test_engines_per_architecture():
    assert tile_shapes.engine_of("float16", arch=75) == "tensor"
    assert tile_shapes.engine_of("bfloat16", arch=75) == "simt"
    assert tile_shapes.engine_of("float32", tf32=True, arch=75) == "simt"
    assert tile_shapes.engine_of("float32", tf32=True, arch=80) == "tensor"
    assert tile_shapes.engine_of("bfloat16", arch=90) == "tensor"
    assert tile_shapes.engine_of("float64", tf32=True, arch=90) == "simt"
    # the sm_75 fallbacks run the 128-thread SIMT engine of the Wmma instantiations
    assert tile_shapes.choose_tile(16, 16, "bfloat16", arch=75).threads == 128
    assert tile_shapes.choose_tile(16, 16, "float32", tf32=True, arch=75).threads == 128
    assert tile_shapes.choose_tile(16, 16, "float32").threads == 256
    assert tile_shapes.choose_tile(16, 16, "float16").engine == "tensor"
    assert tile_shapes.choose_tile(8, 16, "float16").engine == "simt"  # a narrow reduction
    with pytest.raises(ValueError, match="no fused conv kernel for dtype 'int8'"):
        tile_shapes.choose_tile(16, 16, "int8")


def test_map_stats_count_every_slice():
    rng = rng_for(350)
    table = _table(rng, 203, 7, 0.15)
    order = rng.permutation(203).astype(np.int32)
    stats = tile_shapes.map_stats(table, order)
    assert stats.num_rows == 203 and stats.row_tiles == 4
    assert stats.pairs_per_offset == tuple(int(count) for count in (table >= 0).sum(axis=0))
    for rows in tile_shapes.SLICE_ROWS:
        expected = [0] * 7
        for start in range(0, 203, rows):
            for k in range(7):
                expected[k] += any(table[order[r], k] >= 0 for r in range(start, min(start + rows, 203)))
        assert stats.slices(rows) == tuple(expected), rows
    assert stats.slices(64) == stats.tiles_per_offset
    with pytest.raises(ValueError):
        stats.slices(4)


@pytest.mark.parametrize("dtype_name, tf32", [("float32", False), ("float16", False), ("float32", True)])
def test_forward_cost_of_a_full_table(dtype_name, tf32):
    """Every row holds every offset: issued = useful exactly where the channels fill the units."""
    table = np.arange(128 * 5, dtype=np.int32).reshape(128, 5) % 128
    stats = tile_shapes.map_stats(table, np.arange(128, dtype=np.int32))
    cost = tile_shapes.forward_cost(stats, 32, 96, dtype_name, tf32)
    assert cost.useful_flops == 2 * 128 * 5 * 32 * 96 == cost.issued_flops
    tile = cost.tile
    # two row tiles, two column tiles (64 + 32): 4 tiles leave the GPU idle, so their 5 offsets are split in
    # ceil(5 / 3) = 2 (at most OFFSETS_PER_SPLIT offsets a split)
    assert cost.splits == 2 and cost.blocks == 2 * 2 * 2
    assert tile_shapes.forward_cost(stats, 32, 96, dtype_name, tf32, split=False).blocks == 2 * 2
    assert cost.waves == pytest.approx(cost.blocks / (tile_shapes.DEFAULT_SM_COUNT * tile.blocks_per_sm))
    # 3 input channels: SIMT in every dtype (no padding of the reduction), 3 outputs padded to 16
    narrow = tile_shapes.forward_cost(stats, 3, 3, dtype_name, tf32)
    assert narrow.tile.engine == "simt" and narrow.tile.threads == 256
    assert narrow.issued_flops == 2 * 128 * 5 * 3 * 16


def test_forward_cost_counts_slices_not_tiles():
    """One row of each 64-row tile holds the offset: the issued work is one warp slice per tile."""
    table = np.full((256, 2), -1, np.int32)
    table[::64, 0] = 0
    stats = tile_shapes.map_stats(table, np.arange(256, dtype=np.int32))
    cost = tile_shapes.forward_cost(stats, 16, 16, "float32")
    assert cost.useful_flops == 2 * 4 * 16 * 16
    assert cost.issued_flops == 2 * 4 * cost.tile.slice_rows * 16 * 16


def test_weight_gradient_cost_fills_the_gpu():
    rng = rng_for(351)
    table = _table(rng, 3000, 27, 0.3)
    stats = tile_shapes.map_stats(table, np.argsort((table >= 0).astype(np.int64) @ (1 << np.arange(27)),
                                                    kind="stable").astype(np.int32))
    for dtype_name in ("float32", "float64", "float16", "bfloat16"):
        cost = tile_shapes.weight_gradient_cost(stats, 64, 64, dtype_name)
        assert cost.fills_gpu and cost.splits > 1
        assert cost.blocks == 27 * cost.splits
        assert cost.waves >= 2 or cost.splits == stats.row_tiles
        assert cost.useful_flops == 2 * stats.pairs * 64 * 64 <= cost.issued_flops
        itemsize = 8 if dtype_name == "float64" else 4
        assert cost.scratch_bytes == 27 * cost.splits * 4096 * itemsize + 27 * 4
    small = tile_shapes.map_stats(table[:100], np.arange(100, dtype=np.int32))
    cost = tile_shapes.weight_gradient_cost(small, 256, 256, "float32")
    assert cost.splits == small.row_tiles == 2 and cost.fills_gpu  # every row tile in its own block
