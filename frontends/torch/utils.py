"""spconv 2.x utilities: `PointToVoxel`, `gather_features_by_pc_voxel_id`; and a deprecated checkpoint helper.

`PointToVoxel` wraps `sparsecore.voxelize` (sort-based, O(points) memory:
spconv's CPU build allocates a dense int32 grid of ``prod(grid_size)`` cells).
Its voxel numbering (first-seen order), ``-1`` ids for dropped points and
zyx coordinates follow spconv; see `sparsecore.voxelize` for the exact rules.
"""

from __future__ import annotations

import math
import warnings
from typing import Sequence, Union

import torch
from torch import nn

import sparsecore as sc

from ._convert import core_context, core_view, to_torch

__all__ = ["PointToVoxel", "gather_features_by_pc_voxel_id", "convert_spconv_1x1_weights"]


class PointToVoxel:
    """Points to voxels (spconv ``PointToVoxel``).

    Args:
        vsize_xyz: voxel size per axis, xyz.
        coors_range_xyz: ``(min_x, min_y, min_z, max_x, max_y, max_z)``.
        num_point_features: columns of the point clouds (xyz first).
        max_num_voxels: voxels kept, in first-seen order.
        max_num_points_per_voxel: points stored per voxel.
        device: where the clouds (and results) live.

    Attributes (as spconv, float32-rounded, all zyx): ``ndim``, ``vsize``,
    ``grid_size``, ``grid_stride``, ``coors_range`` (``min_z, min_y, min_x,
    max_z, max_y, max_x``).
    """

    def __init__(self, vsize_xyz: Sequence[float], coors_range_xyz: Sequence[float], num_point_features: int,
                 max_num_voxels: int, max_num_points_per_voxel: int,
                 device: torch.device = torch.device("cpu:0")) -> None:
        self._grid = sc.VoxelGrid(tuple(vsize_xyz), tuple(coors_range_xyz))
        for name, value in (("num_point_features", num_point_features), ("max_num_voxels", max_num_voxels),
                            ("max_num_points_per_voxel", max_num_points_per_voxel)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if num_point_features < self._grid.ndim:
            raise ValueError(f"num_point_features ({num_point_features}) must be at least the number of "
                             f"coordinates ({self._grid.ndim})")
        self.ndim = self._grid.ndim
        self.device = torch.device(device)
        self.num_point_features = num_point_features
        self.max_num_voxels = max_num_voxels
        self.max_num_points_per_voxel = max_num_points_per_voxel
        rounded = torch.tensor(self._grid.voxel_size, dtype=torch.float32).tolist()
        self.vsize = list(reversed(rounded))
        self.grid_size = list(self._grid.grid_size)
        self.grid_stride = [math.prod(self.grid_size[axis + 1:]) for axis in range(self.ndim)]
        bounds = torch.tensor(self._grid.coordinate_range, dtype=torch.float32).tolist()
        self.coors_range = bounds[:self.ndim][::-1] + bounds[self.ndim:][::-1]

    def __call__(self, pc: torch.Tensor, clear_voxels: bool = True, empty_mean: bool = False):
        """``(voxels [M, max_points, F], indices [M, ndim] int32 zyx, num_points_per_voxel [M] int32)``."""
        return self.generate_voxel_with_id(pc, clear_voxels, empty_mean)[:3]

    def generate_voxel_with_id(self, pc: torch.Tensor, clear_voxels: bool = True, empty_mean: bool = False):
        """As `__call__`, plus ``pc_voxel_id [P]`` int64: each point's voxel row, -1 when dropped.

        ``clear_voxels`` is accepted for compatibility: results are always fresh tensors.
        """
        if not isinstance(pc, torch.Tensor) or pc.ndim != 2 or pc.shape[1] != self.num_point_features:
            shape = tuple(pc.shape) if isinstance(pc, torch.Tensor) else type(pc).__name__
            raise ValueError(f"pc must be a [num_points, {self.num_point_features}] tensor (num_point_features "
                             f"columns, xyz first), got {shape}")
        if pc.device.type != self.device.type:
            raise ValueError(f"pc is on {pc.device} but this PointToVoxel was built for {self.device}; "
                             "construct it with device=pc.device")
        with torch.no_grad(), core_context(pc.device):
            result = sc.voxelize(core_view(pc, "pc"), self._grid.voxel_size, self._grid.coordinate_range,
                                        self.max_num_points_per_voxel, self.max_num_voxels,
                                        empty_mean=bool(empty_mean))
            return (to_torch(result.voxels), to_torch(result.indices), to_torch(result.num_points_per_voxel),
                    to_torch(result.point_voxel_id))


def gather_features_by_pc_voxel_id(seg_res_features: torch.Tensor, pc_voxel_id: torch.Tensor,
                                   invalid_value: Union[int, float] = 0) -> torch.Tensor:
    """Per-voxel results back to the points: row ``p`` is ``seg_res_features[pc_voxel_id[p]]``.

    Points with id ``-1`` get ``invalid_value``. Differentiable in ``seg_res_features``.
    """
    if pc_voxel_id.ndim != 1 or pc_voxel_id.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"pc_voxel_id must be a 1-D integer tensor, got {tuple(pc_voxel_id.shape)} "
                         f"{pc_voxel_id.dtype}")
    if pc_voxel_id.device != seg_res_features.device:
        pc_voxel_id = pc_voxel_id.to(seg_res_features.device)
    num_voxels = seg_res_features.shape[0]
    if pc_voxel_id.numel():
        low, high = int(pc_voxel_id.min()), int(pc_voxel_id.max())
        if low < -1 or high >= num_voxels:
            raise ValueError(f"pc_voxel_id must lie in [-1, {num_voxels}) for {num_voxels} voxels, got values "
                             f"in [{low}, {high}]")
    out = seg_res_features.new_full((pc_voxel_id.shape[0], *seg_res_features.shape[1:]), invalid_value)
    rows = torch.nonzero(pc_voxel_id >= 0).view(-1)
    return out.index_put((rows,), seg_res_features[pc_voxel_id[rows].long()])


def convert_spconv_1x1_weights(model: nn.Module, state_dict: dict) -> dict:
    """Deprecated, and now the identity: a shallow copy of ``state_dict``, unchanged.

    spconv 2.3.8 computes a layer with a 1x1 kernel (subm, or stride 1) as
    ``features @ weight.view(in, out)`` (its issue #450). sparsecore.torch's
    layers now compute the very same product from the same stored tensor
    (`SparseConvolution.reads_weight_as_spconv_1x1`), so an spconv checkpoint
    loads as it is, with ``model.load_state_dict(state_dict)``, and a
    sparsecore.torch checkpoint loads into spconv as it is. Earlier versions
    rewrote each 1x1 weight here; rewriting now would break the match, so this
    returns the weights untouched and warns. Remove the call.

    Args:
        model: the sparsecore.torch model (unused; kept for old call sites).
        state_dict: an spconv (or sparsecore.torch) state_dict.

    Returns:
        A new dict holding the same tensors.
    """
    del model
    warnings.warn(
        "convert_spconv_1x1_weights is no longer needed and returns the state_dict unchanged: "
        "sparsecore.torch's 1x1 layers read the stored weight as spconv does (weight.view(in, out)). "
        "Load spconv checkpoints directly with model.load_state_dict(state_dict) and remove this call.",
        DeprecationWarning, stacklevel=2)
    return dict(state_dict)
