"""A synthetic LiDAR scan: a spinning 64-beam sensor ray-cast into a ground plane and boxes.

The scene is made for demos, tests and toy training runs, with per-point labels
of three classes:

* ``0`` ground: the plane ``z = -sensor_height`` (the sensor is the origin);
* ``1`` car: low, wide boxes standing on the ground;
* ``2`` other: tall, thin boxes (poles, trunks) and a few tall walls.

Every ray of the scan (``beams`` elevation angles times ``azimuth_steps``
azimuths) is intersected with the plane and with every box (the slab method),
vectorised in NumPy; the nearest hit within ``max_range`` becomes a point, with
a little Gaussian range noise. Rays that hit nothing are dropped, as a real
sensor drops them. Everything is seeded: one seed, one scene.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["CLASS_NAMES", "SceneConfig", "LidarScene", "make_boxes", "ray_cast", "lidar_scene"]

CLASS_NAMES: tuple[str, ...] = ("ground", "car", "other")


@dataclass(frozen=True)
class SceneConfig:
    """Parameters of a synthetic scan.

    Attributes:
        beams: number of elevation angles (laser beams).
        azimuth_steps: rays per beam over a full turn.
        min_elevation: lowest beam, degrees (negative looks down).
        max_elevation: highest beam, degrees.
        sensor_height: height of the sensor above the ground, metres.
        max_range: rays are cut off beyond this distance, metres.
        range_noise: standard deviation of the range noise, metres.
        num_cars: boxes of class 1.
        num_poles: thin tall boxes of class 2.
        num_walls: long tall boxes of class 2.
        placement_radius: objects are placed within this distance of the sensor.
    """

    beams: int = 64
    azimuth_steps: int = 1024
    min_elevation: float = -25.0
    max_elevation: float = 3.0
    sensor_height: float = 1.7
    max_range: float = 40.0
    range_noise: float = 0.01
    num_cars: int = 12
    num_poles: int = 10
    num_walls: int = 2
    placement_radius: float = 25.0


@dataclass(frozen=True)
class LidarScene:
    """One scan.

    Attributes:
        points: float32 ``[P, 4]``: x, y, z in metres (sensor at the origin) and the range.
        labels: int64 ``[P]`` class of each point (see `CLASS_NAMES`).
        box_lower: float64 ``[K, 3]`` lower corners of the boxes.
        box_upper: float64 ``[K, 3]`` upper corners.
        box_labels: int64 ``[K]`` class of each box.
        seed: the seed it was made from.
    """

    points: np.ndarray
    labels: np.ndarray
    box_lower: np.ndarray
    box_upper: np.ndarray
    box_labels: np.ndarray
    seed: int

    @property
    def num_points(self) -> int:
        """``P``."""
        return int(self.points.shape[0])


def _place(generator: np.random.Generator, count: int, config: SceneConfig,
           min_radius: float) -> np.ndarray:
    """``[count, 2]`` xy centres at distances in ``[min_radius, placement_radius]``."""
    radius = generator.uniform(min_radius, max(min_radius, config.placement_radius), count)
    angle = generator.uniform(0.0, 2.0 * np.pi, count)
    return np.column_stack([radius * np.cos(angle), radius * np.sin(angle)])


def make_boxes(config: SceneConfig, generator: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Draws the boxes of a scene, all standing on the ground and clear of the sensor.

    Args:
        config: how many boxes of each kind and where.
        generator: the random source.

    Returns:
        ``(lower [K, 3], upper [K, 3], labels [K])`` with ``K = num_cars + num_poles + num_walls``.
    """
    ground = -config.sensor_height
    kinds = []
    # Cars: 3.5-5 m long, 1.6-2 m wide, 1.4-1.8 m high; random 90-degree heading.
    length = generator.uniform(3.5, 5.0, config.num_cars)
    width = generator.uniform(1.6, 2.0, config.num_cars)
    turned = generator.random(config.num_cars) < 0.5
    car_size = np.column_stack([np.where(turned, width, length), np.where(turned, length, width),
                                generator.uniform(1.4, 1.8, config.num_cars)])
    kinds.append((_place(generator, config.num_cars, config, 5.0), car_size, 1))
    # Poles and trunks: 0.2-0.5 m square, 3-6 m high.
    side = generator.uniform(0.2, 0.5, config.num_poles)
    pole_size = np.column_stack([side, side, generator.uniform(3.0, 6.0, config.num_poles)])
    kinds.append((_place(generator, config.num_poles, config, 3.0), pole_size, 2))
    # Walls: 8-15 m long, 0.4 m thick, 3-5 m high, along x or y.
    long_side = generator.uniform(8.0, 15.0, config.num_walls)
    along_x = generator.random(config.num_walls) < 0.5
    wall_size = np.column_stack([np.where(along_x, long_side, 0.4), np.where(along_x, 0.4, long_side),
                                 generator.uniform(3.0, 5.0, config.num_walls)])
    kinds.append((_place(generator, config.num_walls, config, 0.7 * config.placement_radius), wall_size, 2))
    lower, upper, labels = [], [], []
    for centres, size, label in kinds:
        low = np.column_stack([centres - size[:, :2] / 2.0, np.full(len(size), ground)])
        lower.append(low)
        upper.append(low + size)
        labels.append(np.full(len(size), label, dtype=np.int64))
    return np.concatenate(lower), np.concatenate(upper), np.concatenate(labels)


