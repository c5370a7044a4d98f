"""Inputs for the benchmark: the real LiDAR scan when it is present, a synthetic one otherwise.

The real data are two files of one outdoor scan, kept in the repository's
``data/`` folder (``data/README.md`` says where they come from):
``lidar_voxels_125k.npz`` (features, indices in
(batch, z, y, x) order and the spatial shape of a 0.1 m grid over
x, y in [-80, 80] m and z in [-2, 6] m) and ``lidar_points_198k.npz`` (raw
points). The synthetic scene imitates such a scan: a ground plane sampled with
a density that falls with distance from the sensor, plus the surfaces of a few
boxes (cars, walls), voxelized on the same kind of grid.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Mapping

import numpy as np

__all__ = [
    "DATA_DIRECTORY_VARIABLE",
    "VOXELS_FILE_NAME",
    "POINTS_FILE_NAME",
    "VOXEL_SIZE",
    "COORDINATE_RANGE",
    "VoxelScene",
    "SyntheticScale",
    "SYNTHETIC_SCALES",
    "default_data_directories",
    "find_data_file",
    "require_data_file",
    "load_voxel_scene",
    "load_points",
    "synthetic_points",
    "voxelize_points_for_scene",
    "synthetic_voxel_scene",
]

DATA_DIRECTORY_VARIABLE = "SPARSECORE_DATA_DIR"
VOXELS_FILE_NAME = "lidar_voxels_125k.npz"
POINTS_FILE_NAME = "lidar_points_198k.npz"
VOXEL_SIZE: tuple[float, float, float] = (0.1, 0.1, 0.1)
COORDINATE_RANGE: tuple[float, float, float, float, float, float] = (-80.0, -80.0, -2.0, 80.0, 80.0, 6.0)


@dataclass(frozen=True)
class VoxelScene:
    """One batch of voxels to convolve.

    Attributes:
        features: float32 ``[N, C]`` per-voxel features.
        indices: int32 ``[N, 4]`` rows of (batch, z, y, x), unique.
        spatial_shape: the grid's (z, y, x) size.
        batch_size: number of batch elements.
        source: where the scene came from (a file path or ``"synthetic ..."``).
    """

    features: np.ndarray
    indices: np.ndarray
    spatial_shape: tuple[int, int, int]
    batch_size: int
    source: str


@dataclass(frozen=True)
class SyntheticScale:
    """Size of a synthetic scene.

    Attributes:
        name: the ``--scale`` name.
        half_extent: half the side of the square covered in x and y, in metres.
        num_points: number of points sampled before voxelization.
        num_boxes: number of boxes standing on the ground.
    """

    name: str
    half_extent: float
    num_points: int
    num_boxes: int


SYNTHETIC_SCALES: Mapping[str, SyntheticScale] = MappingProxyType(
    {
        "small": SyntheticScale("small", half_extent=12.8, num_points=8_000, num_boxes=6),
        "full": SyntheticScale("full", half_extent=80.0, num_points=200_000, num_boxes=60),
    }
)


def default_data_directories() -> list[Path]:
    """Directories searched for the data files, in order.

    Returns:
        ``$SPARSECORE_DATA_DIR`` when set, then the ``data/`` folder of the
        repository that holds this package (a checkout or an editable install).
    """
    directories: list[Path] = []
    from_environment = os.environ.get(DATA_DIRECTORY_VARIABLE)
    if from_environment:
        directories.append(Path(from_environment))
    directories.append(Path(__file__).resolve().parents[2] / "data")
    return directories


def find_data_file(explicit_path: str | None, file_name: str) -> Path | None:
    """Locates one data file.

    Args:
        explicit_path: a path given on the command line, or None to search.
        file_name: the file's name in the data directory.

    Returns:
        The path found, or None when the file is in none of the searched places.

    Raises:
        FileNotFoundError: when ``explicit_path`` is given but does not exist.
    """
    if explicit_path is not None:
        path = Path(explicit_path)
        if not path.is_file():
            raise FileNotFoundError(
                f"data file {explicit_path!r} does not exist (looked for it from {Path.cwd()}); "
                f"the repository's real scans are {', '.join(str(d / file_name) for d in default_data_directories())}"
            )
        return path
    for directory in default_data_directories():
        candidate = directory / file_name
        if candidate.is_file():
            return candidate
    return None


def require_data_file(explicit_path: str | None, file_name: str) -> Path:
    """Locates one data file, or says clearly which file is missing and where it was looked for.

    Args:
        explicit_path: a path given on the command line, or None to search.
        file_name: the file's name in the data directory.

    Returns:
        The path found.

    Raises:
        FileNotFoundError: naming the file, the folders searched and how to get it.
    """
    path = find_data_file(explicit_path, file_name)
    if path is None:
        searched = ", ".join(str(directory) for directory in default_data_directories())
        raise FileNotFoundError(
            f"the real scan {file_name} is in none of: {searched}. It ships in the data/ folder of the "
            f"sparsecore repository (a git clone has it; an installed wheel does not): run from a clone, "
            f"or set ${DATA_DIRECTORY_VARIABLE} to a folder holding {file_name}"
        )
    return path


def load_voxel_scene(path: Path) -> VoxelScene:
    """Reads a voxelized scan saved like ``lidar_voxels_125k.npz``.

    Args:
        path: an ``.npz`` file with ``features``, ``indices`` and ``spatial_shape``.

    Returns:
        The scene, batch size one more than the largest batch index.

    Raises:
        ValueError: when an array is missing or has the wrong shape.
    """
    with np.load(path) as archive:
        missing = {"features", "indices", "spatial_shape"} - set(archive.files)
        if missing:
            raise ValueError(f"{path} lacks the arrays {sorted(missing)}; it has {archive.files}")
        features = np.ascontiguousarray(archive["features"], dtype=np.float32)
        indices = np.ascontiguousarray(archive["indices"], dtype=np.int32)
        spatial_shape = tuple(int(size) for size in archive["spatial_shape"])
    if indices.ndim != 2 or indices.shape[1] != 4 or len(spatial_shape) != 3:
        raise ValueError(
            f"{path}: expected indices [N, 4] and a 3-D spatial_shape, got indices "
            f"{indices.shape} and spatial_shape {spatial_shape}"
        )
    batch_size = int(indices[:, 0].max()) + 1 if len(indices) else 1
    return VoxelScene(features, indices, spatial_shape, batch_size, str(path))  # type: ignore[arg-type]


def load_points(path: Path) -> np.ndarray:
    """Reads raw points saved like ``lidar_points_198k.npz``.

    Args:
        path: an ``.npz`` file with ``points`` ``[P, 3+]``.

    Returns:
        float32 ``[P, F]`` points, x, y, z first.
    """
    with np.load(path) as archive:
        if "points" not in archive.files:
            raise ValueError(f"{path} has no 'points' array; it has {archive.files}")
        points = np.ascontiguousarray(archive["points"], dtype=np.float32)
    if points.ndim != 2 or points.shape[1] < 3:
        raise ValueError(f"{path}: expected points [P, 3+], got {points.shape}")
    return points


def synthetic_points(scale: SyntheticScale, seed: int = 0) -> np.ndarray:
    """Samples a LiDAR-like point cloud: ground plane plus box surfaces.

    Ground points get a radial density proportional to 1 / distance (as a
    spinning sensor gives); box points lie on the four sides and the top of
    each box. All points fall inside ``COORDINATE_RANGE``.

    Args:
        scale: how large a scene to make.
        seed: random seed.

    Returns:
        float32 ``[P, 3]`` points (x, y, z in metres).
    """
    generator = np.random.default_rng(seed)
    num_ground = scale.num_points * 2 // 3
    num_box_points = scale.num_points - num_ground
    # Radius uniform in [1, R] gives density ~ 1 / r on the plane.
    radius = generator.uniform(1.0, scale.half_extent, num_ground)
    angle = generator.uniform(0.0, 2.0 * np.pi, num_ground)
    ground = np.column_stack(
        [
            radius * np.cos(angle),
            radius * np.sin(angle),
            -1.7 + 0.02 * generator.standard_normal(num_ground),
        ]
    )
    centres = generator.uniform(-0.8 * scale.half_extent, 0.8 * scale.half_extent, (scale.num_boxes, 2))
    sizes = np.column_stack(
        [
            generator.uniform(1.5, 5.0, scale.num_boxes),
            generator.uniform(1.5, 2.5, scale.num_boxes),
            generator.uniform(1.4, 4.0, scale.num_boxes),
        ]
    )
    box_of_point = generator.integers(0, scale.num_boxes, num_box_points)
    face = generator.integers(0, 5, num_box_points)  # 0..3: sides, 4: top
    unit = generator.uniform(-0.5, 0.5, (num_box_points, 3))
    axis = np.where(face < 2, 0, 1)
    side = np.where(face % 2 == 0, -0.5, 0.5)
    unit[face < 4, axis[face < 4]] = side[face < 4]
    unit[face == 4, 2] = 0.5
    box = unit * sizes[box_of_point]
    box[:, 0] += centres[box_of_point, 0]
    box[:, 1] += centres[box_of_point, 1]
    box[:, 2] += -1.7 + sizes[box_of_point, 2] / 2.0
    points = np.concatenate([ground, box]).astype(np.float32)
    low = np.asarray(COORDINATE_RANGE[:3], dtype=np.float32)
    high = np.asarray(COORDINATE_RANGE[3:], dtype=np.float32)
    inside = np.all((points >= low) & (points < high), axis=1)
    return points[inside]


def voxelize_points_for_scene(
    points: np.ndarray, voxel_size: tuple[float, float, float], coordinate_range: tuple[float, ...]
) -> tuple[np.ndarray, np.ndarray, tuple[int, int, int]]:
    """Voxelizes points with plain NumPy (to make inputs, not to be timed).

    Keeps one voxel per occupied cell; its features are the mean of its points.

    Args:
        points: float32 ``[P, 3+]``, x, y, z first.
        voxel_size: cell size (x, y, z) in metres.
        coordinate_range: (x_min, y_min, z_min, x_max, y_max, z_max).

    Returns:
        ``(features [N, F] float32, indices [N, 4] int32 (0, z, y, x) sorted, spatial_shape (z, y, x))``.
    """
    low = np.asarray(coordinate_range[:3], dtype=np.float64)
    high = np.asarray(coordinate_range[3:], dtype=np.float64)
    size = np.asarray(voxel_size, dtype=np.float64)
    grid_xyz = np.round((high - low) / size).astype(np.int64)
    cells = np.floor((points[:, :3].astype(np.float64) - low) / size).astype(np.int64)
    inside = np.all((cells >= 0) & (cells < grid_xyz), axis=1)
    cells, kept = cells[inside], points[inside]
    zyx = cells[:, ::-1]
    spatial_shape = tuple(int(extent) for extent in grid_xyz[::-1])
    keys = np.ravel_multi_index(zyx.T, spatial_shape)
    unique_keys, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    sums = np.zeros((len(unique_keys), kept.shape[1]), dtype=np.float64)
    np.add.at(sums, inverse, kept)
    features = (sums / counts[:, None]).astype(np.float32)
    coordinates = np.stack(np.unravel_index(unique_keys, spatial_shape), axis=1)
    indices = np.column_stack([np.zeros(len(unique_keys), dtype=np.int64), coordinates]).astype(np.int32)
    return features, indices, spatial_shape  # type: ignore[return-value]


def synthetic_voxel_scene(scale: SyntheticScale, seed: int = 0) -> VoxelScene:
    """A voxelized synthetic scene at 0.1 m over a square of the scale's extent.

    Args:
        scale: how large a scene to make.
        seed: random seed.

    Returns:
        The scene (batch size 1).
    """
    points = synthetic_points(scale, seed)
    extent = scale.half_extent
    coordinate_range = (-extent, -extent, COORDINATE_RANGE[2], extent, extent, COORDINATE_RANGE[5])
    features, indices, spatial_shape = voxelize_points_for_scene(points, VOXEL_SIZE, coordinate_range)
    return VoxelScene(features, indices, spatial_shape, 1, f"synthetic ({scale.name}, seed {seed})")
