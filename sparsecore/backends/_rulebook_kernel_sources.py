"""The numba kernels behind `sparsecore.backends._rulebook_kernels` (imported on first use).

Plain loops compiled with ``cache=True``. The radix sort is serial; in the pair
kernels the threads claim kernel offsets or fixed chunks of keys from a shared
counter (`_work_queue`), each item writing its own segment of the outputs, so
results do not depend on the number of threads or on which thread ran an item.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

from ._work_queue import claim, new_counter  # new_counter: no parallel region of its own

__all__ = ["radix_sort", "radix_sort_packed", "unique_inverse_sorted", "subm_found", "subm_fill", "axis_tables",
           "axis_outputs", "strided_count", "strided_fill", "neighbour_table_fill"]

_SERIAL = {"cache": True, "nogil": True}
_PARALLEL = {"cache": True, "nogil": True, "parallel": True}
_DIGIT_BITS = 11


@njit(**_SERIAL)
def _digit_starts(values: Any, shift: int, mask: int) -> Any:
    """Where each digit value ``(values >> shift) & mask`` starts in the sorted order (exclusive
    prefix sums, ``[mask + 2]``), or an empty array when every value has the same digit (the pass
    would move nothing)."""
    count = values.shape[0]
    histogram = np.zeros(mask + 2, dtype=np.int64)
    for index in range(count):
        histogram[((values[index] >> shift) & mask) + 1] += 1
    if histogram.max() == count:
        return histogram[:0]
    for digit in range(1, mask + 2):
        histogram[digit] += histogram[digit - 1]
    return histogram


@njit(**_SERIAL)
def _radix_passes(values: Any, payload: Any, bits: int) -> tuple[Any, Any]:
    """Stable LSD passes over the low ``bits`` of non-negative int64 ``values``; ``payload`` (same
    length, or empty for none) moves with them. Both arrays are the caller's to overwrite (no copies).
    Returns both, sorted."""
    count = values.shape[0]
    carry = payload.shape[0] == count and count > 0
    current, other = values, np.empty_like(values)
    current_payload, other_payload = payload, np.empty_like(payload)
    mask = (1 << _DIGIT_BITS) - 1
    shift = 0
    while shift < bits:
        starts = _digit_starts(current, shift, mask)
        if starts.shape[0] > 0:  # else one digit value only: this pass moves nothing
            for index in range(count):
                value = current[index]
                digit = (value >> shift) & mask
                position = starts[digit]
                starts[digit] = position + 1
                other[position] = value
                if carry:
                    other_payload[position] = current_payload[index]
            current, other = other, current
            current_payload, other_payload = other_payload, current_payload
        shift += _DIGIT_BITS
    return current, current_payload


@njit(**_SERIAL)
def radix_sort(keys: Any, bits: int) -> tuple[Any, Any]:
    """Stable LSD radix sort of non-negative int64 ``keys`` below ``2 ** bits``: ``(sorted_keys, order)``."""
    return _radix_passes(keys.copy(), np.arange(keys.shape[0]), bits)


@njit(**_SERIAL)
def radix_sort_packed(keys: Any, index_bits: int, bits: int) -> tuple[Any, Any]:
    """`radix_sort` of keys packed with their index as ``key << index_bits | index`` (``bits`` in all,
    at most 63): one array moves per pass, about 5x the two-array sort on a scan's candidate keys."""
    count = keys.shape[0]
    packed = np.empty(count, dtype=np.int64)
    for index in range(count):
        packed[index] = (keys[index] << index_bits) | index
    current, _ = _radix_passes(packed, np.empty(0, dtype=np.int64), bits)
    index_mask = (1 << index_bits) - 1
    order = np.empty(count, dtype=np.int64)
    for index in range(count):
        value = current[index]
        order[index] = value & index_mask
        current[index] = value >> index_bits
    return current, order


@njit(**_SERIAL)
def unique_inverse_sorted(sorted_keys: Any, order: Any) -> tuple[Any, Any]:
    """Unique keys and inverse from keys sorted by ``order`` (``sorted_keys = keys[order]``)."""
    count = sorted_keys.shape[0]
    inverse = np.empty(count, dtype=np.int64)
    unique = np.empty(count, dtype=np.int64)
    rank = -1
    previous = 0
    for index in range(count):
        key = sorted_keys[index]
        if rank < 0 or key != previous:
            rank += 1
            unique[rank] = key
            previous = key
        inverse[order[index]] = rank
    return unique[:rank + 1], inverse


