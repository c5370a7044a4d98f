"""What frontends need from the core: array detection and conversion, the shared
argument checks with their messages, and the dtype tables.

Every check raises a ``ValueError`` or ``TypeError`` whose message names the
argument, says what was expected and what was seen, and how to fix it. The
core and the frontends (``sparsecore.torch``, ``sparsecore.jax``) call these
instead of restating them, so one input gets one message wherever it enters.

The duplicate-sites rule: active sites are unique. A tensor made by a user
(constructor, reassigned indices, unpickled) is checked once, for range and
duplicates; tensors the library derives from it keep that guarantee without a
new check.
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import numpy as np

from ._bfloat16 import bfloat16_dtype
from ._dispatch import (
    array_library,
    array_module,
    check_same_device,
    device_of,
    from_core_array,
    is_cupy_array,
    is_jax_array,
    is_jax_tracer,
    is_numpy_array,
    is_torch_tensor,
    to_core_array,
)

__all__ = [
    "FLOAT_DTYPES",
    "INT32_MIN",
    "INT32_MAX",
    "INT64_MAX",
    "MAX_SPATIAL_AXES",
    "array_library",
    "array_module",
    "as_batch_size",
    "as_features",
    "as_indices",
    "as_spatial_shape",
    "bfloat16_dtype",
    "check_dense_size",
    "check_indices_in_range",
    "check_integer_array",
    "check_rank",
    "check_same_device",
    "check_unique_sites",
    "device_of",
    "from_core_array",
    "is_cupy_array",
    "is_jax_array",
    "is_jax_tracer",
    "is_numpy_array",
    "is_torch_tensor",
    "memory_limit",
    "to_core_array",
]

#: Feature dtypes every feature pass accepts.
FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
#: Limits of the int32 indices and pair rows, and of the int64 packed keys.
INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
#: Spatial axes a grid may have.
MAX_SPATIAL_AXES = 4


def as_spatial_shape(spatial_shape: Any, name: str = "spatial_shape") -> tuple[int, ...]:
    """A tuple of 1 to 4 positive Python ints.

    Accepts a list, tuple, NumPy array or any object with ``tolist`` (a torch
    tensor) of integers. Floats (even whole ones), NaN, strings and bools are
    refused rather than truncated.
    """
    value = spatial_shape
    if not isinstance(value, np.ndarray) and hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        try:
            value = value.tolist()
        except Exception:  # noqa: BLE001 - a device array that cannot be read: refused below
            value = spatial_shape
    try:
        raw = np.asarray(value)
    except (TypeError, ValueError):
        raw = np.asarray(None)
    has_bool = isinstance(value, (list, tuple)) and any(isinstance(v, (bool, np.bool_)) for v in value)
    if raw.dtype.kind not in "iu" or raw.ndim > 1 or has_bool:
        raise ValueError(
            f"{name} must be a sequence of 1 to {MAX_SPATIAL_AXES} positive ints (one per spatial "
            f"axis), got {spatial_shape!r}; pass integers, e.g. [41, 1600, 1408], after rounding "
            "any computed float sizes with int(math.ceil(...))"
        )
    shape = tuple(int(size) for size in raw.reshape(-1).tolist())
    if not 1 <= len(shape) <= MAX_SPATIAL_AXES or min(shape) < 1:
        raise ValueError(
            f"{name} must be 1 to {MAX_SPATIAL_AXES} positive ints (one per spatial axis), got "
            f"{spatial_shape!r}; every axis needs at least one cell"
        )
    if max(shape) > INT32_MAX + 1:
        raise ValueError(
            f"{name} = {shape} has an axis longer than 2^31 cells, beyond the int32 coordinates of "
            "indices; use a coarser voxel size"
        )
    return shape


def as_batch_size(batch_size: Any, name: str = "batch_size") -> int:
    """A positive Python int (bools and floats are refused)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(
            f"{name} must be a positive int (the number of batch elements), got {batch_size!r}; "
            "pass int(indices[:, 0].max()) + 1 or the number of samples in the batch"
        )
    return int(batch_size)


def check_rank(array: Any, ndim: int, name: str, layout: str) -> None:
    """Raises a ``ValueError`` naming ``name`` unless ``array`` (of any library) has ``ndim`` axes.

    Args:
        array: anything with ``ndim`` and ``shape`` (a torch tensor, a core array).
        ndim: the expected number of axes.
        name: the argument's name.
        layout: the expected layout, for the message (e.g. ``"[N, C]"``).
    """
    if array.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(array.shape)}")


