"""tools/gpu_layer_model.py: a pass's blocks, FLOPs, splits and bytes on hand-made map statistics, and the
time model's direction (the old loads never faster than the new ones, a launch at least)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sparsecore.backends.tile_shapes import TileShape

from tests.tool_modules import load_tool

ROOT = Path(__file__).resolve().parents[1]


model = load_tool("gpu_layer_model")
SIMT = TileShape(64, 64, 16, 256, "simt", 2)
TENSOR = TileShape(64, 64, 32, 128, "tensor", 4)
# two row tiles of 64 rows; offset 0 in both tiles (100 pairs), offset 1 in one (30), offset 2 nowhere
SIDE = model.SideStats(128, (100, 30, 0), (2, 1, 0), 64)


def test_forward_counts_by_hand() -> None:
    estimate = model.pass_estimate("forward", SIDE, 20, 70, "float32", SIMT, model.OLD_LOADS)
    assert estimate.useful_flops == 2 * 130 * 20 * 70
    # 3 (tile, offset) visits x 64 rows x 20 channels padded to 32 x 70 padded to 128
    assert estimate.issued_flops == 2 * 3 * 64 * 32 * 128
    assert (estimate.blocks, estimate.splits, estimate.every_row_tile_own_block) == (4, 1, False)
    assert estimate.waves == pytest.approx(4 / (132 * 2))
    gathered, outputs = 130 * 20 * 4 * 2, 128 * 70 * 4  # rows gathered once per column tile; outputs once
    assert estimate.l2_bytes >= gathered + outputs
    assert estimate.tile == "64x64/16 simt 256t"


def test_weight_gradient_counts_by_hand() -> None:
    estimate = model.pass_estimate("weight gradient", SIDE, 20, 70, "float16", TENSOR, model.NEW_LOADS, splits=2)
    # 3 offsets x 1 x 2 channel tiles, 2 splits; the tiles holding an offset, each a 64 x (64 x 128) product
    assert (estimate.blocks, estimate.splits) == (12, 2)
    assert estimate.issued_flops == 2 * 3 * 64 * 2 * 64 * 64
    assert estimate.every_row_tile_own_block  # 2 splits for 2 row tiles
    assert not model.pass_estimate("weight gradient", SIDE, 20, 70, "float16", TENSOR, model.NEW_LOADS).\
        every_row_tile_own_block
    assert model.pass_estimate("weight gradient", SIDE, 20, 70, "float16", TENSOR, model.NEW_LOADS,
                               blocks=30).blocks == 30


@pytest.mark.parametrize("pass_name", ["forward", "input gradient", "weight gradient"])
@pytest.mark.parametrize(("dtype", "tile"), [("float32", SIMT), ("float16", TENSOR), ("tf32", TENSOR)])
def test_old_loads_are_never_faster(pass_name: str, dtype: str, tile: Any) -> None:
    old = model.pass_estimate(pass_name, SIDE, 96, 96, dtype, tile, model.OLD_LOADS)
    new = model.pass_estimate(pass_name, SIDE, 96, 96, dtype, tile, model.NEW_LOADS)
    assert old.seconds >= new.seconds > model.H100_MODEL.launch_seconds
    assert {old.bound, new.bound} <= {"latency", "compute", "issue", "L2"}
    assert old.issued_flops == new.issued_flops >= old.useful_flops


def test_unknown_engine_or_dtype_is_named() -> None:
    with pytest.raises(ValueError, match="no rate for engine 'tensor' and dtype 'float64'"):
        model.pass_estimate("forward", SIDE, 8, 8, "float64", TENSOR, model.OLD_LOADS)
