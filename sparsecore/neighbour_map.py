"""Neighbour maps: a rulebook as per-row tables, the form the GPU's fused feature kernels read.

A `NeighbourMap` holds, for every output row ``o`` and kernel offset ``k``, the
input row that feeds ``o`` through ``k`` (``output_neighbours[o, k]``, -1 for
none), and the same relation seen from the inputs (``input_neighbours[i, k]``,
the output row that input ``i`` feeds through ``k``). It is the same
information as a `sparsecore.rulebook.PairMap` (pairs grouped by offset), laid
out per row:

- an output-stationary kernel (forward, and the input gradient over the
  input-side table) walks its rows, reads each row's ``K`` neighbours and writes
  each row once: no scatter, no atomics, deterministic;
- ``output_masks`` / ``input_masks`` hold each row's offsets as bits (uint32
  words, bit ``k % 32`` of word ``k // 32``) and ``output_order`` /
  ``input_order`` the rows stably sorted by mask, so a tile of consecutive rows
  in that order shares most of its offsets and a kernel skips the offsets no
  row of its tile has; inside each 64-row tile the rows are then regrouped
  into 16- and 8-row slices of similar masks (`sparsecore.tile_order`), the
  slices the kernels' warps skip offsets by.

A submanifold map is symmetric (``input_neighbours[i, k] == output_neighbours[i, K - 1 - k]``),
so it stores one side only (``symmetric=True``; ``input_neighbours`` and the
input masks and order are None) and the input gradient reads the output side
with the offsets reversed.

The row orders are sorted when first read (`row_order`, memoised on the map)
unless a builder gave them: only a kernel that tiles rows by mask asks for
them, so a pooling layer, whose kernels read the tables alone, never pays for
the sort, and the input side's order is sorted by the first input gradient.
The GPU's fused passes build a side's order as a row plan instead
(``sparsecore.backends._kernel_maps.row_plan``: the same order, and per-offset
row-tile bit sets for the weight gradient, kept in ``derived`` under
`ROW_PLAN`); the attribute reads the order out of a plan when there is one.
The masks, likewise, are made from their table when first read unless the
builder gave them: the GPU's strided builds leave the input side's out (a
pooling layer's kernels never read them) and the GPU's fused passes make them
with a kernel when a conv first tiles that side (`stored_masks`, `keep_masks`).

This module holds the value and its two conversions, written once against
``xp`` (NumPy or CuPy): `neighbour_map_from_pairs` (a map for any pair map,
memoised per `PairMap` by `neighbour_map_of`) and `pairs_from_neighbour_map`
(the pair-list view, derived on demand, ordered by output row within each
offset). The kernel backend's rulebook builders write maps directly with their
own kernels (`sparsecore._kernel_builds`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import numpy

from .interop import array_module
from .tile_order import mask_order, row_order

__all__ = [
    "NeighbourMap",
    "mask_words",
    "neighbour_map_from_pairs",
    "pairs_from_neighbour_map",
    "neighbour_map_of",
    "row_masks",
    "mask_order",
    "row_order",
    "stored_order",
    "stored_masks",
    "keep_masks",
    "ROW_PLAN",
]

ROW_PLAN = "row plan"  # NeighbourMap.derived[(ROW_PLAN, side)]: a side's int64 row plan (see _kernel_maps.row_plan)


def mask_words(kernel_volume: int) -> int:
    """uint32 words of a row mask for ``kernel_volume`` offsets (at least 1)."""
    return max(1, -(-int(kernel_volume) // 32))


@dataclass(frozen=True, eq=False)
class NeighbourMap:
    """A rulebook's pairs as per-row neighbour tables (see the module docstring).

    Attributes:
        output_neighbours: int32 ``[N_out, K]``: the input row paired with output
            row ``o`` through offset ``k``, or -1.
        output_masks: uint32 ``[N_out, W]`` (``W = mask_words(K)``): bit ``k % 32``
            of word ``k // 32`` is set exactly when ``output_neighbours[o, k] >= 0``. Made from the
            table (`row_masks`) when first read if the map was made with None (the `swapped` view of
            a map whose input masks were never made).
        output_order: int32 ``[N_out]``: a permutation of ``range(N_out)`` that
            puts rows of similar masks together (`row_order`: stably sorted by
            mask, word 0 first, then regrouped inside each 64-row tile); any
            permutation is valid. Made from the masks when first read if the map
            was made with None.
        input_neighbours: int32 ``[N_in, K]``: the output row fed by input row
            ``i`` through offset ``k``, or -1; None when ``symmetric``.
        input_masks: uint32 ``[N_in, W]`` of ``input_neighbours``; None when ``symmetric``. Made from
            ``input_neighbours`` (`row_masks`) when first read if the map was made with None: the GPU's
            strided builds leave them to the first pass that tiles the input side by mask (a conv's
            input gradient, an inverse conv's forward), so a pooling layer never makes them.
        input_order: int32 ``[N_in]``, likewise (sorted when first read if made with None); None when
            ``symmetric``.
        num_input: input rows ``N_in``.
        num_output: output rows ``N_out``.
        kernel_size: per-axis kernel size (``prod == K``).
        identity_offset: an offset whose pairs are ``i -> i`` for every row (a
            submanifold centre), or -1.
        symmetric: a submanifold map (``N_in == N_out``, offset ``k`` of input
            ``i`` is offset ``K - 1 - k`` of output ``i``): one side is stored.
        derived: a per-map cache of what is computed from the map alone (its
            pair-list view, kernel launch plans), filled on first use; not part
            of the value.
    """

    output_neighbours: Any
    output_masks: Any = dataclasses.field(repr=False)  # a descriptor: see _MadeOnRead below
    output_order: Any = dataclasses.field(repr=False)  # a descriptor: see _MadeOnRead below
    input_neighbours: Any
    input_masks: Any = dataclasses.field(repr=False)  # a descriptor: see _MadeOnRead below
    input_order: Any = dataclasses.field(repr=False)
    num_input: int
    num_output: int
    kernel_size: tuple[int, ...]
    identity_offset: int = -1
    symmetric: bool = False
    derived: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict:
        # a copy or a pickle starts with an empty cache
        return {**self.__dict__, "derived": {}}

    def __post_init__(self) -> None:
        volume = self.kernel_volume
        if tuple(self.output_neighbours.shape) != (self.num_output, volume):
            raise ValueError(
                f"output_neighbours must have shape [num_output, K] = [{self.num_output}, {volume}], got "
                f"{tuple(self.output_neighbours.shape)}"
            )
        given = stored_masks(self, "output")  # None: made when first read
        if given is not None and tuple(given.shape) != (self.num_output, mask_words(volume)):
            raise ValueError(
                f"output_masks must have shape [{self.num_output}, {mask_words(volume)}], got "
                f"{tuple(given.shape)}"
            )
        if self.symmetric:
            if self.num_input != self.num_output or self.input_neighbours is not None:
                raise ValueError("a symmetric neighbour map has num_input == num_output and stores no input side")
        elif self.input_neighbours is None or tuple(self.input_neighbours.shape) != (self.num_input, volume):
            raise ValueError(
                f"input_neighbours must have shape [num_input, K] = [{self.num_input}, {volume}], got "
                f"{None if self.input_neighbours is None else tuple(self.input_neighbours.shape)}"
            )

    @property
    def kernel_volume(self) -> int:
        """Number of kernel offsets ``K``."""
        volume = 1
        for size in self.kernel_size:
            volume *= int(size)
        return volume

    def input_side(self) -> tuple[Any, Any, Any, bool]:
        """``(neighbours, masks, order, reversed)`` of the input side, as an input-gradient kernel reads it.

        ``reversed`` is True for a symmetric map: the output side's tables, where
        offset ``k`` stands for weight offset ``K - 1 - k``.
        """
        if self.symmetric:
            return self.output_neighbours, self.output_masks, self.output_order, True
        return self.input_neighbours, self.input_masks, self.input_order, False

    def swapped(self) -> "NeighbourMap":
        """The map with inputs and outputs exchanged (an inverse conv of a regular one): same offsets.

        Orders not sorted and masks not made yet stay so (each map makes its own on first read); row plans
        built so far are carried over.
        """
        if self.symmetric:
            return self
        stored = self.__dict__
        swapped = NeighbourMap(self.input_neighbours, stored["_input_masks"], stored["_input_order"],
                               self.output_neighbours, stored["_output_masks"], stored["_output_order"],
                               self.num_output, self.num_input, tuple(self.kernel_size), self.identity_offset)
        for side, other in (("output", "input"), ("input", "output")):  # row plans built so far
            plan = self.derived.get((ROW_PLAN, other))
            if plan is not None:
                swapped.derived[(ROW_PLAN, side)] = plan
        return swapped


def _sorted_order(instance: "NeighbourMap", side: str) -> Any:
    """A side's order: its masks sorted by `mask_order` (or its row plan's low words, where one was built)."""
    masks = getattr(instance, f"{side}_masks")
    if masks is None:  # the input side of a symmetric map
        return None
    plan = instance.derived.get((ROW_PLAN, side))
    if plan is not None:  # the order is the plan's low words (one cast)
        return plan.astype(array_module(plan).int32)
    return row_order(array_module(masks), masks)


def _table_masks(instance: "NeighbourMap", side: str) -> Any:
    """A side's masks: `row_masks` of its table."""
    table = getattr(instance, f"{side}_neighbours")
    return None if table is None else row_masks(array_module(table), table)