def check_integer_array(array: Any, name: str, ndim: int = 1) -> Any:
    """``array`` as a core integer array of rank ``ndim``; floats and bools are refused."""
    array = to_core_array(array, name)
    if array.dtype.kind not in "iu":
        raise TypeError(
            f"{name} must be an integer array, got dtype {array.dtype}; floats are not truncated "
            "silently: floor or round them and cast with .astype(int64) first"
        )
    if array.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(array.shape)}")
    return array


def as_indices(indices: Any, ndim: int, name: str = "indices") -> Any:
    """An int32 core array ``[N, 1 + ndim]`` (converted from any integer dtype)."""
    array = to_core_array(indices, name)
    if array.ndim != 2 or array.shape[1] != ndim + 1:
        raise ValueError(
            f"{name} must have shape [N, {ndim + 1}] (batch index, then {ndim} spatial "
            f"coordinates), got shape {tuple(array.shape)}"
        )
    if array.dtype.kind not in "iu":
        raise TypeError(
            f"{name} must be an integer array (int32 preferred), got dtype {array.dtype}; "
            "convert coordinates with .astype(int32) after flooring them"
        )
    if array.dtype != np.int32:
        xp = array_module(array)
        if array.size and (int(array.max()) > INT32_MAX or int(array.min()) < INT32_MIN):
            raise ValueError(
                f"{name} has values outside the int32 range [{INT32_MIN}, {INT32_MAX}] "
                f"(seen {int(array.min())} to {int(array.max())}); coordinates must fit the grid"
            )
        array = array.astype(xp.int32)
    return array


def check_indices_in_range(
    indices: Any, spatial_shape: Sequence[int], batch_size: int, name: str = "indices"
) -> None:
    """Raises when a batch index or a coordinate lies outside the grid.

    Args:
        indices: integer ``[N, 1 + D]`` core array.
        spatial_shape: ``D`` positive ints.
        batch_size: the number of batch elements.
        name: the argument's name.
    """
    if indices.shape[0] == 0:
        return
    # per-column reductions (an axis-0 reduction of a narrow [N, 4] array is ~15x slower on NumPy),
    # read back in one transfer (one host synchronisation on the GPU, not one per value)
    xp = array_module(indices)
    columns = range(indices.shape[1])
    bounds = xp.stack([indices[:, column].min() for column in columns]
                      + [indices[:, column].max() for column in columns]).tolist()
    low, high = bounds[:indices.shape[1]], bounds[indices.shape[1]:]
    limits = (batch_size,) + tuple(spatial_shape)
    for column, (lowest, highest, limit) in enumerate(zip(low, high, limits)):
        if lowest >= 0 and highest < limit:
            continue
        bad_value = lowest if lowest < 0 else highest
        rows = (indices[:, column] == bad_value).nonzero()[0]
        row = int(rows[0])
        what = "batch index" if column == 0 else f"coordinate on spatial axis {column - 1}"
        bound = "batch_size" if column == 0 else f"spatial_shape[{column - 1}]"
        raise ValueError(
            f"{name}[{row}] = {indices[row].tolist()} has {what} {bad_value}, outside "
            f"[0, {limit}) ({bound} = {limit}); "
            + (
                "batch indices must be smaller than batch_size"
                if column == 0
                else "coordinates must be non-negative and smaller than the spatial shape: "
                "crop or shift the points, or enlarge spatial_shape"
            )
        )


def _grid_keys(indices: Any, spatial_shape: Sequence[int]) -> Any:
    xp = array_module(indices)
    keys = indices[:, 0].astype(xp.int64)
    for axis, size in enumerate(spatial_shape):
        keys *= size
        keys += indices[:, axis + 1]
    return keys


def _raise_duplicate(indices: Any, keys: Any, duplicate_key: int, name: str) -> None:
    rows = (keys == duplicate_key).nonzero()[0]
    first, second = int(rows[0]), int(rows[1])
    raise ValueError(
        f"{name} contains duplicate sites: rows {first} and {second} are both "
        f"{indices[first].tolist()}. Each active site must appear once; merge duplicate "
        "points first (for example with sparsecore.voxelize, or by summing their features)"
    )


