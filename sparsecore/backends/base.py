"""The primitive protocol: what an array backend must provide to run the core.

The core's algorithms (rulebook builders, feature passes) are written once
against these primitives plus NumPy-compatible array functions of ``xp``.
A backend implements primitives only, never an algorithm. A backend with
``fused_passes`` (the kernel backend: the GPU and its emulation) runs the
feature passes as fused kernels over neighbour maps instead
(`sparsecore.backends._kernel_fused`), so it provides the hashing, rulebook
and int8 primitives but not the pair feature primitives below (gathers,
scatters, pools over pairs, ``compute_dtype``, ``chunk_elements``), which only
the NumPy backend's dataflows use.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

__all__ = ["ArrayBackend"]


@runtime_checkable
class ArrayBackend(Protocol):
    """Array primitives the core's algorithms are written against.

    Attributes:
        name: ``"numpy"`` or ``"cupy"``.
        xp: the NumPy-compatible array module (``numpy`` or ``cupy``).
        chunk_elements: how many gathered feature elements (pair rows times
            channels) a feature pass may hold at once: the passes group
            consecutive kernel offsets into chunks of at most this size, each
            one gather, one batched GEMM and one `scatter_add_pairs` (see
            `sparsecore._chunks`). 0 means one offset per chunk (best for CPU
            caches); more than one offset per chunk needs `skips_negative_rows`.
        skips_negative_rows: whether the pair primitives treat a row of -1 as
            "no pair" (gathers read zeros, scatters and groupings drop it), so
            that padded pair maps (`sparsecore.PairMap.padded`) run as they are.
    """

    name: str
    xp: Any
    chunk_elements: int
    skips_negative_rows: bool

    def compute_dtype(self, dtype: Any) -> Any:
        """The dtype the feature passes' products run in for storage ``dtype``.

        NumPy has no fast float16 GEMM, so it computes float16 in float32; a GEMM
        multiplies float16 natively (accumulating in float32).
        """

    def hash_build(self, keys: Any, values: Any, check_duplicates: bool = True) -> tuple[Any, tuple[int, int] | None]:
        """Builds a hash table of unique int64 keys.

        Args:
            keys: int64 ``[N]``, non-negative.
            values: int64 ``[N]``.
            check_duplicates: look for repeated keys (on the GPU a host
                synchronisation); pass False for keys known to be unique.

        Returns:
            ``(table, duplicate)``: an opaque table for `hash_lookup` and `hash_items`,
            and ``None`` or the values of the first two entries that share a key
            (always ``None`` without ``check_duplicates``).
        """

    def hash_lookup(self, table: Any, queries: Any) -> Any:
        """Values for int64 ``queries [M]``; ``-1`` where a key is absent (int64 ``[M]``).

        Sorted queries may be faster (the NumPy backend uses a merge-friendly search).
        """

    def hash_lookup_offsets(self, table: Any, queries: Any, deltas: Sequence[int]) -> Any:
        """Values of the keys ``queries + deltas[j]``: int64 ``[len(deltas), M]``, -1 where absent.

        ``queries`` are int64 ``[M]`` keys of the table's packing (non-negative; a negative
        query answers -1 for every delta); ``deltas`` are host ints (a submanifold rulebook's
        kernel offsets as key distances), so one call looks up every offset.
        """

    def hash_items(self, table: Any) -> tuple[Any, Any]:
        """``(keys, values)`` of a table, int64 ``[N]`` each, sorted by key."""

    def unique_inverse(self, keys: Any) -> tuple[Any, Any]:
        """Sorted unique int64 keys ``[U]`` and, for each input key, its position ``[M]``."""

    def compact_pairs(self, table: Any) -> tuple[Any, Any, tuple[int, ...]]:
        """The entries ``>= 0`` of an integer ``[R, L]`` table, row by row, in order.

        Returns:
            ``(columns, values, row_starts)``: int32 ``[P]`` column and value of
            every entry ``>= 0`` in row-major order, and ``R + 1`` host ints, row
            ``r`` owning ``[row_starts[r], row_starts[r + 1])``.
        """

    def conv_candidate_pairs(self, indices: Any, geometry: Any,
                             output_spatial_shape: tuple[int, ...]) -> tuple[Any, Any, tuple[int, ...]]:
        """Every (input site, kernel offset) of a regular or transposed conv that reaches an output site.

        Args:
            indices: int32 ``[N, 1 + D]`` input sites.
            geometry: a `sparsecore.ConvGeometry` of kind ``"regular"`` or ``"transposed"``.
            output_spatial_shape: its output grid.

        Returns:
            ``(input_rows, keys, offset_starts)``: int32 ``[P]`` input rows and int64
            ``[P]`` packed output keys (row-major over batch and the output grid, no
            margin), grouped by kernel offset (row-major over the kernel) with rows
            increasing within an offset, and ``K + 1`` host ints delimiting them.
        """

    def gather_rows(self, source: Any, rows: Any) -> Any:
        """``source[rows]`` for a ``[N, C]`` array and int ``rows [M]``."""

    def scatter_add_rows(self, target: Any, rows: Any, values: Any) -> None:
        """``target[rows] += values`` in place, for rows that are unique within the call."""

    def scatter_add_pairs(self, target: Any, rows: Any, values: Any, run_starts: tuple[int, ...]) -> None:
        """``target[rows[p]] += values[p]`` for every ``p``, in place.

        Rows are unique within each run ``[run_starts[r], run_starts[r + 1])``
        (the pairs of one kernel offset) but may repeat across runs. The sums
        are deterministic: the same inputs give bitwise-identical results.
        """

    def scatter_plan(self, rows: Any, run_starts: tuple[int, ...], num_rows: int) -> Any:
        """An opaque plan of `scatter_add_pairs` through ``rows``, for `scatter_add_planned`.

        A feature pass that scatters through the same rows on every call (a
        rulebook's chunk) builds the plan once and keeps it (`sparsecore._conv_products.chunk_layout`).

        Args:
            rows: integer ``[M]`` in ``[0, num_rows)``, or -1 where a backend that
                `skips_negative_rows` drops the entry; unique within each run.
            run_starts: host ints from 0 to ``M`` delimiting the runs.
            num_rows: the target's rows.
        """

    def scatter_add_planned(self, target: Any, plan: Any, values: Any) -> None:
        """`scatter_add_pairs` through a `scatter_plan`: ``target [num_rows, C]`` += ``values [M, C]``, in place."""

    def max_pool_pairs(self, features: Any, pair_input: Any, pair_output: Any, run_starts: tuple[int, ...],
                       num_output: int) -> tuple[Any, Any]:
        """Maximum of ``features[pair_input[p]]`` over the pairs of each output row.

        Args:
            features: ``[N, C]`` float array.
            pair_input: int32 ``[P]`` input rows, grouped by kernel offset.
            pair_output: int32 ``[P]`` output rows in ``[0, num_output)``, unique
                within each run (kernel offset).
            run_starts: ``K + 1`` host ints delimiting the kernel offsets' pairs.
            num_output: output rows.

        Returns:
            ``(out [num_output, C], argmax [num_output, C] int32)``: the earliest pair
            wins ties; an output without pairs gives 0 and argmax -1.
        """

    def max_pool_backward_pairs(self, grad_output: Any, argmax: Any, pair_input: Any, pair_output: Any,
                                run_starts: tuple[int, ...], num_input: int) -> Any:
        """Gradient of `max_pool_pairs`: ``grad_output[o, j]`` goes to input ``argmax[o, j]``.

        Sums over each input's pairs in pair order (float32 for 16-bit storage).
        ``argmax`` is only compared with row numbers, never used as an index.

        Returns:
            ``[num_input, C]`` in ``grad_output``'s dtype.
        """

    def avg_pool_pairs(self, features: Any, pair_input: Any, pair_output: Any, run_starts: tuple[int, ...],
                       num_output: int) -> Any:
        """Mean of ``features[pair_input[p]]`` over the pairs of each output row.

        The arguments are those of `max_pool_pairs`. Returns ``[num_output, C]`` in
        ``features``' dtype: each output's sum over its pairs in pair order (in float32
        for 16-bit storage, float64 for float64) divided by their count; 0 for an output
        without pairs.
        """

    def avg_pool_backward_pairs(self, grad_output: Any, pair_input: Any, pair_output: Any,
                                run_starts: tuple[int, ...], num_input: int) -> Any:
        """Gradient of `avg_pool_pairs`: ``grad_output[o] / count(o)`` summed into each input of ``o``.

        Sums over each input's pairs in pair order, in the accumulator of `avg_pool_pairs`.

        Returns:
            ``[num_input, C]`` in ``grad_output``'s dtype.
        """

    def int8_conv_pairs(self, features: Any, weight: Any, pair_input: Any, pair_output: Any,
                        run_starts: tuple[int, ...], num_output: int, identity_offset: int, groups: int,
                        epilogue: Any) -> Any:
        """The int8 conv pass of `sparsecore.int8.int8_conv_forward`: exact int32 sums over the pairs, then
        ``epilogue`` (a ``backends._numpy_int8.Int8Epilogue``): int8 or float32 ``[num_output, C_out]``."""

    def int8_max_pool_pairs(self, features: Any, pair_input: Any, pair_output: Any, run_starts: tuple[int, ...],
                            num_output: int) -> Any:
        """Maximum of int8 ``features[pair_input[p]]`` over each output's pairs; 0 without pairs (int8)."""

    def index_add(self, size: int, index: Any, values: Any) -> Any:
        """Deterministic sum of ``values [M]`` into ``size`` bins by int ``index [M]``.

        Returns a float64 (NumPy) or accumulate-dtype array ``[size]``; repeated
        indices are summed in a fixed order, so the result is bitwise reproducible.
        """

    def matmul(self, left: Any, right: Any) -> Any:
        """Batched or plain matrix product (BLAS)."""
