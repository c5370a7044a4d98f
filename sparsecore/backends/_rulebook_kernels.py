"""Compiled CPU kernels of the rulebook builders (numba, compiled on first use, cached on disk).

The NumPy backend's rulebook primitives run on these:

- `argsort_keys`: a stable LSD radix sort of non-negative int64 keys (11-bit
  digits, passes skipped where every key shares the digit; each key packed
  with its index into one int64 where the bits allow, so one array moves per
  pass), 5-7x NumPy's ``argsort`` on the keys of a scan.
- `unique_inverse`: sorted unique keys and the inverse, from that sort.
- `submanifold_pairs`: a subm rulebook's pairs in their final layout, from
  the sorted keys: one merge walk per kernel offset before the centre (the
  queries ``key + delta`` of sorted keys are sorted too), the mirror offsets
  written swapped, the centre as the identity.
- `strided_candidates`: a regular or transposed layer's (input row, output
  key) candidates grouped by kernel offset, rows ascending within each.

Parallel kernels split their work into kernel offsets or fixed chunks of keys,
claimed by the threads one at a time (`_work_queue`), each writing its own segment, so every result is identical at every thread
count. Builds of fewer than about a million site-offset checks (``4 * N * K``
below ``SERIAL_MAX_WORK``: clouds of up to ~35k sites at k3) run on the calling
thread: waking the pool did not pay there (20k sites, strided: 3.5 ms on one
thread, 5.7 ms on two, on a loaded 2-core machine).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .._compile_notice import numba_for_kernels
from ._cpu_kernels import compiled_kernel, kernel_threads

__all__ = ["argsort_keys", "unique_inverse", "submanifold_pairs", "strided_candidates", "neighbour_table"]


_SORT_WORK_PER_KEY = 16
"""A sort of ``N`` keys counts ``16 N`` against `_cpu_kernels.NUMPY_MAX_WORK`: up to 16,384 keys take
NumPy's stable sort (random 40-bit keys on the 2-core machine, 2026-12-05: 16,384 in 1.15 ms against
0.71 compiled, 65,536 in 5.6 against 3.8), as many as a subm build of the largest cloud the pair twins
take (about 2,400 sites at k3)."""

_CHUNK = 16384
"""Keys per work item of the subm kernels (a fixed split: the same pairs at any thread count)."""


_TABLE_MIN_EXTENT = 1 << 16
"""Grid extents up to which output coordinates are read from per-coordinate tables whatever the
number of sites (beyond it, only up to 4 entries per site)."""


def _sources() -> Any:
    numba_for_kernels()
    from . import _rulebook_kernel_sources

    return _rulebook_kernel_sources


def _sort_work(count: int) -> int:
    return _SORT_WORK_PER_KEY * count


def argsort_keys(keys: np.ndarray, compiled: Optional[bool] = None) -> tuple[np.ndarray, np.ndarray]:
    """``(keys[order], order)`` with ``order`` the stable ascending order of int64 ``keys``.

    Non-negative keys (every packed key) take the radix sort; others, and few keys
    (`compiled_kernel`), NumPy's stable sort (the same order).
    """
    keys = np.ascontiguousarray(keys, dtype=np.int64)
    if keys.shape[0] == 0:
        return keys.copy(), np.zeros(0, dtype=np.int64)
    if not compiled_kernel(_sort_work(keys.shape[0]), compiled) or int(keys.min()) < 0:
        order = np.argsort(keys, kind="stable").astype(np.int64, copy=False)
        return keys[order], order
    key_bits = max(1, int(keys.max()).bit_length())
    index_bits = max(1, int(keys.shape[0] - 1).bit_length())
    if key_bits + index_bits <= 63:
        return _sources().radix_sort_packed(keys, index_bits, key_bits + index_bits)
    return _sources().radix_sort(keys, key_bits)


def unique_inverse(keys: np.ndarray, compiled: Optional[bool] = None) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique int64 keys ``[U]`` and the int64 ``[M]`` inverse (``unique[inverse] == keys``)."""
    if keys.shape[0] == 0:
        return np.asarray(keys, dtype=np.int64).copy(), np.zeros(0, dtype=np.int64)
    compiled = compiled_kernel(_sort_work(keys.shape[0]), compiled)
    sorted_keys, order = argsort_keys(keys, compiled)
    if compiled:
        return _sources().unique_inverse_sorted(sorted_keys, order)
    first = np.empty(sorted_keys.shape[0], dtype=bool)
    first[0] = True
    np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=first[1:])
    inverse = np.empty(sorted_keys.shape[0], dtype=np.int64)
    inverse[order] = np.cumsum(first) - 1
    return sorted_keys[first], inverse


