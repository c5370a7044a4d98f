"""The kernel backend's fused feature passes: one launch per pass over a neighbour map.

Convolution (``kernels_cu/implicit_gemm.cu``): the forward and the input
gradient are one ``sc_implicit_gemm`` launch each (an output-stationary
implicit GEMM over the map's rows in mask order, bias in its epilogue), the
weight gradient one ``sc_weight_gradient`` launch (split partial sums added in
a fixed order by the last block of each tile, written in spconv's weight
layout). Pools (``kernels_cu/pool_maps.cu``): one launch each way. No cuBLAS
call, no gathered rows, no scatter, no atomics in any sum: results are bitwise
reproducible.

Engines per dtype: float32 and float64 on SIMT; float16 and bfloat16 on tensor
cores (wmma, float32 accumulation); float32 on TF32 tensor cores only when the
backend's TF32 switch is on (`FusedPasses.tf32`). Host work per pass: the
outputs' allocations and the launch (plus a copy only for an operand that is
not contiguous or not of the features' dtype); the launch arguments that
depend on the map alone are kept per map (`NeighbourMap.derived`).

The weight gradient's scratch (its split partials) stays under
`SCRATCH_FRACTION` of the output gradient's size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._launch import KernelDevice, check_float, check_row_count, expression_of

__all__ = ["FusedPasses", "SIMT_THREADS", "WMMA_THREADS", "TILE_ROWS", "TILE_COLUMNS", "SCRATCH_FRACTION",
           "engine_of", "weight_gradient_splits", "weight_gradient_tiles"]

SIMT_THREADS = 256  # sc::kSimtThreads
WMMA_THREADS = 128  # sc::kWmmaThreads
TILE_ROWS = 64  # sc::kTileRows: rows of a block's tile
TILE_COLUMNS = 64  # sc::kTileCols
TILE_ELEMENTS = TILE_ROWS * TILE_COLUMNS
# The weight gradient splits each tile's rows so that about this many blocks run...
SPLIT_TARGET_BLOCKS = 1024
# ...each split at least this many row tiles long...
SPLIT_MIN_ROW_TILES = 4
# ...and its partials take at most 1 / SCRATCH_FRACTION of the output gradient's bytes.
SCRATCH_FRACTION = 5

_REVERSED, _TRANSPOSED, _BIAS = 1, 2, 4  # sc_implicit_gemm's flags


def engine_of(dtype_name: str, tf32: bool) -> tuple[str, int]:
    """``(Math tag, threads per block)`` of the conv kernels for a storage dtype name."""
    if dtype_name in ("float16", "bfloat16") or (dtype_name == "float32" and tf32):
        return "sc::Wmma", WMMA_THREADS
    return "sc::Simt", SIMT_THREADS


def weight_gradient_tiles(volume: int, groups: int, in_per_group: int, out_per_group: int) -> int:
    """64 x 64 tiles of the weight gradient: ``K * groups * ceil(a / 64) * ceil(b / 64)``."""
    return volume * groups * -(-in_per_group // TILE_ROWS) * -(-out_per_group // TILE_COLUMNS)


def weight_gradient_splits(num_rows: int, tiles: int, partial_itemsize: int, budget_bytes: int) -> int:
    """How many parts the weight gradient splits the rows of each tile into (from sizes only, so fixed).

    Enough blocks to fill a GPU (`SPLIT_TARGET_BLOCKS`), each split at least
    `SPLIT_MIN_ROW_TILES` row tiles, and the partials (``tiles * splits`` tiles
    of ``partial_itemsize``-byte sums) within ``budget_bytes``.
    """
    row_tiles = -(-num_rows // TILE_ROWS)
    wanted = -(-SPLIT_TARGET_BLOCKS // max(tiles, 1))
    by_rows = row_tiles // SPLIT_MIN_ROW_TILES
    by_memory = budget_bytes // max(tiles * TILE_ELEMENTS * partial_itemsize, 1)
    return max(1, min(wanted, by_rows, by_memory))


@dataclass(frozen=True)
class _Side:
    """One side of a map as a kernel reads it: table, masks, order (None for the pools, which need
    none: reading it would sort it), reversed, and their scalars."""

    neighbours: Any
    masks: Any
    order: Any
    reversed: bool
    num_rows: np.int64
    volume: np.int32
    mask_words: np.int32


def _side(neighbour_map: Any, which: str, ordered: bool = True) -> _Side:
    """The map's ``"output"`` or ``"input"`` side, kept in ``neighbour_map.derived``."""
    key = ("fused side", which, ordered)
    side = neighbour_map.derived.get(key)
    if side is None:
        if which == "output":
            neighbours, masks, reversed_offsets = neighbour_map.output_neighbours, neighbour_map.output_masks, False
        elif neighbour_map.symmetric:
            neighbours, masks, reversed_offsets = neighbour_map.output_neighbours, neighbour_map.output_masks, True
        else:
            neighbours, masks, reversed_offsets = neighbour_map.input_neighbours, neighbour_map.input_masks, False
        order = None
        if ordered:
            order = neighbour_map.input_side()[2] if which == "input" else neighbour_map.output_order
        check_row_count(int(neighbours.shape[0]), f"the map's {which} side", "fused passes")
        side = _Side(neighbours, masks, order, reversed_offsets, np.int64(neighbours.shape[0]),
                     np.int32(neighbours.shape[1]), np.int32(masks.shape[1]))
        neighbour_map.derived[key] = side
    return side


