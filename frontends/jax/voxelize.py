"""Points to a `SparseTensor` (outside jit), and voxel results back to the points (inside jit).

Wraps `sparsecore.voxelize_batch`: NumPy or JAX point arrays (one cloud, or a
list of clouds that become the batch), voxel features the mean of each
voxel's stored points, padded by the capacity policy.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

import sparsecore as sc

from .buckets import CapacityPolicy
from .plan import require_concrete
from .tensor import SparseTensor

__all__ = ["voxelize", "voxels_to_points"]


def voxelize(point_clouds: Any, voxel_size: Sequence[float], coordinate_range: Sequence[float], *,
             max_num_points_per_voxel: int = 32, max_num_voxels: int = 200_000, empty_mean: bool = False,
             capacity: CapacityPolicy | int | None = None, name: str = "input") -> tuple[SparseTensor, Any]:
    """Voxelizes one cloud ``[P, F]`` or a list of clouds into a batched `SparseTensor`.

    Args:
        point_clouds: ``[P, F]`` (xyz first) or a sequence of them (NumPy / JAX, concrete).
        voxel_size, coordinate_range, max_num_points_per_voxel, max_num_voxels, empty_mean:
            as `sparsecore.voxelize_batch` (``max_num_voxels`` per cloud).
        capacity: the capacity policy of the tensor and its plan.
        name: the site set's name.

    Returns:
        ``(tensor, voxels)``: the tensor has the voxel means ``[M, F]`` as features, indices
        ``(batch, z, y, x)``, ``spatial_shape = voxels.grid_size`` and one batch element per
        cloud; ``voxels`` is the core's `sparsecore.BatchedVoxels` (``point_voxel_id`` etc.).
    """
    clouds = [point_clouds] if hasattr(point_clouds, "shape") else list(point_clouds)
    for b, cloud in enumerate(clouds):
        require_concrete(cloud, f"point_clouds[{b}]", "sparsecore.jax.voxelize")
    arrays = [np.asarray(sc._dispatch.to_core_array(cloud, f"point_clouds[{b}]")) for b, cloud in enumerate(clouds)]
    voxels = sc.voxelize_batch(arrays, voxel_size, coordinate_range, max_num_points_per_voxel, max_num_voxels,
                               empty_mean=empty_mean)
    features = sc.voxel_means(voxels)
    tensor = SparseTensor.from_arrays(features, voxels.indices, voxels.grid_size, voxels.batch_size,
                                      capacity=capacity, name=name)
    return tensor, voxels


def voxels_to_points(features: Any, point_voxel_id: Any, invalid_value: float = 0) -> Any:
    """``[P, C]``: each point gets its voxel's row of ``features`` (``invalid_value`` for id -1).

    Works inside jit (a gather); ``point_voxel_id`` is ``voxels.point_voxel_id[b]`` (or
    their concatenation) from `voxelize`.
    """
    ids = jnp.asarray(point_voxel_id)
    rows = jnp.where(ids >= 0, ids, features.shape[0])
    return jnp.take(features, rows, axis=0, mode="fill", fill_value=invalid_value)
