"""Preprocess a batch of LiDAR clouds with the sparsecore core: NumPy on the CPU, CuPy on a GPU.

The same code runs on both: sparsecore returns arrays of the library it was
given (NumPy in, NumPy out; CuPy in, CuPy out), so only the choice of ``xp``
changes. For each batch it

1. voxelizes all clouds in one call (``sc.voxelize_batch``): voxel rows of
   every cloud, with the cloud's index in column 0 of the indices,
2. reads each point's voxel row (``point_voxel_id``, -1 for dropped points),
3. computes per-voxel features (mean point, point count, height above the
   lowest point of the voxel's column) and hands them back to the points
   (``sc.gather_voxel_features``), the usual "voxel context" feature of a
   point-voxel network.

Run ``python examples/voxelize_numpy.py`` (synthetic scans), or
``--device cuda`` on a machine with CuPy and a GPU.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import sparsecore as sc
from sparsecore.backends import CudaUnavailableError, require_cuda
from sparsecore.scene import lidar_scene

VOXEL_SIZE = (0.1, 0.1, 0.2)  # x, y, z in metres
RANGE = (-40.0, -40.0, -2.0, 40.0, 40.0, 4.0)  # min x, y, z, then max x, y, z


def voxel_context_features(xp, batch):
    """Per-voxel features ``[M, 6]``: mean x, y, z, range, point count, height over the column's floor."""
    means = sc.voxel_means(batch)  # [M, 4]
    counts = batch.num_points_per_voxel.astype(means.dtype)[:, None]
    # Lowest voxel z in each (cloud, y, x) column: sort voxels by column, take the minimum per group.
    cloud, z, y, x = (batch.indices[:, axis].astype(xp.int64) for axis in range(4))
    ny, nx = batch.grid_size[1], batch.grid_size[2]
    column = (cloud * ny + y) * nx + x
    _, column_id = xp.unique(column, return_inverse=True)
    column_id = column_id.ravel()
    # Sort voxels by (column, z): the first voxel of each column in that order is its floor.
    nz = batch.grid_size[0]
    ordered = xp.sort(column_id * nz + z)
    first = xp.ones(len(ordered), dtype=bool)
    first[1:] = ordered[1:] // nz != ordered[:-1] // nz
    floor = ordered[first] % nz  # indexed by column id (0, 1, 2, ... in sorted order)
    height = ((z - floor[column_id]) * VOXEL_SIZE[2]).astype(means.dtype)[:, None]
    return xp.concatenate([means, counts, height], axis=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where to voxelize (cuda: CuPy)")
    parser.add_argument("--clouds", type=int, default=4, help="clouds per batch")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic clouds")
    args = parser.parse_args()

    if args.device == "cuda":
        try:  # CuPy, once a CUDA device is known to be visible (one clear message otherwise)
            xp = require_cuda("--device cuda", "Run without --device cuda to use the CPU (NumPy), the default.")
        except CudaUnavailableError as error:
            raise SystemExit(f"error: {error}") from None
    else:
        xp = np
    # Clouds as they come from a loader: host arrays, moved to the device once.
    clouds = [xp.asarray(lidar_scene(args.seed + b).points) for b in range(args.clouds)]
    print(f"{len(clouds)} clouds, {sum(len(c) for c in clouds):,} points, on {args.device}")

    start = time.perf_counter()
    batch = sc.voxelize_batch(clouds, VOXEL_SIZE, RANGE, max_num_points_per_voxel=10, max_num_voxels=150_000)
    voxel_features = voxel_context_features(xp, batch)
    # Back to the points: one id array per cloud, rows into the whole batch.
    point_features = [sc.gather_voxel_features(voxel_features, ids, invalid_value=0.0)
                      for ids in batch.point_voxel_id]
    elapsed = time.perf_counter() - start

    print(f"grid (z, y, x) {batch.grid_size}; {batch.num_voxels:,} voxels; {elapsed * 1e3:.1f} ms")
    for b, (cloud, ids, features) in enumerate(zip(clouds, batch.point_voxel_id, point_features)):
        rows = int((batch.indices[:, 0] == b).sum())
        dropped = int((ids < 0).sum())
        print(f"  cloud {b}: {len(cloud):,} points -> {rows:,} voxels, {dropped:,} points out of range, "
              f"point features {tuple(features.shape)}")
        # Sanity checks a user may keep: each point lies in its voxel, counts add up.
        kept = ids >= 0
        cells = xp.floor((cloud[kept, :3] - xp.asarray(RANGE[:3], cloud.dtype))
                         / xp.asarray(VOXEL_SIZE, cloud.dtype)).astype(xp.int32)
        assert bool((cells[:, ::-1] == batch.indices[ids[kept], 1:]).all()), "a point is not in its voxel"
        assert bool((batch.indices[ids[kept], 0] == b).all()), "a point is in another cloud's voxel"
    total = int(sum(int((ids >= 0).sum()) for ids in batch.point_voxel_id))
    assert total >= int(batch.num_points_per_voxel.sum()), "stored points exceed assigned points"
    print("every point lies in its voxel; per-voxel features gathered back to every point")


if __name__ == "__main__":
    main()
