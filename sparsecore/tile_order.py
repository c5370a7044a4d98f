"""Rows regrouped inside each row tile, so that the fused kernels' row slices skip more offsets.

The fused GPU kernels (``kernels_cu/implicit_gemm.cu``) take a map's rows in
tiles of `TILE_ROWS` consecutive positions of its row order, and inside a tile
a warp skips an offset for a slice of rows only when no row of the slice holds
it: 8-row slices in every dtype's forward, 16-row slices in the 128-thread
SIMT engine that bfloat16 and TF32 fall back to on sm_75. The stable sort by
mask (`mask_order`) puts rows with similar masks into the same tile, but
inside a tile it leaves rows of different masks side by side. `regroup_tiles`
reorders the rows of each tile (never moving a row to another tile) in two
greedy passes:

1. the tile's rows into 16-row groups, and then
2. each 16-row group into two 8-row slices,

where a pass fills each group in turn: its seed is the remaining row with the
most offsets, and each next row is the one whose mask adds the fewest offsets
the group does not hold yet (ties: the row with more offsets, then the earlier
position). Pass 2 serves the 8-row slices, pass 1 the 16-row ones. A greedy
rule can lose to the sorted order: a tile keeps its regrouped rows only when
neither its 8-row nor its 16-row slices hold more offsets in all (the sum over
slices of the offsets some row of the slice holds) than in the sorted order, so
regrouping never adds padding at either granularity. On spconv's basic network
(the real scan) it cuts the padding of the forward's 8-row slices by about a
sixth at full resolution (docs/gpu.md).

Only masks of up to `MAX_REGROUP_WORDS` words (kernels of up to 64 offsets) are
regrouped; wider ones keep the mask order. Everything is integer arithmetic
with fixed tie-breaks, so the order is deterministic: the kernel that builds it
on the GPU (``sc_map_row_plan`` in ``kernels_cu/neighbour_map.cu``) gives the
same order bitwise as this NumPy version, written once against ``xp`` with no
boolean mask and no read back to the host.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TILE_ROWS", "GROUP_PASSES", "MAX_REGROUP_WORDS", "regroup_tiles", "sorted_rows", "mask_order", "row_order"]

TILE_ROWS = 64  # rows of a fused kernel's tile (sc::kTileRows)
GROUP_PASSES = ((TILE_ROWS, 16), (16, 8))  # (segment rows, group rows) of each pass, in order
MAX_REGROUP_WORDS = 2  # sc::kPlanWords: masks of at most this many uint32 words are regrouped


def _popcount(xp: Any, words: Any) -> Any:
    """Set bits of each uint32 (SWAR; int64 result)."""
    v = words.astype(xp.uint32)
    v = v - ((v >> xp.uint32(1)) & xp.uint32(0x55555555))
    v = (v & xp.uint32(0x33333333)) + ((v >> xp.uint32(2)) & xp.uint32(0x33333333))
    v = (v + (v >> xp.uint32(4))) & xp.uint32(0x0F0F0F0F)
    return ((v * xp.uint32(0x01010101)) >> xp.uint32(24)).astype(xp.int64)


def _greedy_pass(xp: Any, positions: Any, masks: Any, segment: int, group: int) -> Any:
    """One pass over ``positions`` int64 ``[S * segment]`` (row ids, -1 for none): each segment's rows in groups
    of ``group`` rows, picked greedily (module docstring); -1 entries stay after the rows of their segment."""
    segments = positions.shape[0] // segment
    words = int(masks.shape[1])
    rows = positions.reshape(segments, segment)
    valid = rows >= 0
    safe = xp.where(valid, rows, 0)
    row_masks = [xp.where(valid, masks[:, w][safe], xp.uint32(0)).astype(xp.uint32) for w in range(words)]
    counts = sum(_popcount(xp, m) for m in row_masks)  # [S, segment]
    most = 32 * words + 1
    index = xp.arange(segment, dtype=xp.int64)[None, :]
    never = xp.int64(1 << 62)
    taken = ~valid
    held = [xp.zeros((segments, 1), dtype=xp.uint32) for _ in range(words)]
    picked = []
    for pick in range(segment):
        if pick % group == 0:  # a new group: the seed has the most offsets
            held = [xp.zeros((segments, 1), dtype=xp.uint32) for _ in range(words)]
            key = (most - counts) * segment + index
        else:  # the fewest new offsets, then the most offsets, then the earliest position
            growth = sum(_popcount(xp, m & ~h) for m, h in zip(row_masks, held))
            key = (growth * most + (most - counts)) * segment + index
        key = xp.where(taken, never, key)
        choice = xp.argmin(key, axis=1)  # [S]
        chosen = xp.take_along_axis(rows, choice[:, None], axis=1)[:, 0]
        fresh = ~xp.take_along_axis(taken, choice[:, None], axis=1)[:, 0]
        picked.append(xp.where(fresh, chosen, -1))
        held = [h | xp.take_along_axis(m, choice[:, None], axis=1) for m, h in zip(row_masks, held)]
        taken = taken | (index == choice[:, None])
    return xp.stack(picked, axis=1).reshape(-1)


def regroup_tiles(xp: Any, masks: Any, order: Any) -> Any:
    """``order`` with the rows of each `TILE_ROWS`-row tile regrouped (module docstring).

    Args:
        xp: the array module (NumPy, CuPy or the emulation's device arrays: no host read).
        masks: uint32 ``[N, W]`` row masks.
        order: int ``[N]``, the rows stably sorted by mask.

    Returns:
        int32 ``[N]``: a permutation of ``range(N)`` with the same rows in every tile as ``order``; ``order``
        itself (as int32) when ``W > MAX_REGROUP_WORDS``.
    """
    rows, words = int(masks.shape[0]), int(masks.shape[1])
    if rows == 0 or words > MAX_REGROUP_WORDS:
        return order.astype(xp.int32)
    tiles = -(-rows // TILE_ROWS)
    sorted_positions = xp.full(tiles * TILE_ROWS, -1, dtype=xp.int64)
    sorted_positions[:rows] = order.astype(xp.int64)
    positions = sorted_positions
    for segment, group in GROUP_PASSES:
        positions = _greedy_pass(xp, positions, masks, segment, group)
    before, after = _slice_counts(xp, sorted_positions, masks), _slice_counts(xp, positions, masks)
    keep = (after[0] <= before[0]) & (after[1] <= before[1])  # [tiles]
    positions = xp.where(keep[:, None], positions.reshape(tiles, TILE_ROWS),
                         sorted_positions.reshape(tiles, TILE_ROWS)).reshape(-1)
    # -1 entries (the last tile's missing rows) stay at its end through both passes
    return positions[:rows].astype(xp.int32)


def _slice_counts(xp: Any, positions: Any, masks: Any) -> tuple[Any, Any]:
    """Per tile, the offsets held by its 8-row slices and by its 16-row slices, summed: int64 ``[tiles]`` each."""
    tiles = positions.shape[0] // TILE_ROWS
    valid = positions >= 0
    safe = xp.where(valid, positions, 0)
    eight, sixteen = 0, 0
    for w in range(int(masks.shape[1])):
        words = xp.where(valid, masks[:, w][safe], xp.uint32(0)).astype(xp.uint32).reshape(tiles, TILE_ROWS // 8, 8)
        held = words[:, :, 0]
        for r in range(1, 8):
            held = held | words[:, :, r]  # [tiles, 8]: each 8-row slice's OR
        pairs = held.reshape(tiles, TILE_ROWS // 16, 2)
        eight = eight + _popcount(xp, held).sum(axis=1)
        sixteen = sixteen + _popcount(xp, pairs[:, :, 0] | pairs[:, :, 1]).sum(axis=1)
    return eight, sixteen


def row_order(xp: Any, masks: Any) -> Any:
    """int32 ``[N]``: a side's row order, its masks' `mask_order` regrouped inside each row tile
    (`regroup_tiles`)."""
    return regroup_tiles(xp, masks, sorted_rows(xp, masks))


def sorted_rows(xp: Any, masks: Any) -> Any:
    """int64 ``[N]``: `mask_order` before its cast to int32 (what ``xp.argsort`` returns)."""
    rows, words = int(masks.shape[0]), int(masks.shape[1])
    if words == 1:
        return xp.argsort(masks.reshape(rows), kind="stable")
    order = xp.argsort(masks[:, words - 1], kind="stable")
    for word in range(words - 2, -1, -1):
        order = order[xp.argsort(masks[order, word], kind="stable")]
    return order


def mask_order(xp: Any, masks: Any) -> Any:
    """int32 ``[N]`` rows stably sorted by their uint32 ``[N, W]`` masks (word 0 first).

    One stable argsort and a cast for ``W == 1`` (kernels of up to 32 offsets);
    wider masks are sorted word by word from the last (least significant) to
    word 0, each a stable argsort of the rows in the order so far: a
    lexicographic sort that needs no multi-key sort (CuPy's ``lexsort`` takes
    two-dimensional keys only).
    """
    return sorted_rows(xp, masks).astype(xp.int32)
