"""Tests for sparsecore.voxelization: a per-point Python oracle, spconv's PointToVoxel, and errors."""

from __future__ import annotations

import math

from pathlib import Path

import numpy as np
import pytest

from sparsecore.voxelization import (
    BatchedVoxels,
    VoxelGrid,
    Voxels,
    gather_voxel_features,
    voxel_means,
    voxelize,
    voxelize_batch,
)

LIDAR = str(Path(__file__).resolve().parents[1] / "data" / "lidar_points_198k.npz")


# --------------------------------------------------------------------------- oracle


def oracle_grid_size_xyz(voxel_size, coordinate_range):
    """round((max - min) / size) in float32, halves up (spconv's rule), xyz order."""
    ndim = len(voxel_size)
    out = []
    for axis in range(ndim):
        lo, hi = np.float32(coordinate_range[axis]), np.float32(coordinate_range[ndim + axis])
        out.append(int(np.floor(np.float64((hi - lo) / np.float32(voxel_size[axis])) + 0.5)))
    return out


def oracle_voxelize(points, voxel_size, coordinate_range, max_points, max_voxels, empty_mean=False):
    """One point at a time: a dict from voxel coordinate to first-seen rank."""
    ndim = len(voxel_size)
    real = points.dtype.type
    lower = [real(v) for v in coordinate_range[:ndim]]
    upper = [real(v) for v in coordinate_range[ndim:]]
    size = [real(v) for v in voxel_size]
    grid = oracle_grid_size_xyz(voxel_size, coordinate_range)
    rank_of, coords, members = {}, [], []
    point_voxel_id = np.full(len(points), -1, dtype=np.int64)
    for i, point in enumerate(points):
        coord = []
        for axis in range(ndim):
            x = point[axis]
            if not (lower[axis] <= x < upper[axis]):
                break
            cell = math.floor((x - lower[axis]) / size[axis])
            if cell >= grid[axis]:
                break
            coord.append(cell)
        else:
            key = tuple(coord)
            if key not in rank_of:
                rank_of[key] = len(coords)
                coords.append(key)
                members.append([])
            rank = rank_of[key]
            if rank < max_voxels:
                point_voxel_id[i] = rank
                members[rank].append(i)
    count = min(len(coords), max_voxels)
    voxels = np.zeros((count, max_points, points.shape[1]), dtype=points.dtype)
    num = np.zeros(count, dtype=np.int32)
    for rank in range(count):
        stored = members[rank][:max_points]
        num[rank] = len(stored)
        voxels[rank, : len(stored)] = points[stored]
        if empty_mean:
            voxels[rank, len(stored) :] = points[stored].mean(axis=0)
    indices = np.array([c[::-1] for c in coords[:count]], dtype=np.int32).reshape(count, ndim)
    return voxels, indices, num, point_voxel_id


