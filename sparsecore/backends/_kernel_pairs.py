"""The kernel backend's pair primitives: compaction of pair tables and strided conv candidates.

Functions of a `KernelDevice` (a kernel backend's ``xp`` and launch settings),
kept apart from the hashing primitives of `kernel_backend` so each module has
one concern. Each makes its inputs contiguous, checks them, launches
registered ``sc_*`` kernels (never a zero-block grid) and uses ``xp`` for
sorts and scans. None needs atomics, so every result is bitwise reproducible,
and none synchronises with the host except where a size must be known to
allocate (`compact_pairs`' total). (The feature passes are the fused kernels
of `_kernel_fused`.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._launch import INT32_MAX, KernelDevice, check_row_count

__all__ = ["compact_pairs", "conv_candidate_pairs"]

# Entries of a compaction tile per thread: a tile is this many times the block.
_TILE_ENTRIES_PER_THREAD = 8


def compact_pairs(device: KernelDevice, table: Any) -> tuple[Any, Any, tuple[int, ...]]:
    """Entries ``>= 0`` of an integer ``[R, L]`` table, in row-major order (see `ArrayBackend.compact_pairs`).

    Two passes of ``rulebook.cu``: ``sc_compact_count`` counts each tile's
    entries, ``xp.cumsum`` turns counts into positions, ``sc_compact_write``
    writes them; one device-to-host copy brings the per-row counts.
    """
    xp = device.xp
    if table.ndim != 2 or table.dtype.kind not in "iu":
        raise ValueError(f"compact_pairs: table must be a 2-D integer array, got {table.dtype} {tuple(table.shape)}")
    num_rows, row_length = (int(size) for size in table.shape)
    if row_length > INT32_MAX:
        raise ValueError(f"compact_pairs: rows of {row_length} entries exceed the int32 column numbers")
    values = xp.ascontiguousarray(table, dtype=xp.int32)  # entries are rows or -1: int32 holds them
    if num_rows == 0 or row_length == 0:
        empty = xp.zeros(0, dtype=xp.int32)
        return empty, empty.copy(), (0,) * (num_rows + 1)
    tile_size = device.block_threads * _TILE_ENTRIES_PER_THREAD
    tiles_per_row = -(-row_length // tile_size)
    num_tiles = num_rows * tiles_per_row
    tile_counts = xp.empty(num_tiles, dtype=xp.int64)
    device.run("sc_compact_count", (), num_tiles * device.block_threads,
               (values, np.int64(num_rows), np.int64(row_length), np.int64(tile_size), tile_counts))
    tile_offsets = xp.cumsum(tile_counts) - tile_counts
    row_counts = tile_counts.reshape(num_rows, tiles_per_row).sum(axis=1).tolist()
    starts = [0]
    for count in row_counts:
        starts.append(starts[-1] + int(count))
    columns = xp.empty(starts[-1], dtype=xp.int32)
    found = xp.empty(starts[-1], dtype=xp.int32)
    if starts[-1]:
        device.run("sc_compact_write", (), num_tiles * device.block_threads,
                   (values, np.int64(num_rows), np.int64(row_length), np.int64(tile_size), tile_offsets,
                    columns, found))
    return columns, found, tuple(starts)


def conv_candidate_pairs(device: KernelDevice, indices: Any, geometry: Any,
                         output_spatial_shape: tuple[int, ...]) -> tuple[Any, Any, tuple[int, ...]]:
    """Input rows and output keys of every valid (site, offset) pair (see `ArrayBackend.conv_candidate_pairs`).

    ``sc_regular_conv_candidates`` / ``sc_transposed_conv_candidates`` fill a
    ``[K, N]`` key table in one launch; `compact_pairs` over a table holding the
    offset where the key is valid keeps the pairs grouped by offset, rows
    increasing.
    """
    xp = device.xp
    if geometry.kind not in ("regular", "transposed"):
        raise ValueError(f"conv_candidate_pairs: geometry must be regular or transposed, got {geometry.kind!r}")
    ndim = geometry.ndim
    if indices.ndim != 2 or indices.shape[1] != ndim + 1:
        raise ValueError(f"conv_candidate_pairs: indices must be [N, {ndim + 1}], got {tuple(indices.shape)}")
    count, volume = int(indices.shape[0]), int(geometry.kernel_volume)
    check_row_count(count, "indices", "conv_candidate_pairs")
    if max(output_spatial_shape, default=0) > INT32_MAX:
        raise ValueError(f"conv_candidate_pairs: output grid {tuple(output_spatial_shape)} exceeds int32 coordinates")
    positions = np.indices(geometry.kernel_size).reshape(ndim, -1).T
    parameters = np.array([geometry.stride, geometry.padding, geometry.dilation, tuple(output_spatial_shape)])
    keys = xp.empty((volume, count), dtype=xp.int64)
    kernel = "sc_transposed_conv_candidates" if geometry.kind == "transposed" else "sc_regular_conv_candidates"
    device.run(kernel, (), volume * count,
               (xp.ascontiguousarray(indices, dtype=xp.int32), np.int64(count), np.int32(ndim),
                xp.asarray(np.ascontiguousarray(positions, dtype=np.int32)), np.int32(volume),
                xp.asarray(np.ascontiguousarray(parameters, dtype=np.int32)), keys))
    offset_of_valid = xp.where(keys >= 0, xp.arange(volume, dtype=xp.int32)[:, None], xp.int32(-1))
    rows, offsets, starts = compact_pairs(device, offset_of_valid)
    pair_keys = xp.take(keys.reshape(-1), offsets.astype(xp.int64) * count + rows)
    return rows, pair_keys, starts
