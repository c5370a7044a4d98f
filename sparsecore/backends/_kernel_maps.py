"""The kernel backend's rulebook builds as neighbour maps (``kernels_cu/neighbour_map.cu``), in a handful of
host operations each.

On the GPU every array operation costs host time (about 20 us of CuPy on an
H200's host, 2026-12-04), and every read of device data makes the host wait
for the device. So the builds here pass per-axis parameters as kernel scalars
(no host-to-device copy), write whole rows per thread, and read back only what
sizes an allocation:

- `submanifold_map`: one table allocation, ``sc_map_insert_sites``, two
  allocations and ``sc_map_submanifold``: five operations, no read. Checked
  (the first, untrusted layer): ``sc_map_check_sites`` into a small device
  array the caller reads once.
- `strided_map` (regular, transposed, pooling): candidates, an argsort, marks,
  a cumsum, the output count read back (the one read; a checked build's
  problem bits travel in the same value), five allocations and one
  ``sc_map_strided``: thirteen operations.
- a capacity build (`strided_map` with ``capacity``, `sparsecore.capacity`):
  the same, but the output tables are allocated at the capacity, filled with
  padding, and ``sc_map_strided_capacity`` writes the count it needed (and a
  checked build's problem bits) into an int32 ``[2]`` device status instead
  of the host reading it: no read back, thirteen operations. Rows past the
  capacity are never written (the overflow the status reports).

The maps' mask-sorted row orders are not sorted here: `sparsecore.neighbour_map.NeighbourMap`
sorts a side when it is first read, so a pooling layer (whose kernels read the
tables only) never pays for them. A submanifold map (convolutions only) gets
its `row_plan` with its build; other maps when a fused conv pass first asks for
a side's order: the stable argsort of the masks (int64, as ``xp.argsort`` gives
it) rewritten in place by ``sc_map_row_plan``: the rows of each 64-row tile
regrouped (`sparsecore.tile_order`) in the low words, the per-offset row-tile
bit sets of the weight gradient in the high words: two operations, as the
argsort and the cast to int32 were before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..neighbour_map import mask_words
from ..tile_order import sorted_rows
from ..tile_order import MAX_REGROUP_WORDS, TILE_ROWS
from ._launch import INT32_MAX, KernelDevice, check_row_count, hash_capacity, launch

__all__ = ["MAX_AXES", "PROBLEM_OUTSIDE", "PROBLEM_DUPLICATE", "PLAN_THREADS", "StridedMap", "submanifold_map",
           "strided_map", "row_masks", "row_plan", "plan_bit_sets"]

MAX_AXES = 4  # sc::kMapAxes
PROBLEM_OUTSIDE = 1  # a site outside [0, batch_size) x the grid
PROBLEM_DUPLICATE = 2  # two sites with the same coordinates
_PROBLEM_SHIFT = 40  # where a checked strided build's problem bits sit in its count word
PLAN_THREADS = 32  # sc::kPlanThreads: threads (row tiles) per block of sc_map_row_plan


def _axes(values: Sequence[int]) -> tuple[np.int64, ...]:
    """Four per-axis kernel scalars (unused axes 0)."""
    values = [int(value) for value in values]
    if not 1 <= len(values) <= MAX_AXES:
        raise ValueError(f"neighbour maps take 1 to {MAX_AXES} spatial axes, got {len(values)}")
    return tuple(np.int64(value) for value in values + [0] * (MAX_AXES - len(values)))


def _check_sites(indices: Any, ndim: int, function: str) -> tuple[int, int]:
    if indices.ndim != 2 or indices.shape[1] != ndim + 1 or indices.dtype != np.int32:
        raise ValueError(f"{function}: indices must be int32 [N, {ndim + 1}], got {indices.dtype} "
                         f"{tuple(indices.shape)}")
    if not indices.flags.c_contiguous:
        raise ValueError(f"{function}: indices must be C-contiguous (a kernel ignores strides)")
    count = int(indices.shape[0])
    check_row_count(count, "indices", function)
    return count, ndim


def _site_table(device: KernelDevice, indices: Any, count: int, ndim: int, batch_size: int,
                grid: tuple[np.int64, ...], margin: tuple[np.int64, ...]) -> tuple[Any, int]:
    """The sites' hash table (``neighbour_map.cu`` section 1): one allocation, one launch."""
    capacity = hash_capacity(count)
    table = device.xp.full(2 * capacity, -1, dtype=device.xp.int64)
    device.run("sc_map_insert_sites", (), count,
               (indices, np.int64(count), np.int32(ndim), np.int64(batch_size), *grid, *margin, table,
                np.int64(capacity)))
    return table, capacity


