"""The matrix products of the per-offset convolution dataflow, on any backend.

A conv weight ``[C_out, *kernel_size, C_in // groups]`` is used as ``K``
per-offset block-diagonal matrices ``[K, groups, in_per_group, out_per_group]``
(`offset_matrices`). The feature passes (`sparsecore.conv`) multiply gathered
rows by them, one offset (`grouped_product`, `grouped_outer`) or a chunk of
offsets laid out ``[m, W]`` (`batched_product`, `batched_outer`) at a time,
each one backend GEMM (batched over groups and offsets).

A chunk's ``[m, W]`` rows and its scatter plan depend on the pairs alone:
`chunk_layout` builds them once per pair map and pass direction and keeps them
in ``PairMap.derived``. This is the NumPy backend's dataflow; the kernel
backend runs fused kernels instead (`sparsecore.backends._kernel_fused`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._chunks import PairChunk, chunk_rows, pair_chunks
from .backends import ArrayBackend
from .rulebook import PairMap, Rulebook

__all__ = [
    "offset_matrices",
    "weight_from_matrices",
    "grouped_product",
    "grouped_outer",
    "batched_product",
    "batched_outer",
    "offset_chunks",
    "offset_index",
    "uniform_starts",
    "ChunkLayout",
    "chunk_layout",
]


def offset_matrices(weight: Any, groups: int, dtype: Any) -> Any:
    """``[K, groups, in_per_group, out_per_group]`` matrices (a view where possible) from a conv weight."""
    out_channels, in_per_group = weight.shape[0], weight.shape[-1]
    volume = 1
    for size in weight.shape[1:-1]:
        volume *= size
    flat = weight.astype(dtype, copy=False).reshape(groups, out_channels // groups, volume, in_per_group)
    return flat.transpose(2, 0, 3, 1)


def weight_from_matrices(grad_matrices: Any, weight: Any) -> Any:
    """``[K, g, a, b]`` per-offset matrices back in the weight's layout ``[C_out, *kernel_size, a]``."""
    return grad_matrices.transpose(1, 3, 0, 2).reshape(
        (weight.shape[0],) + tuple(weight.shape[1:-1]) + (weight.shape[-1],))


def grouped_product(backend: ArrayBackend, rows: Any, matrices: Any) -> Any:
    """``rows [P, g * a] @ block-diagonal(matrices [g, a, b]) -> [P, g * b]``."""
    groups, in_per_group, out_per_group = matrices.shape
    if groups == 1:
        return backend.matmul(rows, matrices[0])
    count = rows.shape[0]
    split = rows.reshape(count, groups, in_per_group).transpose(1, 0, 2)
    product = backend.matmul(split, matrices)
    return product.transpose(1, 0, 2).reshape(count, groups * out_per_group)


def grouped_outer(backend: ArrayBackend, left: Any, right: Any, groups: int) -> Any:
    """``[g, a, b]`` per-group products ``left_g^T @ right_g`` for ``left [P, g*a], right [P, g*b]``."""
    count = left.shape[0]
    if groups == 1:
        return backend.matmul(left.T, right)[None]
    left_split = left.reshape(count, groups, -1).transpose(1, 2, 0)
    right_split = right.reshape(count, groups, -1).transpose(1, 0, 2)
    return backend.matmul(left_split, right_split)


def batched_product(backend: ArrayBackend, rows: Any, matrices: Any) -> Any:
    """``rows [m, W, g * a]`` times block-diagonal ``matrices [m, g, a, b]``: ``[m * W, g * b]``, one batched GEMM."""
    count, width = rows.shape[:2]
    groups, in_per_group, out_per_group = matrices.shape[1:]
    if count == 1:  # one offset: a plain GEMM (NumPy's BLAS path for 2-D operands)
        return grouped_product(backend, rows[0], matrices[0])
    if groups == 1:
        product = backend.matmul(rows, matrices[:, 0])
        return product.reshape(count * width, out_per_group)
    split = rows.reshape(count, width, groups, in_per_group).transpose(0, 2, 1, 3)
    product = backend.matmul(split, matrices)
    return product.transpose(0, 2, 1, 3).reshape(count * width, groups * out_per_group)


