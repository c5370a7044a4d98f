"""The array algorithm behind :mod:`sparsecore.voxelization`, written once against ``xp``.

Everything here runs unchanged on NumPy and on CuPy: it uses only functions
both provide with the same meaning (``flatnonzero``, ``ndarray.sort``,
``argsort(kind="stable")``, ``cumsum``, ``take``, ``copyto``, ``bincount``,
``searchsorted``, ufuncs with ``out=``, fancy indexing). The NumPy-only speed
paths (one scratch block, ``take``/``put`` with ``mode="clip"``, rows moved as
``void`` items) live in `sparsecore._voxel_storage` (:class:`Scratch`,
:func:`take`, :func:`copy_rows`), each with a plain branch for CuPy. Memory is O(points): voxels are found by
sorting packed int64 keys, never through a dense grid. Host arrays in native
byte order take `sparsecore._voxel_hashing` instead (a compiled hash-table pass,
bitwise the same results); this path serves CuPy and is its CPU oracle.

How a first-seen numbering falls out of one sort
------------------------------------------------
Each in-range point gets a key ``cloud * cells + row_major(z, y, x)``. When the
key and the point's position fit together in 63 bits, the composite
``key << bits | position`` is sorted with the library's fastest (not
necessarily stable) sort: composites are all distinct, so any sort orders them
exactly as a stable sort of the keys would. Otherwise a stable argsort is used.
In sorted order each run of equal keys is one voxel with its points in input
order; a run's first point is the voxel's first-seen point, and ranking runs by
it (a running count over a mask, no second sort) numbers voxels first-seen.
"""

from __future__ import annotations

import math
import struct
from typing import Any, NamedTuple

from ._voxel_storage import Scratch, copy_rows, take
from .interop import memory_limit


class VoxelArrays(NamedTuple):
    """Raw outputs of :func:`voxelize_points` (core arrays)."""

    voxels: Any  # [M, max_points, F], the points' dtype
    indices: Any  # [M, D] int32, zyx
    batch: Any  # [M] int32, the cloud of each voxel
    num_points_per_voxel: Any  # [M] int32
    point_voxel_id: Any  # [P] int64, -1 for dropped points