def ray_cast(directions: np.ndarray, ground_z: float, box_lower: np.ndarray, box_upper: np.ndarray,
             max_range: float) -> tuple[np.ndarray, np.ndarray]:
    """Distance to the nearest surface along rays from the origin.

    Args:
        directions: ``[R, 3]`` unit ray directions.
        ground_z: height of the ground plane.
        box_lower: ``[K, 3]`` lower box corners.
        box_upper: ``[K, 3]`` upper box corners.
        max_range: hits farther than this do not count.

    Returns:
        ``(distance [R], hit [R])``: ``distance`` is ``inf`` where nothing is hit;
        ``hit`` is ``-1`` for no hit, ``0`` for the ground and ``1 + k`` for box ``k``.
    """
    dz = directions[:, 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        ground_t = np.where(dz < 0.0, ground_z / dz, np.inf)
    # Slab method: the ray is inside box k for t in [max over axes of the entry, min of the exits].
    safe = np.where(np.abs(directions) < 1e-12, 1e-12, directions)
    inverse = 1.0 / safe  # [R, 3]
    t_low = box_lower[None, :, :] * inverse[:, None, :]  # [R, K, 3]
    t_high = box_upper[None, :, :] * inverse[:, None, :]
    entry = np.minimum(t_low, t_high).max(axis=2)  # [R, K]
    exit_ = np.maximum(t_low, t_high).min(axis=2)
    box_t = np.where((exit_ >= entry) & (entry > 0.0), entry, np.inf)
    all_t = np.concatenate([ground_t[:, None], box_t], axis=1)  # [R, 1 + K]
    nearest = np.argmin(all_t, axis=1)
    distance = all_t[np.arange(len(all_t)), nearest]
    hit = np.where(distance <= max_range, nearest, -1)
    distance = np.where(hit >= 0, distance, np.inf)
    return distance, hit


def lidar_scene(seed: int = 0, config: SceneConfig | None = None) -> LidarScene:
    """Makes one seeded synthetic scan.

    Args:
        seed: random seed (box layout and range noise).
        config: scan and scene parameters; the defaults give about 45,000 points.

    Returns:
        The scan with per-point labels.
    """
    config = config or SceneConfig()
    generator = np.random.default_rng(seed)
    box_lower, box_upper, box_labels = make_boxes(config, generator)
    elevation = np.deg2rad(np.linspace(config.min_elevation, config.max_elevation, config.beams))
    # A random start angle per scan, so that scans differ even in the ray pattern.
    start = generator.uniform(0.0, 2.0 * np.pi)
    azimuth = start + np.arange(config.azimuth_steps) * (2.0 * np.pi / config.azimuth_steps)
    elevation_grid, azimuth_grid = np.meshgrid(elevation, azimuth, indexing="ij")
    cos_elevation = np.cos(elevation_grid).ravel()
    directions = np.column_stack([cos_elevation * np.cos(azimuth_grid).ravel(),
                                  cos_elevation * np.sin(azimuth_grid).ravel(),
                                  np.sin(elevation_grid).ravel()])
    distance, hit = ray_cast(directions, -config.sensor_height, box_lower, box_upper, config.max_range)
    keep = hit >= 0
    directions, distance, hit = directions[keep], distance[keep], hit[keep]
    distance = distance + config.range_noise * generator.standard_normal(len(distance))
    xyz = directions * distance[:, None]
    labels = np.where(hit == 0, 0, box_labels[np.maximum(hit - 1, 0)])
    points = np.column_stack([xyz, distance]).astype(np.float32)
    return LidarScene(points, labels.astype(np.int64), box_lower, box_upper, box_labels, seed)