@njit(**_PARALLEL)
def subm_found(sorted_keys: Any, sorted_rows: Any, run_deltas: Any, run_firsts: Any, run_widths: Any, step: int,
               chunk: int, found: Any, chunk_counts: Any, lanes: int) -> None:
    """``found[k, i]``: the row of key ``sorted_keys[i] + delta_k``, or -1.

    Offsets come in runs (``run_widths[r]`` offsets from ``run_firsts[r]``, deltas ``run_deltas[r]``
    plus multiples of ``step``): one merge walk per run over sorted queries. Work items are fixed
    chunks of ``chunk`` queries; ``chunk_counts[c, k]`` counts chunk ``c``'s matches through ``k``.
    ``sorted_keys`` ends in a sentinel larger than every query.
    """
    count = found.shape[1]
    items = (count + chunk - 1) // chunk
    counter = new_counter()
    for lane in prange(min(lanes, items)):  # noqa: B007 (one iteration per thread)
        item = claim(counter)
        while item < items:
            low = item * chunk
            high = min(count, low + chunk)
            for run in range(run_deltas.shape[0]):
                delta, first, width = run_deltas[run], run_firsts[run], run_widths[run]
                position = np.searchsorted(sorted_keys, sorted_keys[low] + delta)
                for index in range(low, high):
                    query = sorted_keys[index] + delta
                    while sorted_keys[position] < query:
                        position += 1
                    probe = position
                    for column in range(width):
                        target = query + column * step
                        while sorted_keys[probe] < target:
                            probe += 1
                        if sorted_keys[probe] == target:
                            found[first + column, index] = sorted_rows[probe]
                            chunk_counts[item, first + column] += 1
                        else:
                            found[first + column, index] = -1
            item = claim(counter)


@njit(**_PARALLEL)
def subm_fill(found: Any, sorted_rows: Any, chunk: int, chunk_starts: Any, mirror_starts: Any, centre_start: int,
              pair_input: Any, pair_output: Any, lanes: int) -> None:
    """Writes, per chunk of keys, offset ``k < centre`` as ``(found, sorted row)`` pairs at
    ``chunk_starts[c, k]``, its mirror swapped at ``mirror_starts[c, k]``, and the centre ``i -> i``
    (compacted without branches into a per-chunk buffer first)."""
    count = found.shape[1]
    items = (count + chunk - 1) // chunk
    counter = new_counter()
    for lane in prange(min(lanes, items)):  # noqa: B007 (one iteration per thread)
        item = claim(counter)
        while item < items:
            kept_found = np.empty(chunk + 1, dtype=np.int32)
            kept_rows = np.empty(chunk + 1, dtype=np.int32)
            low = item * chunk
            high = min(count, low + chunk)
            for index in range(low, high):
                pair_input[centre_start + index] = index
                pair_output[centre_start + index] = index
            for offset in range(found.shape[0]):
                kept = 0
                for index in range(low, high):
                    row = found[offset, index]
                    kept_found[kept] = row
                    kept_rows[kept] = sorted_rows[index]
                    kept += row >= 0
                position = chunk_starts[item, offset]
                mirror = mirror_starts[item, offset]
                for entry in range(kept):
                    pair_input[position + entry] = kept_found[entry]
                    pair_output[position + entry] = kept_rows[entry]
                    pair_input[mirror + entry] = kept_rows[entry]
                    pair_output[mirror + entry] = kept_found[entry]
            item = claim(counter)


@njit(**_SERIAL)
def axis_tables(kernel_size: Any, stride: Any, padding: Any, dilation: Any, in_shape: Any, out_shape: Any,
                transposed: bool, tables: Any) -> None:
    """``tables[axis, k, c]``: the output coordinate of input coordinate ``c`` through kernel index ``k``
    on ``axis``, or -1 (every division of a layer done once per grid coordinate, not per site)."""
    for axis in range(out_shape.shape[0]):
        step, pad, spacing, size = stride[axis], padding[axis], dilation[axis], out_shape[axis]
        for kernel_index in range(kernel_size[axis]):
            for coordinate in range(in_shape[axis]):
                out = -1
                if transposed:
                    candidate = coordinate * step + kernel_index * spacing - pad
                    if 0 <= candidate < size:
                        out = candidate
                else:
                    numerator = coordinate + pad - kernel_index * spacing
                    if numerator >= 0:
                        candidate = numerator // step
                        if candidate * step == numerator and candidate < size:
                            out = candidate
                tables[axis, kernel_index, coordinate] = out


