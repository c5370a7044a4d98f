"""The NumPy backend: vectorised, sort-based hashing and BLAS matrix products.

A real CPU engine (for data loaders and CPU inference), not a slow reference:
the hash table is a sorted key array (sorted by a compiled radix sort)
searched with ``numpy.searchsorted``. Rulebook builds run on the compiled
kernels of `sparsecore.backends._rulebook_kernels`: ``submanifold_pairs``
(a fused subm build the generic builder uses when a backend offers it),
``conv_candidate_pairs`` and ``unique_inverse``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from . import _cpu_pool_kernels, _numpy_int8, _rulebook_kernels
from ._pair_runs import offset_runs

__all__ = ["NumpyBackend", "SortedTable"]


@dataclass(frozen=True)
class SortedTable:
    """A hash table as two arrays sorted by key, each ending in a sentinel.

    Attributes:
        keys: int64 ``[N + 1]``, increasing; the last entry is the int64 maximum,
            so a search position never needs clipping.
        values: int64 ``[N + 1]``, the value of each key; -1 for the sentinel.
    """

    keys: np.ndarray
    values: np.ndarray


_SENTINEL = np.iinfo(np.int64).max


@dataclass(frozen=True)
class RowRuns:
    """The NumPy backend's `scatter_plan`: the rows and their runs as given (one scatter per run)."""

    rows: np.ndarray
    run_starts: tuple[int, ...]
    num_rows: int


