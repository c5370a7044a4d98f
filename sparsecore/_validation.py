"""Input checks shared by the core: each error names the argument, what was expected,
what was seen, and how to fix it."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ._dispatch import array_module, to_core_array

__all__ = [
    "FLOAT_DTYPES",
    "as_features",
    "as_indices",
    "as_spatial_shape",
    "as_batch_size",
    "check_indices_in_range",
]

FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def as_spatial_shape(spatial_shape: Any, name: str = "spatial_shape") -> tuple[int, ...]:
    """A tuple of 1 to 4 positive Python ints."""
    try:
        shape = tuple(int(size) for size in np.asarray(spatial_shape).reshape(-1).tolist())
        raw = np.asarray(spatial_shape)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a sequence of positive ints, got {spatial_shape!r}") from None
    if raw.dtype.kind not in "iu" or not 1 <= len(shape) <= 4 or min(shape) < 1:
        raise ValueError(
            f"{name} must be 1 to 4 positive ints (one per spatial axis), got {spatial_shape!r}"
        )
    return shape


def as_batch_size(batch_size: Any) -> int:
    """A positive Python int."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    return int(batch_size)


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
        if array.size and (int(array.max()) > np.iinfo(np.int32).max or int(array.min()) < np.iinfo(np.int32).min):
            raise ValueError(f"{name} has values outside the int32 range")
        array = array.astype(xp.int32)
    return array


def check_indices_in_range(
    indices: Any, spatial_shape: Sequence[int], batch_size: int, name: str = "indices"
) -> None:
    """Raises when a batch index or a coordinate lies outside the grid.

    Args:
        indices: int32 ``[N, 1 + D]`` core array.
        spatial_shape: ``D`` positive ints.
        batch_size: the number of batch elements.
        name: the argument's name.
    """
    if indices.shape[0] == 0:
        return
    # per-column reductions: an axis-0 reduction of a narrow [N, 4] array is ~15x slower
    low = [int(indices[:, column].min()) for column in range(indices.shape[1])]
    high = [int(indices[:, column].max()) for column in range(indices.shape[1])]
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


def as_features(features: Any, num_rows: int | None = None, name: str = "features",
                rows_meaning: str = "active sites; features and indices must have one row per site") -> Any:
    """A float16/32/64 core array ``[N, C]``, with ``num_rows`` rows when given."""
    array = to_core_array(features, name)
    if array.ndim != 2:
        raise ValueError(f"{name} must be 2-D [N, C], got shape {tuple(array.shape)}")
    if array.dtype not in FLOAT_DTYPES:
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