def check_unique_sites(indices: Any, spatial_shape: Sequence[int], batch_size: int,
                       name: str = "indices") -> None:
    """Raises when two rows of ``indices`` are the same site.

    The sites must already be in range (`check_indices_in_range`). On NumPy the
    keys are bucketed by a multiplicative hash first and only the keys that
    share a bucket are sorted (about 3 ms for 125k sites instead of 8 for a sort).

    Args:
        indices: integer ``[N, 1 + D]`` core array of in-range sites.
        spatial_shape: ``D`` positive ints.
        batch_size: the number of batch elements.
        name: the argument's name.

    Raises:
        ValueError: naming the two rows that hold the same site.
    """
    count = int(indices.shape[0])
    if count < 2:
        return
    if batch_size * math.prod(spatial_shape) > INT64_MAX:
        raise ValueError(
            f"batch_size {batch_size} x spatial_shape {tuple(spatial_shape)} has more than 2^63 - 1 "
            "cells; sites cannot be told apart by one int64 key. Use a coarser voxel size"
        )
    xp = array_module(indices)
    keys = _grid_keys(indices, spatial_shape)
    if is_numpy_array(keys):
        bits = max(4, int(count - 1).bit_length() + 2)
        buckets = keys.view(np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing
        buckets >>= np.uint64(64 - bits)
        buckets = buckets.view(np.int64)  # < 2^bits: the same values as int64, no copy
        counts = np.bincount(buckets, minlength=1 << bits)
        candidates = np.sort(keys[np.take(counts, buckets) > 1])
    else:
        candidates = xp.sort(keys)
    if candidates.shape[0] < 2:
        return
    same = xp.nonzero(candidates[1:] == candidates[:-1])[0]
    if same.shape[0]:
        _raise_duplicate(indices, keys, int(candidates[int(same[0])]), name)


def as_features(features: Any, num_rows: int | None = None, name: str = "features",
                rows_meaning: str = "active site (features and indices must have one row per site)",
                bfloat16: bool = False) -> Any:
    """A float16/32/64 core array ``[N, C]`` (bfloat16 too when ``bfloat16``: a pass that runs it on the
    kernel backend), with ``num_rows`` rows when given."""
    array = to_core_array(features, name)
    if array.ndim != 2:
        raise ValueError(f"{name} must be 2-D [N, C], got shape {tuple(array.shape)}")
    if array.dtype not in FLOAT_DTYPES and not (bfloat16 and array.dtype.name == "bfloat16"):
        raise TypeError(
            f"{name} must be float16, float32 or float64, got dtype {array.dtype}; cast it "
            "with .astype(float32)"
        )
    if num_rows is not None and array.shape[0] != num_rows:
        raise ValueError(
            f"{name} has {array.shape[0]} rows but {num_rows} are expected: one per "
            f"{rows_meaning}"
        )
    return array


def memory_limit(xp: Any) -> int:
    """Bytes of the memory an array of module ``xp`` lives in (host RAM, or the current GPU's)."""
    if xp.__name__ == "numpy":
        try:
            return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):
            return INT64_MAX
    return int(xp.cuda.Device().mem_info[1])


def check_dense_size(batch_size: int, spatial_shape: Sequence[int], channels: int, itemsize: int,
                     limit_bytes: int = INT64_MAX) -> int:
    """The number of bytes of a dense ``[B, *spatial, C]`` grid; raises beyond ``limit_bytes``.

    Args:
        batch_size: ``B``.
        spatial_shape: the grid.
        channels: ``C``.
        itemsize: bytes per element.
        limit_bytes: the largest size accepted.

    Raises:
        ValueError: naming spatial_shape, batch_size and channels with the size they imply.
    """
    elements = batch_size * math.prod(spatial_shape) * channels
    size = elements * itemsize
    if size > limit_bytes or elements > INT64_MAX:
        raise ValueError(
            f"a dense grid of batch_size {batch_size} x spatial_shape {tuple(spatial_shape)} x "
            f"{channels} channels has {elements} elements ({size / 2**40:.3g} TiB), more than "
            f"can be allocated (at most {limit_bytes / 2**40:.3g} TiB); densify a cropped region "
            "or a coarser grid, or stay sparse"
        )
    return size
