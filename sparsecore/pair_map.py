"""`PairMap`: a rulebook's pairs as lists grouped by kernel offset, the form the CPU passes read.

A sparse convolution's rulebook has one logical content, the (input row,
output row) pairs of every kernel offset, and two views of it:

- `PairMap` (here): the pairs as two int32 lists grouped by offset, with host
  offset starts: what the CPU's compiled dataflows plan from, what spconv's
  ``indice_pairs`` and exported graphs carry, and what frontends rebuild from
  saved tensors;
- `sparsecore.neighbour_map.NeighbourMap`: the same pairs as per-row tables,
  masks and mask-sorted orders, what the GPU's fused kernels read.

Each is derivable from the other (`sparsecore.neighbour_map.neighbour_map_from_pairs`,
`sparsecore.neighbour_map.pairs_from_neighbour_map`); a `sparsecore.rulebook.Rulebook`
stores the one its backend computes natively and derives the other on demand.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["PairMap"]


@dataclass(frozen=True, eq=False)
class PairMap:
    """The part of a rulebook the feature passes read: pairs, counts and sizes.

    Frontends rebuild it from saved integer tensors (a ``torch.library`` op or a
    JAX callback cannot carry a Python `Rulebook`); every feature pass accepts
    a `PairMap` or a `Rulebook`.

    Attributes:
        pair_input: int32 ``[P]`` input rows, grouped by kernel offset.
        pair_output: int32 ``[P]`` output rows, grouped by kernel offset.
        offset_starts: ``K + 1`` ints delimiting each offset's pairs.
        num_input: number of input rows.
        num_output: number of output rows.
        kernel_size: per-axis kernel size (``prod == K``).
        identity_offset: an offset whose pairs are ``i -> i`` for all rows, or -1.
        padded: the pair arrays may hold -1 entries, padding that is no pair
            (a fixed-capacity layout such as ``sparsecore.jax``'s, used without
            reading its true counts back to the host). Only backends whose
            ``skips_negative_rows`` is true (the GPU kernels) accept it.
        trusted: the pairs come from a rulebook the library built, so the range
            check of the rows is skipped (no host synchronisation on the GPU).
        derived: a per-map cache of layouts computed from the pairs alone (the CPU
            neighbour tables of `sparsecore.cpu_dataflow`), filled on first use so
            every pass and every layer sharing the map builds them once; not part
            of the value.

    Raises:
        ValueError: offsets that do not match the kernel or the pair arrays, or
            (unless ``trusted``) a row outside ``[0, num_input)`` /
            ``[0, num_output)``; only a ``padded`` map may hold -1 (no pair).
        TypeError: non-integer pair arrays.
    """

    pair_input: Any
    pair_output: Any
    offset_starts: tuple[int, ...]
    num_input: int
    num_output: int
    kernel_size: tuple[int, ...]
    identity_offset: int = -1
    padded: bool = False
    trusted: bool = dataclasses.field(default=False, repr=False)
    derived: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        volume = 1
        for size in self.kernel_size:
            volume *= size
        if len(self.offset_starts) != volume + 1:
            raise ValueError(
                f"offset_starts has {len(self.offset_starts)} entries; kernel_size "
                f"{tuple(self.kernel_size)} needs {volume + 1}"
            )
        if self.pair_input.shape[0] != self.offset_starts[-1] or self.pair_output.shape[0] != self.offset_starts[-1]:
            raise ValueError(
                f"pair arrays have {self.pair_input.shape[0]} / {self.pair_output.shape[0]} "
                f"entries but offset_starts ends at {self.offset_starts[-1]}"
            )
        if not self.trusted:
            self._check_rows()

    def __getstate__(self) -> dict:
        # a copy or a pickle starts with an empty cache (the layouts are rebuilt on use)
        return {**self.__dict__, "derived": {}}

    def _check_rows(self) -> None:
        starts = tuple(self.offset_starts)
        if starts[0] != 0 or any(b < a for a, b in zip(starts[:-1], starts[1:])):
            raise ValueError(f"offset_starts must start at 0 and never decrease, got {starts}")
        for name, rows, limit in (("pair_input", self.pair_input, self.num_input),
                                  ("pair_output", self.pair_output, self.num_output)):
            if getattr(rows, "ndim", None) != 1 or getattr(rows, "dtype", None) is None or rows.dtype.kind not in "iu":
                raise TypeError(
                    f"{name} must be a 1-D integer array of rows, got "
                    f"{getattr(rows, 'dtype', type(rows).__name__)} with shape {getattr(rows, 'shape', None)}"
                )
            if rows.shape[0] == 0:
                continue
            lowest, highest = int(rows.min()), int(rows.max())
            floor = -1 if self.padded else 0
            if lowest < floor or highest >= limit:
                bad = lowest if lowest < floor else highest
                raise ValueError(
                    f"{name} holds row {bad}, outside [{floor}, {limit}) ("
                    + ("num_input" if name == "pair_input" else "num_output")
                    + f" = {limit}); rows index the feature arrays"
                    + ("" if self.padded else
                       "; negative rows are never wrapped (only a padded=True map may hold -1 = no pair)")
                )

    @property
    def kernel_volume(self) -> int:
        """Number of kernel offsets."""
        return len(self.offset_starts) - 1

    @property
    def num_pairs(self) -> int:
        """Total number of pairs."""
        return self.offset_starts[-1]

    def pairs(self, offset: int) -> tuple[Any, Any]:
        """``(input_rows, output_rows)`` int32 arrays of one kernel offset."""
        start, stop = self.offset_starts[offset], self.offset_starts[offset + 1]
        return self.pair_input[start:stop], self.pair_output[start:stop]
