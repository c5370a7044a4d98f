"""The checks of a SparseConvTensor's arguments, and its helpers that act on plain torch tensors.

Messages name the argument, what was expected, what was seen and how to fix
it; the rules shared with the core (spatial shape, batch size, sites in range
and unique, dense size, ranks) are `sparsecore.interop`'s.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sparsecore.interop import (as_batch_size, as_spatial_shape, check_dense_size, check_indices_in_range,
                               check_rank, check_unique_sites, memory_limit)

from ._convert import core_context, core_view

__all__ = ["as_shape_list", "check_sites", "feature_functions", "check_selection", "dense_zeros", "validate"]


def as_shape_list(spatial_shape: Any) -> list[int]:
    """``spatial_shape`` checked (`sparsecore.interop.as_spatial_shape`), as a list (spconv keeps lists)."""
    return list(as_spatial_shape(spatial_shape))


@torch.compiler.disable
def check_sites(indices: torch.Tensor, spatial_shape: list[int], batch_size: int) -> None:
    """The sites rule (see `sparsecore.interop`): in range and unique, checked once per tensor."""
    with core_context(indices.device):
        sites = core_view(indices, "indices")
        check_indices_in_range(sites, spatial_shape, batch_size)
        check_unique_sites(sites, spatial_shape, batch_size)


def feature_functions() -> frozenset:
    """The torch functions that act on each feature row alone (applied to a SparseConvTensor's features)."""
    functional = torch.nn.functional
    return frozenset((
        functional.relu, functional.relu_, torch.relu, torch.relu_, functional.relu6, functional.leaky_relu,
        functional.elu, functional.gelu, functional.silu, functional.hardtanh, functional.sigmoid, torch.sigmoid,
        torch.tanh, functional.batch_norm, functional.linear, functional.dropout, functional.layer_norm,
    ))


def check_selection(valid_indices: Any, rows: int) -> None:
    """Raises unless ``valid_indices`` is a bool mask of ``rows`` entries or integer rows in ``[-rows, rows)``."""
    if not isinstance(valid_indices, torch.Tensor) or valid_indices.is_floating_point() or valid_indices.is_complex():
        kind = valid_indices.dtype if isinstance(valid_indices, torch.Tensor) else type(valid_indices).__name__
        raise TypeError(f"select_by_index: valid_indices must be a bool mask or an integer tensor of rows, got {kind}")
    if valid_indices.dtype == torch.bool:
        if tuple(valid_indices.shape) != (rows,):
            raise ValueError(f"select_by_index: a bool valid_indices must have one entry per site ({rows}), "
                             f"got shape {tuple(valid_indices.shape)}")
    elif valid_indices.numel() and not torch.compiler.is_compiling():
        low, high = int(valid_indices.min()), int(valid_indices.max())
        if low < -rows or high >= rows:
            raise ValueError(f"select_by_index: valid_indices holds row {low if low < -rows else high}, outside "
                             f"[-{rows}, {rows}) for this tensor's {rows} sites")


def dense_zeros(features: torch.Tensor, batch_size: int, spatial_shape: list[int],
                channels_first_memory: bool = False) -> torch.Tensor:
    """Zeros ``[B, *spatial, C]`` like ``features``, sized before allocating; with
    ``channels_first_memory`` a view of ``[B, C, *spatial]`` memory (so a scatter into it
    and ``movedim(-1, 1)`` give the channels-first grid without a transposing copy)."""
    channels = features.shape[1]
    if features.device.type == "cuda":
        limit = torch.cuda.mem_get_info(features.device)[1]
    else:
        limit = memory_limit(np)
    size = check_dense_size(batch_size, spatial_shape, channels, features.element_size(), limit)
    try:
        if channels_first_memory:
            return features.new_zeros((batch_size, channels, *spatial_shape)).movedim(1, -1)
        return features.new_zeros((batch_size, *spatial_shape, channels))
    except (RuntimeError, MemoryError) as error:
        raise ValueError(
            f"dense(): cannot allocate the grid of batch_size {batch_size} x spatial_shape {spatial_shape} x "
            f"{channels} channels ({size / 2**30:.3g} GiB): {error}. Densify a cropped region or a coarser "
            "grid, or stay sparse"
        ) from None


def validate(features: Any, indices: Any, spatial_shape: list[int], batch_size: Any) -> None:
    """Raises a clear error for features / indices that are not a SparseConvTensor's (types, shapes, dtypes,
    rows, devices, grid); the sites themselves are `check_sites`'s."""
    if not isinstance(features, torch.Tensor) or not isinstance(indices, torch.Tensor):
        raise TypeError(
            f"features and indices must be torch.Tensors, got {type(features).__name__} and "
            f"{type(indices).__name__}"
        )
    check_rank(features, 2, "features", "[N, C]")
    if features.is_complex():
        raise TypeError(f"features must be real (a float or quantized dtype), got {features.dtype}")
    check_rank(indices, 2, "indices", "[N, ndim + 1] (batch index first)")
    if indices.dtype != torch.int32:
        raise TypeError(
            f"indices must be an integer tensor (int32 as spconv stores them; int64 and other integer "
            f"dtypes are converted once when their values fit int32), got {indices.dtype}; floor "
            "coordinates and convert with indices.int()"
        )
    ndim = indices.shape[1] - 1
    if len(spatial_shape) != ndim or not 1 <= ndim <= 4:
        raise ValueError(
            f"indices must be [N, ndim + 1] with one column per spatial axis of spatial_shape "
            f"{spatial_shape} ({len(spatial_shape)} axes) plus the batch column, got shape "
            f"{tuple(indices.shape)}"
        )
    as_spatial_shape(spatial_shape)
    as_batch_size(batch_size)
    if features.shape[0] != indices.shape[0]:
        raise ValueError(
            f"features has {features.shape[0]} rows but indices has {indices.shape[0]}; they must "
            "have one row per active site"
        )
    if features.device != indices.device:
        raise ValueError(
            f"features is on {features.device} but indices is on {indices.device}; put both on "
            "one device (indices.to(features.device))"
        )