class _MadeOnRead:
    """The data descriptor of `NeighbourMap.output_order` / ``input_order`` (``make``: `_sorted_order`) and
    ``output_masks`` / ``input_masks`` (`_table_masks`): the array given, else ``make(map, side)`` when first
    read, kept in the instance's ``_{side}_{name}`` slot so it is made once; None where the side has none
    (the input side of a symmetric map), not kept."""

    def __init__(self, side: str, name: str, make: Callable[["NeighbourMap", str], Any]) -> None:
        self.side = side
        self.slot = f"_{side}_{name}"
        self.make = make

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        value = instance.__dict__.get(self.slot)
        if value is None:
            value = self.make(instance, self.side)
            if value is not None:
                instance.__dict__[self.slot] = value
        return value

    def __set__(self, instance: Any, value: Any) -> None:
        instance.__dict__[self.slot] = value


# After the dataclass is made, so the generated __init__ stores these fields through the descriptors.
NeighbourMap.output_order = _MadeOnRead("output", "order", _sorted_order)  # type: ignore[assignment]
NeighbourMap.input_order = _MadeOnRead("input", "order", _sorted_order)  # type: ignore[assignment]
NeighbourMap.output_masks = _MadeOnRead("output", "masks", _table_masks)  # type: ignore[assignment]
NeighbourMap.input_masks = _MadeOnRead("input", "masks", _table_masks)  # type: ignore[assignment]