def random_cloud(rng, ndim, num_points, voxel_size, coordinate_range, num_features=None, dtype=np.float32):
    """Uniform points (some outside the range), dense clusters, and points on cell boundaries."""
    num_features = num_features or ndim + 2
    lo = np.asarray(coordinate_range[:ndim], dtype=np.float64)
    hi = np.asarray(coordinate_range[ndim:], dtype=np.float64)
    size = np.asarray(voxel_size, dtype=np.float64)
    span = hi - lo
    n_uniform, n_cluster = num_points // 3, num_points // 3
    n_boundary = num_points - n_uniform - n_cluster
    uniform = rng.uniform(lo - 0.15 * span, hi + 0.15 * span, size=(n_uniform, ndim))
    centers = rng.uniform(lo, hi, size=(max(1, num_points // 40), ndim))
    cluster = centers[rng.integers(len(centers), size=n_cluster)] + rng.normal(0, size / 4, (n_cluster, ndim))
    cells = np.floor(span / size).astype(np.int64) + 1
    boundary = lo + rng.integers(0, cells + 1, size=(n_boundary, ndim)) * size
    boundary[: n_boundary // 4, 0] = hi[0]  # exactly at max: out of range
    boundary[n_boundary // 4 : n_boundary // 2, -1] = lo[-1]  # exactly at min: in range
    xyz = np.concatenate([uniform, cluster, boundary])
    extra = rng.normal(size=(num_points, num_features - ndim))
    cloud = np.concatenate([xyz, extra], axis=1).astype(dtype)
    return cloud[rng.permutation(num_points)]


def assert_matches_oracle(points, voxel_size, coordinate_range, max_points, max_voxels, empty_mean=False):
    result = voxelize(points, voxel_size, coordinate_range, max_points, max_voxels, empty_mean=empty_mean)
    voxels, indices, num, ids = oracle_voxelize(
        points, voxel_size, coordinate_range, max_points, max_voxels, empty_mean
    )
    assert isinstance(result, Voxels)
    assert result.grid_size == tuple(oracle_grid_size_xyz(voxel_size, coordinate_range)[::-1])
    assert result.voxels.dtype == points.dtype and result.voxels.shape == voxels.shape
    assert result.indices.dtype == np.int32 and result.num_points_per_voxel.dtype == np.int32
    assert result.point_voxel_id.dtype == np.int64
    np.testing.assert_array_equal(result.indices, indices)
    np.testing.assert_array_equal(result.num_points_per_voxel, num)
    np.testing.assert_array_equal(result.point_voxel_id, ids)
    if empty_mean:
        np.testing.assert_allclose(result.voxels, voxels, rtol=1e-5, atol=1e-5)
    else:
        np.testing.assert_array_equal(result.voxels, voxels)
    return result


# (voxel_size, coordinate_range): dyadic sizes, sizes that do not divide the span
# (grid rounds down: round-off drops; grid rounds up: points up to max kept), offsets.
CONFIGS = {
    1: [((0.25,), (-2.0, 3.0)), ((0.3,), (0.0, 1.0)), ((0.4,), (0.0, 1.0))],
    2: [((0.5, 0.25), (-4.0, -2.0, 4.0, 2.0)), ((0.3, 0.7), (-1.3, 0.2, 2.9, 5.1))],
    3: [((0.1, 0.1, 0.2), (-3.0, -3.0, -1.0, 3.0, 3.0, 1.0)), ((0.5, 0.3, 0.25), (0.0, -1.0, -2.0, 4.0, 2.0, 1.0))],
    4: [((0.5, 0.5, 0.5, 1.0), (0.0, 0.0, 0.0, 0.0, 3.0, 3.0, 2.0, 4.0))],
}


@pytest.mark.parametrize("ndim", [1, 2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_oracle_random_clouds(ndim, seed):
    rng = np.random.default_rng(seed)
    for voxel_size, coordinate_range in CONFIGS[ndim]:
        cloud = random_cloud(rng, ndim, 900, voxel_size, coordinate_range)
        # caps hit (1 and 3 points, few voxels) and not hit
        for max_points, max_voxels in [(1, 10**6), (3, 10**6), (64, 10**6), (3, 7), (2, 1)]:
            assert_matches_oracle(cloud, voxel_size, coordinate_range, max_points, max_voxels)


@pytest.mark.parametrize("seed", [3, 4])
def test_matches_oracle_float64_and_empty_mean(seed):
    rng = np.random.default_rng(seed)
    voxel_size, coordinate_range = CONFIGS[3][1]
    cloud64 = random_cloud(rng, 3, 700, voxel_size, coordinate_range, dtype=np.float64)
    assert_matches_oracle(cloud64, voxel_size, coordinate_range, 4, 10**6)
    cloud32 = cloud64.astype(np.float32)
    for max_points, max_voxels in [(4, 10**6), (2, 9), (1, 10**6)]:
        assert_matches_oracle(cloud32, voxel_size, coordinate_range, max_points, max_voxels, empty_mean=True)


def test_points_beyond_cap_keep_their_voxel_id_and_order():
    points = np.array(
        [[0.5, 0.5], [1.5, 0.5], [0.6, 0.5], [0.7, 0.5], [0.8, 0.6], [9.0, 0.0], [1.2, 0.1], [2.5, 2.5]],
        dtype=np.float32,
    )
    result = voxelize(points, (1.0, 1.0), (0.0, 0.0, 4.0, 4.0), 2, 2)
    # voxels numbered by first point: (0,0) then (1,0); (2,2) is the third voxel: dropped
    np.testing.assert_array_equal(result.indices, [[0, 0], [0, 1]])
    np.testing.assert_array_equal(result.num_points_per_voxel, [2, 2])
    np.testing.assert_array_equal(result.point_voxel_id, [0, 1, 0, 0, 0, -1, 1, -1])
    np.testing.assert_array_equal(result.voxels[0], points[[0, 2]])
    np.testing.assert_array_equal(result.voxels[1], points[[1, 6]])


def test_boundaries_min_inclusive_max_exclusive():
    points = np.array([[0.0], [1.0], [0.999999], [-1e-7], [0.5], [np.nan], [np.inf], [-np.inf]], dtype=np.float32)
    result = voxelize(points, (0.25,), (0.0, 1.0), 4, 100)
    np.testing.assert_array_equal(result.point_voxel_id, [0, -1, 1, -1, 2, -1, -1, -1])
    np.testing.assert_array_equal(result.indices[:, 0], [0, 3, 2])


def test_round_off_into_cell_grid_size_is_dropped():
    # float32: (1.7499999 - -79.8) / 0.05 rounds to exactly 1631 = grid_size, though x < max
    below_max = np.nextafter(np.float32(1.75), np.float32(-np.inf))
    points = np.array([[below_max], [1.7], [-79.8]], dtype=np.float32)
    result = voxelize(points, (0.05,), (-79.8, 1.75), 1, 10)
    assert result.grid_size == (1631,)
    assert (below_max - np.float32(-79.8)) / np.float32(0.05) == 1631
    np.testing.assert_array_equal(result.point_voxel_id, [-1, 0, 1])
    cell = int(np.floor((np.float32(1.7) - np.float32(-79.8)) / np.float32(0.05)))
    np.testing.assert_array_equal(result.indices[:, 0], [cell, 0])


def test_grid_size_rounds_like_spconv():
    assert VoxelGrid((0.1, 0.1, 0.2), (-80, -80, -2, 80, 80, 6)).grid_size == (40, 1600, 1600)
    assert VoxelGrid((0.3,), (0, 1)).grid_size == (3,)  # 3.33 -> 3
    assert VoxelGrid((0.4,), (0, 1)).grid_size == (3,)  # 2.5 -> 3 (halves round up)
    assert VoxelGrid((0.16, 0.16), (0, -39.68, 69.12, 39.68)).grid_size == (496, 432)


def test_voxel_grid_is_frozen_and_hashable():
    grid = VoxelGrid([0.5, 0.5], np.array([0, 0, 2, 3]))
    assert grid.voxel_size == (0.5, 0.5) and grid.coordinate_range == (0.0, 0.0, 2.0, 3.0)
    assert grid.ndim == 2 and grid.lower == (0.0, 0.0) and grid.upper == (2.0, 3.0)
    assert hash(grid) == hash(VoxelGrid((0.5, 0.5), (0, 0, 2, 3)))
    with pytest.raises(AttributeError):
        grid.voxel_size = (1.0, 1.0)


def test_fallback_sort_path_for_wide_keys():
    """Keys too wide to pack with positions take the stable-argsort path."""
    rng = np.random.default_rng(7)
    voxel_size, coordinate_range = (1.0,) * 4, (0.0,) * 4 + (32768.0,) * 4  # 2^60 cells
    cloud = rng.uniform(-100, 32868, size=(300, 5))
    cloud[150:, :4] = np.floor(cloud[:150, :4]) + 0.5  # revisit voxels
    cloud = cloud[rng.permutation(300)].astype(np.float32)
    assert_matches_oracle(cloud, voxel_size, coordinate_range, 2, 10**6)
    assert_matches_oracle(cloud, voxel_size, coordinate_range, 1, 50)


# --------------------------------------------------------------------------- empty inputs


@pytest.mark.parametrize("empty_mean", [False, True])
def test_empty_inputs(empty_mean):
    for points in (np.zeros((0, 4), np.float32), np.full((5, 4), 100.0, np.float32)):
        result = voxelize(points, (0.5, 0.5, 0.5), (0, 0, 0, 2, 2, 2), 3, 10, empty_mean=empty_mean)
        assert result.voxels.shape == (0, 3, 4) and result.voxels.dtype == np.float32
        assert result.indices.shape == (0, 3) and result.indices.dtype == np.int32
        assert result.num_points_per_voxel.shape == (0,)
        np.testing.assert_array_equal(result.point_voxel_id, np.full(len(points), -1))
        assert result.num_voxels == 0
        assert voxel_means(result).shape == (0, 4)
        assert gather_voxel_features(np.zeros((0, 2)), result.point_voxel_id, invalid_value=7).tolist() == [
            [7.0, 7.0]
        ] * len(points)


# --------------------------------------------------------------------------- means and gather


def test_voxel_means_and_empty_mean_padding():
    rng = np.random.default_rng(11)
    voxel_size, coordinate_range = CONFIGS[3][0]
    cloud = random_cloud(rng, 3, 600, voxel_size, coordinate_range)
    plain = voxelize(cloud, voxel_size, coordinate_range, 3, 10**6)
    padded = voxelize(cloud, voxel_size, coordinate_range, 3, 10**6, empty_mean=True)
    expected = np.stack(
        [cloud[np.flatnonzero(plain.point_voxel_id == v)[:3]].mean(axis=0) for v in range(plain.num_voxels)]
    )
    np.testing.assert_allclose(voxel_means(plain), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(voxel_means(padded), expected, rtol=1e-5, atol=1e-6)
    slots = np.arange(3)[None, :] < plain.num_points_per_voxel[:, None]
    np.testing.assert_array_equal(padded.voxels[slots], plain.voxels[slots])
    np.testing.assert_allclose(padded.voxels, np.where(slots[..., None], plain.voxels, expected[:, None]), rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="voxels must be the Voxels or BatchedVoxels"):
        voxel_means(plain.voxels)


def test_gather_voxel_features():
    points = np.array([[0.5, 0.5], [5.0, 5.0], [1.5, 0.5], [0.6, 0.6]], dtype=np.float32)
    result = voxelize(points, (1.0, 1.0), (0, 0, 2, 2), 1, 10)
    features = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float64)
    out = gather_voxel_features(features, result.point_voxel_id, invalid_value=-9)
    assert out.dtype == np.float64 and out.shape == (4, 2)
    np.testing.assert_array_equal(out, [[1, 2], [-9, -9], [3, 4], [1, 2]])
    np.testing.assert_array_equal(gather_voxel_features(features, result.point_voxel_id)[1], [0, 0])
    with pytest.raises(ValueError, match=r"point_voxel_id must lie in \[-1, 2\).*got values in \[-1, 2\]"):
        gather_voxel_features(features, np.array([0, 2, -1]))
    with pytest.raises(ValueError, match=r"point_voxel_id must lie in \[-1, 2\)"):
        gather_voxel_features(features, np.array([-2]))
    with pytest.raises(TypeError, match="point_voxel_id must be a 1-D integer array"):
        gather_voxel_features(features, np.array([0.0, 1.0]))
    with pytest.raises(TypeError, match=r"point_voxel_id must be a 1-D integer array \[P\].*shape \(2, 1\)"):
        gather_voxel_features(features, np.array([[0], [1]]))


# --------------------------------------------------------------------------- batches


def test_batch_equals_per_cloud_voxelize():
    rng = np.random.default_rng(5)
    voxel_size, coordinate_range = CONFIGS[3][1]
    clouds = [
        random_cloud(rng, 3, 500, voxel_size, coordinate_range),
        np.zeros((0, 5), np.float32),  # empty cloud
        random_cloud(rng, 3, 300, voxel_size, coordinate_range),
        np.full((4, 5), 1e3, np.float32),  # all out of range
        random_cloud(rng, 3, 400, voxel_size, coordinate_range),
    ]
    for max_points, max_voxels in [(3, 10**6), (2, 25), (1, 1)]:
        batched = voxelize_batch(clouds, voxel_size, coordinate_range, max_points, max_voxels, empty_mean=True)
        assert isinstance(batched, BatchedVoxels) and batched.batch_size == len(clouds)
        assert batched.indices.shape[1] == 4 and batched.indices.dtype == np.int32
        singles = [voxelize(c, voxel_size, coordinate_range, max_points, max_voxels, empty_mean=True) for c in clouds]
        offsets = np.cumsum([0] + [s.num_voxels for s in singles])
        assert batched.num_voxels == offsets[-1]
        for b, single in enumerate(singles):
            rows = slice(offsets[b], offsets[b + 1])
            assert single.num_voxels <= max_voxels
            np.testing.assert_array_equal(batched.indices[rows, 0], b)
            np.testing.assert_array_equal(batched.indices[rows, 1:], single.indices)
            np.testing.assert_array_equal(batched.voxels[rows], single.voxels)
            np.testing.assert_array_equal(batched.num_points_per_voxel[rows], single.num_points_per_voxel)
            ids = single.point_voxel_id
            np.testing.assert_array_equal(batched.point_voxel_id[b], np.where(ids >= 0, ids + offsets[b], -1))
        assert batched.grid_size == singles[0].grid_size
        means = gather_voxel_features(voxel_means(batched), np.concatenate(batched.point_voxel_id))
        assert means.shape == (sum(len(c) for c in clouds), 5)


def test_batch_of_one_and_errors():
    cloud = np.array([[0.1, 0.1, 0.1]], np.float32)
    batched = voxelize_batch((cloud,), (1, 1, 1), (0, 0, 0, 1, 1, 1), 1, 1)
    np.testing.assert_array_equal(batched.indices, [[0, 0, 0, 0]])
    assert len(batched.point_voxel_id) == 1 and batched.point_voxel_id[0].tolist() == [0]
    with pytest.raises(ValueError, match="point_clouds must be a non-empty list or tuple"):
        voxelize_batch([], (1, 1, 1), (0, 0, 0, 1, 1, 1), 1, 1)
    with pytest.raises(ValueError, match=r"point_clouds\[1\] is \[1, 4\] float32"):
        voxelize_batch([cloud, np.zeros((1, 4), np.float32)], (1, 1, 1), (0, 0, 0, 1, 1, 1), 1, 1)
    with pytest.raises(ValueError, match=r"point_clouds\[1\] is \[1, 3\] float64"):
        voxelize_batch([cloud, cloud.astype(np.float64)], (1, 1, 1), (0, 0, 0, 1, 1, 1), 1, 1)
    with pytest.raises(TypeError, match=r"point_clouds\[0\] must be float32 or float64, got int64"):
        voxelize_batch([np.zeros((1, 3), np.int64)], (1, 1, 1), (0, 0, 0, 1, 1, 1), 1, 1)


# --------------------------------------------------------------------------- bad input

GOOD = dict(voxel_size=(0.1, 0.1, 0.2), coordinate_range=(0, 0, 0, 1, 1, 1), max_num_points_per_voxel=5, max_num_voxels=100)


def call(points=None, **changes):
    kwargs = {**GOOD, **changes}
    points = np.zeros((4, 4), np.float32) if points is None else points
    return voxelize(points, kwargs["voxel_size"], kwargs["coordinate_range"],
                    kwargs["max_num_points_per_voxel"], kwargs["max_num_voxels"])


@pytest.mark.parametrize(
    "changes, error, pattern",
    [
        (dict(voxel_size=(0.1, 0.0, 0.2)), ValueError,
         r"voxel_size must be 3 positive finite numbers \(xyz\), got \(0\.1, 0\.0, 0\.2\): axis y is 0\.0"),
        (dict(voxel_size=(-0.1, 0.1, 0.2)), ValueError, "axis x is -0.1"),
        (dict(voxel_size=(0.1, 0.1, float("nan"))), ValueError, "axis z is nan"),
        (dict(voxel_size=(0.1, float("inf"), 0.1)), ValueError, "axis y is inf"),
        (dict(voxel_size=()), ValueError, r"voxel_size must have 1 to 4 entries .* got 0"),
        (dict(voxel_size=(1,) * 5), ValueError, r"voxel_size must have 1 to 4 entries .* got 5"),
        (dict(voxel_size=0.1), TypeError, r"voxel_size must be a sequence of numbers \(xyz order\), got 0\.1"),
        (dict(voxel_size="abc"), TypeError, "voxel_size must be a sequence of numbers"),
        (dict(coordinate_range=(0, 0, 0, 1)), ValueError,
         r"coordinate_range must have 2 \* 3 = 6 numbers \(min_x, min_y, min_z, max_x, max_y, max_z\).*got 4"),
        (dict(coordinate_range=(0, 2, 0, 1, 1, 1)), ValueError,
         r"coordinate_range min_y \(2\.0\) must be less than max_y \(1\.0\)"),
        (dict(coordinate_range=(0, 0, 1, 1, 1, 1)), ValueError, r"min_z \(1\.0\) must be less than max_z \(1\.0\)"),
        (dict(coordinate_range=(0, 0, 0, 1, float("nan"), 1)), ValueError, "coordinate_range must be finite.*max_y is nan"),
        (dict(coordinate_range=(0, 0, -1e39, 1, 1, 1)), ValueError, "min_z is -1e\\+39"),
        (dict(coordinate_range=(0, 0, 0, 1, 1, 0.05)), ValueError, "less than half a voxel.*0 cells"),
        (dict(max_num_points_per_voxel=0), ValueError, r"max_num_points_per_voxel must be an integer >= 1 .*got 0"),
        (dict(max_num_points_per_voxel=2.5), TypeError, r"max_num_points_per_voxel must be an integer >= 1 .*got 2\.5"),
        (dict(max_num_points_per_voxel=True), TypeError, "max_num_points_per_voxel must be an integer"),
        (dict(max_num_voxels=0), ValueError, r"max_num_voxels must be an integer >= 1 .*got 0"),
        (dict(max_num_voxels=-3), ValueError, r"max_num_voxels must be an integer >= 1 .*got -3"),
        (dict(voxel_size=(1.0,) * 4, coordinate_range=(0,) * 4 + (1e9,) * 4), ValueError,
         r"voxel keys overflow int64: batch_size 1 x grid_size \(1000000000, "),
        (dict(voxel_size=(1e-3,), coordinate_range=(0, 1e7)), ValueError, "beyond int32 voxel indices"),
    ],
)
def test_bad_parameters(changes, error, pattern):
    points = np.zeros((4, 4), np.float32)
    with pytest.raises(error, match=pattern):
        call(points, **changes)


@pytest.mark.parametrize(
    "points, error, pattern",
    [
        (np.zeros(6, np.float32), ValueError, r"points must be 2-D \[num_points, 3 \+ extra features\].*got shape \(6,\)"),
        (np.zeros((2, 3, 1), np.float32), ValueError, r"got shape \(2, 3, 1\)"),
        (np.zeros((4, 2), np.float32), ValueError, r"points has 2 columns but voxel_size is 3-D.*\[P, >= 3\]"),
        (np.zeros((4, 3), np.int32), TypeError, "points must be float32 or float64, got int32"),
        (np.zeros((4, 3), np.float16), TypeError, "points must be float32 or float64, got float16"),
        ("not an array", TypeError, "points must be an array"),
    ],
)
def test_bad_points(points, error, pattern):
    with pytest.raises(error, match=pattern):
        call(points)


def test_key_capacity_names_batch_size():
    grid = VoxelGrid((1.0, 1.0), (0, 0, 2e9, 2e9))  # 4e18 cells: 2 clouds fit in int64, 3 do not
    grid.check_key_capacity(2)
    with pytest.raises(ValueError, match=r"batch_size 3 x grid_size \(2000000000, 2000000000\)"):
        grid.check_key_capacity(3)


def test_torch_input_and_jax_tracer():
    torch = pytest.importorskip("torch")
    cloud = random_cloud(np.random.default_rng(9), 3, 200, *CONFIGS[3][0])
    expected = voxelize(cloud, *CONFIGS[3][0], 2, 1000)
    got = voxelize(torch.from_numpy(cloud), *CONFIGS[3][0], 2, 1000)
    np.testing.assert_array_equal(got.voxels, expected.voxels)
    np.testing.assert_array_equal(got.point_voxel_id, expected.point_voxel_id)
    with pytest.raises(TypeError, match="points is a torch tensor that requires grad.*sparsecore.torch"):
        voxelize(torch.from_numpy(cloud).requires_grad_(True), *CONFIGS[3][0], 2, 1000)
    jax = pytest.importorskip("jax")
    with pytest.raises(TypeError, match="points is a JAX tracer"):
        jax.jit(lambda p: voxelize(p, *CONFIGS[3][0], 2, 1000).voxels)(cloud)


# --------------------------------------------------------------------------- spconv


def spconv_point_to_voxel(points, voxel_size, coordinate_range, max_points, max_voxels):
    torch = pytest.importorskip("torch")
    utils = pytest.importorskip("spconv.pytorch.utils")
    generator = utils.PointToVoxel(
        vsize_xyz=list(voxel_size), coors_range_xyz=list(coordinate_range),
        num_point_features=points.shape[1], max_num_voxels=max_voxels, max_num_points_per_voxel=max_points,
    )
    out = generator.generate_voxel_with_id(torch.from_numpy(points))
    return [t.numpy() for t in out], tuple(generator.grid_size)


def lidar_points(count, with_intensity=True):
    points = np.load(LIDAR)["points"][:count]
    if with_intensity:  # a synthetic 4th feature, so every column is checked to travel along
        points = np.concatenate([points, np.linspace(0, 1, len(points), dtype=np.float32)[:, None]], axis=1)
    return np.ascontiguousarray(points, dtype=np.float32)


@pytest.mark.parametrize(
    "voxel_size, coordinate_range, max_points, max_voxels",
    [
        ((0.2, 0.2, 0.2), (-80, -80, -2, 80, 80, 6), 5, 10**6),
        ((0.2, 0.2, 0.2), (-80, -80, -2, 80, 80, 6), 1, 10**6),
        ((0.2, 0.2, 0.2), (-40, -20, -1, 40, 20, 3), 3, 4000),  # range and voxel caps hit
        ((0.32, 0.32), (-51.2, -51.2, 51.2, 51.2), 20, 12000),  # pillars
    ],
)
def test_matches_spconv_on_real_lidar(voxel_size, coordinate_range, max_points, max_voxels):
    points = lidar_points(60000)
    (voxels, coords, num, ids), grid_size = spconv_point_to_voxel(
        points, voxel_size, coordinate_range, max_points, max_voxels
    )
    result = voxelize(points, voxel_size, coordinate_range, max_points, max_voxels)
    assert result.grid_size == grid_size
    # same order: spconv's CPU build also numbers voxels by first point
    np.testing.assert_array_equal(result.indices, coords)
    np.testing.assert_array_equal(result.num_points_per_voxel, num)
    np.testing.assert_array_equal(result.point_voxel_id, ids)
    np.testing.assert_array_equal(result.voxels, voxels)


def test_matches_spconv_4d_random():
    rng = np.random.default_rng(13)
    voxel_size, coordinate_range = (0.5, 0.5, 0.5, 1.0), (0, 0, 0, 0, 3, 3, 2, 4)
    points = random_cloud(rng, 4, 2000, voxel_size, coordinate_range, num_features=5)
    (voxels, coords, num, ids), grid_size = spconv_point_to_voxel(points, voxel_size, coordinate_range, 3, 200)
    result = voxelize(points, voxel_size, coordinate_range, 3, 200)
    assert result.grid_size == grid_size
    np.testing.assert_array_equal(result.indices, coords)
    np.testing.assert_array_equal(result.point_voxel_id, ids)
    np.testing.assert_array_equal(result.voxels, voxels)


def test_strided_and_fortran_points():
    rng = np.random.default_rng(17)
    voxel_size, coordinate_range = CONFIGS[3][0]
    cloud = random_cloud(rng, 3, 400, voxel_size, coordinate_range, num_features=6)
    for view in (cloud[::2, ::2], np.asfortranarray(cloud[::2, ::2]), cloud[::2], cloud[::-3, :4]):
        for max_points in (1, 3):
            expected = voxelize(np.ascontiguousarray(view), voxel_size, coordinate_range, max_points, 10**6)
            got = voxelize(view, voxel_size, coordinate_range, max_points, 10**6)
            np.testing.assert_array_equal(got.voxels, expected.voxels)
            np.testing.assert_array_equal(got.point_voxel_id, expected.point_voxel_id)


def test_empty_mean_against_spconv_first_voxel():
    """spconv 2.3.8's CPU empty_mean only fills its first voxel right (see the module docstring)."""
    points = lidar_points(5000)
    voxel_size, coordinate_range = (0.2, 0.2, 0.2), (-80, -80, -2, 80, 80, 6)
    torch = pytest.importorskip("torch")
    utils = pytest.importorskip("spconv.pytorch.utils")
    generator = utils.PointToVoxel(list(voxel_size), list(coordinate_range), 4, 10**5, 5)
    spconv_voxels = generator.generate_voxel_with_id(torch.from_numpy(points), empty_mean=True)[0].numpy()
    result = voxelize(points, voxel_size, coordinate_range, 5, 10**5, empty_mean=True)
    assert result.num_points_per_voxel[0] < 5  # the first voxel has padding to fill
    np.testing.assert_allclose(result.voxels[0], spconv_voxels[0], rtol=1e-6)
    assert_matches_oracle(points, voxel_size, coordinate_range, 5, 10**5, empty_mean=True)


@pytest.mark.gpu
def test_cupy_matches_numpy():
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(19)
    for ndim in (1, 2, 3, 4):
        for voxel_size, coordinate_range in CONFIGS[ndim]:
            cloud = random_cloud(rng, ndim, 3000, voxel_size, coordinate_range)
            for max_points, max_voxels, empty_mean in [(1, 10**6, False), (3, 10**6, True), (2, 40, False)]:
                expected = voxelize(cloud, voxel_size, coordinate_range, max_points, max_voxels,
                                    empty_mean=empty_mean)
                got = voxelize(cupy.asarray(cloud), voxel_size, coordinate_range, max_points, max_voxels,
                               empty_mean=empty_mean)
                assert isinstance(got.voxels, cupy.ndarray)
                np.testing.assert_array_equal(cupy.asnumpy(got.indices), expected.indices)
                np.testing.assert_array_equal(cupy.asnumpy(got.point_voxel_id), expected.point_voxel_id)
                np.testing.assert_array_equal(cupy.asnumpy(got.num_points_per_voxel), expected.num_points_per_voxel)
                np.testing.assert_allclose(cupy.asnumpy(got.voxels), expected.voxels, rtol=1e-6)
            clouds = [cloud[:1000], cloud[1000:1000], cloud[1000:]]
            expected = voxelize_batch(clouds, voxel_size, coordinate_range, 2, 50)
            got = voxelize_batch([cupy.asarray(c) for c in clouds], voxel_size, coordinate_range, 2, 50)
            np.testing.assert_array_equal(cupy.asnumpy(got.indices), expected.indices)
            means = gather_voxel_features(voxel_means(got), cupy.concatenate(got.point_voxel_id), invalid_value=-1)
            np.testing.assert_allclose(
                cupy.asnumpy(means),
                gather_voxel_features(voxel_means(expected), np.concatenate(expected.point_voxel_id), -1),
                rtol=1e-6,
            )


# --------------------------------------------------------------------------- refusals (issue 16)


def test_voxelize_bounds_max_num_points_per_voxel_by_the_memory_and_names_the_densest_voxel():
    points = np.random.default_rng([16004]).uniform(0, 4, (200, 4)).astype(np.float32)
    with pytest.raises(ValueError, match=r"max_num_points_per_voxel=1000000000 .* expected at most the number "
                                         r"of points \(200\), and here the densest voxel holds \d+"):
        voxelize(points, (1.0, 1.0, 1.0), (0, 0, 0, 4, 4, 4), 10**9, 1000)
    # more slots than points is valid: every point is stored
    voxels = voxelize(points, (1.0, 1.0, 1.0), (0, 0, 0, 4, 4, 4), 500, 1000)
    assert voxels.voxels.shape[1] == 500 and int(np.asarray(voxels.num_points_per_voxel).sum()) == 200
