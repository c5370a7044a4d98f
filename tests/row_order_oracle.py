"""A plain-Python oracle of a map side's row order (`sparsecore.neighbour_map.row_order`), by loops.

Masks are Python ints (bit ``k`` for offset ``k``); rows are sorted by
``sorted`` (stable), then each 64-row tile is regrouped as
`sparsecore.tile_order` describes (16-row groups, then 8-row halves; seed: most
offsets, earliest; then fewest new offsets, most offsets, earliest), kept only
where neither its 8-row nor its 16-row slices hold more offsets than sorted.
Written from the rule, not from the vectorised code.
"""

from __future__ import annotations

__all__ = ["oracle_order", "slice_offsets"]


def _greedy(entries: list[int | None], masks: list[int], group: int) -> list[int | None]:
    """One segment's entries (row ids, None for none) in groups of ``group`` rows."""
    left = [position for position, row in enumerate(entries) if row is not None]
    result: list[int | None] = []
    held = 0
    while left:
        if len(result) % group == 0:
            position = min(left, key=lambda p: (-bin(masks[entries[p]]).count("1"), p))
            held = 0
        else:
            position = min(left, key=lambda p: (bin(masks[entries[p]] & ~held).count("1"),
                                                -bin(masks[entries[p]]).count("1"), p))
        left.remove(position)
        held |= masks[entries[position]]
        result.append(entries[position])
    return result + [None] * (len(entries) - len(result))


def slice_offsets(rows: list[int | None], masks: list[int], height: int) -> int:
    """Offsets held by each ``height``-row slice of ``rows`` (one tile), summed."""
    total = 0
    for start in range(0, len(rows), height):
        held = 0
        for row in rows[start:start + height]:
            if row is not None:
                held |= masks[row]
        total += bin(held).count("1")
    return total


def oracle_order(masks: list[int], words: int, regroup: bool = True) -> list[int]:
    """The rows' order: stably sorted by their masks (word 0 first), each tile regrouped (masks of at most
    two 32-bit words only)."""
    def key(row: int) -> tuple[int, ...]:
        return tuple((masks[row] >> (32 * word)) & 0xFFFFFFFF for word in range(words))

    order = sorted(range(len(masks)), key=key)
    if not regroup or words > 2:
        return order
    result: list[int] = []
    for start in range(0, len(order), 64):
        tile: list[int | None] = list(order[start:start + 64])
        tile += [None] * (64 - len(tile))
        grouped = _greedy(tile, masks, 16)
        halves: list[int | None] = []
        for segment in range(0, 64, 16):
            halves += _greedy(grouped[segment:segment + 16], masks, 8)
        better = all(slice_offsets(halves, masks, height) <= slice_offsets(tile, masks, height) for height in (8, 16))
        result += [row for row in (halves if better else tile) if row is not None]
    return result
