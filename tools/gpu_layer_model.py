"""The cost model behind `gpu_layer_estimate.py`: one convolution pass in the fused kernels, old and new shapes.

A pass (forward, input gradient, weight gradient) of one layer is described by
its tile shape (`sparsecore.backends.tile_shapes.TileShape`: rows, columns,
reduction step, threads, engine, resident blocks per SM), how it loads
(`LoadScheme`), and the statistics of the neighbour-map side it walks (rows,
pairs per offset, row tiles holding each offset). From them, `pass_estimate`
gives:

- **useful FLOPs**: ``2 * pairs * a * b``;
- **issued FLOPs**: what the MMA or FMA units execute: per offset, the row tiles
  holding it times the tile's rows, the reduction padded to the step, the
  columns padded to the tile (the same rules as `tile_shapes`);
- **blocks** and **waves**: ``blocks / (SMs * blocks per SM)``;
- **bytes from L2**: gathered rows (each column tile gathers them again),
  weight blocks per visited offset, neighbour indices per visited offset
  (per walked row tile for the weight gradient), the outputs, the weight
  gradient's partials;
- **modelled time**: a wave model. A block runs ``rounds`` (one visited offset
  times one reduction step), each costing the larger of its loads' latency
  and its share of the SM's arithmetic; a visit costs one more round trip
  (indices before the gather), and a forward block two at its start (its
  rows, then their masks). The old kernels issue scalar loads one at a
  time (`OLD_LOADS`: each thread's loads of a round are a serial chain of
  L2 round trips); the new ones put a round's 16-byte copies in flight
  together in a pipeline of ``stages`` rounds (`NEW_LOADS`). The blocks
  resident on an SM share its arithmetic and its instruction issue (each load
  costs ``instructions_per_load`` issue slots of each thread, a round
  ``round_instructions`` more; four schedulers). A pass with fewer blocks
  than slots runs one partial wave. A forward split over ``splits`` blocks
  per tile (`tile_shapes.forward_splits`) spreads a tile's offsets over
  ``min(splits, offsets per tile)`` working blocks, each paying the block
  start, the partial tile's store and its counter (two round trips), and per
  tile the last block's sum (a round trip per 4 splits per 4-element chunk
  of its share), with the partials written and read once through L2. The time is the larger of that and the
  L2 traffic over its bandwidth, plus a launch.

`GpuModel` holds the H100 SXM's numbers; the time is an estimate to be
calibrated by the first device run (`tools/gpu_check.sh` prints both).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["GpuModel", "H100_MODEL", "LoadScheme", "OLD_LOADS", "NEW_LOADS", "SideStats", "PassEstimate",
           "pass_estimate", "storage_bytes"]


@dataclass(frozen=True)
class GpuModel:
    """The GPU the time is modelled for.

    Attributes:
        name: in words.
        multiprocessors: SMs.
        clock_ghz: SM clock.
        l2_latency_cycles: one dependent L2 round trip under load.
        l2_bytes_per_second: L2 bandwidth of the whole GPU.
        launch_seconds: a kernel launch's fixed cost on the device.
        schedulers: warp schedulers per SM (one instruction per cycle each).
        round_instructions: instructions per thread of a round besides its loads (barriers, fragment
            loads, MMAs, the loop).
        flops_per_cycle: per SM per cycle, by engine and dtype: ``(engine, dtype) -> rate`` pairs
            (2 FLOP per multiply-add), each at the fraction the kernels can reach.
    """

    name: str = "H100 SXM"
    multiprocessors: int = 132
    clock_ghz: float = 1.755
    l2_latency_cycles: int = 400
    l2_bytes_per_second: float = 5.5e12
    launch_seconds: float = 4e-6
    schedulers: int = 4
    round_instructions: int = 64
    flops_per_cycle: tuple[tuple[str, str, float], ...] = (
        ("simt", "float32", 256 * 0.5),  # 128 FFMA lanes; 8 LDS per 16 FFMA in the micro-tile: ~50%
        ("simt", "float64", 128 * 0.5),
        ("simt", "bfloat16", 256 * 0.5),
        ("simt", "float16", 256 * 0.5),
        ("simt", "tf32", 256 * 0.5),  # float32 on SIMT where the table keeps a narrow reduction off tensor cores
        ("tensor", "float16", 4096 * 0.6),  # mma.sync (wmma on Hopper): ~60% of the dense peak
        ("tensor", "bfloat16", 4096 * 0.6),
        ("tensor", "tf32", 2048 * 0.6),
        ("tensor", "float32", 2048 * 0.6),
    )

    def rate(self, engine: str, dtype_name: str) -> float:
        """FLOP per cycle per SM of an engine on a dtype (``"tf32"`` for float32 on tensor cores)."""
        for candidate_engine, candidate_dtype, value in self.flops_per_cycle:
            if candidate_engine == engine and candidate_dtype == dtype_name:
                return value
        raise ValueError(f"no rate for engine {engine!r} and dtype {dtype_name!r} in {self.name}'s model")


H100_MODEL = GpuModel()


@dataclass(frozen=True)
class LoadScheme:
    """How a kernel brings a round's operands into shared memory.

    Attributes:
        name: in words.
        vector_bytes: bytes per load instruction (at most; the element size when smaller).
        in_flight: loads a thread keeps in flight (0: all of a round's).
        stages: rounds in flight at once (a cp.async pipeline's depth; 1: none).
        walks_all_row_tiles: the weight gradient visits every row tile of its split (the old kernel),
            not only those holding its offset.
        instructions_per_load: instructions a thread issues per load (address, index from shared
            memory, the load, the store to shared memory).
    """

    name: str
    vector_bytes: int
    in_flight: int
    stages: int
    walks_all_row_tiles: bool
    instructions_per_load: int


OLD_LOADS = LoadScheme("scalar loads, one in flight", 0, 1, 1, True, 8)
NEW_LOADS = LoadScheme("cp.async 16-byte chunks, a round in flight, 2 stages", 16, 0, 2, False, 6)


@dataclass(frozen=True)
class SideStats:
    """A neighbour-map side as a pass walks it.

    Attributes:
        num_rows: rows written (outputs for the forward).
        pairs_per_offset: pairs of each offset.
        tiles_per_offset: row tiles (of ``tile_rows`` rows in mask order) whose OR mask holds each offset.
        tile_rows: rows per tile of ``tiles_per_offset``.
    """

    num_rows: int
    pairs_per_offset: tuple[int, ...]
    tiles_per_offset: tuple[int, ...]
    tile_rows: int

    @property
    def row_tiles(self) -> int:
        return -(-self.num_rows // self.tile_rows)

    @property
    def pairs(self) -> int:
        return int(sum(self.pairs_per_offset))

    @property
    def visits(self) -> int:
        """(row tile, offset) pairs a tile visits: ``sum(tiles_per_offset)``."""
        return int(sum(self.tiles_per_offset))


@dataclass(frozen=True)
class PassEstimate:
    """One pass of one layer.

    Attributes:
        pass_name: ``"forward"``, ``"input gradient"`` or ``"weight gradient"``.
        tile: ``"RxC/step"`` of the tile, its engine and threads.
        blocks: blocks (work items).
        blocks_per_sm: resident blocks per SM.
        waves: ``blocks / (SMs * blocks_per_sm)``.
        splits: row splits (weight gradient; 1 otherwise).
        every_row_tile_own_block: the weight gradient gives every row tile of an offset its own block.
        useful_flops: of the convolution.
        issued_flops: executed, padding included.
        l2_bytes: modelled traffic from L2.
        seconds: modelled time.
        bound: what bounds the modelled time (``"latency"``, ``"compute"``, ``"issue"``, ``"L2"``).
    """

    pass_name: str
    tile: str
    blocks: int
    blocks_per_sm: int
    waves: float
    splits: int
    every_row_tile_own_block: bool
    useful_flops: int
    issued_flops: int
    l2_bytes: int
    seconds: float
    bound: str


def storage_bytes(dtype_name: str) -> int:
    """Bytes of one stored element of a benchmark dtype (``"tf32"`` stores float32)."""
    return {"float16": 2, "bfloat16": 2, "float32": 4, "tf32": 4, "float64": 8}[dtype_name]


def _padded(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def _round_cost(elements: int, threads: int, itemsize: int, loads: LoadScheme,
                model: GpuModel) -> tuple[float, float]:
    """``(latency cycles, issue cycles)`` of one round bringing ``elements`` into shared memory
    (``threads`` share them); the issue cycles are the block's on its SM's schedulers."""
    width = max(itemsize, min(loads.vector_bytes, 16)) if loads.vector_bytes else itemsize
    per_thread = -(-elements * itemsize // (width * threads))
    chains = per_thread if loads.in_flight == 1 else (1 if loads.in_flight == 0 else -(-per_thread // loads.in_flight))
    warps = -(-threads // 32)
    issue = warps * (per_thread * loads.instructions_per_load + model.round_instructions) / model.schedulers
    return chains * model.l2_latency_cycles / loads.stages, issue


def _wave_seconds(blocks: int, per_block_latency: float, per_block_flops: float, per_block_issue: float,
                  blocks_per_sm: int, rate: float, model: GpuModel) -> tuple[float, str]:
    """Seconds of ``blocks`` equal blocks and whether latency, compute or instruction issue bounds them."""
    if blocks <= 0:
        return 0.0, "latency"
    slots = model.multiprocessors * blocks_per_sm
    resident = min(blocks_per_sm, -(-blocks // model.multiprocessors))  # blocks sharing one SM
    compute = resident * per_block_flops / rate
    issue = resident * per_block_issue
    waves = max(1.0, blocks / (model.multiprocessors * resident)) if blocks > slots else 1.0
    cycles = waves * max(per_block_latency, compute, issue)
    bound = "latency" if per_block_latency >= max(compute, issue) else "compute" if compute >= issue else "issue"
    return cycles / (model.clock_ghz * 1e9), bound


def pass_estimate(pass_name: str, side: SideStats, reduce: int, width: int, dtype_name: str, tile: Any,
                  loads: LoadScheme, model: GpuModel = H100_MODEL, splits: int = 1,
                  blocks: int | None = None, issued: int | None = None) -> PassEstimate:
    """The estimate of one pass.

    Args:
        pass_name: ``"forward"``, ``"input gradient"`` (``side`` the input side, ``reduce`` = output
            channels, ``width`` = input channels) or ``"weight gradient"`` (``side`` the output side,
            ``reduce`` = input, ``width`` = output channels; ``tile.rows`` input channels).
        side: the map side's statistics (its ``tile_rows`` equal to the map-row tile of the pass).
        reduce: channels summed over (forward: input channels per group).
        width: channels written (forward: output channels per group).
        dtype_name: ``"float32"``, ``"float16"``, ``"bfloat16"``, ``"float64"`` or ``"tf32"``.
        tile: a `tile_shapes.TileShape` (rows, columns, step, threads, engine, blocks_per_sm).
        loads: the loading scheme (its ``stages`` replaced by the tile's ``stages`` where the tile has one).
        model: the GPU.
        splits: the weight gradient's row splits, the forward's (and input gradient's) offset splits.
        blocks: the blocks the kernel launches when its tile table counts them otherwise (offsets split
            across blocks, say): the same work spread over them.
        issued: the issued FLOPs when the tile table counts them otherwise (warps skipping row slices
            without the offset, say): the arithmetic the time model charges.
    """
    itemsize = storage_bytes(dtype_name)
    if loads.vector_bytes and getattr(tile, "stages", None):  # a tile table that states its pipeline's depth
        loads = dataclasses.replace(loads, stages=int(tile.stages))
    rate = model.rate(tile.engine, dtype_name) * 1.0
    latency = model.l2_latency_cycles
    tile_text = f"{tile.rows}x{tile.columns}/{tile.step} {tile.engine} {tile.threads}t"
    useful = 2 * side.pairs * reduce * width
    if pass_name == "weight gradient":
        channel_tiles = -(-reduce // tile.rows) * -(-width // tile.columns)
        tiles = len(side.pairs_per_offset) * channel_tiles
        natural_blocks = tiles * splits
        issued_here = 2 * side.visits * side.tile_rows * channel_tiles * tile.rows * tile.columns
        walked = tiles * side.row_tiles if loads.walks_all_row_tiles else side.visits * channel_tiles
        present = side.visits * channel_tiles  # (block's tile, row tile holding its offset) visits
        rounds = present * -(-side.tile_rows // tile.step)
        round_cycles, round_issue = _round_cost(tile.step * (tile.rows + tile.columns), tile.threads, itemsize,
                                                loads, model)
        total_latency = walked * 2 * latency + rounds * round_cycles  # order, then neighbours, per row tile
        warps = -(-tile.threads // 32)
        total_issue = rounds * round_issue + walked * model.round_instructions * warps / model.schedulers
        partial_bytes = 8 if dtype_name == "float64" else 4
        scratch = 2 * tiles * splits * tile.rows * tile.columns * partial_bytes if splits > 1 else 0
        l2 = (walked * side.tile_rows * 8 + side.pairs * itemsize * (reduce * -(-width // tile.columns)
              + width * -(-reduce // tile.rows)) + scratch + len(side.pairs_per_offset) * reduce * width * itemsize)
        own_block = splits >= side.row_tiles
        working = natural_blocks if blocks is None else int(blocks)
    else:
        column_tiles = -(-width // tile.columns)
        tiles = side.row_tiles * column_tiles
        natural_blocks = tiles * splits
        issued_here = 2 * side.visits * side.tile_rows * _padded(reduce, tile.step) * column_tiles * tile.columns
        visits = side.visits * column_tiles
        rounds = visits * -(-reduce // tile.step)
        round_cycles, round_issue = _round_cost(tile.step * (side.tile_rows + tile.columns), tile.threads,
                                                itemsize, loads, model)
        launched = natural_blocks if blocks is None else int(blocks)
        total_latency = visits * latency + rounds * round_cycles + launched * 2 * latency  # + each block's start
        total_issue = rounds * round_issue
        l2 = (side.pairs * reduce * itemsize * column_tiles + side.visits * reduce * width * itemsize
              + visits * side.tile_rows * 4 + launched * side.tile_rows * 8 + side.num_rows * width * itemsize)
        working = launched
        if splits > 1:  # offsets split over blocks: only min(splits, offsets per tile) of a tile's blocks work
            per_tile = side.visits / max(side.row_tiles, 1)
            working = max(1, round(tiles * min(splits, max(per_tile, 1.0))))
            partial_bytes = 8 if dtype_name == "float64" else 4
            chunks = -(-side.tile_rows * tile.columns // (tile.threads * 16 // partial_bytes))  # per thread
            total_latency += working * 2 * latency + tiles * chunks * -(-splits // 4) * latency
            l2 += 2 * working * side.tile_rows * tile.columns * partial_bytes + tiles * 4 * 2
        own_block = False
    blocks = natural_blocks if blocks is None else int(blocks)
    issued = issued_here if issued is None else int(issued)
    seconds, bound = _wave_seconds(working, total_latency / max(working, 1), issued / max(working, 1),
                                   total_issue / max(working, 1), tile.blocks_per_sm, rate, model)
    l2_seconds = l2 / model.l2_bytes_per_second
    if l2_seconds > seconds:
        seconds, bound = l2_seconds, "L2"
    waves = blocks / (model.multiprocessors * tile.blocks_per_sm)
    return PassEstimate(pass_name, tile_text, blocks, tile.blocks_per_sm, waves, splits, own_block, useful,
                        issued, int(l2), seconds + model.launch_seconds, bound)
