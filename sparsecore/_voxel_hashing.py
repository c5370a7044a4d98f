"""Voxelization on the CPU: one pass over the points through a hash table (numba).

`sparsecore._voxel_math` finds voxels by sorting keys, a method that runs on
NumPy and CuPy alike; on the CPU the sort alone took half the time of a
120k-point cloud, and the in-range test, keys and ranking passes most of the
rest. Here one serial numba loop (`sparsecore._voxel_kernels.assign_voxels`)
visits the points in input order, tests and keys each one with the same
arithmetic, and numbers each new key as it appears: first-seen order,
per-cloud ``max_num_voxels`` and per-voxel slots fall straight out of the visit
order, with no sort and no ranking pass; a second loop stores the points.
The results are identical to the sorting path's (tests/test_voxelization.py
compares the two).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _voxel_math
from ._voxel_storage import Scratch
from ._compile_notice import numba_for_kernels

__all__ = ["voxelize_points"]


def _kernels() -> Any:
    numba_for_kernels()
    from . import _voxel_kernels

    return _voxel_kernels


def _axis_bounds(grid: Any, dtype: np.dtype) -> tuple[np.ndarray, ...]:
    """``(lower, upper, voxel_size, cells, grid, test_upper)`` per axis (xyz) for `assign_voxels`.

    ``test_upper[axis]`` is `_voxel_math.in_range_points`'s choice of upper test: ``x < max``
    when ``(max - min) / size < cells`` in the points' dtype, else ``offset < cells``.
    """
    scalar = dtype.type
    grid_xyz = np.asarray(tuple(reversed(grid.grid_size)), dtype=np.int64)
    lower = np.asarray(grid.lower, dtype=dtype)
    upper = np.asarray(grid.upper, dtype=dtype)
    size = np.asarray(grid.voxel_size, dtype=dtype)
    cells = grid_xyz.astype(dtype)
    test_upper = np.asarray(
        [(scalar(upper[axis]) - scalar(lower[axis])) / scalar(size[axis]) < scalar(cells[axis])
         for axis in range(grid.ndim)],
        dtype=np.bool_,
    )
    return lower, upper, size, cells, grid_xyz, test_upper


def voxelize_points(points: np.ndarray, cloud_sizes: tuple[int, ...], grid: Any, max_points: int,
                    max_voxels: int, empty_mean: bool) -> _voxel_math.VoxelArrays:
    """`_voxel_math.voxelize_points` for a NumPy ``points`` array: the same arguments (less ``xp``),
    the same :class:`sparsecore._voxel_math.VoxelArrays`, bit for bit."""
    num_points, num_features = int(points.shape[0]), int(points.shape[1])
    ndim = grid.ndim
    if num_points == 0:
        return _voxel_math.empty_result(np, num_points, num_features, ndim, max_points, points.dtype)
    table_bits = max(4, (2 * num_points - 1).bit_length())  # load factor at most 1/2
    cells = _voxel_math.cell_count(grid.grid_size)
    group_bits = max(1, (num_points - 1).bit_length())
    if (len(cloud_sizes) * cells - 1).bit_length() + group_bits > 63:
        group_bits = 0  # key and group do not fit one int64: store them side by side
    group_dtype = np.dtype(np.int32 if num_points < 2**31 else np.int64)
    table_width = 1 if group_bits else 2
    # Every temporary comes from one huge-page block (page faults on fresh small arrays
    # cost as much as the loops). Sized for the worst case (every point its own
    # voxel); untouched pages cost nothing.
    scratch = Scratch(np, (table_width << table_bits) * 8 + num_points * (1 + 4 + 8 + 3 * group_dtype.itemsize) + 5 * 64)
    table = scratch.empty(table_width << table_bits, np.int64).reshape(1 << table_bits, table_width)
    table[...] = -1
    keys, outside = scratch.empty(num_points, np.int64), scratch.empty(num_points, np.bool_)
    point_slot = scratch.empty(num_points, np.int32)
    groups = scratch.empty(3 * num_points, group_dtype).reshape(num_points, 3)
    point_voxel_id = np.full((num_points,), -1, dtype=np.int64)
    cloud_ends = np.cumsum(np.asarray(cloud_sizes, dtype=np.int64))
    kernels = _kernels()
    bounds = _axis_bounds(grid, points.dtype)
    kernels.point_keys(points, *bounds, cloud_ends, cells, keys, outside)
    num_groups, num_voxels = kernels.assign_voxels(
        keys, cloud_ends, max_voxels, np.uint64(64 - table_bits), group_bits, table, point_voxel_id,
        point_slot, groups,
    )
    if num_groups == 0:
        return _voxel_math.empty_result(np, num_points, num_features, ndim, max_points, points.dtype)
    counts = groups[:num_groups, 1]
    if num_voxels == num_groups:
        voxel_first, voxel_count = groups[:num_groups, 2], counts
    else:
        voxel_group = np.flatnonzero(groups[:num_groups, 0] >= 0)
        voxel_first, voxel_count = groups[voxel_group, 2], counts[voxel_group]
    indices = np.empty((num_voxels, ndim), dtype=np.int32)
    kernels.voxel_cells(points, bounds[0], bounds[2], voxel_first, indices)
    num_per_voxel = np.minimum(voxel_count, max_points).astype(np.int32)
    batch = np.zeros((num_voxels,), dtype=np.int32)
    if len(cloud_sizes) > 1:
        batch[...] = np.searchsorted(cloud_ends, voxel_first, side="right")

    _voxel_math.check_voxels_size(
        np, num_voxels, max_points, num_features, points.dtype.itemsize, counts, num_points
    )
    voxels = np.zeros((num_voxels, max_points, num_features), dtype=points.dtype)
    kernels.store_points(points, point_voxel_id, point_slot, voxels)
    if empty_mean and max_points > 1:
        voxels = _voxel_math.fill_empty_with_mean(np, voxels, num_per_voxel)
    return _voxel_math.VoxelArrays(voxels, indices, batch, num_per_voxel, point_voxel_id)