def neighbour_table(keys: np.ndarray, values: np.ndarray, offset_starts: tuple[int, ...], rows: int,
                    compiled: Optional[bool] = None) -> tuple[np.ndarray, np.ndarray]:
    """One side's neighbour table and row masks of pairs grouped by offset (`sparsecore.neighbour_map`'s
    host build).

    Args:
        keys: int32 ``[P]`` the side's rows of the pairs (-1: padding).
        values: int32 ``[P]`` the other side's rows (-1: padding).
        offset_starts: ``K + 1`` ints delimiting each offset's pairs.
        rows: the side's rows.
        compiled: the compiled kernel or the NumPy twin (default: `compiled_kernel` of the pairs and table entries).

    Returns:
        ``(table, masks)``: int32 ``[rows, K]``, ``values[p]`` at ``[keys[p], k]`` for offset ``k``'s pairs and
        -1 elsewhere; uint32 ``[rows, W]`` (``W = max(1, ceil(K / 32))``) its row masks: bit ``k % 32`` of
        word ``k // 32`` set where the table's entry ``k`` is >= 0 (`sparsecore.neighbour_map.row_masks`).
    """
    volume = len(offset_starts) - 1
    table = np.full((rows, volume), -1, dtype=np.int32)
    masks = np.zeros((rows, max(1, -(-volume // 32))), dtype=np.uint32)
    count = int(offset_starts[-1])
    keys, values = keys[:count], values[:count]
    if count and compiled_kernel(count + rows * volume, compiled):
        _sources().neighbour_table_fill(np.ascontiguousarray(keys, dtype=np.int32),
                                        np.ascontiguousarray(values, dtype=np.int32),
                                        np.asarray(offset_starts, dtype=np.int64), table, masks)
    elif count:
        offsets = np.repeat(np.arange(volume, dtype=np.int64), np.diff(np.asarray(offset_starts, dtype=np.int64)))
        valid = (keys >= 0) & (values >= 0)
        keys, offsets = keys[valid].astype(np.int64), offsets[valid]
        table.reshape(-1)[keys * volume + offsets] = values[valid]
        np.bitwise_or.at(masks, (keys, offsets // 32), np.left_shift(np.uint32(1), (offsets % 32).astype(np.uint32)))
    return table, masks


def submanifold_pairs(sorted_keys: np.ndarray, sorted_rows: np.ndarray, deltas: np.ndarray, run_length: int,
                      step: int, compiled: Optional[bool] = None) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """The pairs of a subm rulebook of ``K = 2 * len(deltas) + 1`` offsets.

    Args:
        sorted_keys: int64 ``[N + 1]`` unique packed keys, increasing, ending in a sentinel above
            every ``key + delta``.
        sorted_rows: int64 ``[N]`` the row of each key.
        deltas: int64 ``[centre]`` key differences of the offsets before the centre, in runs of
            ``run_length`` (the last kernel axis) whose deltas grow by ``step``.
        run_length: offsets per run (the last axis' kernel size).
        step: delta between neighbours of a run (the last axis' dilation).
        compiled: the compiled kernels or the NumPy twin (default: `compiled_kernel` of the work).

    Returns:
        ``(pair_input int32 [P], pair_output int32 [P], offset_starts)``: offset ``k < centre`` pairs
        ``(row of key + delta_k, row of key)`` in key order, offset ``K - 1 - k`` the same pairs
        swapped, the centre ``i -> i``.
    """
    count = sorted_rows.shape[0]
    centre = deltas.shape[0]
    if not compiled_kernel(4 * count * (2 * centre + 1), compiled):
        return _submanifold_pairs_twin(sorted_keys, sorted_rows, deltas)
    firsts = np.arange(0, centre, max(1, run_length), dtype=np.int64)
    widths = np.minimum(max(1, run_length), centre - firsts)
    chunks = max(1, -(-count // _CHUNK))
    found = np.empty((centre, count), dtype=np.int32)
    chunk_counts = np.zeros((chunks, centre), dtype=np.int64)
    rows32 = sorted_rows.astype(np.int32)
    sources = _sources()
    if centre and count:
        with kernel_threads(4 * count * (2 * centre + 1)) as lanes:
            sources.subm_found(sorted_keys, rows32, np.ascontiguousarray(deltas[firsts], dtype=np.int64), firsts,
                               widths, int(step), _CHUNK, found, chunk_counts, lanes)
    counts = chunk_counts.sum(axis=0)
    sizes = counts.tolist() + [count] + counts.tolist()[::-1]
    starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    before = np.cumsum(chunk_counts, axis=0) - chunk_counts  # pairs of earlier chunks, per offset
    chunk_starts = np.ascontiguousarray(starts[:centre] + before)
    mirror_starts = np.ascontiguousarray(starts[2 * centre - np.arange(centre)] + before)
    pair_input = np.empty(int(starts[-1]), dtype=np.int32)
    pair_output = np.empty(int(starts[-1]), dtype=np.int32)
    if count:
        with kernel_threads(4 * count * (2 * centre + 1)) as lanes:
            sources.subm_fill(found, rows32, _CHUNK, chunk_starts, mirror_starts, int(starts[centre]),
                              pair_input, pair_output, lanes)
    return pair_input, pair_output, tuple(starts.tolist())


def _submanifold_pairs_twin(sorted_keys: np.ndarray, sorted_rows: np.ndarray,
                            deltas: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """`submanifold_pairs` in NumPy (the same arrays): one binary search of every key plus every delta."""
    keys, rows = sorted_keys[:-1], sorted_rows.astype(np.int32)
    queries = deltas.astype(np.int64)[:, None] + keys[None, :]  # [centre, N], key order along each offset
    position = np.searchsorted(sorted_keys, queries)  # the sentinel is above every query
    found = sorted_keys[position] == queries
    offsets, columns = np.nonzero(found)  # grouped by offset, keys ascending within each
    before_input, before_output = rows[position[offsets, columns]], rows[columns]
    counts = np.count_nonzero(found, axis=1).tolist()
    before_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    identity = np.arange(keys.shape[0], dtype=np.int32)
    mirrored = [slice(int(before_starts[k]), int(before_starts[k + 1])) for k in range(len(counts) - 1, -1, -1)]
    pair_input = np.concatenate([before_input, identity, *[before_output[part] for part in mirrored]])
    pair_output = np.concatenate([before_output, identity, *[before_input[part] for part in mirrored]])
    sizes = counts + [keys.shape[0]] + counts[::-1]
    starts = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    return pair_input, pair_output, tuple(starts.tolist())


def strided_candidates(indices: np.ndarray, geometry: Any, output_spatial_shape: tuple[int, ...],
                       compiled: Optional[bool] = None) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """Every (input row, output key) pair of a regular or transposed layer, grouped by offset.

    Args:
        indices: integer ``[N, 1 + D]`` sites in range.
        geometry: the layer's `ConvGeometry` (kind ``"regular"`` or ``"transposed"``).
        output_spatial_shape: the output grid.
        compiled: the compiled kernels or the NumPy twin (default: `compiled_kernel` of the work).

    Returns:
        ``(input_rows int32 [P], keys int64 [P], offset_starts)``: keys pack ``(batch, output
        coordinates)`` row-major over the output grid (no margin); rows ascend within each offset.
    """
    ndim = geometry.ndim
    sites = np.ascontiguousarray(indices, dtype=np.int32)
    kernel_indices = np.ascontiguousarray(geometry.kernel_offsets(), dtype=np.int64).reshape(-1, ndim)
    kernel_size = np.asarray(geometry.kernel_size, dtype=np.int64)
    in_shape = np.asarray(np.max(sites[:, 1:], axis=0) + 1 if sites.shape[0] else np.zeros(ndim), dtype=np.int64)
    strides = np.ones(ndim + 1, dtype=np.int64)
    for axis in range(ndim - 1, -1, -1):
        strides[axis] = strides[axis + 1] * int(output_spatial_shape[axis])
    counts = np.zeros(kernel_indices.shape[0], dtype=np.int64)
    work = 4 * sites.shape[0] * kernel_indices.shape[0]
    # output coordinates fit int32 (the builder checks the output grid)
    outputs = np.empty((ndim, int(kernel_size.max(initial=0)), sites.shape[0]), dtype=np.int32)
    if not compiled_kernel(work, compiled):
        _axis_outputs(sites, geometry, output_spatial_shape, outputs)
        return _strided_candidates_twin(sites, outputs, kernel_indices, strides)
    sources = _sources()
    if sites.shape[0] and int(in_shape.max()) <= max(_TABLE_MIN_EXTENT, 4 * sites.shape[0]):
        # one table entry per grid coordinate the sites reach: the divisions done once per coordinate
        tables = np.empty((ndim, outputs.shape[1], int(in_shape.max())), dtype=np.int32)
        sources.axis_tables(kernel_size, *[np.asarray(value, dtype=np.int64) for value in (
            geometry.stride, geometry.padding, geometry.dilation)], in_shape,
            np.asarray(output_spatial_shape, dtype=np.int64), geometry.kind == "transposed", tables)
        with kernel_threads(outputs.size):  # one table lookup per entry: small layers on the calling thread
            sources.axis_outputs(sites, tables, kernel_size, outputs)
    elif sites.shape[0]:  # few sites on a vast grid: the divisions once per site
        _axis_outputs(sites, geometry, output_spatial_shape, outputs)
    if sites.shape[0]:
        with kernel_threads(work) as lanes:
            sources.strided_count(outputs, kernel_indices, counts, lanes)
    starts = np.zeros(kernel_indices.shape[0] + 1, dtype=np.int64)
    np.cumsum(counts, out=starts[1:])
    input_rows = np.empty(int(starts[-1]), dtype=np.int32)
    keys = np.empty(int(starts[-1]), dtype=np.int64)
    if starts[-1]:
        with kernel_threads(work) as lanes:
            sources.strided_fill(np.ascontiguousarray(sites[:, 0]), outputs, kernel_indices, starts, strides,
                                 input_rows, keys, lanes)
    return input_rows, keys, tuple(starts.tolist())


def _strided_candidates_twin(sites: np.ndarray, outputs: np.ndarray, kernel_indices: np.ndarray,
                             strides: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """The candidates of `strided_candidates` in NumPy (the same arrays), from ``outputs`` (`_axis_outputs`)."""
    ndim = outputs.shape[0]
    # [K, N] output coordinates per axis: -1 where the site has no output through the offset
    coordinates = [outputs[axis][kernel_indices[:, axis]] for axis in range(ndim)]
    valid = np.logical_and.reduce([column >= 0 for column in coordinates])
    offsets, rows = np.nonzero(valid)  # grouped by offset, rows ascending within each
    keys = sites[rows, 0].astype(np.int64) * strides[0]
    for axis, column in enumerate(coordinates):
        keys += column[offsets, rows].astype(np.int64) * strides[axis + 1]
    starts = np.zeros(kernel_indices.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.count_nonzero(valid, axis=1), out=starts[1:])
    return rows.astype(np.int32), keys, tuple(starts.tolist())


def _axis_outputs(sites: np.ndarray, geometry: Any, output_spatial_shape: tuple[int, ...],
                  outputs: np.ndarray) -> None:
    """``outputs[axis, k, row]``: the output coordinate of ``row`` through kernel index ``k``, or -1."""
    for axis in range(geometry.ndim):
        coordinate = sites[:, axis + 1].astype(np.int64)
        step, pad, spacing = geometry.stride[axis], geometry.padding[axis], geometry.dilation[axis]
        size = int(output_spatial_shape[axis])
        for kernel_index in range(geometry.kernel_size[axis]):
            if geometry.kind == "transposed":
                out = coordinate * step + (kernel_index * spacing - pad)
                valid = (out >= 0) & (out < size)
            else:
                numerator = coordinate + (pad - kernel_index * spacing)
                out = numerator // step
                valid = (numerator >= 0) & (out < size) & (numerator - out * step == 0)
            outputs[axis, kernel_index] = np.where(valid, out, -1)
