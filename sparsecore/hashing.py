"""Key packing and the hash table of active sites.

A site ``(batch, c_0, ..., c_{D-1})`` packs into one int64 key, row-major over
``(batch_size, *shape)``. Rulebook builders pack over a grid padded by the
kernel's reach on every side (``margin``), so that adding a fixed key delta to
a site's key moves it by a fixed coordinate offset without ever wrapping into
another row of the grid: a neighbour outside the real grid lands on a key that
no active site can have.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from .backends import backend_for
from .interop import INT64_MAX, array_module, as_batch_size, as_spatial_shape, check_integer_array, to_core_array

__all__ = ["pack_keys", "unpack_keys", "key_strides", "check_packable", "HashTable"]

_INT64_LIMIT = INT64_MAX


def check_packable(spatial_shape: Sequence[int], batch_size: int, margin: Sequence[int] | None = None) -> None:
    """Raises when ``batch_size * prod(spatial_shape + 2 * margin)`` keys overflow int64.

    Args:
        spatial_shape: ``D`` positive ints.
        batch_size: number of batch elements.
        margin: per-axis padding added on both sides (zeros when omitted).
    """
    margin = tuple(margin) if margin is not None else (0,) * len(spatial_shape)
    padded = [size + 2 * extra for size, extra in zip(spatial_shape, margin)]
    volume = batch_size * math.prod(padded)
    if volume > _INT64_LIMIT:
        raise ValueError(
            f"cannot pack sites into int64 keys: batch_size {batch_size} x grid "
            f"{tuple(padded)} (spatial_shape {tuple(spatial_shape)} plus the kernel's reach "
            f"{margin} on each side) has {volume} cells, more than 2^63 - 1. Use a coarser "
            "voxel size, a smaller coordinate range, or fewer batch elements per call."
        )


def key_strides(spatial_shape: Sequence[int], margin: Sequence[int] | None = None) -> tuple[int, ...]:
    """Per-column key strides ``(batch, axis_0, ..., axis_{D-1})`` of the (padded) grid."""
    margin = tuple(margin) if margin is not None else (0,) * len(spatial_shape)
    padded = [size + 2 * extra for size, extra in zip(spatial_shape, margin)]
    strides = [1] * (len(padded) + 1)
    for axis in range(len(padded) - 1, -1, -1):
        strides[axis] = strides[axis + 1] * padded[axis]
    return tuple(strides)


def pack_keys(
    indices: Any,
    spatial_shape: Sequence[int],
    batch_size: int,
    margin: Sequence[int] | None = None,
    *,
    assume_in_range: bool = False,
    backend: Any | None = None,
) -> Any:
    """Packs ``(batch, coords...)`` rows into int64 keys, row-major.

    Args:
        indices: integer ``[N, 1 + D]`` array (NumPy or CuPy), batch first.
        spatial_shape: ``D`` positive ints.
        batch_size: number of batch elements.
        margin: per-axis offset added to each coordinate; the grid is padded by
            it on both sides (rulebook builders use the kernel's reach).
        assume_in_range: skip the range check, for sites the library checked or
            produced (no host synchronisation on the GPU).
        backend: the primitives to run on; by default the backend of ``indices``
            (on the GPU, int32 sites are packed by one kernel launch).

    Returns:
        int64 ``[N]`` keys; ``key = ((b * S_0 + c_0 + m_0) * S_1 + c_1 + m_1) ...``
        with ``S_d = spatial_shape[d] + 2 m_d``.

    Raises:
        ValueError: when the padded grid cannot be packed into int64, or a batch
            index or coordinate lies outside the (padded) grid: such a site
            would share its key with another one.
        TypeError: for non-integer indices.
    """
    indices = check_integer_array(indices, "indices", ndim=2)
    xp = array_module(indices)
    if assume_in_range:
        spatial_shape = tuple(int(size) for size in spatial_shape)
    else:
        spatial_shape = as_spatial_shape(spatial_shape)
        batch_size = as_batch_size(batch_size)
    if indices.shape[1] != len(spatial_shape) + 1:
        raise ValueError(
            f"indices must have shape [N, {len(spatial_shape) + 1}] (batch index, then one column per "
            f"axis of spatial_shape {spatial_shape}), got shape {tuple(indices.shape)}"
        )
    check_packable(spatial_shape, batch_size, margin)
    margin = tuple(int(extra) for extra in margin) if margin is not None else (0,) * len(spatial_shape)
    if len(margin) != len(spatial_shape) or min(margin, default=0) < 0:
        raise ValueError(f"margin must be {len(spatial_shape)} non-negative ints, got {margin}")
    if not assume_in_range:
        _check_packable_sites(indices, spatial_shape, batch_size, margin)
    strides = key_strides(spatial_shape, margin)
    packed = getattr(backend if backend is not None else backend_for(indices), "pack_site_keys", None)
    if packed is not None and indices.dtype == xp.int32:  # the kernel backend: one launch
        return packed(indices, strides, (0, *margin))
    keys = indices[:, 0].astype(xp.int64) * strides[0]
    for axis, extra in enumerate(margin):
        column = indices[:, axis + 1].astype(xp.int64)
        if extra:
            column += extra
        keys += column * strides[axis + 1]
    return keys


def _check_packable_sites(indices: Any, spatial_shape: tuple[int, ...], batch_size: int,
                          margin: tuple[int, ...]) -> None:
    if indices.shape[0] == 0:
        return
    limits = [(0, batch_size)] + [(-extra, size + extra) for size, extra in zip(spatial_shape, margin)]
    for column, (low, high) in enumerate(limits):
        lowest, highest = int(indices[:, column].min()), int(indices[:, column].max())
        if lowest >= low and highest < high:
            continue
        bad = lowest if lowest < low else highest
        row = int((indices[:, column] == bad).nonzero()[0][0])
        what = "batch index" if column == 0 else f"coordinate on axis {column - 1}"
        raise ValueError(
            f"indices[{row}] = {indices[row].tolist()} has {what} {bad}, outside [{low}, {high}) "
            f"(batch_size {batch_size}, spatial_shape {spatial_shape}, margin {margin}); it would "
            "pack into the key of another site. Crop the sites to the grid or enlarge spatial_shape"
        )


def unpack_keys(keys: Any, spatial_shape: Sequence[int], margin: Sequence[int] | None = None, *,
                backend: Any | None = None) -> Any:
    """Inverse of `pack_keys`: int64 keys ``[N]`` to int32 ``[N, 1 + D]`` indices.

    ``backend``: the primitives to run on; by default the backend of ``keys`` (on the
    GPU, one kernel launch).
    """
    keys = check_integer_array(keys, "keys", ndim=1)
    xp = array_module(keys)
    spatial_shape = tuple(int(size) for size in spatial_shape)
    margin = tuple(int(extra) for extra in margin) if margin is not None else (0,) * len(spatial_shape)
    strides = key_strides(spatial_shape, margin)
    unpacked = getattr(backend if backend is not None else backend_for(keys), "unpack_site_keys", None)
    if unpacked is not None:  # the kernel backend: one launch
        return unpacked(keys, strides, (0, *margin))
    out = xp.empty((keys.shape[0], len(spatial_shape) + 1), dtype=xp.int32)
    remainder = keys
    out[:, 0] = remainder // strides[0]
    remainder = remainder % strides[0]
    for axis, extra in enumerate(margin):
        stride = strides[axis + 1]
        out[:, axis + 1] = remainder // stride - extra
        remainder = remainder % stride
    return out


class HashTable:
    """A table from unique int64 keys to int64 values, built once, looked up many times.

    The NumPy backend keeps keys sorted and searches them; the CuPy backend uses
    open addressing on the GPU. Both give the same answers.

    Args:
        keys: int64 (or any integer) ``[N]`` non-negative keys, unique.
        values: integer ``[N]`` values; ``arange(N)`` when omitted.

    Raises:
        ValueError: on duplicate or negative keys, or mismatched lengths.
    """

    def __init__(self, keys: Any, values: Any | None = None) -> None:
        keys = to_core_array(keys, "keys")
        xp = array_module(keys)
        if keys.ndim != 1 or keys.dtype.kind not in "iu":
            raise ValueError(f"keys must be a 1-D integer array, got shape {keys.shape} dtype {keys.dtype}")
        keys = keys.astype(xp.int64, copy=False)
        if values is None:
            values = xp.arange(keys.shape[0], dtype=xp.int64)
        else:
            values = to_core_array(values, "values")
            if values.shape != keys.shape or values.dtype.kind not in "iu":
                raise ValueError(
                    f"values must be an integer array shaped like keys {keys.shape}, got "
                    f"shape {values.shape} dtype {values.dtype}"
                )
            values = values.astype(xp.int64, copy=False)
        if keys.shape[0] and int(keys.min()) < 0:
            raise ValueError("keys must be non-negative (-1 marks an empty slot)")
        self._backend = backend_for(keys)
        self._table, duplicate = self._backend.hash_build(keys, values)
        if duplicate is not None:
            raise ValueError(f"keys must be unique; the entries with values {duplicate} share a key")
        self._size = int(keys.shape[0])

    def __len__(self) -> int:
        return self._size

    def lookup(self, queries: Any) -> Any:
        """Values of ``queries`` (integer ``[M]``), ``-1`` for keys not in the table.

        Raises:
            TypeError: for float (or other non-integer) queries: 20.7 is no key.
        """
        queries = check_integer_array(queries, "queries", ndim=1)
        xp = array_module(queries)
        return self._backend.hash_lookup(self._table, queries.astype(xp.int64, copy=False))

    def items(self) -> tuple[Any, Any]:
        """All ``(keys, values)``, int64 ``[N]`` each, sorted by key."""
        return self._backend.hash_items(self._table)
