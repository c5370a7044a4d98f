"""Tile shapes of the fused convolution kernels, and what a layer costs in them (pure functions, no GPU).

`kernels_cu/implicit_gemm.cu` computes every feature pass of a convolution in
blocks that each own a tile: ``rows`` rows of the map (in its mask order) by
``columns`` output channels of one group for the forward and input gradient,
``rows`` input channels by ``columns`` output channels of one offset for the
weight gradient. This module holds the table of those shapes (`choose_tile`),
how the weight gradient splits its rows (`weight_gradient_splits`), and, for
a layer described by its neighbour map's statistics (`MapStats`), the blocks
a pass launches and its useful and issued floating-point operations
(`forward_cost`, `weight_gradient_cost`): the per-layer estimate a device
run is compared with. A forward or input gradient with fewer output tiles
than the GPU has block slots splits each tile's offsets over several blocks
(`forward_splits`). Nothing here imports CuPy; `map_stats` takes NumPy arrays.

Counting rules (2 FLOP per multiply-add):

- useful: ``pairs * a * b`` per group (``a`` input, ``b`` output channels per group);
- issued, forward and input gradient: a block stages every offset present in
  the OR of its rows' masks; each warp multiplies its slice of rows
  (`TileShape.slice_rows`) only where one of them holds the offset, the
  reduction padded to `TileShape.reduce_unit` and the columns to
  `TileShape.column_unit`; so per offset, the slices holding it times
  ``slice_rows`` times the padded channels;
- issued, weight gradient: per offset, the rounds of ``step`` rows (within
  the row tiles holding it) where a row holds it, times the ``a x b``
  channels padded to the warps' units.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["TileShape", "MapStats", "SLICE_ROWS", "PassCost", "WeightGradientCost", "DEFAULT_SM_COUNT",
           "SCRATCH_FLOOR_BYTES", "TILE_ROWS", "NARROW_REDUCTION", "FORWARD_WAVES", "OFFSETS_PER_SPLIT", "engine_of",
           "choose_tile",
           "weight_gradient_tile", "map_stats", "forward_splits", "forward_cost", "weight_gradient_splits",
           "weight_gradient_cost", "scratch_cap"]

# Multiprocessors assumed where no device says (the emulation, the CPU estimate): an H100 SXM.
DEFAULT_SM_COUNT = 132
# Rows of every tile (the map's mask order is cut into tiles of this many rows).
TILE_ROWS = 64
# The weight gradient's split partials may take max(SCRATCH_FLOOR_BYTES, the output gradient's bytes).
SCRATCH_FLOOR_BYTES = 64 * 1024 * 1024
# A forward or input gradient reducing over at most this many channels (a first layer's 3 inputs) runs
# on SIMT in every dtype instead of padding them to the tensor cores' k (16, or 8 for TF32).
NARROW_REDUCTION = 8
# Resident blocks wanted per multiprocessor slot: the weight gradient launches at least this many waves.
WEIGHT_GRADIENT_WAVES = 2
# A SIMT forward or input gradient with fewer output tiles than block slots splits their offsets for about
# this many waves; a tensor-core one only up to one block per multiprocessor (`forward_splits`).
FORWARD_WAVES = 2
# A split takes at least about this many of the kernel's offsets (more splits would be mostly empty blocks:
# a deep layer's tile holds a third to four fifths of its 27 offsets on the real scan).
OFFSETS_PER_SPLIT = 3


@dataclass(frozen=True)
class TileShape:
    """One block's tile and engine.

    Attributes:
        rows: rows of the tile (map rows; input channels for the weight gradient).
        columns: output channels of the tile.
        step: reduction elements staged per round (the reduction is padded to it).
        threads: threads per block.
        engine: ``"simt"`` (CUDA cores) or ``"tensor"`` (tensor cores: mma.sync, wmma for float16 on sm_75).
        blocks_per_sm: resident blocks per multiprocessor at the kernel's registers and shared memory
            (ptxas on sm_90; H100: 65,536 registers, 228 KiB shared memory per multiprocessor).
        slice_rows: rows a warp skips together where none holds the round's offset (a warp's rows in
            SIMT, an 8-row slice of mma.sync fragments on sm_80+, a 16-row wmma fragment on sm_75).
        reduce_unit: the reduction is padded to a multiple of this (1 SIMT, the mma's k on tensor cores).
        column_unit: the columns are padded to a multiple of this (a warp's or fragment's 16 columns).
    """

    rows: int
    columns: int
    step: int
    threads: int
    engine: str
    blocks_per_sm: int
    slice_rows: int = 16
    reduce_unit: int = 1
    column_unit: int = 16


# The table (docs/gpu.md, "Tile shapes"): one 64 x 64 tile per engine; per dtype the reduction step (16 for
# TF32, 32 for 16-bit types) and the residency ptxas' registers and shared memory allow on sm_90.
_FORWARD = {  # (dtype, engine) -> sc_implicit_gemm's TileShape (sm_90 registers; residency: sc::ForwardBlocks)
    ("float32", "simt"): TileShape(TILE_ROWS, 64, 16, 256, "simt", 4, 8, 1),  # 56 registers
    ("float64", "simt"): TileShape(TILE_ROWS, 64, 16, 256, "simt", 2, 8, 1),  # 102
    ("float16", "tensor"): TileShape(TILE_ROWS, 64, 32, 128, "tensor", 6, 8, 16, 16),  # mma.sync m16n8k16: 77
    ("bfloat16", "tensor"): TileShape(TILE_ROWS, 64, 32, 128, "tensor", 6, 8, 16, 16),  # mma.sync m16n8k16: 77
    ("float16", "wmma"): TileShape(TILE_ROWS, 64, 32, 128, "tensor", 4, 8, 16, 32),  # sm_75: wmma 8 x 32 fragments
    ("float32", "tensor"): TileShape(TILE_ROWS, 64, 16, 128, "tensor", 5, 8, 8),  # TF32, mma.sync m16n8k8: 92
    ("float16", "simt"): TileShape(TILE_ROWS, 64, 16, 256, "simt", 4, 8, 1),  # a narrow reduction: 63
    ("bfloat16", "simt"): TileShape(TILE_ROWS, 64, 16, 256, "simt", 4, 8, 1),  # a narrow reduction: 63
    ("bfloat16", "fallback"): TileShape(TILE_ROWS, 64, 16, 128, "simt", 4, 16, 1),  # sm_75: 128-thread SIMT, 100
    ("tf32", "fallback"): TileShape(TILE_ROWS, 64, 16, 128, "simt", 4, 16, 1),  # sm_75: 96
}
_WEIGHT_GRADIENT = {  # sc_weight_gradient, its residency pinned by __launch_bounds__ (sc::WeightGradientBlocks)
    ("float32", "simt"): TileShape(TILE_ROWS, 64, 16, 256, "simt", 3, 8, 1),  # 78 registers
    ("float64", "simt"): TileShape(TILE_ROWS, 64, 16, 256, "simt", 2, 8, 1),  # 115
    ("float16", "tensor"): TileShape(TILE_ROWS, 64, 32, 128, "tensor", 5, 8, 16),  # mma.sync m16n8k16: 94
    ("bfloat16", "tensor"): TileShape(TILE_ROWS, 64, 32, 128, "tensor", 4, 8, 16),  # mma.sync m16n8k16: 120
    ("float16", "wmma"): TileShape(TILE_ROWS, 64, 32, 128, "tensor", 4, 16, 16),  # sm_75: wmma 16 x 16 fragments
    ("float32", "tensor"): TileShape(TILE_ROWS, 64, 16, 128, "tensor", 4, 8, 8),  # TF32, mma.sync m16n8k8: 120
    ("bfloat16", "fallback"): TileShape(TILE_ROWS, 64, 16, 128, "simt", 4, 16, 1),  # sm_75
    ("tf32", "fallback"): TileShape(TILE_ROWS, 64, 16, 128, "simt", 4, 16, 1),  # sm_75
}


def _shape(table: dict, dtype_name: str, tf32: bool, arch: int, narrow: bool = False) -> TileShape:
    engine = engine_of(dtype_name, tf32, arch)
    tensor_type = dtype_name in ("float16", "bfloat16") or (dtype_name == "float32" and tf32)
    if tensor_type and narrow:  # the 256-thread SIMT instantiation of the dtype
        key = (dtype_name, "simt")
    elif tensor_type and engine == "simt":  # below sm_80: the Wmma instantiation's 128-thread SIMT engine
        key = ("tf32" if dtype_name == "float32" else dtype_name, "fallback")
    elif dtype_name == "float16" and arch < 80:  # sm_75 has no m16n8k16: wmma
        key = ("float16", "wmma")
    else:
        key = (dtype_name, engine)
    if key not in table:
        raise ValueError(f"no fused conv kernel for dtype {dtype_name!r}; expected float32, float64, float16 or "
                         "bfloat16")
    return table[key]


def engine_of(dtype_name: str, tf32: bool = False, arch: int = 90) -> str:
    """``"tensor"`` or ``"simt"``: the engine a dtype runs on for a compute capability ``arch`` (75, 80, 86, 89, 90).

    float16 runs on tensor cores from sm_75 on; bfloat16 and TF32 (float32 with ``tf32``) from sm_80 on
    (on sm_75 they run on SIMT); float64, and float32 without ``tf32``, on SIMT.
    """
    if dtype_name == "float16":
        return "tensor"
    if dtype_name == "bfloat16" or (dtype_name == "float32" and tf32):
        return "tensor" if arch >= 80 else "simt"
    return "simt"


def choose_tile(in_channels: int, out_channels: int, dtype_name: str, tf32: bool = False, arch: int = 90) -> TileShape:
    """The tile of the forward (``in_channels -> out_channels`` per group) or, swapped, the input gradient.

    Args:
        in_channels: reduction channels per group (``a`` forward, ``b`` input gradient).
        out_channels: written channels per group.
        dtype_name: storage dtype name (``"float32"``, ``"float64"``, ``"float16"``, ``"bfloat16"``).
        tf32: float32 on TF32 tensor cores.
        arch: compute capability as an integer (75 for sm_75).

    Returns:
        The `TileShape` the kernel uses: the dtype's engine, except that a reduction over at most
        `NARROW_REDUCTION` channels runs on the 256-thread SIMT engine in every dtype.
    """
    del out_channels
    return _shape(_FORWARD, dtype_name, tf32, arch, narrow=in_channels <= NARROW_REDUCTION)


def weight_gradient_tile(in_channels: int, out_channels: int, dtype_name: str, tf32: bool = False,
                         arch: int = 90) -> TileShape:
    """The weight gradient's tile: ``rows`` input by ``columns`` output channels of one offset (see `choose_tile`)."""
    del in_channels, out_channels
    return _shape(_WEIGHT_GRADIENT, dtype_name, tf32, arch)


SLICE_ROWS = (8, 16, 32, TILE_ROWS)  # the granularities `MapStats` counts


@dataclass(frozen=True)
class MapStats:
    """What the cost of a pass needs of a neighbour map's side (host numbers).

    Attributes:
        num_rows: rows of the side (outputs for the forward).
        pairs_per_offset: non-negative entries of each offset's column.
        tiles_per_offset: row tiles (``TILE_ROWS`` consecutive rows of the mask order) whose OR mask holds
            each offset.
        slices_per_offset: ``(rows, counts)`` for each granularity of `SLICE_ROWS`: per offset, the slices of
            ``rows`` consecutive rows of the mask order (within a row tile) that hold it.
    """

    num_rows: int
    pairs_per_offset: tuple[int, ...]
    tiles_per_offset: tuple[int, ...]
    slices_per_offset: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @property
    def row_tiles(self) -> int:
        """Tiles of ``TILE_ROWS`` rows: ``ceil(num_rows / TILE_ROWS)``."""
        return -(-self.num_rows // TILE_ROWS)

    @property
    def pairs(self) -> int:
        return int(sum(self.pairs_per_offset))

    def slices(self, rows: int) -> tuple[int, ...]:
        """Per offset, the slices of ``rows`` rows holding it (``rows`` one of `SLICE_ROWS`)."""
        if rows == TILE_ROWS:
            return self.tiles_per_offset
        for slice_rows, counts in self.slices_per_offset:
            if slice_rows == rows:
                return counts
        raise ValueError(f"MapStats counts slices of {SLICE_ROWS} rows, not {rows}")


def map_stats(neighbours: Any, order: Any) -> MapStats:
    """`MapStats` of one side of a map (NumPy arrays; pass ``cupy.asnumpy`` of device ones).

    Args:
        neighbours: int32 ``[N, K]``, -1 for none.
        order: int32 ``[N]``, the side's mask order.
    """
    table = np.asarray(neighbours)
    rows, volume = int(table.shape[0]), int(table.shape[1])
    present = table[np.asarray(order, dtype=np.int64)] >= 0  # [N, K] in mask order
    row_tiles = -(-rows // TILE_ROWS)
    padded = np.zeros((row_tiles * TILE_ROWS, volume), dtype=bool)
    padded[:rows] = present
    counts = {}
    for slice_rows in SLICE_ROWS:
        held = padded.reshape(-1, slice_rows, volume).any(axis=1)
        counts[slice_rows] = tuple(int(count) for count in held.sum(axis=0))
    return MapStats(rows, tuple(int(count) for count in present.sum(axis=0)), counts[TILE_ROWS],
                    tuple((slice_rows, counts[slice_rows]) for slice_rows in SLICE_ROWS[:-1]))


@dataclass(frozen=True)
class PassCost:
    """A feature pass of one layer in the kernels.

    Attributes:
        tile: the tile shape.
        blocks: blocks launched (work items; the grid covers them in waves).
        waves: ``blocks / (sm_count * tile.blocks_per_sm)``.
        useful_flops: 2 * multiply-adds of the convolution itself.
        issued_flops: 2 * multiply-adds the tensor or CUDA cores execute, padding included.
        splits: blocks per output tile (the forward's offset splits, the weight gradient's row splits).
        scratch_bytes: the split partials and counters.
    """

    tile: TileShape
    blocks: int
    waves: float
    useful_flops: int
    issued_flops: int
    splits: int = 1
    scratch_bytes: int = 0


def _padded(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def forward_splits(tiles: int, volume: int, blocks_per_sm: int, partial_itemsize: int = 4,
                   sm_count: int = DEFAULT_SM_COUNT, engine: str = "simt") -> int:
    """Offset splits per output tile of a forward or input gradient, from host-known sizes only.

    A pass with few output tiles (row tiles x column tiles x groups) leaves most of the GPU idle; its
    tiles' offsets are then split over several blocks, each writing a partial tile that the tile's last
    block adds (a float32 or float64 tile per split, written and read once more through L2):

    - SIMT (``engine="simt"``; latency- and issue-bound per block): with fewer tiles than block slots
      (``sm_count * blocks_per_sm``), ``floor(FORWARD_WAVES * slots / tiles)`` splits, about
      `FORWARD_WAVES` waves;
    - tensor cores (``"tensor"``): a tile's arithmetic is fast and its time is its L2 traffic, which the
      partials only add to, so they split only a pass of fewer tiles than multiprocessors, up to one block
      per multiprocessor: ``ceil(sm_count / tiles)`` splits.

    Either way at most ``ceil(volume / OFFSETS_PER_SPLIT)`` splits, and the partials (``tiles * splits``
    tiles of ``TILE_ROWS x 64`` sums of ``partial_itemsize`` bytes) within `SCRATCH_FLOOR_BYTES`.
    (`tools/gpu_layer_estimate.py`'s model on the real scan: these choices are within a few percent of
    the best split count of every layer of the basic network, and never slower than no split.)

    Args:
        tiles: output tiles of the pass.
        volume: kernel offsets ``K``.
        blocks_per_sm: resident blocks per multiprocessor of the pass's tile (`choose_tile`).
        partial_itemsize: bytes of one partial sum (4, or 8 for float64).
        sm_count: multiprocessors of the GPU.
        engine: the tile's engine (`TileShape.engine`).
    """
    slots = sm_count * blocks_per_sm
    if tiles <= 0 or volume <= 1:
        return 1
    if engine == "simt":
        if tiles >= slots:
            return 1
        wanted = FORWARD_WAVES * slots // tiles
    else:
        if tiles >= sm_count:
            return 1
        wanted = -(-sm_count // tiles)
    by_memory = SCRATCH_FLOOR_BYTES // (tiles * TILE_ROWS * 64 * partial_itemsize)
    return int(max(1, min(wanted, -(-volume // OFFSETS_PER_SPLIT), by_memory)))


def forward_cost(stats: MapStats, in_channels: int, out_channels: int, dtype_name: str, tf32: bool = False,
                 arch: int = 90, groups: int = 1, sm_count: int = DEFAULT_SM_COUNT,
                 split: bool = True) -> PassCost:
    """The forward (or, with the channels swapped and the input side's stats, the input gradient) of a layer.

    Args:
        stats: the written side's `MapStats` (the output side for the forward).
        in_channels: total input channels (``groups * a``).
        out_channels: total output channels (``groups * b``).
        dtype_name, tf32, arch: as for `choose_tile`.
        groups: channel groups.
        sm_count: multiprocessors of the GPU.
        split: split offsets as the kernels do (`forward_splits`); False: one block per tile.
    """
    a, b = in_channels // groups, out_channels // groups
    tile = choose_tile(a, b, dtype_name, tf32, arch)
    column_tiles = -(-b // tile.columns)
    tiles = stats.row_tiles * groups * column_tiles
    itemsize = 8 if dtype_name == "float64" else 4
    splits = (forward_splits(tiles, len(stats.tiles_per_offset), tile.blocks_per_sm, itemsize, sm_count, tile.engine)
              if split else 1)
    blocks = tiles * splits
    slices = sum(stats.slices(tile.slice_rows))
    issued = 2 * groups * slices * tile.slice_rows * _padded(a, tile.reduce_unit) * _padded(b, tile.column_unit)
    useful = 2 * groups * stats.pairs * a * b
    scratch = (tiles * splits * TILE_ROWS * 64 * itemsize + tiles * 4) if splits > 1 else 0
    return PassCost(tile, blocks, blocks / (sm_count * tile.blocks_per_sm), useful, issued, splits, scratch)


def scratch_cap(grad_output_bytes: int) -> int:
    """Bytes the weight gradient's split partials may take: ``max(SCRATCH_FLOOR_BYTES, grad_output_bytes)``."""
    return max(SCRATCH_FLOOR_BYTES, int(grad_output_bytes))


def weight_gradient_splits(row_tiles: int, tiles: int, partial_itemsize: int, grad_output_bytes: int,
                           blocks_per_sm: int, sm_count: int = DEFAULT_SM_COUNT) -> int:
    """Splits of each weight-gradient tile's rows, from host-known sizes only (so fixed for a layer).

    Enough blocks (``tiles * splits``) for `WEIGHT_GRADIENT_WAVES` waves of ``sm_count * blocks_per_sm``
    resident blocks, but no more splits than row tiles (then every row tile of an offset has its own
    block) and the partials (``tiles * splits`` tiles of ``TILE_ROWS x 64`` sums of ``partial_itemsize``
    bytes) within `scratch_cap`. Split ``s`` of offset ``k`` walks the ``s``-th of ``splits`` equal
    chunks of the row tiles holding ``k`` (a list on the device; its length, unknown to the host, is at
    most ``row_tiles``).

    Args:
        row_tiles: ``ceil(rows / TILE_ROWS)`` of the output side.
        tiles: channel tiles of the weight gradient (`weight_gradient_tiles` in `_kernel_fused`).
        partial_itemsize: bytes of one partial sum (4, or 8 for float64).
        grad_output_bytes: bytes of the output gradient.
        blocks_per_sm: resident blocks per multiprocessor of the kernel.
        sm_count: multiprocessors of the GPU.
    """
    if row_tiles <= 1 or tiles <= 0:
        return 1
    wanted = -(-WEIGHT_GRADIENT_WAVES * sm_count * blocks_per_sm // tiles)
    partial_bytes = tiles * TILE_ROWS * 64 * partial_itemsize
    by_memory = scratch_cap(grad_output_bytes) // partial_bytes
    return int(max(1, min(wanted, row_tiles, by_memory)))


@dataclass(frozen=True)
class WeightGradientCost(PassCost):
    """`PassCost` of a weight gradient, plus its splits and scratch.

    Attributes:
        splits: row splits per tile.
        scratch_bytes: the split partials and counters.
        fills_gpu: at least `WEIGHT_GRADIENT_WAVES` waves, or every row tile in its own block.
    """

    splits: int = 1
    scratch_bytes: int = 0
    fills_gpu: bool = False


def weight_gradient_cost(stats: MapStats, in_channels: int, out_channels: int, dtype_name: str,
                         tf32: bool = False, arch: int = 90, groups: int = 1,
                         sm_count: int = DEFAULT_SM_COUNT) -> WeightGradientCost:
    """The weight gradient of a layer (``stats`` of the output side; arguments as for `forward_cost`)."""
    a, b = in_channels // groups, out_channels // groups
    tile = weight_gradient_tile(a, b, dtype_name, tf32, arch)
    volume = len(stats.tiles_per_offset)
    channel_tiles = -(-a // tile.rows) * -(-b // tile.columns)
    tiles = volume * groups * channel_tiles
    itemsize = 8 if dtype_name == "float64" else 4
    grad_output_bytes = stats.num_rows * out_channels * (2 if dtype_name in ("float16", "bfloat16") else itemsize)
    splits = weight_gradient_splits(stats.row_tiles, tiles, itemsize, grad_output_bytes, tile.blocks_per_sm,
                                    sm_count)
    blocks = tiles * splits
    waves = blocks / (sm_count * tile.blocks_per_sm)
    # a round of `step` rows without the offset is skipped; the channel tile is padded to the warps' units
    issued = (2 * groups * sum(stats.slices(tile.step)) * tile.step * _padded(a, tile.slice_rows)
              * _padded(b, tile.column_unit))
    useful = 2 * groups * stats.pairs * a * b
    scratch = (tiles * splits * tile.rows * tile.columns * itemsize + tiles * 4) if splits > 1 else 0
    fills = waves >= WEIGHT_GRADIENT_WAVES or splits >= stats.row_tiles
    return WeightGradientCost(tile, blocks, waves, useful, issued, splits, scratch, fills)
