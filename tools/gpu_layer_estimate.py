"""Per-layer estimate of the fused GPU kernels on spconv's basic network, old and new tile shapes (no GPU).

    python tools/gpu_layer_estimate.py [--scene basic|synthetic] [--dtypes float32,float16,tf32] [--json PATH]
                                       [--no-forward-splits]

The neighbour maps of the network's 14 SubMConv3d layers (`sparsecore.benchmark.network`)
are built on the CPU from the scene's sites (the pools only give the next block
its sites); each map side's row masks in mask order give its statistics. For
each conv layer, dtype and pass (forward, input gradient, weight gradient):

- **new**: the tile `sparsecore.backends.tile_shapes` chooses, its blocks,
  useful and issued FLOPs, the forward's and input gradient's offset splits
  (layers with fewer output tiles than block slots) and the weight
  gradient's row splits (`forward_cost`, `weight_gradient_cost`: the
  kernels' own tile table; ``--no-forward-splits``: one block per output
  tile, as before the offset splits);
- **old**: the kernels of issue 28 (commit 3ed261f): every tile 64 rows x 64
  columns, the reduction step of the engine (16 SIMT and TF32, 32 float16 and
  bfloat16), resident blocks per SM from that code's SASS on sm_90
  (`OLD_BLOCKS_PER_SM`), the weight gradient split by the old
  `weight_gradient_splits` rule (about 1,024 blocks, splits of at least four
  row tiles, partials within a fifth of the output gradient) and walking every
  row tile of its split, loads scalar and one at a time;

and from `gpu_layer_model` the bytes from L2 and a modelled time on an H100.
It prints a table per dtype, the totals, and issue 35's CPU targets: the
forward's issued FLOPs at most 1.5x the useful, and every weight gradient at
least 2 waves on 132 SMs (or every row tile in its own block). ``--json``
writes every number; `tools/gpu_check.sh` prints the measured times beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_layer_model import (H100_MODEL, NEW_LOADS, OLD_LOADS, GpuModel, PassEstimate, SideStats,  # noqa: E402
                             pass_estimate, storage_bytes)

__all__ = ["OLD_BLOCKS_PER_SM", "LayerMaps", "LayerEstimate", "network_maps", "side_stats", "old_tile",
           "old_weight_gradient_splits", "estimate_layer", "estimate_network", "format_estimates", "targets", "main"]

PASSES = ("forward", "input gradient", "weight gradient")
FORWARD_TARGET = 1.5  # issued / useful forward FLOPs of the network
WAVES_TARGET = 2.0  # weight-gradient waves per layer on 132 SMs
# Resident blocks per SM of the issue-28 kernels on sm_90 (their SASS: registers bound all of them):
# (engine key, pass) -> blocks; pass "conv" is the forward and input gradient.
OLD_BLOCKS_PER_SM = {("float32", "conv"): 2, ("float64", "conv"): 2, ("tf32", "conv"): 4, ("float16", "conv"): 4,
                     ("bfloat16", "conv"): 4, ("float32", "weight"): 2, ("float64", "weight"): 2,
                     ("tf32", "weight"): 4, ("float16", "weight"): 5, ("bfloat16", "weight"): 3}
_OLD_SPLIT_TARGET_BLOCKS, _OLD_SPLIT_MIN_ROW_TILES, _OLD_SCRATCH_FRACTION = 1024, 4, 5


@dataclass(frozen=True)
class LayerMaps:
    """One conv layer of the network and the statistics of its map's two sides.

    Attributes:
        index: the layer's position in the network.
        name: its label (``"L03 SubMConv3d 64->96 [c1]"``).
        in_channels: input channels.
        out_channels: output channels.
        output_side: the output side (forward, weight gradient) at 64-row tiles.
        input_side: the input side (input gradient) at 64-row tiles.
        new_output: `tile_shapes.MapStats` of the output side (the new kernels' tiles).
        new_input: likewise of the input side.
    """

    index: int
    name: str
    in_channels: int
    out_channels: int
    output_side: SideStats
    input_side: SideStats
    new_output: Any
    new_input: Any


@dataclass(frozen=True)
class LayerEstimate:
    """The passes of one layer in one dtype, old and new.

    Attributes:
        layer: the layer's label.
        dtype: ``"float32"``, ``"float16"``, ``"bfloat16"``, ``"float64"`` or ``"tf32"``.
        sites: output rows.
        pairs: pairs of the map.
        old: the issue-28 kernels' passes, in `PASSES` order.
        new: the new kernels' passes.
    """

    layer: str
    dtype: str
    sites: int
    pairs: int
    old: tuple[PassEstimate, ...]
    new: tuple[PassEstimate, ...]


def side_stats(neighbours: np.ndarray, order: np.ndarray, tile_rows: int = 64) -> SideStats:
    """`SideStats` of a map side: pairs per offset, and row tiles of ``tile_rows`` rows (mask order) per offset."""
    present = np.asarray(neighbours)[np.asarray(order, dtype=np.int64)] >= 0
    rows, volume = present.shape
    tiles = -(-rows // tile_rows)
    padded = np.zeros((tiles * tile_rows, volume), dtype=bool)
    padded[:rows] = present
    held = padded.reshape(tiles, tile_rows, volume).any(axis=1).sum(axis=0)
    return SideStats(int(rows), tuple(int(count) for count in present.sum(axis=0)),
                     tuple(int(count) for count in held), tile_rows)


def network_maps(indices: np.ndarray, spatial_shape: tuple[int, ...], layers: tuple[Any, ...] | None = None
                 ) -> tuple[LayerMaps, ...]:
    """Builds the network's maps on the CPU from int32 ``[N, 4]`` sites and returns each conv layer's statistics."""
    import sparsecore as sc
    from sparsecore.backends import tile_shapes
    from sparsecore.benchmark.network import REFERENCE_NETWORK
    from sparsecore.neighbour_map import neighbour_map_of

    subm = sc.ConvGeometry.create(3, 3, kind="subm")
    sites, shape = np.ascontiguousarray(indices, dtype=np.int32), tuple(int(size) for size in spatial_shape)
    result, cached = [], None
    for layer in layers or REFERENCE_NETWORK:
        if layer.kind != "subm":
            rulebook = sc.build_pool_rulebook(sites, shape, 1, 2, 2, assume_unique=True)
            sites, shape = np.asarray(rulebook.output_indices), tuple(rulebook.output_spatial_shape)
            continue
        if layer.builds_rulebook or cached is None:
            rulebook = sc.build_rulebook(sites, shape, 1, subm, assume_unique=layer.index > 0)
            neighbour_map = neighbour_map_of(rulebook, np)
            output_neighbours, output_order = neighbour_map.output_neighbours, neighbour_map.output_order
            input_neighbours, _, input_order, _ = neighbour_map.input_side()
            cached = (side_stats(output_neighbours, output_order), side_stats(input_neighbours, input_order),
                      tile_shapes.map_stats(output_neighbours, output_order),
                      tile_shapes.map_stats(input_neighbours, input_order))
        result.append(LayerMaps(layer.index, layer.name, layer.in_channels, layer.out_channels, *cached))
    return tuple(result)


def old_tile(dtype_name: str, weight: bool) -> Any:
    """The issue-28 kernels' `tile_shapes.TileShape` for a dtype (``"tf32"`` for float32 on tensor cores)."""
    from sparsecore.backends.tile_shapes import TileShape

    tensor = dtype_name in ("float16", "bfloat16", "tf32")
    step = 32 if dtype_name in ("float16", "bfloat16") else 16
    blocks = OLD_BLOCKS_PER_SM[(dtype_name, "weight" if weight else "conv")]
    return TileShape(64, 64, step, 128 if tensor else 256, "tensor" if tensor else "simt", blocks)


def old_weight_gradient_splits(rows: int, tiles: int, partial_itemsize: int, grad_output_bytes: int) -> int:
    """The issue-28 rule: about 1,024 blocks, at least 4 row tiles a split, partials within a fifth of the
    output gradient's bytes."""
    row_tiles = -(-rows // 64)
    wanted = -(-_OLD_SPLIT_TARGET_BLOCKS // max(tiles, 1))
    by_memory = (grad_output_bytes // _OLD_SCRATCH_FRACTION) // max(tiles * 4096 * partial_itemsize, 1)
    return max(1, min(wanted, row_tiles // _OLD_SPLIT_MIN_ROW_TILES, by_memory))


def _new_side(stats: Any) -> SideStats:
    from sparsecore.backends import tile_shapes

    rows = getattr(stats, "tile_rows", tile_shapes.TILE_ROWS)
    return SideStats(stats.num_rows, tuple(stats.pairs_per_offset), tuple(stats.tiles_per_offset), rows)


def _new_pass(pass_name: str, stats: Any, reduce: int, width: int, dtype_name: str, cost: Any, model: GpuModel,
              splits: int = 1) -> PassEstimate:
    """The model's estimate of a pass in the tile the table chose, with the table's own blocks, waves and
    FLOPs (`tile_shapes.PassCost`)."""
    from dataclasses import replace

    estimate = pass_estimate(pass_name, _new_side(stats), reduce, width, dtype_name, cost.tile, NEW_LOADS, model,
                             splits, blocks=int(cost.blocks), issued=int(cost.issued_flops))
    return replace(estimate, waves=float(cost.waves), useful_flops=int(cost.useful_flops))


def estimate_layer(maps: LayerMaps, dtype_name: str, model: GpuModel = H100_MODEL,
                   forward_splits: bool = True) -> LayerEstimate:
    """Old and new estimates of the three passes of one layer in one dtype (``forward_splits``: the new
    forward and input gradient split their offsets where the kernels do)."""
    from sparsecore.backends import tile_shapes

    a, b = maps.in_channels, maps.out_channels
    itemsize = storage_bytes(dtype_name)
    partial = 8 if dtype_name == "float64" else 4
    grad_bytes = maps.output_side.num_rows * b * itemsize
    old_splits = old_weight_gradient_splits(maps.output_side.num_rows, 27 * -(-a // 64) * -(-b // 64), partial,
                                            grad_bytes)
    old = (pass_estimate("forward", maps.output_side, a, b, dtype_name, old_tile(dtype_name, False), OLD_LOADS, model),
           pass_estimate("input gradient", maps.input_side, b, a, dtype_name, old_tile(dtype_name, False), OLD_LOADS,
                         model),
           pass_estimate("weight gradient", maps.output_side, a, b, dtype_name, old_tile(dtype_name, True), OLD_LOADS,
                         model, old_splits))
    name, tf32 = ("float32", True) if dtype_name == "tf32" else (dtype_name, False)
    forward = tile_shapes.forward_cost(maps.new_output, a, b, name, tf32, sm_count=model.multiprocessors,
                                       split=forward_splits)
    backward = tile_shapes.forward_cost(maps.new_input, b, a, name, tf32, sm_count=model.multiprocessors,
                                        split=forward_splits)
    weight = tile_shapes.weight_gradient_cost(maps.new_output, a, b, name, tf32, sm_count=model.multiprocessors)
    new = (_new_pass("forward", maps.new_output, a, b, dtype_name, forward, model, int(forward.splits)),
           _new_pass("input gradient", maps.new_input, b, a, dtype_name, backward, model, int(backward.splits)),
           _new_pass("weight gradient", maps.new_output, a, b, dtype_name, weight, model, int(weight.splits)))
    return LayerEstimate(maps.name, dtype_name, maps.output_side.num_rows, maps.output_side.pairs, old, new)


def estimate_network(maps: tuple[LayerMaps, ...], dtypes: tuple[str, ...], model: GpuModel = H100_MODEL,
                     forward_splits: bool = True) -> tuple[LayerEstimate, ...]:
    """`estimate_layer` of every layer in every dtype (dtype-major)."""
    return tuple(estimate_layer(layer, dtype, model, forward_splits) for dtype in dtypes for layer in maps)


def _ratio(issued: float, useful: float) -> str:
    return f"{issued / useful:.2f}x" if useful else "-"


def _fills(estimate: PassEstimate) -> bool:
    return estimate.waves >= WAVES_TARGET or estimate.every_row_tile_own_block


def targets(estimates: tuple[LayerEstimate, ...], dtype: str) -> list[str]:
    """Issue 35's CPU targets for one dtype, old and new: one line each."""
    rows = [item for item in estimates if item.dtype == dtype]
    lines = []
    for column in ("old", "new"):
        forward = [getattr(item, column)[0] for item in rows]
        useful, issued = sum(p.useful_flops for p in forward), sum(p.issued_flops for p in forward)
        ratio = issued / useful if useful else 0.0
        starved = [item.layer.split()[0] for item in rows if not _fills(getattr(item, column)[2])]
        lines.append(f"{dtype} {column}: forward issued/useful {ratio:.3f}x of {useful / 1e9:.2f} GFLOP "
                     f"({'PASS' if ratio <= FORWARD_TARGET else 'FAIL'} <= {FORWARD_TARGET}x); weight gradient "
                     f">= {WAVES_TARGET:g} waves or a block per row tile: "
                     f"{'PASS' if not starved else 'FAIL: ' + ' '.join(starved)}")
    return lines


def format_estimates(estimates: tuple[LayerEstimate, ...], model: GpuModel = H100_MODEL) -> str:
    """A table per dtype: per layer and pass, old -> new; totals and the targets."""
    lines = [f"Per-layer estimate on an {model.name} ({model.multiprocessors} SMs; time modelled, not measured: "
             f"{OLD_LOADS.name} (old) vs {NEW_LOADS.name} (new); the first device run calibrates it)"]
    for dtype in dict.fromkeys(item.dtype for item in estimates):
        rows = [item for item in estimates if item.dtype == dtype]
        lines += ["", f"== {dtype}: old -> new",
                  f"{'layer':<30} {'pass':<6} {'useful GF':>9} {'issued/useful':>14} {'blocks':>13} "
                  f"{'waves':>11} {'splits':>9} {'L2 MB':>13} {'model ms':>13}  tile new"]
        for item in rows:
            for old, new in zip(item.old, item.new):
                short = {"forward": "fwd", "input gradient": "dgrad", "weight gradient": "wgrad"}[old.pass_name]
                lines.append(
                    f"{item.layer[:30]:<30} {short:<6} {old.useful_flops / 1e9:>9.3f} "
                    f"{_ratio(old.issued_flops, old.useful_flops):>6}->{_ratio(new.issued_flops, new.useful_flops):<7}"
                    f"{old.blocks:>6}->{new.blocks:<6} {old.waves:>5.2f}->{new.waves:<5.2f}"
                    f"{old.splits:>4}->{new.splits:<4} {old.l2_bytes / 1e6:>6.1f}->{new.l2_bytes / 1e6:<6.1f}"
                    f"{old.seconds * 1e3:>6.3f}->{new.seconds * 1e3:<6.3f} {new.tile}")
        for index, name in enumerate(PASSES):
            old = [item.old[index] for item in rows]
            new = [item.new[index] for item in rows]
            useful = sum(p.useful_flops for p in old)
            lines.append(f"{'total ' + name:<37} {useful / 1e9:>9.3f} "
                         f"{_ratio(sum(p.issued_flops for p in old), useful):>6}->"
                         f"{_ratio(sum(p.issued_flops for p in new), useful):<7}{'':>40}"
                         f"{sum(p.seconds for p in old) * 1e3:>6.2f}->{sum(p.seconds for p in new) * 1e3:<6.2f}")
        lines += targets(estimates, dtype)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scene", choices=("basic", "synthetic"), default="basic",
                        help="basic: data/lidar_voxels_125k.npz (the real scan); synthetic: the benchmark's "
                        "synthetic scan (--scale)")
    parser.add_argument("--scale", choices=("small", "full"), default="small", help="the synthetic scan's size")
    parser.add_argument("--dtypes", default="float32,float16,tf32",
                        help="comma-separated: float32, float16, tf32, bfloat16, float64")
    parser.add_argument("--json", metavar="PATH", help="write every estimate as JSON")
    parser.add_argument("--no-forward-splits", action="store_true",
                        help="the new forward and input gradient with one block per output tile (no offset splits)")
    args = parser.parse_args(argv)
    dtypes = tuple(name for name in args.dtypes.split(",") if name)
    unknown = [name for name in dtypes if name not in ("float32", "float16", "tf32", "bfloat16", "float64")]
    if unknown or not dtypes:
        parser.error(f"--dtypes takes float32, float16, tf32, bfloat16, float64; got {args.dtypes!r}")
    from sparsecore.benchmark.network import network_scene

    started = time.perf_counter()
    try:
        scene = network_scene(args.scene, args.scale)
    except FileNotFoundError as error:
        print(f"gpu_layer_estimate: {error}", file=sys.stderr)
        return 2
    maps = network_maps(np.asarray(scene.indices), tuple(scene.spatial_shape))
    estimates = estimate_network(maps, dtypes, forward_splits=not args.no_forward_splits)
    print(f"scene {args.scene}: {len(scene.indices)} sites ({scene.source}); maps and estimate in "
          f"{time.perf_counter() - started:.1f} s")
    print(format_estimates(estimates))
    if args.json:
        document = {"scene": args.scene, "sites": int(len(scene.indices)), "model": asdict(H100_MODEL),
                    "estimates": [asdict(item) for item in estimates]}
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