def stored_masks(neighbour_map: NeighbourMap, side: str) -> Any:
    """The ``"output"`` or ``"input"`` masks of a map if they were given or already made, else None (never
    makes them)."""
    return neighbour_map.__dict__.get(f"_{side}_masks")


def keep_masks(neighbour_map: NeighbourMap, side: str, masks: Any) -> Any:
    """Keeps ``masks`` (`row_masks` of the side's table, made by a backend's kernel) as the map's ``"output"``
    or ``"input"`` masks unless it holds some already; returns the side's masks."""
    kept = stored_masks(neighbour_map, side)
    if kept is None:
        neighbour_map.__dict__[f"_{side}_masks"] = kept = masks
    return kept


def row_masks(xp: Any, neighbours: Any) -> Any:
    """uint32 ``[N, W]`` bit masks of an int32 ``[N, K]`` table's non-negative entries (xp, a few operations)."""
    rows, volume = int(neighbours.shape[0]), int(neighbours.shape[1])
    words = mask_words(volume)
    if xp is numpy:  # the host: packed bytes read as little-endian words (3-5x faster)
        packed = xp.zeros((rows, words * 4), dtype=xp.uint8)
        packed[:, : -(-volume // 8)] = xp.packbits(neighbours >= 0, axis=1, bitorder="little")
        return packed.view("<u4").astype(xp.uint32, copy=False)
    padded = xp.zeros((rows, words * 32), dtype=xp.uint32)
    padded[:, :volume] = (neighbours >= 0).astype(xp.uint32)
    bits = xp.left_shift(xp.uint32(1), xp.arange(32, dtype=xp.uint32))
    return (padded.reshape(rows, words, 32) * bits).sum(axis=2, dtype=xp.uint32).astype(xp.uint32)


def stored_order(neighbour_map: NeighbourMap, side: str) -> Any:
    """The ``"output"`` or ``"input"`` order of a map if it was given or already made, else None (never sorts)."""
    return neighbour_map.__dict__.get(f"_{side}_order")


def neighbour_map_from_pairs(xp: Any, pair_input: Any, pair_output: Any, offset_starts: tuple[int, ...],
                             num_input: int, num_output: int, kernel_size: tuple[int, ...],
                             identity_offset: int = -1, symmetric: bool = False) -> NeighbourMap:
    """The neighbour map of pairs grouped by offset (rows of -1, padding, are dropped).

    Args:
        xp: the array module of the pairs.
        pair_input: int32 ``[P]`` input rows, grouped by offset.
        pair_output: int32 ``[P]`` output rows, grouped by offset.
        offset_starts: ``K + 1`` host ints delimiting the offsets' pairs.
        num_input: input rows.
        num_output: output rows.
        kernel_size: per-axis kernel size.
        identity_offset: the identity offset, or -1.
        symmetric: store one side (a submanifold rulebook's pairs).

    Returns:
        The `NeighbourMap`.

    Nothing is read back to the host (the offset of each pair comes from the
    host ``offset_starts``; padding is written to a spare row that is cut off),
    so a padded pair map on the GPU converts inside a JAX callback.
    """
    volume = len(offset_starts) - 1
    if xp is numpy:  # one compiled pass over the pairs per side, table and masks together
        from .backends._rulebook_kernels import neighbour_table

        def side(rows: int, keys: Any, values: Any) -> tuple[Any, Any, Any]:
            return (*neighbour_table(keys, values, tuple(offset_starts), rows), None)
    else:
        ends = xp.asarray([int(stop) for stop in offset_starts[1:]], dtype=xp.int64)
        pairs = xp.arange(int(offset_starts[-1]), dtype=xp.int64)
        offsets = xp.searchsorted(ends, pairs, side="right")  # offset of each pair
        valid = (pair_input >= 0) & (pair_output >= 0)

        def side(rows: int, keys: Any, values: Any) -> tuple[Any, Any, Any]:
            table = xp.full((rows + 1, volume), -1, dtype=xp.int32)  # row `rows` takes the padding
            table[xp.where(valid, keys.astype(xp.int64), rows), offsets] = xp.where(valid, values, -1).astype(
                xp.int32, copy=False)
            table = table[:rows]
            return table, row_masks(xp, table), None  # the order is sorted when first read

    out_table, out_masks, out_order = side(int(num_output), pair_output, pair_input)
    if symmetric:
        return NeighbourMap(out_table, out_masks, out_order, None, None, None, int(num_input), int(num_output),
                            tuple(int(k) for k in kernel_size), int(identity_offset), True)
    in_table, in_masks, in_order = side(int(num_input), pair_input, pair_output)
    return NeighbourMap(out_table, out_masks, out_order, in_table, in_masks, in_order, int(num_input),
                        int(num_output), tuple(int(k) for k in kernel_size), int(identity_offset), False)


def pairs_from_neighbour_map(xp: Any, neighbour_map: NeighbourMap) -> tuple[Any, Any, tuple[int, ...]]:
    """The pair-list view of a map: ``(pair_input, pair_output, offset_starts)``.

    Pairs are grouped by offset and ordered by output row within an offset. The
    offset counts are read back to the host (one synchronisation on the GPU):
    only callers that ask for pairs pay it.

    Returns:
        int32 ``[P]``, int32 ``[P]`` and ``K + 1`` host ints.
    """
    table = neighbour_map.output_neighbours
    by_offset = xp.ascontiguousarray(table.T)  # [K, N_out]
    offset_ids, output_rows = xp.nonzero(by_offset >= 0)
    pair_input = by_offset[offset_ids, output_rows].astype(xp.int32)
    volume = neighbour_map.kernel_volume
    counts = xp.bincount(offset_ids, minlength=volume) if offset_ids.shape[0] else xp.zeros(volume, dtype=xp.int64)
    starts = [0]
    for count in (counts.tolist() if hasattr(counts, "tolist") else list(counts)):
        starts.append(starts[-1] + int(count))
    return pair_input, output_rows.astype(xp.int32), tuple(starts)


def neighbour_map_of(rulebook: Any, xp: Any) -> NeighbourMap:
    """The neighbour map of a `Rulebook` or `PairMap`: its own, else derived from its pairs once.

    A rulebook the GPU built carries its map (``rulebook.neighbour_map``); any
    other pair map gets one from `neighbour_map_from_pairs`, memoised in the
    `PairMap`'s ``derived`` slot (so every pass and layer sharing it builds it once).
    """
    own = getattr(rulebook, "neighbour_map", None)
    if own is not None:
        return own
    pair_map = getattr(rulebook, "pair_map", rulebook)
    cached = pair_map.derived.get("neighbour_map")
    if cached is None:
        geometry = getattr(rulebook, "geometry", None)
        symmetric = geometry is not None and geometry.kind == "subm"
        cached = neighbour_map_from_pairs(xp, pair_map.pair_input, pair_map.pair_output,
                                          tuple(pair_map.offset_starts), pair_map.num_input, pair_map.num_output,
                                          tuple(pair_map.kernel_size), pair_map.identity_offset, symmetric)
        pair_map.derived["neighbour_map"] = cached
    return cached

