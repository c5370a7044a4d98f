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
from sparsecore.interop import is_jax_tracer, to_core_array

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
    arrays = [np.asarray(to_core_array(cloud, f"point_clouds[{b}]")) for b, cloud in enumerate(clouds)]
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

    Args:
        features: ``[rows, C]`` voxel features (padding rows included), or a `SparseTensor`,
            whose true rows (``num_active``) bound the valid ids.
        point_voxel_id: integer ``[P]``: a voxel row per point, -1 for a point in no voxel.
        invalid_value: the row given to points with id -1.

    Raises:
        TypeError: ``point_voxel_id`` is not an integer array.
        ValueError: an id is below -1 or not a row of ``features`` (checked when the ids are
            concrete). Inside jit, where they are abstract, such points get NaN rows
            instead (float features), never a plausible value.
    """
    rows, limit = features, None
    if isinstance(features, SparseTensor):
        rows = features.features
        if not is_jax_tracer(features.num_active):
            limit = int(features.num_active)
    count = int(rows.shape[0]) if limit is None else limit
    ids = point_voxel_id if is_jax_tracer(point_voxel_id) else np.asarray(point_voxel_id)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"point_voxel_id must be an integer array (voxel rows, -1 for none), got dtype {ids.dtype}")
    if not is_jax_tracer(ids) and ids.size:
        bad = np.flatnonzero((ids < -1) | (ids >= count))
        if bad.size:
            raise ValueError(
                f"point_voxel_id must hold -1 (no voxel) or a voxel row in [0, {count}) (the rows of "
                f"{'the tensor' if limit is not None else 'features'}), got {int(ids[bad[0]])} at point "
                f"{int(bad[0])} ({bad.size} such points); pass the point_voxel_id that came with these voxels"
            )
    ids = jnp.asarray(ids)
    fill = jnp.asarray(invalid_value, rows.dtype)
    if is_jax_tracer(ids) and jnp.issubdtype(rows.dtype, jnp.floating):
        out_of_range = (ids < -1) | (ids >= count)
        fill_rows = jnp.where(out_of_range, jnp.nan, fill).astype(rows.dtype)
        gathered = jnp.take(rows, jnp.where(ids >= 0, ids, rows.shape[0]), axis=0, mode="fill", fill_value=0)
        return jnp.where(((ids < 0) | out_of_range)[:, None], fill_rows[:, None], gathered)
    safe = jnp.where(ids >= 0, ids, rows.shape[0])
    return jnp.take(rows, safe, axis=0, mode="fill", fill_value=invalid_value)