@dataclass(frozen=True)
class FusedPasses:
    """The fused feature passes of a kernel backend (its `KernelDevice` and TF32 switch).

    Attributes:
        device: the backend's array module and launcher.
        tf32: run float32 convolutions on TF32 tensor cores.
    """

    device: KernelDevice
    tf32: bool = False

    def _ready(self, array: Any, dtype: Any) -> Any:
        """``array`` contiguous in ``dtype``: itself when it already is (an attribute test, no operation)."""
        if array.dtype == dtype and array.flags.c_contiguous:
            return array
        return self.device.xp.ascontiguousarray(array, dtype=dtype)

    def _launch(self, name: str, type_names: tuple[str, ...], items: int, threads: int, args: tuple) -> None:
        grid = max(1, min(int(items), self.device.max_blocks))
        self.device.launcher.launch(expression_of(name, *type_names), grid, threads, args)

    def conv_forward(self, features: Any, weight: Any, neighbour_map: Any, bias: Any | None, groups: int) -> Any:
        """``out [N_out, C_out]`` of a convolution over a map, in one ``sc_implicit_gemm`` launch.

        Args:
            features: ``[N_in, C_in]`` float32/float64/float16/bfloat16.
            weight: ``[C_out, *kernel_size, C_in // groups]`` (spconv's layout), any float dtype.
            neighbour_map: the layer's `NeighbourMap`.
            bias: ``[C_out]`` or None.
            groups: channel groups.

        Returns:
            ``[N_out, C_out]`` in the features' dtype; a row without neighbours holds the bias (or 0).
        """
        xp = self.device.xp
        dtype_name = check_float(features, "features", "conv_forward")
        features = self._ready(features, features.dtype)
        weight = self._ready(weight, features.dtype)
        out_channels, in_per_group = int(weight.shape[0]), int(weight.shape[-1])
        side = _side(neighbour_map, "output")
        rows = int(side.num_rows)
        if in_per_group == 0 or rows == 0 or out_channels == 0:
            out = xp.zeros((rows, out_channels), dtype=features.dtype)
            if bias is not None and rows and out_channels:
                out[...] = bias.astype(features.dtype, copy=False)
            return out
        out = xp.empty((rows, out_channels), dtype=features.dtype)
        flags = _BIAS if bias is not None else 0
        bias = self._ready(bias, features.dtype) if bias is not None else weight
        math, threads = engine_of(dtype_name, self.tf32)
        out_per_group = out_channels // groups
        items = -(-rows // TILE_ROWS) * groups * -(-out_per_group // TILE_COLUMNS)
        self._launch("sc_implicit_gemm", (dtype_name, math), items, threads,
                     (features, weight, bias, side.neighbours, side.masks, side.order, side.num_rows, side.volume,
                      side.mask_words, np.int32(groups), np.int32(in_per_group), np.int32(out_per_group),
                      np.int32(flags | (_REVERSED if side.reversed else 0)), out))
        return out

    def conv_backward(self, grad_output: Any, features: Any, weight: Any, neighbour_map: Any, groups: int,
                      splits: int | None = None) -> tuple[Any, Any]:
        """``(grad_features [N_in, C_in], grad_weight)`` in two launches (input gradient, weight gradient).

        Args:
            grad_output: ``[N_out, C_out]``.
            features: ``[N_in, C_in]``, as passed to the forward.
            weight: ``[C_out, *kernel_size, C_in // groups]``.
            neighbour_map: the layer's `NeighbourMap`.
            groups: channel groups.
            splits: row splits of the weight gradient; by default `weight_gradient_splits`
                (tests pass others: the result depends on it only through rounding).

        Returns:
            The gradients in the features' dtype (``grad_weight`` in the weight's layout; the
            caller casts it to the weight's dtype).
        """
        xp = self.device.xp
        check_float(grad_output, "grad_output", "conv_backward")
        dtype_name = check_float(features, "features", "conv_backward")
        dtype = features.dtype
        grad_output = self._ready(grad_output, dtype)
        features = self._ready(features, dtype)
        weight = self._ready(weight, dtype)
        out_channels, in_per_group = int(weight.shape[0]), int(weight.shape[-1])
        out_per_group = out_channels // groups
        volume = neighbour_map.kernel_volume
        math, threads = engine_of(dtype_name, self.tf32)
        channels_known = in_per_group > 0 and out_per_group > 0
        input_side = _side(neighbour_map, "input")
        if channels_known and int(input_side.num_rows):
            grad_features = xp.empty(features.shape, dtype=dtype)
            items = -(-int(input_side.num_rows) // TILE_ROWS) * groups * -(-in_per_group // TILE_COLUMNS)
            self._launch("sc_implicit_gemm", (dtype_name, math), items, threads,
                         (grad_output, weight, weight, input_side.neighbours, input_side.masks, input_side.order,
                          input_side.num_rows, input_side.volume, input_side.mask_words, np.int32(groups),
                          np.int32(in_per_group), np.int32(out_per_group),
                          np.int32(_TRANSPOSED | (_REVERSED if input_side.reversed else 0)), grad_features))
        else:
            grad_features = xp.zeros(features.shape, dtype=dtype)
        output_side = _side(neighbour_map, "output")
        rows = int(output_side.num_rows)
        if not channels_known or rows == 0 or neighbour_map.num_input == 0:
            return grad_features, xp.zeros(weight.shape, dtype=dtype)
        tiles = weight_gradient_tiles(volume, groups, in_per_group, out_per_group)
        partial = np.dtype(np.float64 if dtype_name == "float64" else np.float32)
        if splits is None:
            splits = weight_gradient_splits(rows, tiles, partial.itemsize, grad_output.nbytes // SCRATCH_FRACTION)
        splits = max(1, int(splits))
        # partials, then one uint32 counter per tile; zeroed (the counters must start at 0)
        scratch_size = tiles * splits * TILE_ELEMENTS + -(-tiles * 4 // partial.itemsize) if splits > 1 else 1
        scratch = xp.zeros(scratch_size, dtype=partial)
        grad_weight = xp.empty(weight.shape, dtype=dtype)
        self._launch("sc_weight_gradient", (dtype_name, math), tiles * splits, threads,
                     (features, grad_output, output_side.neighbours, output_side.order, output_side.num_rows,
                      output_side.volume, np.int32(groups), np.int32(in_per_group), np.int32(out_per_group),
                      np.int32(splits), scratch, grad_weight))
        return grad_features, grad_weight

    def _pool_launch(self, name: str, dtype_name: str, rows: int, channels: int, args: tuple) -> None:
        blocks = -(-rows * channels // self.device.block_threads)
        grid = max(1, min(blocks, self.device.max_blocks))
        self.device.launcher.launch(expression_of(name, dtype_name), grid, self.device.block_threads, args)

    def max_pool_forward(self, features: Any, neighbour_map: Any) -> tuple[Any, Any]:
        """``(out [N_out, C], argmax [N_out, C] int32)`` in one ``sc_max_pool_map`` launch."""
        xp = self.device.xp
        dtype_name = check_float(features, "features", "max_pool_forward")
        features = self._ready(features, features.dtype)
        side = _side(neighbour_map, "output", ordered=False)
        rows, channels = int(side.num_rows), int(features.shape[1])
        out = xp.empty((rows, channels), dtype=features.dtype)
        argmax = xp.empty((rows, channels), dtype=xp.int32)
        if rows and channels:
            self._pool_launch("sc_max_pool_map", dtype_name, rows, channels,
                              (features, side.neighbours, side.num_rows, side.volume, np.int64(channels), out, argmax))
        return out, argmax

    def max_pool_backward(self, grad_output: Any, argmax: Any, neighbour_map: Any) -> Any:
        """``grad_features [N_in, C]``: per input, over the input side, in one ``sc_max_pool_map_backward``."""
        xp = self.device.xp
        dtype_name = check_float(grad_output, "grad_output", "max_pool_backward")
        grad_output = self._ready(grad_output, grad_output.dtype)
        argmax = self._ready(argmax, np.dtype(np.int32))
        side = _side(neighbour_map, "input", ordered=False)
        rows, channels = int(side.num_rows), int(grad_output.shape[1])
        grad = xp.empty((rows, channels), dtype=grad_output.dtype)
        if rows and channels:
            self._pool_launch("sc_max_pool_map_backward", dtype_name, rows, channels,
                              (grad_output, argmax, side.neighbours, side.num_rows, side.volume,
                               np.int32(side.reversed), np.int64(channels), grad))
        return grad

    def avg_pool_forward(self, features: Any, neighbour_map: Any) -> Any:
        """``out [N_out, C]``, the mean of each window's inputs, in one ``sc_avg_pool_map`` launch."""
        xp = self.device.xp
        dtype_name = check_float(features, "features", "avg_pool_forward")
        features = self._ready(features, features.dtype)
        side = _side(neighbour_map, "output", ordered=False)
        rows, channels = int(side.num_rows), int(features.shape[1])
        out = xp.empty((rows, channels), dtype=features.dtype)
        if rows and channels:
            self._pool_launch("sc_avg_pool_map", dtype_name, rows, channels,
                              (features, side.neighbours, side.num_rows, side.volume, np.int64(channels), out))
        return out

    def avg_pool_backward(self, grad_output: Any, neighbour_map: Any) -> Any:
        """``grad_features [N_in, C]`` in one ``sc_avg_pool_map_backward`` launch."""
        xp = self.device.xp
        dtype_name = check_float(grad_output, "grad_output", "avg_pool_backward")
        grad_output = self._ready(grad_output, grad_output.dtype)
        side = _side(neighbour_map, "input", ordered=False)
        output_side = _side(neighbour_map, "output", ordered=False)
        rows, channels = int(side.num_rows), int(grad_output.shape[1])
        grad = xp.empty((rows, channels), dtype=grad_output.dtype)
        if rows and channels:
            self._pool_launch("sc_avg_pool_map_backward", dtype_name, rows, channels,
                              (grad_output, side.neighbours, output_side.masks, side.num_rows, side.volume,
                               output_side.mask_words, np.int32(side.reversed), np.int64(channels), grad))
        return grad
