"""Launch wrappers for every kernel, written once for NumPy (emulation) and CuPy (GPU).

These are the executable form of each kernel's contract: the arrays, dtypes,
layouts and scalar types to pass, how to size the grid, the host-side steps
between passes (the exclusive scan of the compaction) and the empty-input
cases that must not launch at all. The tests run them on the CPU emulation
and, where a GPU is present, on CuPy, against the NumPy twins; the CuPy
backend's wrappers must do the same.

A `Launcher` holds the array module ``xp`` and ``get_function(file,
expression)``, which returns a kernel called as ``kernel((grid,), (block,),
args)``: `harness.load_module(file).get_function` or a CuPy RawModule's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from sparsecore.backends import kernel_registry

__all__ = ["Launcher", "HashTableArrays", "hash_capacity"]

INT32_MAX = np.iinfo(np.int32).max
INT64_MAX = np.iinfo(np.int64).max


def hash_capacity(num_keys: int) -> int:
    """The table capacity for ``num_keys`` keys: a power of two, at least 2 * num_keys (and 2)."""
    capacity = 2
    while capacity < 2 * num_keys:
        capacity *= 2
    return capacity


@dataclass(frozen=True)
class HashTableArrays:
    """The arrays of a GPU hash table (see hash_table.cu).

    Attributes:
        keys: int64 ``[capacity]``, -1 in empty slots.
        values: int32 or int64 ``[capacity]``.
        capacity: a power of two.
    """

    keys: Any
    values: Any
    capacity: int


@dataclass(frozen=True)
class Launcher:
    """Launches registered kernels on arrays of ``xp``.

    Attributes:
        xp: ``numpy`` (emulation) or ``cupy``.
        get_function: ``(file, name expression) -> kernel``.
        block: threads per block.
        max_blocks: grid size cap; grid-stride loops cover the rest.
        tile_size: compaction tile (entries per tile), independent of ``block``.
    """

    xp: Any
    get_function: Callable[[str, str], Any]
    block: int = 256
    max_blocks: int = 4096
    tile_size: int = 1024

    def _launch(self, name: str, types: Sequence[Any], work: int, args: Sequence[Any],
                blocks: int | None = None) -> None:
        """Launches ``name`` over ``work`` items; nothing at all when there is no work."""
        if work <= 0:
            return
        expression = kernel_registry.name_expression(name, *types)
        kernel = self.get_function(kernel_registry.file_of_kernel(name), expression)
        wanted = blocks if blocks is not None else -(-work // self.block)
        kernel((max(1, min(wanted, self.max_blocks)),), (self.block,), tuple(args))

    def _contiguous(self, array: Any, dtype: Any) -> Any:
        return self.xp.ascontiguousarray(array, dtype=dtype)

    def _small(self, values: Sequence[Any], dtype: Any) -> Any:
        """A short host-side parameter list as a contiguous device array."""
        return self.xp.asarray(np.ascontiguousarray(values, dtype=dtype))

    @staticmethod
    def _element_type(array: Any, element_type: str | None) -> str:
        return element_type or kernel_registry.cuda_type_name(array.dtype)

    # ---- hash_table.cu ----

    def hash_build(self, keys: Any, values: Any, capacity: int | None = None) -> HashTableArrays:
        """Inserts int64 ``keys`` -> int32/int64 ``values``; duplicates keep the minimum value."""
        xp = self.xp
        keys = self._contiguous(keys, xp.int64)
        values = xp.ascontiguousarray(values)
        capacity = capacity or hash_capacity(keys.shape[0])
        empty_value = INT32_MAX if values.dtype == xp.int32 else INT64_MAX
        table = HashTableArrays(
            xp.full(capacity, -1, dtype=xp.int64), xp.full(capacity, empty_value, dtype=values.dtype), capacity
        )
        n = keys.shape[0]
        self._launch("sc_hash_insert", [values.dtype], n,
                     [keys, values, np.int64(n), table.keys, table.values, np.int64(capacity)])
        return table

    def hash_lookup(self, table: HashTableArrays, queries: Any) -> Any:
        """Values of int64 ``queries`` (-1 when absent), in the table's value dtype."""
        queries = self._contiguous(queries, self.xp.int64)
        n = queries.shape[0]
        out = self.xp.empty(n, dtype=table.values.dtype)
        self._launch("sc_hash_lookup", [table.values.dtype], n,
                     [queries, np.int64(n), table.keys, table.values, np.int64(table.capacity), out])
        return out

    def hash_lookup_offsets(self, table: HashTableArrays, keys: Any, deltas: Any) -> Any:
        """``out[k, i]`` = value of ``keys[i] + deltas[k]`` (padded-grid keys, see hash_table.cu)."""
        xp = self.xp
        keys = self._contiguous(keys, xp.int64)
        deltas = self._contiguous(deltas, xp.int64)
        n, num_offsets = keys.shape[0], deltas.shape[0]
        out = xp.empty((num_offsets, n), dtype=table.values.dtype)
        self._launch("sc_hash_lookup_offsets", [table.values.dtype], n * num_offsets,
                     [keys, np.int64(n), deltas, np.int32(num_offsets), table.keys, table.values,
                      np.int64(table.capacity), out])
        return out

    def pack_keys(self, indices: Any, strides: Sequence[int], addends: Sequence[int]) -> Any:
        """int64 ``[N]`` keys ``sum_c (indices[:, c] + addends[c]) * strides[c]`` of int32 ``[N, C]`` sites."""
        xp = self.xp
        indices = self._contiguous(indices, xp.int32)
        n, columns = indices.shape
        keys = xp.empty(n, dtype=xp.int64)
        self._launch("sc_pack_keys", [], n, [indices, np.int64(n), np.int32(columns), self._small(list(strides), np.int64),
                                             self._small(list(addends), np.int64), keys])
        return keys

    def unpack_keys(self, keys: Any, strides: Sequence[int], addends: Sequence[int]) -> Any:
        """int32 ``[N, C]`` sites of int64 ``keys`` (the inverse of `pack_keys`)."""
        xp = self.xp
        keys = self._contiguous(keys, xp.int64)
        n, columns = keys.shape[0], len(strides)
        indices = xp.empty((n, columns), dtype=xp.int32)
        self._launch("sc_unpack_keys", [], n, [keys, np.int64(n), np.int32(columns), self._small(list(strides), np.int64),
                                               self._small(list(addends), np.int64), indices])
        return indices

    # ---- segment_sums.cu ----

    def segment_sum_rows(self, target: Any, source: Any, order: Any, segment_starts: Any, segment_rows: Any,
                         element_type: str | None = None) -> None:
        """``target[segment_rows[s]] += sum(source[order[starts[s]:starts[s+1]]])``, in order, in place."""
        xp = self.xp
        source = self._contiguous(source, target.dtype)
        order = self._contiguous(order, xp.int32)
        segment_starts = self._contiguous(segment_starts, xp.int64)
        segment_rows = self._contiguous(segment_rows, xp.int32)
        num_segments, channels = segment_rows.shape[0], target.shape[1]
        self._launch("sc_segment_sum_rows", [self._element_type(target, element_type)], num_segments * channels,
                     [source, order, segment_starts, segment_rows, np.int64(num_segments), np.int64(channels),
                      target])

    # ---- rulebook.cu ----

    def compact(self, values: Any) -> tuple[Any, Any, Any]:
        """Stable compaction of int32 ``values [R, L]`` (entries >= 0 kept), row by row.

        Returns:
            ``(pair_column int32 [P], pair_value int32 [P], row_counts int64 [R])``.
        """
        xp = self.xp
        values = self._contiguous(values, xp.int32)
        num_rows, row_length = values.shape
        tiles_per_row = -(-row_length // self.tile_size)
        num_tiles = num_rows * tiles_per_row
        tile_counts = xp.empty(num_tiles, dtype=xp.int64)  # the kernel writes every tile
        scalars = [np.int64(num_rows), np.int64(row_length), np.int64(self.tile_size)]
        self._launch("sc_compact_count", [], num_tiles, [values, *scalars, tile_counts], blocks=num_tiles)
        tile_offsets = xp.cumsum(tile_counts) - tile_counts
        row_counts = tile_counts.reshape(num_rows, tiles_per_row).sum(axis=1)
        total = int(tile_counts.sum())
        pair_column = xp.empty(total, dtype=xp.int32)
        pair_value = xp.empty(total, dtype=xp.int32)
        if total:
            self._launch("sc_compact_write", [], num_tiles, [values, *scalars, tile_offsets, pair_column, pair_value],
                         blocks=num_tiles)
        return pair_column, pair_value, row_counts

    def conv_candidates(self, indices: Any, kernel_positions: Any, stride: Sequence[int], padding: Sequence[int],
                        dilation: Sequence[int], output_shape: Sequence[int], transposed: bool = False) -> Any:
        """Output keys ``[K, N]`` int64 (-1 where invalid) of a strided or transposed conv."""
        xp = self.xp
        indices = self._contiguous(indices, xp.int32)
        kernel_positions = self._contiguous(kernel_positions, xp.int32)
        n, ndim = indices.shape[0], indices.shape[1] - 1
        num_offsets = kernel_positions.shape[0]
        axis_params = self._small(np.array([stride, padding, dilation, output_shape]).reshape(4, ndim), np.int32)
        out = xp.empty((num_offsets, n), dtype=xp.int64)
        name = "sc_transposed_conv_candidates" if transposed else "sc_regular_conv_candidates"
        self._launch(name, [], n * num_offsets,
                     [indices, np.int64(n), np.int32(ndim), kernel_positions, np.int32(num_offsets),
                      axis_params, out])
        return out