@njit(**_PARALLEL)
def axis_outputs(indices: Any, tables: Any, kernel_size: Any, outputs: Any) -> None:
    """``outputs[axis, k, row] = tables[axis, k, indices[row, axis + 1]]``."""
    for axis in prange(outputs.shape[0]):
        for kernel_index in range(kernel_size[axis]):
            table = tables[axis, kernel_index]
            column = outputs[axis, kernel_index]
            for row in range(indices.shape[0]):
                column[row] = table[indices[row, axis + 1]]


@njit(inline="always")
def _offset_mask(outputs: Any, kernel_indices: Any, offset: int, mask: Any) -> None:
    """``mask[row] < 0`` unless ``row`` has an output through ``offset`` on every axis (-1 has every bit)."""
    mask[:] = outputs[0, kernel_indices[offset, 0]]
    for axis in range(1, outputs.shape[0]):
        column = outputs[axis, kernel_indices[offset, axis]]
        for row in range(mask.shape[0]):
            mask[row] |= column[row]


@njit(**_PARALLEL)
def strided_count(outputs: Any, kernel_indices: Any, counts: Any, lanes: int) -> None:
    """``counts[k]``: the sites with a valid output through kernel offset ``k``."""
    volume = kernel_indices.shape[0]
    counter = new_counter()
    for lane in prange(min(lanes, volume)):  # noqa: B007 (one iteration per thread)
        offset = claim(counter)
        while offset < volume:
            mask = np.empty(outputs.shape[2], dtype=np.int32)
            _offset_mask(outputs, kernel_indices, offset, mask)
            matched = 0
            for row in range(mask.shape[0]):
                matched += mask[row] >= 0
            counts[offset] = matched
            offset = claim(counter)


@njit(**_PARALLEL)
def strided_fill(batch: Any, outputs: Any, kernel_indices: Any, starts: Any, key_strides: Any,
                 pair_input: Any, keys: Any, lanes: int) -> None:
    """Each offset's (input row, output key) candidates, rows ascending, at ``starts[k]``.

    The valid rows are compacted without branches into a per-offset buffer, then keyed.
    """
    count, volume = outputs.shape[2], kernel_indices.shape[0]
    counter = new_counter()
    for lane in prange(min(lanes, volume)):  # noqa: B007 (one iteration per thread)
        offset = claim(counter)
        while offset < volume:
            mask = np.empty(count, dtype=np.int32)
            kept_rows = np.empty(count + 1, dtype=np.int32)
            _offset_mask(outputs, kernel_indices, offset, mask)
            kept = 0
            for row in range(count):
                kept_rows[kept] = row
                kept += mask[row] >= 0
            start = starts[offset]
            for index in range(kept):
                row = kept_rows[index]
                key = batch[row] * key_strides[0]
                for axis in range(outputs.shape[0]):
                    key += outputs[axis, kernel_indices[offset, axis], row] * key_strides[axis + 1]
                pair_input[start + index] = row
                keys[start + index] = key
            offset = claim(counter)


@njit(**_SERIAL)
def neighbour_table_fill(keys: Any, values: Any, offset_starts: Any, table: Any, masks: Any) -> None:
    """``table[keys[p], k] = values[p]`` and bit ``k % 32`` of ``masks[keys[p], k // 32]`` for every pair
    ``p`` of offset ``k`` (``offset_starts[k] <= p < offset_starts[k + 1]``) whose key and value are both
    >= 0; ``table`` int32 ``[rows, K]`` (-1 on entry), ``masks`` uint32 ``[rows, W]`` (0 on entry). One
    pass over the pairs, serial: a map build is a few milliseconds, less than waking the pool costs on a
    loaded machine."""
    for offset in range(offset_starts.shape[0] - 1):
        bit = np.uint32(1) << np.uint32(offset % 32)
        word = offset // 32
        for pair in range(offset_starts[offset], offset_starts[offset + 1]):
            key = keys[pair]
            value = values[pair]
            if key >= 0 and value >= 0:
                table[key, offset] = value
                masks[key, word] |= bit
