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
Engines, device checks and scratch sizes are decided in
`sparsecore.backends._fused_launch_plan` (re-exported here).

The weight gradient splits each tile's rows for at least two waves of
resident blocks on the GPU in hand (`tile_shapes.weight_gradient_splits`:
the multiprocessor count from CuPy's device attributes, `DEFAULT_SM_COUNT`
on the emulation); its scratch (split partials and counters) stays under
`tile_shapes.scratch_cap`.

Row orders: a side the kernels tile by mask is read through its row plan
(`_kernel_maps.row_plan`, built on the first pass that asks, kept in the map's
``derived``): the order, regrouped inside each row tile, and the per-offset
row-tile bit sets the weight gradient walks, in one int64 array (the kernels
read the order every second int32 word: ``order_step`` 2). A map whose order
was given (a JAX layout's) or already read is used as it is (``order_step``
1), and its weight gradient walks every row tile.

The forward and the input gradient of a layer with fewer output tiles than
the GPU has block slots split each tile's offsets over several blocks
(`tile_shapes.forward_splits`); their partial tiles and per-tile counters
live in one scratch buffer per map (`NeighbourMap.derived`), zeroed once when
it is allocated (the kernel leaves the counters zero), sized at the map's
first split pass for that layer's forward and input gradient, grown only when
a later pass needs more. Passes over one map run in stream order, so they
share it; two streams must not run the same map's passes at the same time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..neighbour_map import ROW_PLAN, keep_masks, mask_words, stored_masks, stored_order
from . import tile_shapes
from ._fused_launch_plan import (MAX_KERNEL_VOLUME, MIN_COMPUTE_CAPABILITY, SIMT_THREADS, TILE_COLUMNS,
                                 TILE_ELEMENTS, TILE_ROWS, WMMA_THREADS, DeviceTraits, SplitPlan, SplitScratch,
                                 check_device, device_traits, engine_of, split_scratch, split_scratch_words,
                                 weight_gradient_scratch_words, weight_gradient_tiles)
from ._kernel_maps import row_masks, row_plan
from ._launch import KernelDevice, check_float, check_row_count, expression_of

__all__ = ["FusedPasses", "SIMT_THREADS", "WMMA_THREADS", "TILE_ROWS", "TILE_COLUMNS", "MAX_KERNEL_VOLUME",
           "MIN_COMPUTE_CAPABILITY", "DeviceTraits", "device_traits", "check_device", "engine_of",
           "weight_gradient_tiles", "weight_gradient_scratch_words", "SplitScratch", "split_scratch_words"]

_REVERSED, _TRANSPOSED, _BIAS = 1, 2, 4  # sc_implicit_gemm's flags
_MAX_WORK_ITEMS = 2**31 - 1  # sc_implicit_gemm counts its work items (tiles x splits) in 32 bits


@dataclass(frozen=True)
class _Side:
    """One side of a map as a kernel reads it: table, masks, order (None for the pools, which need
    none: reading it would sort it; a row plan or an int32 order, read every ``order_step`` int32
    words), reversed, and their scalars. The pools' input side has no masks either (None: a strided
    map makes its input masks when first read, and no pooling kernel reads them)."""

    neighbours: Any
    masks: Any
    order: Any
    order_step: np.int32
    reversed: bool
    num_rows: np.int64
    volume: np.int32
    mask_words: np.int32


def _order(device: KernelDevice, neighbour_map: Any, which: str, masks: Any) -> tuple[Any, int]:
    """``(order, order_step)`` of a side: its row plan (built now if the side has neither a plan nor an
    order), else the order it was given (int32, contiguous)."""
    side = "output" if which == "output" or neighbour_map.symmetric else "input"
    plan = neighbour_map.derived.get((ROW_PLAN, side))
    if plan is None:
        order = stored_order(neighbour_map, side)
        if order is not None:
            if order.dtype != np.int32 or not order.flags.c_contiguous:
                order = device.xp.ascontiguousarray(order, dtype=device.xp.int32)
            return order, 1
        plan = row_plan(device, masks, neighbour_map.kernel_volume)
        neighbour_map.derived[(ROW_PLAN, side)] = plan
    return plan.view(device.xp.int32), 2  # int32 words [2 N]: a view, no copy


