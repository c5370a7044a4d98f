"""tools/gpu_layer_estimate.py on a small scene: the maps' statistics against a brute-force count of the
sites' neighbours (pools as the unique halved coordinates), the old rules by hand, the new column from
`tile_shapes`, the targets' lines and the command's JSON."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sparsecore.backends import tile_shapes
from sparsecore.benchmark import scenes
from sparsecore.benchmark.network import REFERENCE_NETWORK

from tests.tool_modules import load_tool

ROOT = Path(__file__).resolve().parents[1]


estimate = load_tool("gpu_layer_estimate")
SHAPE = (64, 64, 64)  # six 2x2x2 pools leave 1 x 1 x 1


def _scene(seed: int) -> np.ndarray:
    """Three dense blobs of sites (so they have neighbours), batch 0: int32 [N, 4]."""
    rng = np.random.default_rng(seed)
    blobs = [rng.integers(0, 9, size=(260, 3)) + rng.integers(0, 54, size=3) for _ in range(3)]
    sites = np.unique(np.concatenate(blobs), axis=0)
    return np.column_stack([np.zeros(len(sites), np.int64), sites]).astype(np.int32)


def _brute_pairs(sites: np.ndarray) -> int:
    present = {tuple(site) for site in sites[:, 1:].tolist()}
    return sum((z + dz, y + dy, x + dx) in present for z, y, x in present
               for dz, dy, dx in itertools.product((-1, 0, 1), repeat=3))


@pytest.fixture(scope="module")
def scene() -> np.ndarray:
    return _scene(7)


@pytest.fixture(scope="module")
def maps(scene: np.ndarray) -> tuple[Any, ...]:
    return estimate.network_maps(scene, SHAPE)


def test_side_stats_count_tiles_holding_each_offset() -> None:
    rng = np.random.default_rng(3)
    table = np.where(rng.random((150, 5)) < 0.3, rng.integers(0, 150, (150, 5)), -1).astype(np.int32)
    table[:, 4] = -1  # an offset no row has
    order = rng.permutation(150).astype(np.int32)
    stats = estimate.side_stats(table, order, 64)
    expected = [sum(any(table[row, k] >= 0 for row in order[start:start + 64]) for start in range(0, 150, 64))
                for k in range(5)]
    assert stats.tiles_per_offset == tuple(expected) and stats.tiles_per_offset[4] == 0
    assert stats.pairs_per_offset == tuple(int((table[:, k] >= 0).sum()) for k in range(5))
    assert (stats.num_rows, stats.row_tiles, stats.tile_rows) == (150, 3, 64)


def test_maps_follow_the_network_against_a_brute_force_count(scene: np.ndarray, maps: tuple[Any, ...]) -> None:
    convs = [layer for layer in REFERENCE_NETWORK if layer.kind == "subm"]
    assert [item.index for item in maps] == [layer.index for layer in convs]
    sites = scene
    for layer in REFERENCE_NETWORK:
        if layer.kind == "maxpool":
            halved = np.unique(sites[:, 1:] // 2, axis=0)
            sites = np.column_stack([np.zeros(len(halved), np.int64), halved]).astype(np.int32)
            continue
        item = next(entry for entry in maps if entry.index == layer.index)
        pairs = _brute_pairs(sites)
        assert (item.in_channels, item.out_channels) == (layer.in_channels, layer.out_channels)
        assert item.output_side.num_rows == item.input_side.num_rows == len(sites)
        assert item.output_side.pairs == item.input_side.pairs == pairs
        assert item.new_output.pairs == pairs and item.new_output.num_rows == len(sites)
        assert all(count <= item.output_side.row_tiles for count in item.output_side.tiles_per_offset)
        assert item.output_side.tiles_per_offset[13] == item.output_side.row_tiles  # the centre is everywhere


def test_old_rules_by_hand() -> None:
    # L00 of the real scan in float32: 27 tiles; ceil(1024 / 27) = 38 wanted, 1962 // 4 row tiles, and
    # (125562 * 64 * 4 // 5) // (27 * 4096 * 4) = 14 by memory
    assert estimate.old_weight_gradient_splits(125_562, 27, 4, 125_562 * 64 * 4) == 14
    # 108 tiles: ceil(1024 / 108) = 10 wanted; memory would allow 25,715,097 // 1,769,472 = 14
    assert estimate.old_weight_gradient_splits(125_562, 27 * 4, 4, 125_562 * 256 * 4) == 10
    assert estimate.old_weight_gradient_splits(100, 27, 4, 10**9) == 1  # 2 row tiles // 4 = 0, at least 1
    old = estimate.old_tile("float16", weight=True)
    assert (old.rows, old.columns, old.step, old.threads, old.engine, old.blocks_per_sm) == (64, 64, 32, 128,
                                                                                             "tensor", 5)
    assert estimate.old_tile("float32", weight=False).step == 16


def test_layer_estimates_old_and_new(maps: tuple[Any, ...]) -> None:
    first = maps[0]  # 3 -> 64
    layer = estimate.estimate_layer(first, "float32")
    forward = layer.old[0]
    side = first.output_side
    assert forward.useful_flops == 2 * side.pairs * 3 * 64
    assert forward.issued_flops == 2 * sum(side.tiles_per_offset) * 64 * 16 * 64  # 3 channels padded to 16
    assert [item.pass_name for item in layer.new] == list(estimate.PASSES)
    cost = tile_shapes.forward_cost(first.new_output, 3, 64, "float32")
    assert (layer.new[0].blocks, layer.new[0].issued_flops, layer.new[0].useful_flops) == (
        cost.blocks, cost.issued_flops, cost.useful_flops)
    weight = tile_shapes.weight_gradient_cost(first.new_output, 3, 64, "float16")
    half = estimate.estimate_layer(first, "float16")
    assert (half.new[2].splits, half.new[2].blocks) == (weight.splits, weight.blocks)
    for item in estimate.estimate_network(maps, ("float16", "tf32")):
        for old, new in zip(item.old, item.new):
            assert old.useful_flops == new.useful_flops and min(old.issued_flops, new.issued_flops) >= old.useful_flops
            assert old.seconds > 0 and new.seconds > 0


def test_targets_and_the_table(maps: tuple[Any, ...]) -> None:
    estimates = estimate.estimate_network(maps, ("float16",))
    useful = sum(item.old[0].useful_flops for item in estimates)
    ratio = sum(item.old[0].issued_flops for item in estimates) / useful
    old_line, new_line = estimate.targets(estimates, "float16")
    assert old_line.startswith(f"float16 old: forward issued/useful {ratio:.3f}x of {useful / 1e9:.2f} GFLOP")
    assert ("FAIL <= 1.5x" in old_line) == (ratio > 1.5)
    starved = [item.layer.split()[0] for item in estimates
               if not (item.old[2].waves >= 2 or item.old[2].every_row_tile_own_block)]
    assert old_line.endswith("PASS" if not starved else "FAIL: " + " ".join(starved))
    table = estimate.format_estimates(estimates)
    assert table.count(" fwd ") == table.count(" wgrad ") == 14 and "total weight gradient" in table


def test_command_writes_json(scene: np.ndarray, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    import sparsecore.benchmark.network as network

    fake = scenes.VoxelScene(np.ones((len(scene), 3), np.float32), scene, SHAPE, 1, "three blobs")
    monkeypatch.setattr(network, "network_scene", lambda name, scale="small", seed=0: fake)
    path = tmp_path / "estimate.json"
    assert estimate.main(["--scene", "synthetic", "--dtypes", "float32", "--json", str(path)]) == 0
    document = json.loads(path.read_text())
    assert document["sites"] == len(scene) and len(document["estimates"]) == 14
    assert {entry["pass_name"] for entry in document["estimates"][0]["new"]} == set(estimate.PASSES)
    assert "float32 new: forward issued/useful" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        estimate.main(["--dtypes", "float8"])
