"""The rulebook forms a feature pass accepts, and the view each backend reads.

`sparsecore.conv` and `sparsecore.pool` take a `Rulebook`, a `PairMap` or a
`NeighbourMap`. A kernel backend (the GPU, or its emulation) runs the fused
map kernels, so it reads a `NeighbourMap` (`map_view`: the rulebook's own, or
one derived from the pairs once, memoised); the NumPy backend keeps its CPU
dataflows over pairs (`pair_view`: a `NeighbourMap` argument is converted to a
`PairMap` once, memoised in its ``derived`` slot).
"""

from __future__ import annotations

from typing import Any

from .interop import array_module
from .neighbour_map import NeighbourMap, neighbour_map_of, pairs_from_neighbour_map
from .pair_map import PairMap

__all__ = ["runs_fused_passes", "map_view", "pair_view", "index_rows", "refuse_bfloat16"]


def runs_fused_passes(backend: Any) -> bool:
    """Whether ``backend`` runs the feature passes as fused kernels over neighbour maps (the kernel backend)."""
    return getattr(backend, "fused_passes", None) is not None


def map_view(rulebook: Any, xp: Any) -> NeighbourMap:
    """The `NeighbourMap` of a `Rulebook`, `PairMap` or `NeighbourMap` (itself)."""
    if isinstance(rulebook, NeighbourMap):
        return rulebook
    return neighbour_map_of(rulebook, xp)


def pair_view(rulebook: Any) -> Any:
    """A `Rulebook` or `PairMap` as given; a `NeighbourMap` as its `PairMap`, derived once (memoised in the map)."""
    if not isinstance(rulebook, NeighbourMap):
        return rulebook
    pairs = rulebook.derived.get("pair_map")
    if pairs is None:
        pair_input, pair_output, starts = pairs_from_neighbour_map(array_module(rulebook.output_neighbours), rulebook)
        pairs = PairMap(pair_input, pair_output, starts, rulebook.num_input, rulebook.num_output,
                        tuple(rulebook.kernel_size), rulebook.identity_offset, trusted=True)
        rulebook.derived["pair_map"] = pairs
    return pairs


def index_rows(rulebook: Any) -> Any:
    """An integer array of the rulebook's, for the same-device check of a pass's arguments, without deriving
    anything: a map's table when the rulebook stores a map, else its pair rows."""
    if isinstance(rulebook, NeighbourMap):
        return rulebook.output_neighbours
    stored = getattr(rulebook, "stored_map", None)
    if stored is not None:
        return stored.output_neighbours
    return rulebook.pair_input


def refuse_bfloat16(backend: Any, **arrays: Any) -> None:
    """Raises for a bfloat16 array reaching a backend whose pair passes do not run it.

    The kernel backend runs bfloat16 in its fused passes and the NumPy backend in its CPU dataflows
    (`sparsecore.bf16_cpu_dataflow`); any other backend refuses it.

    Raises:
        TypeError: naming the first bfloat16 argument.
    """
    from .backends import NumpyBackend

    if isinstance(backend, NumpyBackend):
        return
    for name, array in arrays.items():
        if array is not None and array.dtype.name == "bfloat16":
            raise TypeError(f"{name} has dtype bfloat16, which the {getattr(backend, 'name', type(backend).__name__)} "
                            "backend's pair passes do not run (the NumPy backend and the GPU kernel backend do); "
                            "cast it with .astype(float32)")
