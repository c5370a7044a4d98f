"""Tests for sparsecore._voxel_hashing: the CPU hash-table voxelization against the xp-generic sorting path.

The sorting path (`sparsecore._voxel_math.voxelize_points`, run here on NumPy; it is
what CuPy input takes) is itself checked against a per-point oracle and spconv in
tests/test_voxelization.py; the two must agree bitwise on every output.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparsecore import _voxel_hashing, _voxel_math
from sparsecore.threads import numba_module
from sparsecore.voxelization import VoxelGrid, voxelize, voxelize_batch

FIELDS = ("voxels", "indices", "batch", "num_points_per_voxel", "point_voxel_id")


def assert_same(expected, actual) -> None:
    for name, want, got in zip(FIELDS, expected, actual):
        assert got.dtype == want.dtype, name
        assert got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)


def both_paths(points, sizes, grid, max_points, max_voxels, empty_mean=False):
    sorting = _voxel_math.voxelize_points(np, points, sizes, grid, max_points, max_voxels, empty_mean)
    hashing = _voxel_hashing.voxelize_points(points, sizes, grid, max_points, max_voxels, empty_mean)
    return sorting, hashing


def random_cloud(rng, count, ndim, features, dtype, spread=1.2):
    """Points around a [-1, 1]^D box, some outside, with repeats so voxels hold several points."""
    points = rng.uniform(-spread, spread, size=(count, features)).astype(dtype)
    repeats = rng.integers(0, count, size=count // 3)
    points[rng.integers(0, count, size=count // 3)] = points[repeats]
    return points


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("ndim", [1, 2, 3, 4])
@pytest.mark.parametrize("max_points", [1, 3, 40])
def test_matches_sorting_path(dtype, ndim, max_points) -> None:
    rng = np.random.default_rng(1400 + 10 * ndim + max_points)
    grid = VoxelGrid((0.13, 0.2, 0.07, 0.5)[:ndim], tuple([-1.0] * ndim) + tuple([1.0] * ndim))
    points = random_cloud(rng, 3000, ndim, ndim + 2, dtype)
    for max_voxels in (1, 57, 10_000):
        sorting, hashing = both_paths(points, (3000,), grid, max_points, max_voxels)
        assert_same(sorting, hashing)


@pytest.mark.parametrize("max_voxels", [1, 30, 100_000])
def test_batches_match_sorting_path(max_voxels) -> None:
    rng = np.random.default_rng(1401 + max_voxels)
    grid = VoxelGrid((0.1, 0.15, 0.2), (-1.0, -1.0, -1.0, 1.0, 1.0, 1.0))
    sizes = (500, 0, 1200, 1)
    points = np.concatenate([random_cloud(rng, size, 3, 4, np.float32) for size in sizes if size]
                            + [np.zeros((0, 4), np.float32)])
    for empty_mean in (False, True):
        sorting, hashing = both_paths(points, sizes, grid, 5, max_voxels, empty_mean)
        assert_same(sorting, hashing)
        assert set(np.unique(hashing.batch)) <= {0, 2, 3}


def test_edges_nan_inf_and_strided_points() -> None:
    rng = np.random.default_rng(1402)
    # (max - min) / size is not a whole number of cells, so both upper tests are exercised.
    grid = VoxelGrid((0.3, 0.1, 0.7), (-1.0, -0.5, 0.0, 1.0, 0.5, 2.0))
    points = random_cloud(rng, 4000, 3, 6, np.float32)[:, ::2]  # non-contiguous rows
    points[:20, 0] = np.nan
    points[20:40, 1] = np.inf
    points[40:60, 2] = -np.inf
    points[60:80] = np.asarray(grid.upper, np.float32)
    points[80:100] = np.nextafter(np.asarray(grid.upper, np.float32), np.float32(-np.inf))
    points[100:120] = np.asarray(grid.lower, np.float32)
    assert not points.flags.c_contiguous
    sorting, hashing = both_paths(points, (4000,), grid, 4, 100_000, True)
    assert_same(sorting, hashing)


def test_empty_and_all_outside() -> None:
    grid = VoxelGrid((0.1, 0.1, 0.1), (0.0, 0.0, 0.0, 1.0, 1.0, 1.0))
    for points in (np.zeros((0, 3), np.float32), np.full((7, 3), 5.0, np.float32)):
        sorting, hashing = both_paths(points, (len(points),), grid, 5, 10)
        assert_same(sorting, hashing)
        assert hashing.voxels.shape == (0, 5, 3)


def test_public_functions_take_the_hashing_path_on_numpy(monkeypatch) -> None:
    rng = np.random.default_rng(1403)
    points = random_cloud(rng, 800, 3, 3, np.float32)
    calls = []
    original = _voxel_hashing.voxelize_points

    def spy(*args, **kwargs):
        calls.append(args[1])
        return original(*args, **kwargs)

    monkeypatch.setattr(_voxel_hashing, "voxelize_points", spy)
    voxelize(points, (0.2, 0.2, 0.2), (-1, -1, -1, 1, 1, 1), 3, 100)
    voxelize_batch([points, points[:5]], (0.2, 0.2, 0.2), (-1, -1, -1, 1, 1, 1), 3, 100)
    assert calls == [(800,), (800, 5)]


def test_same_result_at_every_thread_count() -> None:
    numba = numba_module()
    rng = np.random.default_rng(1404)
    points = random_cloud(rng, 20_000, 3, 4, np.float32)
    grid = VoxelGrid((0.05, 0.05, 0.05), (-1.0, -1.0, -1.0, 1.0, 1.0, 1.0))
    previous = numba.get_num_threads()
    results = []
    try:
        for threads in sorted({1, numba.config.NUMBA_NUM_THREADS}):
            numba.set_num_threads(threads)
            results.append(_voxel_hashing.voxelize_points(points, (20_000,), grid, 5, 5000, False))
    finally:
        numba.set_num_threads(previous)
    for result in results[1:]:
        assert_same(results[0], result)


def test_lidar_scan_matches_sorting_path() -> None:
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "data" / "lidar_points_198k.npz"
    if not path.exists():
        pytest.skip(f"{path} is not here")
    with np.load(path) as data:
        points = np.ascontiguousarray(data[data.files[0]][:120_000], dtype=np.float32)
    grid = VoxelGrid((0.1, 0.1, 0.1), (-80.0, -80.0, -2.0, 80.0, 80.0, 6.0))
    sorting, hashing = both_paths(points, (len(points),), grid, 5, 150_000)
    assert_same(sorting, hashing)
    sorting, hashing = both_paths(points, (len(points),), grid, 5, 20_000)
    assert_same(sorting, hashing)


def test_keys_too_wide_to_pack_with_their_group() -> None:
    # 2e6 cells per axis: keys take 63 bits, so the table stores key and group side by side
    # (and the sorting path falls back to a stable argsort).
    rng = np.random.default_rng(1405)
    grid = VoxelGrid((1e-6, 1e-6, 1e-6), (-1.0, -1.0, -1.0, 1.0, 1.0, 1.0))
    points = rng.uniform(-1.0, 1.0, size=(3000, 3))
    points[1000:2000] = points[rng.integers(0, 1000, size=1000)]
    for max_voxels in (10, 100_000):
        sorting, hashing = both_paths(points, (3000,), grid, 3, max_voxels)
        assert_same(sorting, hashing)


def test_voxels_too_large_for_memory_raise_like_the_sorting_path(monkeypatch) -> None:
    rng = np.random.default_rng(1406)
    grid = VoxelGrid((0.1, 0.1, 0.1), (-1.0, -1.0, -1.0, 1.0, 1.0, 1.0))
    points = random_cloud(rng, 2000, 3, 3, np.float32)
    monkeypatch.setattr(_voxel_math, "memory_limit", lambda xp: 1000)
    messages = []
    for run in (_voxel_math.voxelize_points, _voxel_hashing.voxelize_points):
        arguments = (points, (2000,), grid, 50, 100_000, False)
        with pytest.raises(ValueError, match="max_num_points_per_voxel=50") as error:
            run(np, *arguments) if run is _voxel_math.voxelize_points else run(*arguments)
        messages.append(str(error.value))
    assert messages[0] == messages[1]


def test_read_only_and_byte_swapped_points() -> None:
    rng = np.random.default_rng(1407)
    grid = VoxelGrid((0.2, 0.2, 0.2), (-1.0, -1.0, -1.0, 1.0, 1.0, 1.0))
    points = random_cloud(rng, 1000, 3, 4, np.float32)
    sorting = _voxel_math.voxelize_points(np, points, (1000,), grid, 3, 100, False)
    read_only = points.copy()
    read_only.setflags(write=False)
    result = voxelize(read_only, grid.voxel_size, grid.coordinate_range, 3, 100)
    assert_same(sorting, (result.voxels, result.indices, sorting.batch, result.num_points_per_voxel,
                          result.point_voxel_id))
    # numba takes native byte order only: swapped input takes the sorting path, dtype kept.
    swapped = voxelize(points.astype(">f4"), grid.voxel_size, grid.coordinate_range, 3, 100)
    assert swapped.voxels.dtype == np.dtype(">f4")
    np.testing.assert_array_equal(swapped.voxels, sorting.voxels)
    np.testing.assert_array_equal(swapped.point_voxel_id, sorting.point_voxel_id)