def float32(value: float) -> float:
    """``value`` rounded to float32 (overflow gives inf), as a Python float."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def grid_cells(voxel_size: tuple[float, ...], coordinate_range: tuple[float, ...]) -> list[int]:
    """Cells per axis, xyz: ``round((max - min) / size)`` in float32, halves up (spconv's rule)."""
    ndim = len(voxel_size)
    cells = []
    for axis in range(ndim):
        span = float32(float32(coordinate_range[ndim + axis]) - float32(coordinate_range[axis]))
        cells.append(int(math.floor(float32(span / float32(voxel_size[axis])) + 0.5)))
    return cells


def cell_count(grid_size_zyx: tuple[int, ...]) -> int:
    """Number of cells of the grid, as an exact Python int."""
    return math.prod(grid_size_zyx)


def empty_result(xp: Any, num_points: int, num_features: int, ndim: int, max_points: int,
                 dtype: Any) -> VoxelArrays:
    """The M = 0 result: every point dropped."""
    return VoxelArrays(
        voxels=xp.zeros((0, max_points, num_features), dtype=dtype),
        indices=xp.zeros((0, ndim), dtype=xp.int32),
        batch=xp.zeros((0,), dtype=xp.int32),
        num_points_per_voxel=xp.zeros((0,), dtype=xp.int32),
        point_voxel_id=xp.full((num_points,), -1, dtype=xp.int64),
    )


def _count_dtype(xp: Any, count: int) -> Any:
    # NumPy's bool -> int64 cumsum takes a slow buffered path (~10x slower than int32).
    return xp.int32 if count < 2**31 else xp.int64


def in_range_points(xp: Any, scratch: Scratch, points: Any, grid: Any) -> tuple[Any, list[Any]]:
    """The points inside the grid, and every point's offset in voxels.

    A point is inside when ``min <= x < max`` and ``(x - min) / size < grid_size``
    on every axis (the second test drops points that round-off pushes into
    cell ``grid_size``), computed in the points' dtype. NaN is never inside.

    Returns:
        ``(kept, offsets)``: ``[V]`` int64 positions of the inside points
        (increasing), and per axis (xyz) the ``[P]`` offsets ``(x - min) / size``;
        on kept points ``0 <= offset < grid_size``, so truncation is the floor.
    """
    num_points, dtype = int(points.shape[0]), points.dtype.type
    grid_xyz = tuple(reversed(grid.grid_size))
    inside, ok = scratch.empty(num_points, bool), scratch.empty(num_points, bool)
    inside[...] = True
    offsets = []
    for axis in range(grid.ndim):  # one axis at a time: 1-D passes are the fast ones
        column = points[:, axis]
        lower = dtype(grid.lower[axis])
        offset = scratch.empty(num_points, points.dtype)
        xp.subtract(column, lower, out=offset)
        offset /= dtype(grid.voxel_size[axis])
        xp.greater_equal(column, lower, out=ok)
        inside &= ok
        # Both ``x < max`` and ``offset < grid_size`` must hold (round-off can put a
        # point just below ``max`` into cell grid_size). The offset is monotone in x,
        # so one test implies the other: if offset(max) < grid_size, x < max implies
        # offset < grid_size; otherwise offset < grid_size implies x < max.
        upper = dtype(grid.upper[axis])
        cells = dtype(grid_xyz[axis])
        if (upper - lower) / dtype(grid.voxel_size[axis]) < cells:
            xp.less(column, upper, out=ok)
        else:
            xp.less(offset, cells, out=ok)
        inside &= ok
        offsets.append(offset)
    return xp.flatnonzero(inside), offsets


def voxel_keys(xp: Any, scratch: Scratch, offsets: list[Any], kept: Any, grid: Any,
               cloud_sizes: tuple[int, ...]) -> Any:
    """``[V]`` int64 keys of the kept points, row-major over ``(cloud, z, y, x)``."""
    count = int(kept.shape[0])
    grid_xyz = tuple(reversed(grid.grid_size))
    keys, cells = scratch.empty(count, xp.int64), scratch.empty(count, xp.int64)
    offset = scratch.empty(count, offsets[0].dtype)
    for axis in range(grid.ndim - 1, -1, -1):
        take(xp, offsets[axis], kept, out=offset)
        if axis == grid.ndim - 1:
            keys[...] = offset
        else:
            cells[...] = offset
            keys *= grid_xyz[axis]
            keys += cells
    if len(cloud_sizes) > 1:
        starts = xp.asarray(_cumulative((0,) + cloud_sizes[:-1]), dtype=xp.int64)
        cloud = xp.searchsorted(starts, kept, side="right") - 1
        cloud *= cell_count(grid.grid_size)
        keys += cloud
    return keys


def sorted_runs(xp: Any, scratch: Scratch, keys: Any, kept: Any, num_points: int,
                max_key: int) -> tuple[Any, Any, Any, Any]:
    """Stable sort of the kept points by key, cut into runs of equal keys.

    Args:
        keys: ``[V]`` int64 keys (overwritten).
        kept: ``[V]`` int64 point positions, increasing.
        num_points: ``P``, a bound on the positions.
        max_key: a bound on the keys.

    Returns:
        ``(point_of_sorted, run_start, group_start, group_key)``: ``[V]`` point
        positions sorted by key, ties in input order; ``[V]`` bool marking the
        first element of each run; ``[G]`` sorted positions of the runs' starts;
        ``[G]`` the runs' keys.
    """
    count = int(keys.shape[0])
    run_start = scratch.empty(count, bool)
    run_start[0] = True
    position_bits = max(1, (num_points - 1).bit_length())
    if max_key.bit_length() + position_bits <= 63:
        # Distinct composites: any sort of them is a stable sort of the keys, so
        # NumPy's fast (unstable, SIMD) sort will do.
        keys <<= position_bits
        keys |= kept
        keys.sort()
        point_of_sorted = scratch.empty(count, xp.int64)
        xp.bitwise_and(keys, (1 << position_bits) - 1, out=point_of_sorted)
        # Equal keys <=> the composites differ only in the position bits.
        differ = scratch.empty(max(count - 1, 0), xp.int64)
        xp.bitwise_xor(keys[1:], keys[:-1], out=differ)
        xp.greater_equal(differ, 1 << position_bits, out=run_start[1:])
        group_start = xp.flatnonzero(run_start)
        group_key = keys[group_start]
        group_key >>= position_bits
        return point_of_sorted, run_start, group_start, group_key
    order = xp.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    xp.not_equal(sorted_keys[1:], sorted_keys[:-1], out=run_start[1:])
    group_start = xp.flatnonzero(run_start)
    return kept[order], run_start, group_start, sorted_keys[group_start]


def first_seen_rank(xp: Any, scratch: Scratch, group_first: Any, num_points: int) -> Any:
    """``[G]`` int64 rank of each run by its first point's input position (0..G-1).

    Marks the first points in a ``[P]`` mask and counts marks up to each one:
    a ranking of distinct positions without a second sort.
    """
    is_first = scratch.empty(num_points, bool)
    is_first[...] = False
    is_first[group_first] = True
    count_dtype = _count_dtype(xp, num_points)
    seen = xp.cumsum(is_first, dtype=count_dtype, out=scratch.empty(num_points, count_dtype))
    rank = scratch.empty(int(group_first.shape[0]), xp.int64)
    rank[...] = seen[group_first]
    rank -= 1
    return rank


def select_voxels(xp: Any, scratch: Scratch, rank: Any, group_cloud: Any, batch_size: int,
                  max_voxels: int) -> tuple[Any, Any]:
    """Keeps the first ``max_voxels`` runs (first-seen) of every cloud and numbers them.

    Returns:
        ``(group_voxel, voxel_group)``: ``[G]`` voxel row of each run (-1 when
        dropped) and ``[M]`` run of each voxel row; rows are ordered by cloud
        then first-seen rank, which is the global rank order.
    """
    num_groups = int(rank.shape[0])
    if group_cloud is not None:
        per_cloud = xp.bincount(group_cloud, minlength=batch_size)
        keep_group = (rank - (xp.cumsum(per_cloud) - per_cloud)[group_cloud]) < max_voxels
        num_voxels = int(keep_group.sum())
    else:
        num_voxels = min(num_groups, max_voxels)
    by_rank = scratch.empty(num_groups, xp.int64)  # the run of each rank
    by_rank[rank] = xp.arange(num_groups, dtype=xp.int64)
    if num_voxels == num_groups:
        return rank, by_rank
    if group_cloud is None:
        voxel_group = by_rank[:num_voxels]
    else:
        kept_by_rank = scratch.empty(num_groups, bool)
        kept_by_rank[rank] = keep_group
        voxel_group = by_rank[xp.flatnonzero(kept_by_rank)]
    group_voxel = xp.full((num_groups,), -1, dtype=xp.int64)
    group_voxel[voxel_group] = xp.arange(num_voxels, dtype=xp.int64)
    return group_voxel, voxel_group


def voxelize_points(xp: Any, points: Any, cloud_sizes: tuple[int, ...], grid: Any,
                    max_points: int, max_voxels: int, empty_mean: bool) -> VoxelArrays:
    """Voxelizes the concatenation of ``len(cloud_sizes)`` clouds.

    Args:
        xp: ``numpy`` or ``cupy``.
        points: ``[P, F]`` float32/float64, the clouds one after another.
        cloud_sizes: number of points of each cloud (sums to ``P``).
        grid: a validated :class:`sparsecore.voxelization.VoxelGrid`.
        max_points: cap on the points stored per voxel (>= 1).
        max_voxels: cap on the voxels kept per cloud, in first-seen order (>= 1).
        empty_mean: fill the empty slots of each voxel with its mean point.

    Returns:
        :class:`VoxelArrays`; voxel rows are ordered by cloud, then first-seen.
    """
    num_points, num_features = int(points.shape[0]), int(points.shape[1])
    ndim, batch_size = grid.ndim, len(cloud_sizes)
    cells = cell_count(grid.grid_size)
    # An upper bound on the temporaries (V, G, M <= P); untouched pages cost nothing.
    scratch = Scratch(xp, num_points * (6 + (ndim + 3) * points.dtype.itemsize + 13 * 8 + 3 * 4) + 64 * 32)
    kept, offsets = in_range_points(xp, scratch, points, grid)
    num_kept = int(kept.shape[0])
    if num_kept == 0:
        return empty_result(xp, num_points, num_features, ndim, max_points, points.dtype)
    keys = voxel_keys(xp, scratch, offsets, kept, grid, cloud_sizes)
    point_of_sorted, run_start, group_start, group_key = sorted_runs(
        xp, scratch, keys, kept, num_points, batch_size * cells - 1
    )
    num_groups = int(group_start.shape[0])
    group_first = take(xp, point_of_sorted, group_start, out=scratch.empty(num_groups, xp.int64))
    rank = first_seen_rank(xp, scratch, group_first, num_points)
    group_cloud = group_key // cells if batch_size > 1 else None
    group_voxel, voxel_group = select_voxels(xp, scratch, rank, group_cloud, batch_size, max_voxels)
    num_voxels = int(voxel_group.shape[0])

    # Per-voxel outputs.
    counts = scratch.empty(num_groups, xp.int64)
    xp.subtract(group_start[1:], group_start[:-1], out=counts[:-1])
    counts[-1] = num_kept - group_start[-1]
    num_per_voxel = xp.minimum(counts[voxel_group], max_points).astype(xp.int32)
    voxel_first = take(xp, group_first, voxel_group, out=scratch.empty(num_voxels, xp.int64))
    indices = xp.empty((num_voxels, ndim), dtype=xp.int32)
    offset = scratch.empty(num_voxels, points.dtype)
    for axis in range(ndim):  # truncated like the keys: the floor of a non-negative offset
        indices[:, ndim - 1 - axis] = take(xp, offsets[axis], voxel_first, out=offset)
    batch = xp.zeros((num_voxels,), dtype=xp.int32)
    if group_cloud is not None:
        batch[...] = group_cloud[voxel_group]

    # Per-point outputs: voxel ids, and the stored points.
    count_dtype = _count_dtype(xp, num_kept)
    group_of_sorted = xp.cumsum(run_start, dtype=count_dtype, out=scratch.empty(num_kept, count_dtype))
    group_of_sorted -= 1
    voxel_of_sorted = take(xp, group_voxel, group_of_sorted, out=scratch.empty(num_kept, xp.int64))
    point_voxel_id = xp.full((num_points,), -1, dtype=xp.int64)
    point_voxel_id[point_of_sorted] = voxel_of_sorted

    check_voxels_size(xp, num_voxels, max_points, num_features, points.dtype.itemsize, counts, num_points)
    if max_points == 1:  # only first points are stored: a gather in row order
        voxels = xp.empty((num_voxels, num_features), dtype=points.dtype)
        copy_rows(xp, scratch, voxels, None, points, voxel_first)
    else:
        # Row of every kept point: voxel * max_points + slot (its place in the run).
        # Points not stored (slot >= max_points, or a dropped voxel) go to one extra
        # trash row past the end, so no compaction pass is needed.
        slot = scratch.empty(num_kept, count_dtype)
        take(xp, group_start.astype(count_dtype), group_of_sorted, out=slot)
        xp.subtract(xp.arange(num_kept, dtype=count_dtype), slot, out=slot)
        not_stored = run_start  # reused: run_start is no longer needed
        xp.greater_equal(slot, max_points, out=not_stored)
        if num_voxels != num_groups:
            not_stored |= voxel_of_sorted < 0
        rows = voxel_of_sorted  # reused: the ids are in point_voxel_id already
        rows *= max_points
        rows += slot
        trash = num_voxels * max_points
        xp.copyto(rows, trash, where=not_stored)
        # Copy in input order: reads are sequential and rows come nearly increasing
        # (voxels are numbered first-seen), several times faster than sorted order.
        row_of_point = scratch.empty(num_points, xp.int64)
        row_of_point[...] = trash
        row_of_point[point_of_sorted] = rows
        voxels = xp.zeros((trash + 1, num_features), dtype=points.dtype)
        copy_rows(xp, scratch, voxels, row_of_point, points, None)
        voxels = voxels[:-1]
    voxels = voxels.reshape(num_voxels, max_points, num_features)
    if empty_mean and max_points > 1:
        voxels = fill_empty_with_mean(xp, voxels, num_per_voxel)
    return VoxelArrays(voxels, indices, batch, num_per_voxel, point_voxel_id)


def check_voxels_size(xp: Any, num_voxels: int, max_points: int, num_features: int, itemsize: int,
                      counts: Any, num_points: int) -> None:
    """Raises before allocating a ``[M, max_points, F]`` voxels array larger than the memory it needs.

    Args:
        xp: the array module.
        num_voxels: ``M``.
        max_points: the caller's ``max_num_points_per_voxel``.
        num_features: ``F``.
        itemsize: bytes per value.
        counts: int64 points per occupied voxel (any order).
        num_points: points in the input.

    Raises:
        ValueError: naming ``max_num_points_per_voxel``, the size it implies, the
            densest voxel's point count and the number of points.
    """
    size = num_voxels * max_points * num_features * itemsize
    limit = memory_limit(xp)
    if size <= limit:
        return
    densest = int(counts.max()) if counts.shape[0] else 0
    raise ValueError(
        f"max_num_points_per_voxel={max_points} makes the voxels array [{num_voxels}, {max_points}, "
        f"{num_features}] of {size / 2**30:.4g} GiB, more than the {limit / 2**30:.4g} GiB of memory "
        f"it would live in; expected at most the number of points ({num_points}), and here the "
        f"densest voxel holds {densest}. Use a smaller value (e.g. {max(1, min(densest, max_points))}, "
        "which stores every point; spconv models use 5 to 35)"
    )


def stored_point_mask(xp: Any, num_points_per_voxel: Any, max_points: int) -> Any:
    """``[M, max_points]`` bool: which slots hold a real point."""
    return xp.arange(max_points)[None, :] < num_points_per_voxel[:, None]


def masked_means(xp: Any, voxels: Any, num_points_per_voxel: Any) -> Any:
    """``[M, F]`` mean of the real (stored) points of each voxel."""
    real = stored_point_mask(xp, num_points_per_voxel, int(voxels.shape[1]))
    sums = xp.where(real[:, :, None], voxels, 0).sum(axis=1)
    counts = xp.maximum(num_points_per_voxel, 1).astype(voxels.dtype)
    return (sums / counts[:, None]).astype(voxels.dtype, copy=False)


def fill_empty_with_mean(xp: Any, voxels: Any, num_points_per_voxel: Any) -> Any:
    """Replaces the empty slots of zero-padded ``voxels`` by each voxel's mean point."""
    means = (voxels.sum(axis=1) / num_points_per_voxel[:, None].astype(voxels.dtype)).astype(voxels.dtype)
    empty = ~stored_point_mask(xp, num_points_per_voxel, int(voxels.shape[1]))
    return xp.where(empty[:, :, None], means[:, None, :], voxels)


def _cumulative(values: tuple[int, ...]) -> list[int]:
    """Running sums of Python ints."""
    total, out = 0, []
    for value in values:
        total += value
        out.append(total)
    return out