def batched_outer(backend: ArrayBackend, left: Any, right: Any, groups: int) -> Any:
    """``[m, g, a, b]`` products ``left_g^T @ right_g`` for ``left [m, W, g*a]``, ``right [m, W, g*b]``."""
    count, width = left.shape[:2]
    if count == 1:
        return grouped_outer(backend, left[0], right[0], groups)[None]
    if groups == 1:
        return backend.matmul(left.transpose(0, 2, 1), right)[:, None]
    left_split = left.reshape(count, width, groups, -1).transpose(0, 2, 3, 1)
    right_split = right.reshape(count, width, groups, -1).transpose(0, 2, 1, 3)
    return backend.matmul(left_split, right_split)


def offset_chunks(backend: ArrayBackend, rulebook: Rulebook | PairMap, in_channels: int,
                  out_channels: int) -> tuple[PairChunk, ...]:
    """The backend's chunks of the rulebook's offsets, the identity offset left out.

    A chunk of several offsets is padded with row -1 (`sparsecore._chunks.chunk_rows`), so only a
    backend that skips negative rows gets more than one offset per chunk.
    """
    identity = rulebook.identity_offset if rulebook.num_input else -1
    budget = backend.chunk_elements if backend.skips_negative_rows else 0
    return pair_chunks(tuple(rulebook.offset_starts), max(in_channels, out_channels, 1), budget, skip=identity)


def offset_index(chunk: PairChunk) -> slice | list[int]:
    """Indexes a chunk's offsets along a ``[K, ...]`` axis: a slice (views) when they are consecutive."""
    first, last = chunk.offsets[0], chunk.offsets[-1]
    return slice(first, last + 1) if last - first + 1 == len(chunk.offsets) else list(chunk.offsets)


def uniform_starts(chunk: PairChunk, width: int) -> tuple[int, ...]:
    """Run starts of the ``[m, W]`` layout: every offset owns ``W`` slots (``W >= 1``)."""
    return tuple(range(0, len(chunk.offsets) * width + 1, width))


@dataclass(frozen=True)
class ChunkLayout:
    """A chunk's rows in the ``[m, W]`` layout and its scatter plan, for one pass direction.

    Attributes:
        input_rows: int32 ``[m * W]`` input rows, -1 in the padding.
        output_rows: int32 ``[m * W]`` output rows, -1 in the padding.
        count: ``m``, the chunk's offsets.
        width: ``W``, at least the chunk's widest offset.
        scatter: the backend's `scatter_plan` of the rows the pass writes
            (output rows forward, input rows backward).
    """

    input_rows: Any
    output_rows: Any
    count: int
    width: int
    scatter: Any


def chunk_layout(backend: ArrayBackend, rulebook: Rulebook | PairMap, chunk: PairChunk,
                 direction: str) -> ChunkLayout:
    """The `ChunkLayout` of ``chunk`` for a ``"forward"`` or ``"backward"`` pass, built once per pair map.

    Kept in ``PairMap.derived`` under the backend's name and array module, the direction and
    the chunk, so a rulebook shared by layers, or reused across steps, lays its pairs out once.
    """
    if direction not in ("forward", "backward"):
        raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
    pair_map = rulebook.pair_map if isinstance(rulebook, Rulebook) else rulebook
    width = chunk.width
    key = ("chunk layout", backend.name, backend.xp.__name__, direction, chunk)
    layout = pair_map.derived.get(key)
    if layout is not None:
        return layout
    num_rows = pair_map.num_output if direction == "forward" else pair_map.num_input
    input_rows, output_rows = (rows.reshape(-1) for rows in chunk_rows(
        backend.xp, (pair_map.pair_input, pair_map.pair_output), chunk, width))
    written = output_rows if direction == "forward" else input_rows
    plan = backend.scatter_plan(written, uniform_starts(chunk, width), num_rows)
    layout = ChunkLayout(input_rows, output_rows, len(chunk.offsets), width, plan)
    pair_map.derived[key] = layout
    return layout
