"""Conversions between sparse (features, indices) and dense grids, and the union of site sets."""

from __future__ import annotations

from typing import Any, Sequence

from ._dispatch import array_module, to_core_array
from .interop import (as_batch_size, as_features, as_indices, as_spatial_shape, check_dense_size,
                      check_indices_in_range, check_unique_sites, memory_limit)
from .backends import backend_for
from .hashing import pack_keys, unpack_keys
from .memory_budget import check_dense

__all__ = ["to_dense", "padded_to_dense", "from_dense", "union_sites"]


def padded_to_dense(features: Any, indices: Any, spatial_shape: Sequence[int], batch_size: int,
                    channels_first: bool = True) -> Any:
    """`to_dense` of capacity mode's rows (`sparsecore.capacity`): rows whose batch index is -1 are padding and
    left out, with no read back (no site checks: the builds checked the sites; no data-sized operation).

    The padding rows are written to a spare batch element that is cut off.
    """
    shape = as_spatial_shape(spatial_shape)
    batch = as_batch_size(batch_size)
    xp = array_module(features)
    check_dense(batch + 1, shape, features.shape[1], features.dtype.itemsize, features)  # sparsecore.memory_budget
    channels = features.shape[1]
    dense = xp.zeros((batch + 1, channels) + shape if channels_first else (batch + 1,) + shape + (channels,),
                     dtype=features.dtype)
    padding = indices[:, 0] < 0
    columns = [xp.where(padding, batch if axis == 0 else 0, indices[:, axis]) for axis in range(indices.shape[1])]
    values = xp.where(padding[:, None], features.dtype.type(0), features)
    if channels_first:
        dense[(columns[0], slice(None), *columns[1:])] = values
    else:
        dense[tuple(columns)] = values
    return xp.ascontiguousarray(dense[:batch])


def to_dense(features: Any, indices: Any, spatial_shape: Sequence[int], batch_size: int,
             channels_first: bool = True) -> Any:
    """Scatters sparse features into a dense grid (zeros elsewhere).

    Args:
        features: ``[N, C]``.
        indices: ``[N, 1 + D]`` unique sites.
        spatial_shape: ``D`` ints.
        batch_size: ``B``.
        channels_first: ``[B, C, *spatial]`` (spconv's ``.dense()``) when True,
            else ``[B, *spatial, C]``.

    Returns:
        The dense array, in the features' dtype, on their device.
    """
    shape = as_spatial_shape(spatial_shape)
    batch = as_batch_size(batch_size)
    indices = as_indices(indices, len(shape))
    features = as_features(features, indices.shape[0])
    check_indices_in_range(indices, shape, batch)
    check_unique_sites(indices, shape, batch)  # a dense grid holds one feature vector per site
    xp = array_module(features)
    size = check_dense_size(batch, shape, features.shape[1], features.dtype.itemsize, memory_limit(xp))
    check_dense(batch, shape, features.shape[1], features.dtype.itemsize, features)  # sparsecore.memory_budget
    channels = features.shape[1]
    try:
        dense = xp.zeros((batch, channels) + shape if channels_first else (batch,) + shape + (channels,),
                         dtype=features.dtype)
    except (MemoryError, ValueError) as error:
        raise ValueError(
            f"cannot allocate the dense grid of batch_size {batch} x spatial_shape {shape} x "
            f"{features.shape[1]} channels ({size / 2**30:.3g} GiB): {error}. Densify a cropped "
            "region or a coarser grid, or stay sparse"
        ) from None
    columns = [indices[:, axis] for axis in range(indices.shape[1])]
    if channels_first:  # scattered straight into [B, C, *spatial]: no transposing copy of the grid
        dense[(columns[0], slice(None), *columns[1:])] = features
    else:
        dense[tuple(columns)] = features
    return dense


def from_dense(dense: Any, channels_first: bool = False) -> tuple[Any, Any]:
    """Keeps the sites of a dense grid whose feature vector is not all zero.

    Args:
        dense: ``[B, *spatial, C]`` (or ``[B, C, *spatial]`` with ``channels_first``).
        channels_first: the layout of ``dense``.

    Returns:
        ``(features [N, C], indices [N, 1 + D] int32)``, sites sorted by (batch, coordinates).
    """
    dense = to_core_array(dense, "dense")
    if dense.ndim < 3 or dense.ndim > 6:
        raise ValueError(
            f"dense must be [B, *spatial, C] with 1 to 4 spatial axes, got shape {tuple(dense.shape)}"
        )
    xp = array_module(dense)
    if channels_first:
        dense = xp.moveaxis(dense, 1, -1)
    active = xp.any(dense != 0, axis=-1)
    indices = xp.stack(xp.nonzero(active), axis=1).astype(xp.int32)
    return dense[active], indices


def union_sites(indices_list: Sequence[Any], spatial_shape: Sequence[int],
                batch_size: int, *, assume_unique: bool = False) -> tuple[Any, list[Any]]:
    """The sorted union of several site sets and, per set, the union row of each site.

    Args:
        indices_list: arrays ``[N_i, 1 + D]`` of unique sites each.
        spatial_shape: ``D`` ints.
        batch_size: ``B``.

        assume_unique: skip the range and duplicate checks, for site sets the
            library checked or produced.

    Returns:
        ``(union_indices [U, 1 + D] int32, rows)`` with ``rows[i]`` int64 ``[N_i]``.

    Raises:
        ValueError: no site set, sets of the wrong shape, out-of-range sites, or a
            set that holds one site twice (its rows would collide in the union).
    """
    if isinstance(indices_list, (str, bytes)) or not isinstance(indices_list, Sequence) or not indices_list:
        raise ValueError(f"indices_list must be a non-empty sequence of [N, 1 + D] arrays, got {indices_list!r}")
    shape = as_spatial_shape(spatial_shape)
    batch = as_batch_size(batch_size)
    checked = []
    for position, indices in enumerate(indices_list):
        name = f"indices_list[{position}]"
        indices = as_indices(indices, len(shape), name)
        if not assume_unique:
            check_indices_in_range(indices, shape, batch, name)
            check_unique_sites(indices, shape, batch, name)
        checked.append(indices)
    keys = [pack_keys(indices, shape, batch, assume_in_range=True) for indices in checked]
    xp = array_module(keys[0])
    backend = backend_for(keys[0])
    union_keys, inverse = backend.unique_inverse(xp.concatenate(keys))
    rows, start = [], 0
    for part in keys:
        rows.append(inverse[start:start + part.shape[0]])
        start += part.shape[0]
    return unpack_keys(union_keys, shape), rows
