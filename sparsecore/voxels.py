"""What voxelization returns, and how per-voxel results go back to the points.

`Voxels` (one cloud) and `BatchedVoxels` (clouds stacked) are the results of
`sparsecore.voxelization.voxelize` / ``voxelize_batch``; `voxel_means` gives
each voxel's mean stored point and `gather_voxel_features` hands any per-voxel
rows back to the points through ``point_voxel_id``. All four are re-exported
by `sparsecore.voxelization` (the semantics are described there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import _voxel_math
from .interop import array_module, check_same_device, to_core_array

__all__ = ["Voxels", "BatchedVoxels", "voxel_means", "gather_voxel_features"]


@dataclass(frozen=True, eq=False)
class Voxels:
    """Result of :func:`voxelize` (``M`` voxels, ``P`` input points, ``D`` axes, ``F`` features).

    Attributes:
        voxels: ``[M, max_num_points_per_voxel, F]`` the points' dtype; stored points
            in input order, then zero padding (or the voxel mean with ``empty_mean``).
        indices: ``[M, D]`` int32 voxel coordinates, zyx, no batch column.
        num_points_per_voxel: ``[M]`` int32, stored points (``<= max_num_points_per_voxel``).
        point_voxel_id: ``[P]`` int64 voxel row of each point, ``-1`` when dropped.
        grid_size: cells per axis, zyx.
    """

    voxels: Any
    indices: Any
    num_points_per_voxel: Any
    point_voxel_id: Any
    grid_size: tuple[int, ...]

    @property
    def num_voxels(self) -> int:
        """``M``."""
        return int(self.indices.shape[0])


@dataclass(frozen=True, eq=False)
class BatchedVoxels:
    """Result of :func:`voxelize_batch`: rows of all clouds, cloud after cloud.

    Attributes:
        voxels: ``[M, max_num_points_per_voxel, F]``, as in :class:`Voxels`.
        indices: ``[M, 1 + D]`` int32, the cloud's index in column 0, then zyx.
        num_points_per_voxel: ``[M]`` int32.
        point_voxel_id: one ``[P_b]`` int64 array per cloud: rows into this batch, ``-1`` dropped.
        batch_size: number of clouds ``B``.
        grid_size: cells per axis, zyx.
    """

    voxels: Any
    indices: Any
    num_points_per_voxel: Any
    point_voxel_id: tuple[Any, ...]
    batch_size: int
    grid_size: tuple[int, ...]

    @property
    def num_voxels(self) -> int:
        """``M``, over all clouds."""
        return int(self.indices.shape[0])


def voxel_means(voxels: Voxels | BatchedVoxels) -> Any:
    """Mean of the stored points of each voxel.

    Args:
        voxels: a :class:`Voxels` or :class:`BatchedVoxels` (zero- or mean-padded).

    Returns:
        ``[M, F]`` array of the voxels' dtype. Points beyond ``max_num_points_per_voxel``
        were not stored and do not count.
    """
    if not isinstance(voxels, (Voxels, BatchedVoxels)):
        raise TypeError(
            f"voxels must be the Voxels or BatchedVoxels returned by voxelize / voxelize_batch, "
            f"got {type(voxels).__name__}."
        )
    xp = array_module(voxels.voxels)
    return _voxel_math.masked_means(xp, voxels.voxels, voxels.num_points_per_voxel)


def gather_voxel_features(voxel_features: Any, point_voxel_id: Any, invalid_value: float = 0) -> Any:
    """Hands per-voxel results back to the points (spconv ``gather_features_by_pc_voxel_id``).

    Args:
        voxel_features: ``[M, C]`` (or ``[M, ...]``) one row per voxel.
        point_voxel_id: ``[P]`` integer voxel row of each point, ``-1`` for dropped points
            (``Voxels.point_voxel_id``; for a batch, one of ``BatchedVoxels.point_voxel_id``
            or their concatenation).
        invalid_value: value of the rows of dropped points.

    Returns:
        ``[P, C]`` array of ``voxel_features``' dtype: row ``p`` is ``voxel_features[id[p]]``.

    Raises:
        ValueError, TypeError: for ids that are not 1-D integers in ``[-1, M)``.
    """
    features = to_core_array(voxel_features, "voxel_features")
    ids = to_core_array(point_voxel_id, "point_voxel_id")
    check_same_device(voxel_features=features, point_voxel_id=ids)
    if features.ndim < 1:
        raise ValueError("voxel_features must have a leading voxel axis [M, C], got a scalar.")
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise TypeError(
            f"point_voxel_id must be a 1-D integer array [P] (as voxelize returns), got shape "
            f"{tuple(ids.shape)} dtype {ids.dtype}."
        )
    xp = array_module(features)
    num_voxels = int(features.shape[0])
    if ids.shape[0] > 0:
        low, high = int(ids.min()), int(ids.max())
        if low < -1 or high >= num_voxels:
            raise ValueError(
                f"point_voxel_id must lie in [-1, {num_voxels}) for voxel_features with {num_voxels} "
                f"rows, got values in [{low}, {high}]. Pass the ids from the same voxelize call."
            )
    out = xp.full((int(ids.shape[0]),) + tuple(features.shape[1:]), invalid_value, dtype=features.dtype)
    valid = xp.flatnonzero(ids >= 0)
    out[valid] = features[ids[valid]]
    return out