def submanifold_map(device: KernelDevice, indices: Any, spatial_shape: Sequence[int], batch_size: int,
                    kernel_size: Sequence[int], dilation: Sequence[int], check: bool,
                    skip_padding: bool = False) -> tuple[Any, Any, Any]:
    """A submanifold map's output side (the map is symmetric) in two launches, no read back.

    Args:
        device: the kernel device.
        indices: int32 ``[N, 1 + D]`` C-contiguous sites, batch first.
        spatial_shape: the grid, ``D`` ints (with the kernel's reach on each side, it packs into int64: the
            caller checks).
        batch_size: batch elements.
        kernel_size, dilation: ``D`` ints each, odd kernel sizes.
        check: also launch ``sc_map_check_sites`` (the first, untrusted layer).
        skip_padding: the check skips rows whose batch index is -1 (a capacity-mode input's padding).

    Returns:
        ``(neighbours int32 [N, K], masks uint32 [N, W], problems)``: ``problems`` is None unchecked,
        else an int64 ``[1]`` device array of `PROBLEM_OUTSIDE` / `PROBLEM_DUPLICATE` bits for the
        caller to read (once); sites outside the grid have rows of -1.
    """
    xp = device.xp
    count, ndim = _check_sites(indices, len(spatial_shape), "submanifold_map")
    volume = int(np.prod([int(size) for size in kernel_size]))
    words = max(1, -(-volume // 32))
    check_row_count(count * volume, "the neighbour table", "submanifold_map")
    neighbours = xp.empty((count, volume), dtype=xp.int32)
    masks = xp.empty((count, words), dtype=xp.uint32)
    if count == 0:
        return neighbours, masks, None
    problems = xp.zeros(1, dtype=xp.int64) if check else None
    grid, kernel, steps = _axes(spatial_shape), _axes(kernel_size), _axes(dilation)
    margin = _axes([step * (size - 1) // 2 for size, step in zip(kernel_size, dilation)])
    table, capacity = _site_table(device, indices, count, ndim, batch_size, grid, margin)
    if check:
        device.run("sc_map_check_sites", (), count,
                   (indices, np.int64(count), np.int32(ndim), np.int64(batch_size), *grid, *margin, table,
                    np.int64(capacity), problems, np.int64(0), np.int32(0), np.int32(skip_padding)))
    device.run("sc_map_submanifold", (), count,
               (indices, np.int64(count), np.int32(ndim), np.int64(batch_size), *grid, *kernel, *steps, table,
                np.int64(capacity), np.int32(volume), np.int32(words), neighbours, masks))
    return neighbours, masks, problems


@dataclass(frozen=True)
class StridedMap:
    """Both sides of a strided, transposed or pooling map, and its output sites.

    The input side has no masks: `sparsecore.neighbour_map.NeighbourMap` makes them from ``input_neighbours``
    when a kernel first tiles that side by mask (a conv's input gradient, an inverse conv); the pooling
    kernels never read them, so a pooling layer's build skips an allocation and the writes.

    Attributes:
        output_indices: int32 ``[N_out, 1 + D]``, sorted by (batch, coordinates).
        output_neighbours: int32 ``[N_out, K]``.
        output_masks: uint32 ``[N_out, W]``.
        input_neighbours: int32 ``[N_in, K]``.
        problems: host int, `PROBLEM_OUTSIDE` / `PROBLEM_DUPLICATE` bits of a checked build (0 when
            unchecked or clean); when nonzero, every array is None. Always 0 for a capacity build.
        status: a capacity build's int32 ``[2]`` device array (the output count it needed, then the
            problem bits of its site checks); None for an exact build.
    """

    output_indices: Any
    output_neighbours: Any
    output_masks: Any
    input_neighbours: Any
    problems: int = 0
    status: Any = None


def strided_map(device: KernelDevice, indices: Any, spatial_shape: Sequence[int], batch_size: int,
                geometry: Any, output_spatial_shape: Sequence[int], check: bool,
                capacity: int | None = None) -> StridedMap:
    """A regular, transposed or pooling map in four launches, an argsort, a cumsum and one read back.

    Args:
        device: the kernel device.
        indices: int32 ``[N, 1 + D]`` C-contiguous sites, batch first.
        spatial_shape: the input grid.
        batch_size: batch elements.
        geometry: a `sparsecore.geometry.ConvGeometry` of kind ``"regular"`` or ``"transposed"``.
        output_spatial_shape: the output grid (``batch_size * prod`` packs into int64: the caller checks).
        check: also check the sites (grid and duplicates: one table, ``sc_map_insert_sites`` and
            ``sc_map_check_sites``), reading the problem bits back with the output count.
        capacity: None for an exact build; else the output rows to allocate (a capacity build: no read back,
            the count and the problem bits stay on the device in ``status``; rows of -1 in the input's batch
            column are padding, skipped, and not reported by the check).

    Returns:
        The `StridedMap`.
    """
    xp = device.xp
    if geometry.kind not in ("regular", "transposed"):
        raise ValueError(f"strided_map: geometry must be regular or transposed, got {geometry.kind!r}")
    count, ndim = _check_sites(indices, len(spatial_shape), "strided_map")
    if max(output_spatial_shape) > INT32_MAX:
        raise ValueError(f"strided_map: output grid {tuple(output_spatial_shape)} exceeds int32 coordinates")
    volume = int(geometry.kernel_volume)
    words = max(1, -(-volume // 32))
    total = count * volume
    check_row_count(total, "the candidates (sites x kernel offsets)", "strided_map")
    shape = (np.int32(ndim), np.int64(batch_size))
    strided = (*_axes(geometry.kernel_size), *_axes(geometry.stride), *_axes(geometry.padding),
               *_axes(geometry.dilation), *_axes(output_spatial_shape),
               np.int32(geometry.kind == "transposed"), np.int32(volume))
    input_neighbours = xp.empty((count, volume), dtype=xp.int32)  # no input masks: made on first read
    if capacity is not None:
        check_row_count(int(capacity), "the capacity", "strided_map")
        output_indices = xp.full((int(capacity), ndim + 1), -1, dtype=xp.int32)
        output_neighbours = xp.full((int(capacity), volume), -1, dtype=xp.int32)
        output_masks = xp.zeros((int(capacity), words), dtype=xp.uint32)
        if count == 0:
            return StridedMap(output_indices, output_neighbours, output_masks, input_neighbours,
                              status=xp.zeros(2, dtype=xp.int32))
    if count == 0:
        return StridedMap(xp.empty((0, ndim + 1), dtype=xp.int32), xp.empty((0, volume), dtype=xp.int32),
                          xp.empty((0, words), dtype=xp.uint32), input_neighbours)
    if check:
        grid, no_margin = _axes(spatial_shape), _axes([0] * ndim)
        table, slots = _site_table(device, indices, count, ndim, batch_size, grid, no_margin)
    keys = xp.empty(total, dtype=xp.int64)
    device.run("sc_map_candidates", (), total, (indices, np.int64(count), *shape, *strided, keys))
    order = xp.argsort(keys)
    device.run("sc_map_mark_outputs", (), total, (indices, *shape, *strided, order, np.int64(total), keys))
    if check:  # the problem bits join the last mark, so they come back with the count
        device.run("sc_map_check_sites", (), count,
                   (indices, np.int64(count), *shape, *grid, *no_margin, table, np.int64(slots), keys,
                    np.int64(total - 1), np.int32(_PROBLEM_SHIFT), np.int32(capacity is not None)))
    ranks = xp.cumsum(keys)  # a new array: no in-place scan asked of CuPy
    if capacity is not None:  # no read back: the count and the problem bits stay on the device
        status = xp.empty(2, dtype=xp.int32)
        device.run("sc_map_strided_capacity", (), count + total,
                   (indices, np.int64(count), *shape, *strided, np.int32(words), order, ranks, np.int64(total),
                    output_indices, output_neighbours, output_masks, input_neighbours,
                    np.int64(capacity), status, np.int32(_PROBLEM_SHIFT)))
        return StridedMap(output_indices, output_neighbours, output_masks, input_neighbours, status=status)
    last = int(ranks[total - 1])  # the build's one read back
    problems, num_output = last >> _PROBLEM_SHIFT, last & ((1 << _PROBLEM_SHIFT) - 1)
    if problems:
        return StridedMap(None, None, None, None, problems=problems)
    output_indices = xp.empty((num_output, ndim + 1), dtype=xp.int32)
    output_neighbours = xp.empty((num_output, volume), dtype=xp.int32)
    output_masks = xp.empty((num_output, words), dtype=xp.uint32)
    device.run("sc_map_strided", (), count + total,
               (indices, np.int64(count), *shape, *strided, np.int32(words), order, ranks, np.int64(total),
                output_indices, output_neighbours, output_masks, input_neighbours))
    return StridedMap(output_indices, output_neighbours, output_masks, input_neighbours)


def row_masks(device: KernelDevice, neighbours: Any) -> Any:
    """uint32 ``[N, W]`` row masks of an int32 ``[N, K]`` table in two operations (an allocation and one
    ``sc_map_row_masks``), bitwise `sparsecore.neighbour_map.row_masks`; nothing is read back.

    A strided map's input side gets its masks here when a conv first tiles it by mask (`strided_map`
    leaves them out: the pooling kernels never read them).
    """
    rows, volume = int(neighbours.shape[0]), int(neighbours.shape[1])
    words = mask_words(volume)
    if not neighbours.flags.c_contiguous or neighbours.dtype != np.int32:
        neighbours = device.xp.ascontiguousarray(neighbours, dtype=device.xp.int32)
    masks = device.xp.empty((rows, words), dtype=device.xp.uint32)
    device.run("sc_map_row_masks", (), rows, (neighbours, np.int64(rows), np.int32(volume), np.int32(words), masks))
    return masks


def plan_bit_sets(num_rows: int, volume: int, mask_words: int) -> bool:
    """Whether a row plan of these sizes holds the per-offset row-tile bit sets (``neighbour_map.cu`` section 4):
    masks regrouped (at most `MAX_REGROUP_WORDS` words) and ``volume * ceil(tiles / 32) <= num_rows``."""
    tiles = -(-int(num_rows) // TILE_ROWS)
    chunks = -(-tiles // PLAN_THREADS)
    return int(mask_words) <= MAX_REGROUP_WORDS and int(volume) * chunks <= int(num_rows)


def row_plan(device: KernelDevice, masks: Any, volume: int) -> Any:
    """A map side's row plan: int64 ``[N]``, in two operations (an argsort and one ``sc_map_row_plan``).

    Slot ``p``'s low 32-bit word is the row at position ``p`` of the side's order
    (`sparsecore.tile_order.row_order`, bitwise); where `plan_bit_sets`, the high word of slot
    ``k * C + c`` (``C = ceil(tiles / 32)``) has bit ``j`` set when row tile ``32 c + j`` holds offset ``k``;
    every other high word is 0. Nothing is read back.

    Args:
        device: the kernel device.
        masks: uint32 ``[N, W]`` C-contiguous row masks.
        volume: kernel offsets ``K``.
    """
    rows, words = int(masks.shape[0]), int(masks.shape[1])
    plan = sorted_rows(device.xp, masks)  # int64, a new array
    if rows and words <= MAX_REGROUP_WORDS:
        chunks = -(-(-(-rows // TILE_ROWS)) // PLAN_THREADS)
        launch(device.launcher, "sc_map_row_plan", (), chunks * PLAN_THREADS,
               (masks, np.int64(rows), np.int32(words), np.int32(volume), plan), PLAN_THREADS, device.max_blocks)
    return plan
