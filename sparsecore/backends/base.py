"""The primitive protocol: what an array backend must provide to run the core.

The core's algorithms (rulebook builders, feature passes) are written once
against these primitives plus NumPy-compatible array functions of ``xp``.
A backend implements primitives only, never an algorithm.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["ArrayBackend"]


@runtime_checkable
class ArrayBackend(Protocol):
    """Array primitives the core's algorithms are written against.

    Attributes:
        name: ``"numpy"`` or ``"cupy"``.
        xp: the NumPy-compatible array module (``numpy`` or ``cupy``).
    """

    name: str
    xp: Any

    def hash_build(self, keys: Any, values: Any) -> tuple[Any, tuple[int, int] | None]:
        """Builds a hash table of unique int64 keys.

        Args:
            keys: int64 ``[N]``, non-negative.
            values: int64 ``[N]``.

        Returns:
            ``(table, duplicate)``: an opaque table for `hash_lookup` and `hash_items`,
            and ``None`` or the values of the first two entries that share a key.
        """

    def hash_lookup(self, table: Any, queries: Any) -> Any:
        """Values for int64 ``queries [M]``; ``-1`` where a key is absent (int64 ``[M]``).

        Sorted queries may be faster (the NumPy backend uses a merge-friendly search).
        """

    def hash_lookup_window(self, table: Any, queries: Any, width: int, step: int) -> Any:
        """Values of the keys ``queries + j * step`` for ``j < width``: int64 ``[width, M]``, -1 if absent.

        The window runs along the last packed axis (a row of kernel offsets).
        """

    def hash_items(self, table: Any) -> tuple[Any, Any]:
        """``(keys, values)`` of a table, int64 ``[N]`` each, sorted by key."""

    def unique_inverse(self, keys: Any) -> tuple[Any, Any]:
        """Sorted unique int64 keys ``[U]`` and, for each input key, its position ``[M]``."""

    def gather_rows(self, source: Any, rows: Any) -> Any:
        """``source[rows]`` for a ``[N, C]`` array and int ``rows [M]``."""

    def scatter_add_rows(self, target: Any, rows: Any, values: Any) -> None:
        """``target[rows] += values`` in place, for rows that are unique within the call."""

    def index_add(self, size: int, index: Any, values: Any) -> Any:
        """Deterministic sum of ``values [M]`` into ``size`` bins by int ``index [M]``.

        Returns a float64 (NumPy) or accumulate-dtype array ``[size]``; repeated
        indices are summed in a fixed order, so the result is bitwise reproducible.
        """

    def matmul(self, left: Any, right: Any) -> Any:
        """Batched or plain matrix product (BLAS / cuBLAS)."""