def _side(device: KernelDevice, neighbour_map: Any, which: str, ordered: bool = True) -> _Side:
    """The map's ``"output"`` or ``"input"`` side, kept in ``neighbour_map.derived``."""
    key = ("fused side", which, ordered)
    side = neighbour_map.derived.get(key)
    if side is None:
        stored = "output" if which == "output" or neighbour_map.symmetric else "input"
        neighbours = neighbour_map.output_neighbours if stored == "output" else neighbour_map.input_neighbours
        reversed_offsets = which == "input" and neighbour_map.symmetric
        masks = None  # the pools read the output side's masks only: a strided map's input masks are never made
        if ordered or stored == "output":  # masks a builder left out: made here (two operations) when first needed
            masks = stored_masks(neighbour_map, stored)
            if masks is None:
                masks = keep_masks(neighbour_map, stored, row_masks(device, neighbours))
        order, step = None, 1
        if ordered:
            order, step = _order(device, neighbour_map, which, masks)
        check_row_count(int(neighbours.shape[0]), f"the map's {which} side", "fused passes")
        side = _Side(neighbours, masks, order, np.int32(step), reversed_offsets, np.int64(neighbours.shape[0]),
                     np.int32(neighbours.shape[1]), np.int32(mask_words(neighbour_map.kernel_volume)))
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

    def conv_forward(self, features: Any, weight: Any, neighbour_map: Any, bias: Any | None, groups: int,
                     splits: int | None = None) -> Any:
        """``out [N_out, C_out]`` of a convolution over a map, in one ``sc_implicit_gemm`` launch.

        Args:
            features: ``[N_in, C_in]`` float32/float64/float16/bfloat16.
            weight: ``[C_out, *kernel_size, C_in // groups]`` (spconv's layout), any float dtype.
            neighbour_map: the layer's `NeighbourMap`.
            bias: ``[C_out]`` or None.
            groups: channel groups.
            splits: offset splits per output tile; by default `tile_shapes.forward_splits` for the device
                (tests force others: the result depends on it only through rounding).

        Returns:
            ``[N_out, C_out]`` in the features' dtype; a row without neighbours holds the bias (or 0).
        """
        xp = self.device.xp
        dtype_name = check_float(features, "features", "conv_forward")
        features = self._ready(features, features.dtype)
        weight = self._ready(weight, features.dtype)
        out_channels, in_per_group = int(weight.shape[0]), int(weight.shape[-1])
        side = _side(self.device, neighbour_map, "output")
        rows = int(side.num_rows)
        if in_per_group == 0 or rows == 0 or out_channels == 0:
            out = xp.zeros((rows, out_channels), dtype=features.dtype)
            if bias is not None and rows and out_channels:
                out[...] = bias.astype(features.dtype, copy=False)
            return out
        out = xp.empty((rows, out_channels), dtype=features.dtype)
        flags = _BIAS if bias is not None else 0
        bias = self._ready(bias, features.dtype) if bias is not None else weight
        traits = device_traits(xp)
        check_device(dtype_name, traits, neighbour_map.kernel_volume, "conv_forward")
        out_per_group = out_channels // groups
        split = self._split(rows, in_per_group, out_per_group, groups, neighbour_map.kernel_volume, dtype_name,
                            traits, splits)
        # sized for this layer's input gradient too (over the input side), so the backward reuses it
        backward = self._split(neighbour_map.num_input, out_per_group, in_per_group, groups,
                               neighbour_map.kernel_volume, dtype_name, traits, splits)
        self._implicit_gemm(features, weight, bias, side, neighbour_map, dtype_name, groups, in_per_group,
                            out_per_group, flags, split, backward, out)
        return out

    def _split(self, rows: int, reduce: int, width: int, groups: int, volume: int, dtype_name: str,
               traits: DeviceTraits, splits: int | None) -> SplitPlan:
        """The offset splits of an ``sc_implicit_gemm`` pass writing ``rows`` rows of ``groups * width``
        channels, reducing over ``reduce`` per group (``splits`` given: forced, for tests)."""
        tiles = -(-int(rows) // TILE_ROWS) * groups * -(-width // TILE_COLUMNS)
        partial = 8 if dtype_name == "float64" else 4
        if splits is None:
            shape = tile_shapes.choose_tile(reduce, width, dtype_name, self.tf32, traits.compute_capability)
            splits = tile_shapes.forward_splits(tiles, volume, shape.blocks_per_sm, partial, traits.sm_count,
                                                shape.engine)
        splits = max(1, min(int(splits), MAX_KERNEL_VOLUME))  # the kernel's bound (empty splits beyond K)
        return SplitPlan(tiles, splits, tiles * splits * TILE_ELEMENTS * partial if splits > 1 else 0)

    def _implicit_gemm(self, source: Any, weight: Any, bias: Any, side: _Side, neighbour_map: Any,
                       dtype_name: str, groups: int, in_per_group: int, out_per_group: int, flags: int,
                       split: SplitPlan, also: SplitPlan | None, out: Any) -> None:
        """One ``sc_implicit_gemm`` launch; a split one uses the map's split scratch, sized for ``also`` too."""
        transposed = bool(flags & _TRANSPOSED)
        math, threads = engine_of(dtype_name, self.tf32, out_per_group if transposed else in_per_group)
        if split.tiles * split.splits > _MAX_WORK_ITEMS:
            raise ValueError(f"conv: {split.tiles} output tiles x {split.splits} offset splits exceed the fused "
                             f"kernel's {_MAX_WORK_ITEMS} work items; use fewer rows or channels per call")
        scratch, counter_words = side.masks, 0  # splits == 1: the kernel never touches it
        if split.splits > 1:
            counters, partial_bytes = split.tiles, split.partial_bytes
            if also is not None and also.splits > 1:
                counters, partial_bytes = max(counters, also.tiles), max(partial_bytes, also.partial_bytes)
            held = split_scratch(self.device.xp, neighbour_map, counters, partial_bytes)
            scratch, counter_words = held.buffer, held.counter_words
        self._launch("sc_implicit_gemm", (dtype_name, math), split.tiles * split.splits, threads,
                     (source, weight, bias, side.neighbours, side.masks, side.order, side.order_step, side.num_rows,
                      side.volume, side.mask_words, np.int32(groups), np.int32(in_per_group), np.int32(out_per_group),
                      np.int32(flags | (_REVERSED if side.reversed else 0)), np.int32(split.splits), scratch,
                      np.int64(counter_words), out))

    def conv_backward(self, grad_output: Any, features: Any, weight: Any, neighbour_map: Any, groups: int,
                      splits: int | None = None, input_splits: int | None = None) -> tuple[Any, Any]:
        """``(grad_features [N_in, C_in], grad_weight)`` in two launches (input gradient, weight gradient).

        Args:
            grad_output: ``[N_out, C_out]``.
            features: ``[N_in, C_in]``, as passed to the forward.
            weight: ``[C_out, *kernel_size, C_in // groups]``.
            neighbour_map: the layer's `NeighbourMap`.
            groups: channel groups.
            splits: row splits of the weight gradient; by default `tile_shapes.weight_gradient_splits`
                for the device (tests pass others: the result depends on it only through rounding).
            input_splits: offset splits of the input gradient (as ``splits`` of `conv_forward`).

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
        traits = device_traits(xp)
        check_device(dtype_name, traits, volume, "conv_backward")
        math, threads = engine_of(dtype_name, self.tf32)
        channels_known = in_per_group > 0 and out_per_group > 0
        input_side = _side(self.device, neighbour_map, "input")
        if channels_known and int(input_side.num_rows):
            grad_features = xp.empty(features.shape, dtype=dtype)
            split = self._split(int(input_side.num_rows), out_per_group, in_per_group, groups, volume, dtype_name,
                                traits, input_splits)
            self._implicit_gemm(grad_output, weight, weight, input_side, neighbour_map, dtype_name, groups,
                                in_per_group, out_per_group, _TRANSPOSED, split, None, grad_features)
        else:
            grad_features = xp.zeros(features.shape, dtype=dtype)
        output_side = _side(self.device, neighbour_map, "output")
        rows = int(output_side.num_rows)
        if not channels_known or rows == 0 or neighbour_map.num_input == 0:
            return grad_features, xp.zeros(weight.shape, dtype=dtype)
        tiles = weight_gradient_tiles(volume, groups, in_per_group, out_per_group)
        partial = np.dtype(np.float64 if dtype_name == "float64" else np.float32)
        row_tiles = -(-rows // TILE_ROWS)
        if splits is None:
            shape = tile_shapes.weight_gradient_tile(in_per_group, out_per_group, dtype_name, self.tf32,
                                                     traits.compute_capability)
            splits = tile_shapes.weight_gradient_splits(row_tiles, tiles, partial.itemsize, int(grad_output.nbytes),
                                                        shape.blocks_per_sm, traits.sm_count)
        splits = max(1, int(splits))
        # zeroed: the counters must start at 0
        scratch = xp.zeros(weight_gradient_scratch_words(tiles, splits, partial.itemsize), dtype=partial)
        grad_weight = xp.empty(weight.shape, dtype=dtype)
        self._launch("sc_weight_gradient", (dtype_name, math), tiles * splits, threads,
                     (features, grad_output, output_side.neighbours, output_side.order, output_side.order_step,
                      output_side.num_rows, output_side.volume, output_side.mask_words, np.int32(groups),
                      np.int32(in_per_group), np.int32(out_per_group), np.int32(splits), scratch, grad_weight))
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
        side = _side(self.device, neighbour_map, "output", ordered=False)
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
        side = _side(self.device, neighbour_map, "input", ordered=False)
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
        side = _side(self.device, neighbour_map, "output", ordered=False)
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
        side = _side(self.device, neighbour_map, "input", ordered=False)
        output_side = _side(self.device, neighbour_map, "output", ordered=False)
        rows, channels = int(side.num_rows), int(grad_output.shape[1])
        grad = xp.empty((rows, channels), dtype=grad_output.dtype)
        if rows and channels:
            self._pool_launch("sc_avg_pool_map_backward", dtype_name, rows, channels,
                              (grad_output, side.neighbours, output_side.masks, side.num_rows, side.volume,
                               output_side.mask_words, np.int32(side.reversed), np.int64(channels), grad))
        return grad
