"""Sort-based helpers written once against ``xp`` (NumPy or CuPy), shared by the backends.

Written against ``xp`` so that one copy serves NumPy and CuPy arrays
(``xp.argsort`` and ``xp.cumsum`` run well on either library); the kernel
backend computes its sorted uniques here. The NumPy backend's own
``unique_inverse`` runs on a compiled radix sort instead
(`sparsecore.backends._rulebook_kernels`), with the same result.
"""

from __future__ import annotations

from typing import Any

__all__ = ["run_starts", "unique_inverse", "group_starts"]


def run_starts(xp: Any, sorted_values: Any) -> Any:
    """Marks the first element of every run of equal values.

    Args:
        xp: the array module of ``sorted_values``.
        sorted_values: ``[M]`` values, sorted (equal values adjacent), ``M >= 1``.

    Returns:
        bool ``[M]``: True where ``sorted_values[i] != sorted_values[i - 1]``, and at 0.
    """
    is_new = xp.empty(sorted_values.shape[0], dtype=bool)
    is_new[0] = True
    xp.not_equal(sorted_values[1:], sorted_values[:-1], out=is_new[1:])
    return is_new


def unique_inverse(xp: Any, keys: Any) -> tuple[Any, Any]:
    """Sorted unique keys and the position of each input key among them.

    Args:
        xp: the array module of ``keys``.
        keys: int64 ``[M]``.

    Returns:
        ``(unique int64 [U], inverse int64 [M])`` with ``unique[inverse] == keys``.
    """
    if keys.shape[0] == 0:
        return keys.copy(), xp.zeros(0, dtype=xp.int64)
    order = xp.argsort(keys)  # equal keys get one rank whatever their order
    sorted_keys = keys[order]
    is_new = run_starts(xp, sorted_keys)
    rank = xp.cumsum(is_new) - 1
    inverse = xp.empty(keys.shape[0], dtype=xp.int64)
    inverse[order] = rank
    return sorted_keys[is_new], inverse


def group_starts(xp: Any, rows: Any, num_groups: int) -> tuple[Any, Any]:
    """Groups entries by row (a CSR grouping), without a host synchronisation.

    Args:
        xp: the array module of ``rows``.
        rows: integer ``[M]`` in ``[0, num_groups)``.
        num_groups: number of groups.

    Returns:
        ``(order int32 [M], starts int64 [num_groups + 1])``: ``order[starts[g]:starts[g + 1]]``
        are the entries of row ``g``, in input order (a stable sort).
    """
    order = xp.argsort(rows, kind="stable")
    starts = xp.searchsorted(rows[order], xp.arange(num_groups + 1, dtype=rows.dtype))
    return order.astype(xp.int32), starts.astype(xp.int64)
