"""`KernelBackend`: every `ArrayBackend` primitive out of the ``sc_*`` kernels and ``xp``.

The GPU backend implements primitives only, never an algorithm: the core's
rulebook builders and feature passes drive it exactly as they drive the NumPy
backend. It is built from an array module ``xp`` and a `KernelLauncher` that
runs a registered kernel instantiation:

- ``KernelBackend(cupy, CupyLauncher())`` is the GPU backend (`cupy_backend`);
- ``KernelBackend(numpy, <emulated launcher>)`` runs the very same kernels,
  compiled by g++ against ``tests/cuda_emulation/cuda_shim.h``, on NumPy
  arrays: that is how CI, without a GPU, runs the whole core through them.

Each wrapper makes its inputs contiguous (a RawKernel ignores strides), checks
dtypes and shapes, sizes the grid, never launches zero blocks (empty inputs
give empty outputs), and does nothing else. Sorting, scans and compaction of
flags use ``xp`` (CuPy's are CUB/Thrust kernels). The feature passes are not
primitives here: the core runs them as the fused kernels of `fused_passes`
(one launch per pass over a rulebook's neighbour map, `_kernel_fused`), so
this backend has none of the NumPy backend's pair feature primitives (gather,
scatter, pair pools, products by offset). Feature dtypes: float32, float64,
float16 and bfloat16.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from . import _kernel_fused, _kernel_int8, _kernel_keys, _kernel_maps, _kernel_pairs, _launch
from ._launch import INT64_MAX, KernelDevice, KernelLauncher, check_integer_vector, check_row_count
from ._sorting import run_starts, unique_inverse

__all__ = ["KernelBackend", "KernelHashTable", "KernelLauncher", "tf32_from_environment"]

_MAX_BLOCK_THREADS = 1024  # sc::kMaxBlockThreads of kernels_cu/sc_common.cuh


def tf32_from_environment(environment: Any = None) -> bool:
    """Whether ``CUPY_TF32`` asks for TF32, read as CuPy reads it: an integer > 0.

    Args:
        environment: a mapping (default ``os.environ``).

    Raises:
        ValueError: when ``CUPY_TF32`` is set but is not an integer.
    """
    value = (os.environ if environment is None else environment).get("CUPY_TF32", "0")
    try:
        return int(value) > 0
    except ValueError:
        raise ValueError(
            f"CUPY_TF32 must be an integer (1 allows TF32 for float32 convolutions, 0 forbids it), got {value!r}"
        ) from None


@dataclass(frozen=True, eq=False)
class KernelHashTable:
    """An open-addressing hash table on the device (layout of ``kernels_cu/hash_table.cu``).

    Attributes:
        table_keys: int64 ``[capacity]``, the key stored in each slot, -1 where empty.
        table_values: int64 ``[capacity]``, the value of each slot (the minimum of
            the values inserted for its key; int64 max where empty).
        capacity: a power of two, at least twice the number of keys, and at least 2.
        keys: int64 ``[N]``, the inserted keys (contiguous), for `KernelBackend.hash_items`.
        values: int64 ``[N]``, the inserted values.
    """

    table_keys: Any
    table_values: Any
    capacity: int
    keys: Any
    values: Any


@dataclass(frozen=True)
class KernelBackend:
    """Primitives from the ``sc_*`` kernels (see `sparsecore.backends.base.ArrayBackend`).

    Attributes:
        xp: the array module of the arrays the kernels run on (``cupy``, or
            ``numpy`` for the CPU emulation).
        launcher: the `KernelLauncher` that runs a kernel instantiation.
        name: the backend's name (``"cupy"`` for the GPU backend).
        block_threads: threads per block of every launch, 1 to 1024.
        max_blocks: most blocks of a launch; the kernels' grid-stride loops
            cover larger inputs.
        skips_negative_rows: always true: every kernel skips row -1 (padding).
        tf32: float32 convolutions on TF32 tensor cores (`fused_passes`);
            `sparsecore.backends.cupy_backend.CUPY_BACKEND` sets it from
            ``CUPY_TF32`` (the project's one TF32 switch).
        gemm: the engine of `matmul`, an object with ``matmul(xp, left, right)``;
            None means ``xp.matmul``. No feature pass multiplies through it.
    """

    xp: Any
    launcher: KernelLauncher
    name: str = "kernels"
    block_threads: int = 256
    max_blocks: int = 4096
    skips_negative_rows: bool = True
    tf32: bool = False
    gemm: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.launcher, KernelLauncher):
            raise TypeError(
                f"launcher must have a launch(expression, grid, block, args) method, got "
                f"{type(self.launcher).__name__}"
            )
        if not 1 <= self.block_threads <= _MAX_BLOCK_THREADS:
            raise ValueError(f"block_threads must be in [1, {_MAX_BLOCK_THREADS}], got {self.block_threads}")
        if self.max_blocks < 1:
            raise ValueError(f"max_blocks must be at least 1, got {self.max_blocks}")

    @property
    def device(self) -> KernelDevice:
        """The array module and launch settings the launch wrappers (`_kernel_pairs`...) receive."""
        return KernelDevice(self.xp, self.launcher, self.block_threads, self.max_blocks)

    @property
    def fused_passes(self) -> _kernel_fused.FusedPasses:
        """The feature passes over neighbour maps (`_kernel_fused`), float32 on TF32 when ``tf32`` is set."""
        return _kernel_fused.FusedPasses(self.device, self.tf32)

    def _run(self, kernel: str, type_names: tuple[str, ...], work: int, args: tuple[Any, ...]) -> None:
        _launch.launch(self.launcher, kernel, type_names, work, args, self.block_threads, self.max_blocks)

    # ------------------------------------------------------------------ hashing

    def hash_build(self, keys: Any, values: Any,
                   check_duplicates: bool = True) -> tuple[KernelHashTable, tuple[int, int] | None]:
        """Inserts ``keys -> values`` with ``sc_hash_insert<long long>``.

        Args:
            keys: integer ``[N]``, non-negative (a negative key is not stored).
            values: integer ``[N]``.
            check_duplicates: count the occupied slots against the keys (one
                host synchronisation); False skips it for keys known to be unique.

        Returns:
            ``(table, duplicate)``: ``duplicate`` is None when the keys are unique
            (or unchecked), else the values of two entries sharing the smallest
            repeated key (in input order).
        """
        xp = self.xp
        check_integer_vector(keys, "keys", "hash_build")
        check_integer_vector(values, "values", "hash_build", keys.shape[0])
        keys = xp.ascontiguousarray(keys, dtype=xp.int64)
        values = xp.ascontiguousarray(values, dtype=xp.int64)
        count = int(keys.shape[0])
        capacity = _launch.hash_capacity(count)
        table = KernelHashTable(xp.full(capacity, -1, dtype=xp.int64),
                                xp.full(capacity, INT64_MAX, dtype=xp.int64), capacity, keys, values)
        self._run("sc_hash_insert", ("int64",), count,
                  (keys, values, np.int64(count), table.table_keys, table.table_values, np.int64(capacity)))
        return table, (self._find_duplicate(table) if check_duplicates and count > 1 else None)

    def _find_duplicate(self, table: KernelHashTable) -> tuple[int, int] | None:
        xp = self.xp
        # One slot per distinct key: fewer occupied slots than keys means repeats.
        # A single reduction on the happy path; the pair is only searched for on error.
        missing = int(xp.count_nonzero(table.keys >= 0) - xp.count_nonzero(table.table_keys >= 0))
        if missing == 0:
            return None
        order = xp.argsort(table.keys, kind="stable")
        sorted_keys = table.keys[order]
        repeats = xp.nonzero((sorted_keys[1:] == sorted_keys[:-1]) & (sorted_keys[1:] >= 0))[0]
        first = int(repeats[0])
        pair = table.values[order[first:first + 2]].tolist()
        return int(pair[0]), int(pair[1])

    def hash_lookup(self, table: KernelHashTable, queries: Any) -> Any:
        """Values of integer ``queries`` (any shape) with ``sc_hash_lookup<long long>``; -1 where absent.

        Returns:
            int64, shaped like ``queries``.
        """
        xp = self.xp
        if queries.dtype.kind not in "iu":
            raise TypeError(f"hash_lookup: queries must be an integer array, got dtype {queries.dtype}")
        flat = xp.ascontiguousarray(queries, dtype=xp.int64).reshape(-1)
        count = int(flat.shape[0])
        out = xp.empty(count, dtype=xp.int64)
        self._run("sc_hash_lookup", ("int64",), count,
                  (flat, np.int64(count), table.table_keys, table.table_values, np.int64(table.capacity), out))
        return out.reshape(queries.shape)

    def hash_lookup_offsets(self, table: KernelHashTable, queries: Any, deltas: Sequence[int]) -> Any:
        """Values of ``queries + deltas[j]`` for every host int ``deltas[j]``, in one
        ``sc_hash_lookup_offsets<long long>`` launch.

        Args:
            table: from `hash_build`.
            queries: integer ``[M]``, non-negative (padded-grid keys, as the rulebook
                builders pass): a negative query answers -1 for every delta.
            deltas: host ints, the key distances to look up.

        Returns:
            int64 ``[len(deltas), M]``, -1 where absent.
        """
        xp = self.xp
        check_integer_vector(queries, "queries", "hash_lookup_offsets")
        deltas = np.asarray(deltas, dtype=np.int64).reshape(-1)
        if deltas.shape[0] > np.iinfo(np.int32).max:
            raise ValueError(f"hash_lookup_offsets: {deltas.shape[0]} deltas exceed the kernel's int32 offset count")
        queries = xp.ascontiguousarray(queries, dtype=xp.int64)
        count, width = int(queries.shape[0]), int(deltas.shape[0])
        out = xp.empty((width, count), dtype=xp.int64)
        if count and width:
            self._run("sc_hash_lookup_offsets", ("int64",), count * width,
                      (queries, np.int64(count), xp.asarray(deltas), np.int32(width), table.table_keys,
                       table.table_values, np.int64(table.capacity), out))
        return out

    def pack_site_keys(self, indices: Any, strides: Sequence[int], addends: Sequence[int]) -> Any:
        """int64 keys of int32 sites in one launch (`_kernel_keys`; `sparsecore.hashing.pack_keys` calls it)."""
        return _kernel_keys.pack_site_keys(self.device, indices, strides, addends)

    def unpack_site_keys(self, keys: Any, strides: Sequence[int], addends: Sequence[int]) -> Any:
        """int32 sites of int64 keys in one launch (`_kernel_keys`; `sparsecore.hashing.unpack_keys` calls it)."""
        return _kernel_keys.unpack_site_keys(self.device, keys, strides, addends)

    def hash_items(self, table: KernelHashTable) -> tuple[Any, Any]:
        """``(keys, values)`` int64 ``[N]`` each, sorted by key (``xp.argsort`` on the device)."""
        order = self.xp.argsort(table.keys)
        return table.keys[order], table.values[order]

    def unique_inverse(self, keys: Any) -> tuple[Any, Any]:
        """Sorted unique int64 keys ``[U]`` and each key's position among them, int64 ``[M]``."""
        check_integer_vector(keys, "keys", "unique_inverse")
        return unique_inverse(self.xp, keys)

    def compact_pairs(self, table: Any) -> tuple[Any, Any, tuple[int, ...]]:
        """Entries ``>= 0`` of an integer ``[R, L]`` table with ``sc_compact_count`` / ``sc_compact_write``."""
        return _kernel_pairs.compact_pairs(self.device, table)

    def conv_candidate_pairs(self, indices: Any, geometry: Any,
                             output_spatial_shape: tuple[int, ...]) -> tuple[Any, Any, tuple[int, ...]]:
        """Valid (input row, output key) pairs per offset with the ``sc_*_conv_candidates`` kernels."""
        return _kernel_pairs.conv_candidate_pairs(self.device, indices, geometry, output_spatial_shape)

    def submanifold_map(self, indices: Any, spatial_shape: Sequence[int], batch_size: int,
                        kernel_size: Sequence[int], dilation: Sequence[int], check: bool,
                        skip_padding: bool = False) -> tuple[Any, Any, Any]:
        """A submanifold neighbour map's tables in two launches, no read back (`_kernel_maps.submanifold_map`)."""
        return _kernel_maps.submanifold_map(self.device, indices, spatial_shape, batch_size, kernel_size, dilation,
                                            check, skip_padding)

    def row_plan(self, masks: Any, volume: int) -> Any:
        """A map side's row plan (its order, regrouped by tile, and per-offset row-tile bit sets) in two
        operations, no read back (`_kernel_maps.row_plan`)."""
        return _kernel_maps.row_plan(self.device, masks, volume)

    def strided_map(self, indices: Any, spatial_shape: Sequence[int], batch_size: int, geometry: Any,
                    output_spatial_shape: Sequence[int], check: bool, capacity: int | None = None) -> Any:
        """A regular, transposed or pooling neighbour map with one read back, or none at a ``capacity``
        (`_kernel_maps.strided_map`)."""
        return _kernel_maps.strided_map(self.device, indices, spatial_shape, batch_size, geometry,
                                        output_spatial_shape, check, capacity)

    # ------------------------------------------------------------------ int8

    def int8_conv_pairs(self, features: Any, weight: Any, pair_input: Any, pair_output: Any,
                        run_starts: tuple[int, ...], num_output: int, identity_offset: int, groups: int,
                        epilogue: Any) -> Any:
        """int8 conv with ``sc_int8_conv`` (dp4a, fused epilogue; ``identity_offset`` unused)."""
        return _kernel_int8.conv_pairs(self.device, features, weight, pair_input, pair_output, run_starts, num_output,
                                       groups, epilogue)

    def int8_max_pool_pairs(self, features: Any, pair_input: Any, pair_output: Any, run_starts: tuple[int, ...],
                            num_output: int) -> Any:
        """int8 max pool with ``sc_int8_max_pool`` (``run_starts`` unused)."""
        return _kernel_int8.max_pool_pairs(self.device, features, pair_input, pair_output, num_output)

    def index_add(self, size: int, index: Any, values: Any) -> Any:
        """Deterministic float64 sums of ``values`` into ``size`` bins by ``index``.

        A stable ``xp.argsort`` groups equal indices in input order, and
        ``sc_segment_sum_rows<double, double>`` (one channel) sums each group in
        that order, so the result is bitwise reproducible (and equals NumPy's
        ``bincount``, which adds in input order too).

        Args:
            size: number of bins.
            index: integer ``[M]`` in ``[0, size)``.
            values: real ``[M]``.

        Returns:
            float64 ``[size]``.

        Raises:
            ValueError: when an index lies outside ``[0, size)``.
        """
        xp = self.xp
        check_integer_vector(index, "index", "index_add")
        if values.ndim != 1 or values.shape[0] != index.shape[0]:
            raise ValueError(
                f"index_add: values must be 1-D like index ({index.shape[0]} entries), got shape "
                f"{tuple(values.shape)}"
            )
        size, count = int(size), int(index.shape[0])
        if size < 0:
            raise ValueError(f"index_add: size must be >= 0, got {size}")
        check_row_count(size, "the output (size)", "index_add")
        check_row_count(count, "index", "index_add")
        out = xp.zeros((size, 1), dtype=xp.float64)
        if count == 0:
            return out.reshape(size)
        order = xp.argsort(index, kind="stable")
        sorted_index = index[order]
        low, high = (int(value) for value in sorted_index[[0, count - 1]].tolist())
        if low < 0 or high >= size:
            raise ValueError(f"index_add: index holds values from {low} to {high}, outside [0, {size})")
        starts = xp.nonzero(run_starts(xp, sorted_index))[0]
        num_segments = int(starts.shape[0])
        segment_starts = xp.empty(num_segments + 1, dtype=xp.int64)
        segment_starts[:-1] = starts
        segment_starts[-1] = count
        segment_rows = xp.ascontiguousarray(sorted_index[starts], dtype=xp.int32)
        source = xp.ascontiguousarray(values, dtype=xp.float64).reshape(count, 1)
        self._run("sc_segment_sum_rows", ("float64",), num_segments,
                  (source, xp.ascontiguousarray(order, dtype=xp.int32), segment_starts, segment_rows,
                   np.int64(num_segments), np.int64(1), out))
        return out.reshape(size)

    def matmul(self, left: Any, right: Any) -> Any:
        """``left @ right`` (NumPy semantics, 2 or more axes) through ``gemm``, else ``xp.matmul``."""
        if self.gemm is None:
            return self.xp.matmul(left, right)
        return self.gemm.matmul(self.xp, left, right)