@dataclass(frozen=True)
class NumpyBackend:
    """Primitives on NumPy arrays (see `sparsecore.backends.base.ArrayBackend`).

    Feature passes run one kernel offset at a time (``chunk_elements = 0``):
    the gathered rows of one offset stay in cache for its GEMM and scatter.
    """

    name: str = "numpy"
    xp: Any = np
    chunk_elements: int = 0
    skips_negative_rows: bool = False

    def compute_dtype(self, dtype: Any) -> Any:
        # NumPy's float16 matmul has no BLAS kernel: compute float16 in float32; bfloat16 (ml_dtypes) too,
        # where the vdpbf16ps kernels do not run it (sparsecore.bf16_cpu_dataflow)
        dtype = np.dtype(dtype)
        return np.dtype(np.float32) if dtype == np.float16 or dtype.name == "bfloat16" else dtype

    def hash_build(self, keys: np.ndarray, values: np.ndarray,
                   check_duplicates: bool = True) -> tuple[SortedTable, tuple[int, int] | None]:
        # a stable radix sort (compiled): 4-8x NumPy's argsort on packed keys
        packed, order = _sort_keys(keys)
        sorted_keys = np.empty(keys.shape[0] + 1, dtype=np.int64)
        sorted_keys[:-1] = packed
        sorted_keys[-1] = _SENTINEL
        sorted_values = np.empty(keys.shape[0] + 1, dtype=np.int64)
        np.take(values, order, out=sorted_values[:-1])
        sorted_values[-1] = -1
        duplicate = None
        if check_duplicates and keys.shape[0] > 1:
            same = np.flatnonzero(sorted_keys[1:-1] == sorted_keys[:-2])
            if same.shape[0]:
                first = int(same[0])
                duplicate = (int(sorted_values[first]), int(sorted_values[first + 1]))
        return SortedTable(sorted_keys, sorted_values), duplicate

    def hash_lookup(self, table: SortedTable, queries: np.ndarray) -> np.ndarray:
        position = np.searchsorted(table.keys, queries)
        np.minimum(position, table.keys.shape[0] - 1, out=position)
        return np.where(table.keys[position] == queries, table.values[position], np.int64(-1))

    def hash_lookup_offsets(self, table: SortedTable, queries: np.ndarray, deltas: Sequence[int]) -> np.ndarray:
        queries = np.asarray(queries, dtype=np.int64)
        out = np.empty((len(deltas), queries.shape[0]), dtype=np.int64)
        for row, delta in enumerate(deltas):
            out[row] = self.hash_lookup(table, queries + np.int64(delta))
        out[:, queries < 0] = -1
        return out

    def hash_items(self, table: SortedTable) -> tuple[np.ndarray, np.ndarray]:
        return table.keys[:-1], table.values[:-1]

    def unique_inverse(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _rulebook_kernels.unique_inverse(keys)

    def submanifold_pairs(self, table: SortedTable, deltas: np.ndarray, run_length: int,
                          step: int) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
        """A subm rulebook's pairs in their final layout (see `_rulebook_kernels.submanifold_pairs`).

        Args:
            table: the `SortedTable` of the sites' packed keys (with the kernel's margin).
            deltas: int64 ``[K // 2]`` key differences of the offsets before the centre.
            run_length: the last axis' kernel size (offsets per run of deltas).
            step: the last axis' dilation (delta between neighbours of a run).

        Returns:
            ``(pair_input int32, pair_output int32, offset_starts)``, as the generic builder's.
        """
        return _rulebook_kernels.submanifold_pairs(table.keys, table.values[:-1], deltas, run_length, step)

    def compact_pairs(self, table: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
        num_rows, row_length = table.shape
        flat_table = table.reshape(-1)
        flat = np.flatnonzero(flat_table >= 0)  # row-major order
        values = np.take(flat_table, flat).astype(np.int32)
        starts = np.searchsorted(flat, np.arange(num_rows + 1, dtype=np.int64) * row_length)
        columns = (flat - np.repeat(np.arange(num_rows, dtype=np.int64) * row_length, np.diff(starts)))
        return columns.astype(np.int32), values, tuple(starts.tolist())

    def conv_candidate_pairs(self, indices: np.ndarray, geometry: Any,
                             output_spatial_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
        return _rulebook_kernels.strided_candidates(indices, geometry, output_spatial_shape)

    def gather_rows(self, source: np.ndarray, rows: np.ndarray) -> np.ndarray:
        # take() with intp indices is ~2.5x faster than with int32 ones, conversion included
        return np.take(source, rows.astype(np.intp, copy=False), axis=0)

    def scatter_add_rows(self, target: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
        # Fancy `target[rows] += values` goes through NumPy's slow 2-D map iterator;
        # a take, an add and a put of whole rows viewed as one void item each is
        # about 2.5x faster. Rows are unique within a call, so the result is the same.
        rows = rows.astype(np.intp, copy=False)
        row_bytes = target.dtype.itemsize * (target.shape[1] if target.ndim == 2 else 0)
        if target.ndim != 2 or row_bytes == 0 or not target.flags.c_contiguous:
            target[rows] += values
            return
        summed = np.take(target, rows, axis=0)
        summed += values
        row_type = np.dtype((np.void, row_bytes))
        np.put(target.view(row_type).reshape(-1), rows, summed.view(row_type).reshape(-1))

    def scatter_add_pairs(self, target: np.ndarray, rows: np.ndarray, values: np.ndarray,
                          run_starts: tuple[int, ...]) -> None:
        for start, stop in zip(run_starts[:-1], run_starts[1:]):
            if stop > start:
                self.scatter_add_rows(target, rows[start:stop], values[start:stop])

    def scatter_plan(self, rows: np.ndarray, run_starts: tuple[int, ...], num_rows: int) -> RowRuns:
        starts = tuple(int(start) for start in run_starts)
        if not starts or starts[0] != 0 or starts[-1] != rows.shape[0]:
            raise ValueError(f"scatter_plan: run_starts must run from 0 to {rows.shape[0]}, got {starts}")
        return RowRuns(rows, starts, int(num_rows))

    def scatter_add_planned(self, target: np.ndarray, plan: RowRuns, values: np.ndarray) -> None:
        if not isinstance(plan, RowRuns):
            raise TypeError(f"scatter_add_planned: plan must come from scatter_plan, got {type(plan).__name__}")
        if target.shape[0] != plan.num_rows:
            raise ValueError(f"scatter_add_planned: the plan scatters into {plan.num_rows} rows, "
                             f"the target has {target.shape[0]}")
        self.scatter_add_pairs(target, plan.rows, values, plan.run_starts)

    def max_pool_pairs(self, features: np.ndarray, pair_input: np.ndarray, pair_output: np.ndarray,
                       run_starts: tuple[int, ...], num_output: int) -> tuple[np.ndarray, np.ndarray]:
        # one compiled pass over the pairs in order: the earliest pair wins ties, NaN propagates
        del run_starts  # the pairs' order is all the pass needs
        return _cpu_pool_kernels.max_pool_forward(features, pair_input, pair_output, num_output,
                                                  self.compute_dtype(features.dtype))

    def max_pool_backward_pairs(self, grad_output: np.ndarray, argmax: np.ndarray, pair_input: np.ndarray,
                                pair_output: np.ndarray, run_starts: tuple[int, ...], num_input: int) -> np.ndarray:
        del run_starts
        return _cpu_pool_kernels.max_pool_backward(grad_output, argmax, pair_input, pair_output, num_input,
                                                   self.compute_dtype(grad_output.dtype))

    def avg_pool_pairs(self, features: np.ndarray, pair_input: np.ndarray, pair_output: np.ndarray,
                       run_starts: tuple[int, ...], num_output: int) -> np.ndarray:
        wide = _sum_dtype(features.dtype)
        out = np.zeros((num_output, features.shape[1]), dtype=wide)
        for input_rows, output_rows in offset_runs(pair_input, pair_output, run_starts):
            self.scatter_add_rows(out, output_rows, np.take(features, input_rows, axis=0).astype(wide, copy=False))
        out /= _window_counts(pair_output, num_output, wide)
        return out.astype(features.dtype, copy=False)

    def avg_pool_backward_pairs(self, grad_output: np.ndarray, pair_input: np.ndarray, pair_output: np.ndarray,
                                run_starts: tuple[int, ...], num_input: int) -> np.ndarray:
        wide = _sum_dtype(grad_output.dtype)
        scaled = grad_output.astype(wide) / _window_counts(pair_output, grad_output.shape[0], wide)
        grad = np.zeros((num_input, grad_output.shape[1]), dtype=wide)
        for input_rows, output_rows in offset_runs(pair_input, pair_output, run_starts):
            self.scatter_add_rows(grad, input_rows, np.take(scaled, output_rows, axis=0))
        return grad.astype(grad_output.dtype, copy=False)

    def int8_conv_pairs(self, features: np.ndarray, weight: np.ndarray, pair_input: np.ndarray,
                        pair_output: np.ndarray, run_starts: tuple[int, ...], num_output: int,
                        identity_offset: int, groups: int, epilogue: Any) -> np.ndarray:
        return _numpy_int8.conv_pairs(self, features, weight, pair_input, pair_output, run_starts, num_output,
                                      identity_offset, groups, epilogue)

    def int8_max_pool_pairs(self, features: np.ndarray, pair_input: np.ndarray, pair_output: np.ndarray,
                            run_starts: tuple[int, ...], num_output: int) -> np.ndarray:
        return _numpy_int8.max_pool_pairs(features, pair_input, pair_output, run_starts, num_output)

    def index_add(self, size: int, index: np.ndarray, values: np.ndarray) -> np.ndarray:
        return np.bincount(index, weights=values, minlength=size)

    def matmul(self, left: np.ndarray, right: np.ndarray) -> np.ndarray:
        return np.matmul(left, right)


def _sum_dtype(dtype: Any) -> np.dtype:
    """The pools' accumulator: float64 for float64, else float32 (float16 and bfloat16 too; as the kernels'
    ``Accumulator``)."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _window_counts(pair_output: np.ndarray, num_output: int, dtype: np.dtype) -> np.ndarray:
    """``[num_output, 1]``: the pairs (active inputs) of each output, at least 1, in ``dtype``."""
    counts = np.bincount(pair_output.astype(np.intp, copy=False), minlength=num_output)[:num_output]
    return np.maximum(counts, 1).astype(dtype).reshape(-1, 1)


_RADIX_MIN_KEYS = 2048
"""Fewest keys sorted by the compiled radix sort; fewer take NumPy's stable sort (the same order)."""


def _sort_keys(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(keys[order], order)``, ``order`` the stable ascending order of int64 ``keys``."""
    if keys.shape[0] >= _RADIX_MIN_KEYS:
        return _rulebook_kernels.argsort_keys(keys)
    order = np.argsort(keys, kind="stable")
    return keys[order], order
