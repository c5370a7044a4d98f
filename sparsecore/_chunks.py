"""Chunks of kernel offsets: how a feature pass batches its gathers and scatters.

A feature pass walks the kernel offsets of a rulebook; its pairs are stored
offset by offset. A `PairChunk` is a run of offsets (each located by its own
first pair and count, so a chunk may step over a submanifold centre, which
runs as a plain GEMM), sized by the backend's ``chunk_elements``. A conv lays a
chunk's rows out as ``[m, W]`` (`chunk_rows`: ``m`` offsets, each padded with
row -1 to the widest one's ``W`` pairs), so a chunk costs one gather, one
batched GEMM (``[m, W, a] @ [m, a, b]``) and one scatter. The NumPy backend
takes one offset per chunk (cache-sized work, no padding); a backend with a
``chunk_elements`` budget that skips rows of -1 could take as many as fit.
(The GPU runs fused kernels over neighbour maps and has no chunks.)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

__all__ = ["PairChunk", "pair_chunks", "chunk_rows", "check_padded_pairs"]


@dataclass(frozen=True)
class PairChunk:
    """Kernel offsets whose pairs a feature pass handles together.

    Attributes:
        offsets: the kernel offsets, increasing, each with at least one pair.
        starts: the first pair of each offset (index into the rulebook's pair arrays).
        counts: the pairs of each offset.
    """

    offsets: tuple[int, ...]
    starts: tuple[int, ...]
    counts: tuple[int, ...]

    @property
    def width(self) -> int:
        """``W``: the most pairs of one offset in the chunk."""
        return max(self.counts)


@functools.lru_cache(maxsize=1024)
def pair_chunks(offset_starts: tuple[int, ...], channels: int, chunk_elements: int,
                skip: int = -1) -> tuple[PairChunk, ...]:
    """Groups the non-empty kernel offsets into chunks of at most ``chunk_elements`` gathered elements.

    The fewest chunks of consecutive offsets that keep to the budget (greedy packing),
    balanced where that count allows: offset counts that differ by at most one when
    such a split keeps to the budget too (a layer that needs two chunks gets two
    halves, not a full chunk and a remainder, so its peak memory stays lower).

    Args:
        offset_starts: ``K + 1`` pair positions of a rulebook.
        channels: the widest row a chunk gathers or produces (the more of the
            input and output channels).
        chunk_elements: most ``m * W * channels`` per chunk (``m`` offsets padded
            to the widest one's ``W`` pairs, the `chunk_rows` layout); an offset
            larger than that is a chunk of its own. 0 gives one offset per chunk.
        skip: an offset to leave out (a submanifold centre, run as a plain
            GEMM), or -1. A chunk may hold the offsets on both sides of it (each
            offset's pairs are located by its own start), so a layer whose pairs
            fit the budget is one chunk.

    Returns:
        The chunks, in offset order (memoised: a layer's passes ask again with the same sizes).
    """
    counts = {offset: offset_starts[offset + 1] - offset_starts[offset] for offset in range(len(offset_starts) - 1)}
    offsets = [offset for offset, count in counts.items() if count > 0 and offset != skip]

    def fits(group: list[int]) -> bool:
        return len(group) == 1 or len(group) * max(counts[offset] for offset in group) * channels <= chunk_elements

    greedy: list[list[int]] = []  # the fewest chunks of consecutive offsets that keep to the budget
    for offset in offsets:
        if not greedy or not fits(greedy[-1] + [offset]):
            greedy.append([])
        greedy[-1].append(offset)
    number = len(greedy)
    balanced = [offsets[len(offsets) * part // number:len(offsets) * (part + 1) // number] for part in range(number)]
    groups = balanced if all(fits(group) for group in balanced) else greedy
    return tuple(PairChunk(tuple(group), tuple(offset_starts[offset] for offset in group),
                           tuple(counts[offset] for offset in group)) for group in groups)


def chunk_rows(xp: Any, pair_arrays: tuple[Any, ...], chunk: PairChunk, width: int | None = None) -> tuple[Any, ...]:
    """A chunk's entries of pair arrays, each as int32 ``[m, W]`` with every offset's row padded with -1.

    One offset at its own width gives its rows as they are (``[1, W]``, views).
    Otherwise the rows are laid out on the device from the chunk's (host) offset
    starts, with the same few array operations whatever ``m``, shared by all the arrays.

    Args:
        xp: the array module of the arrays.
        pair_arrays: int32 ``[P]`` arrays, e.g. a rulebook's ``(pair_input, pair_output)``.
        chunk: the chunk.
        width: ``W``, at least ``chunk.width`` (the default): a wider layout pads every offset.

    Returns:
        One ``[m, W]`` array per entry of ``pair_arrays``.
    """
    width = chunk.width if width is None else int(width)
    if width < chunk.width:
        raise ValueError(f"chunk_rows: width must be at least the chunk's widest offset ({chunk.width}), got {width}")
    if len(chunk.offsets) == 1 and width == chunk.width:
        first = chunk.starts[0]
        return tuple(rows[first:first + chunk.counts[0]].reshape(1, -1) for rows in pair_arrays)
    step = xp.arange(width, dtype=xp.int64)[None, :]
    counts = xp.asarray(chunk.counts, dtype=xp.int64)[:, None]
    valid = step < counts
    positions = xp.asarray(chunk.starts, dtype=xp.int64)[:, None] + xp.minimum(step, counts - 1)  # in each offset
    return tuple(xp.where(valid, xp.take(rows, positions), -1).astype(xp.int32, copy=False) for rows in pair_arrays)


def check_padded_pairs(rulebook: Any, backend: Any) -> None:
    """Raises when a padded `PairMap` (rows of -1) meets a backend that cannot skip them.

    Raises:
        ValueError: for a padded pair map on a backend whose ``skips_negative_rows`` is false.
    """
    if getattr(rulebook, "padded", False) and not backend.skips_negative_rows:
        raise ValueError(
            f"this PairMap is padded (rows of -1 mark no pair), which the {backend.name} backend cannot "
            "skip; cut the pairs to their true counts first (as sparsecore.jax does on the CPU), or run "
            "on the GPU backend"
        )
