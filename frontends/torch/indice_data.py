"""`IndiceData` (a layer's rulebook under spconv's names) and `IndiceDict` (a tensor's ``indice_dict``).

`IndiceData` is a view over one core `sparsecore.Rulebook`: spconv's attribute
names (``indices``, ``out_indices``, ``spatial_shape``, ``out_spatial_shape``,
``is_subm``, ``ksize``, ``stride``, ``padding``, ``dilation``, ``algo``,
``indice_pairs``, ``indice_pair_num``, ``voxel_num``) and the ones the custom
ops read (``output_neighbours``, ``input_neighbours``: the rulebook's
`sparsecore.neighbour_map.NeighbourMap` tables; ``kernel_size``,
``identity_offset``) are read from the rulebook; its arrays become torch
tensors zero-copy (DLPack) when first read, and that tensor is kept (at most
one torch view of each array). Pair lists (spconv's ``indice_pairs``, and
``pair_input`` / ``pair_output`` / ``offset_starts``) are derived on demand:
nobody pays for them who does not ask.

The neighbour tensors are marked with their rulebook: an op handed the untouched
tensors of one `IndiceData` recovers the library's rulebook itself
(`library_rulebook`), so the CPU passes keep the pair layouts and tile plans it
memoises and the GPU passes its native map; any other tensors are rebuilt into a
checked map (`checked_rulebook`).

`IndiceDict` is the ``dict`` a SparseConvTensor holds as ``indice_dict``: keys
to `IndiceData`, as in spconv, plus the canonical part of the core's
`sparsecore.layer_geometry.GeometryCache` (rulebooks found by the identity of
their input sites and their geometry, with no key) as ``geometry_cache``. A
plain ``dict`` (given by a user, or ``indice_dict.copy()``) works too: it just
carries no canonical entries.
"""

from __future__ import annotations

import math
from functools import cached_property
from operator import attrgetter
from typing import Any, Callable, Optional, Sequence

import torch

import sparsecore as sc
from sparsecore.interop import array_module
from sparsecore.layer_geometry import GeometryCache
from sparsecore.neighbour_map import (NeighbourMap, neighbour_map_from_pairs, neighbour_map_of,
                                      pairs_from_neighbour_map, row_masks)

from ._convert import to_torch

__all__ = ["IndiceData", "IndiceDict", "canonical_cache", "input_cache", "layer_data", "output_indice_dict",
           "library_rulebook", "checked_rulebook"]


def _read(path: str, doc: str, convert: Callable[[Any], Any] = lambda value: value) -> property:
    """A read-only `IndiceData` property: ``convert(rulebook.<path>)``."""
    getter = attrgetter(path)
    return property(lambda data: convert(getter(data.rulebook)), doc=doc)


class IndiceData:
    """A layer's rulebook, as saved under an ``indice_key`` (spconv's ``IndiceData``): a view over `rulebook`.

    Args:
        rulebook: the core `sparsecore.Rulebook`.
        indices: the torch tensor of the layer's input sites, when the caller has it
            (else made from ``rulebook.input_indices`` when first read).
        out_indices: the torch tensor of its output sites, likewise.
        algo: recorded (spconv compatibility; unused).

    Attributes (spconv names): ``indices``, ``out_indices`` (int32 ``[N, 1 + D]``
    torch tensors), ``spatial_shape`` / ``out_spatial_shape`` (lists), ``is_subm``,
    ``ksize``, ``stride``, ``padding``, ``dilation`` (lists), ``algo``,
    ``indice_pairs`` (spconv's ``[2, K, N_in]`` Native layout, -1 = no pair) and
    ``indice_pair_num`` (int32 ``[K]`` pairs per offset), both derived when first
    read, ``voxel_num`` (None).
    sparsecore's own: ``rulebook``; ``output_neighbours`` (int32 ``[N_out, K]``)
    and ``input_neighbours`` (int32 ``[N_in, K]``, None for a symmetric,
    submanifold map), torch views of the rulebook's neighbour map (what the custom
    ops carry); ``num_input``, ``num_output``, ``kernel_size``,
    ``identity_offset``, ``out_core_indices`` (the core array of the output
    sites); the pair-list view ``pair_input`` / ``pair_output`` (int32 ``[P]``)
    and ``offset_starts``, derived when first read.
    """

    def __init__(self, rulebook: sc.Rulebook, indices: Optional[torch.Tensor] = None,
                 out_indices: Optional[torch.Tensor] = None, algo: Any = None) -> None:
        self.rulebook = rulebook
        if indices is not None:
            self.__dict__["indices"] = indices  # the cached_property's slot
        if out_indices is not None:
            self.__dict__["out_indices"] = out_indices
        self.algo = algo
        self.voxel_num = None

    # ------------------------------------------------------------ torch views, made once

    @cached_property
    def indices(self) -> torch.Tensor:
        """The layer's input sites, int32 ``[N_in, 1 + D]``."""
        return to_torch(self.rulebook.input_indices)

    @cached_property
    def out_indices(self) -> torch.Tensor:
        """The layer's output sites, int32 ``[N_out, 1 + D]`` (the input's tensor for a subm layer)."""
        if self.rulebook.output_indices is self.rulebook.input_indices:
            return self.indices
        return to_torch(self.rulebook.output_indices)

    @cached_property
    def neighbour_map(self) -> NeighbourMap:
        """The rulebook's `sparsecore.neighbour_map.NeighbourMap` (the kernel backend's own; derived from the
        pairs once on the NumPy backend, memoised by the core)."""
        return neighbour_map_of(self.rulebook, array_module(self.rulebook.input_indices))

    @cached_property
    def output_neighbours(self) -> torch.Tensor:
        """int32 ``[N_out, K]``: the input row feeding output row ``o`` through offset ``k``, or -1."""
        return _marked(to_torch(self.neighbour_map.output_neighbours), self.rulebook, "output")

    @cached_property
    def input_neighbours(self) -> Optional[torch.Tensor]:
        """int32 ``[N_in, K]``: the output row input ``i`` feeds through offset ``k``, or -1; None for a
        symmetric (submanifold) map, whose input side is its output side with the offsets reversed."""
        table = self.neighbour_map.input_neighbours
        return None if table is None else _marked(to_torch(table), self.rulebook, "input")

    @cached_property
    def pair_input(self) -> torch.Tensor:
        """Input rows of the pairs, int32 ``[P]``, grouped by kernel offset (derived when first read)."""
        return to_torch(self.rulebook.pair_input)

    @cached_property
    def pair_output(self) -> torch.Tensor:
        """Output rows of the pairs, int32 ``[P]``, grouped by kernel offset (derived when first read)."""
        return to_torch(self.rulebook.pair_output)

    @cached_property
    def indice_pairs(self) -> torch.Tensor:
        """spconv's Native layout, int32 ``[2, K, N_in]``: row 0 input rows, row 1 output rows of each
        offset's pairs, then -1 (no pair). Made from the pair view when first read."""
        pair_input, pair_output = self.pair_input, self.pair_output
        device = pair_input.device
        counts = torch.tensor(self.rulebook.offset_counts, dtype=torch.int64)
        volume = counts.shape[0]
        offsets = torch.repeat_interleave(torch.arange(volume), counts).to(device)
        starts = torch.tensor(self.rulebook.offset_starts[:-1], dtype=torch.int64, device=device)
        positions = torch.arange(pair_input.shape[0], device=device) - starts[offsets]
        pairs = torch.full((2, volume, self.num_input), -1, dtype=torch.int32, device=device)
        pairs[0, offsets, positions] = pair_input
        pairs[1, offsets, positions] = pair_output
        return pairs

    @property
    def indice_pair_num(self) -> torch.Tensor:
        """Pairs per kernel offset, int32 ``[K]`` (derived from the pair view)."""
        return torch.tensor(self.rulebook.offset_counts, dtype=torch.int32)

    def op_arguments(self) -> tuple[torch.Tensor, Optional[torch.Tensor], list[int], int]:
        """The rulebook arguments of a feature-pass op (`sparsecore.torch.ops`): ``(output_neighbours,
        input_neighbours, kernel_size, identity_offset)``."""
        rulebook = self.rulebook
        return (self.output_neighbours, self.input_neighbours, list(rulebook.geometry.kernel_size),
                int(rulebook.identity_offset))

    def output_sites(self) -> tuple[torch.Tensor, list[int], Any]:
        """``(out_indices, out_spatial_shape, out_core_indices)``: what a layer's output tensor is made on."""
        return self.out_indices, list(self.rulebook.output_spatial_shape), self.rulebook.output_indices

    # ------------------------------------------------------------ read from the rulebook

    @property
    def out_core_indices(self) -> Any:
        """The core (NumPy / CuPy) array of the output sites (the identity of the output's sites)."""
        return self.rulebook.output_indices

    offset_starts = _read("offset_starts", "``K + 1`` ints delimiting each kernel offset's pairs (derived).", list)
    num_input = _read("num_input", "Number of input sites.")
    num_output = _read("num_output", "Number of output sites.")
    identity_offset = _read("identity_offset", "An offset whose pairs are ``i -> i`` for every site, or -1.", int)
    spatial_shape = _read("input_spatial_shape", "The input grid.", list)
    out_spatial_shape = _read("output_spatial_shape", "The output grid.", list)
    kernel_size = _read("geometry.kernel_size", "Per-axis kernel size.", list)
    ksize = kernel_size
    stride = _read("geometry.stride", "Per-axis stride.", list)
    padding = _read("geometry.padding", "Per-axis padding (the one applied; spconv records a subm layer's argument).",
                    list)
    dilation = _read("geometry.dilation", "Per-axis dilation.", list)

    @property
    def is_subm(self) -> bool:
        """True for a submanifold layer."""
        return self.rulebook.geometry.kind == "subm"

    def inverse(self) -> "IndiceData":
        """The rulebook of the inverse conv that undoes this (regular) layer."""
        return IndiceData(sc.inverse_rulebook(self.rulebook), self.out_indices, self.indices, self.algo)

    def __repr__(self) -> str:
        geometry = self.rulebook.geometry.describe()
        return f"IndiceData({geometry}, {self.num_input} -> {self.num_output} sites)"


_RULEBOOK_MARK = "_sparsecore_rulebook"


class _RulebookMark:
    """What a neighbour tensor made by `IndiceData` carries: its rulebook, its side and its version then.

    A copy or a pickle of the tensor carries an empty mark (``rulebook`` None): the rulebook
    stays with the tensors made from it, and a checkpoint does not grow by it.
    """

    __slots__ = ("rulebook", "side", "version")

    def __init__(self, rulebook: Optional[sc.Rulebook] = None, side: str = "", version: int = -1) -> None:
        self.rulebook, self.side, self.version = rulebook, side, version

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_RulebookMark, ())


def _marked(tensor: torch.Tensor, rulebook: sc.Rulebook, side: str) -> torch.Tensor:
    """``tensor``, marked as the ``side`` neighbour table of ``rulebook`` at its current version."""
    setattr(tensor, _RULEBOOK_MARK, _RulebookMark(rulebook, side, tensor._version))
    return tensor


def _mark_of(tensor: Any, side: str) -> Optional[sc.Rulebook]:
    mark = getattr(tensor, _RULEBOOK_MARK, None)
    if not isinstance(mark, _RulebookMark) or mark.rulebook is None or mark.side != side \
            or mark.version != tensor._version:
        return None
    return mark.rulebook


def library_rulebook(output_neighbours: Any, input_neighbours: Any) -> Optional[sc.Rulebook]:
    """The core `sparsecore.Rulebook` whose neighbour tables these tensors are, or None.

    The custom ops receive a rulebook as its neighbour tensors; when they are the
    untouched tensors an `IndiceData` made of one library-built rulebook (both
    sides, or the output side alone for a symmetric map), the op hands that
    rulebook to the core itself: nothing converted, nothing checked, the layouts
    the core memoises on it shared by every pass and layer. A tensor written in
    place since (its version moved), a copy, or any other tensor gives None.
    """
    rulebook = _mark_of(output_neighbours, "output")
    if rulebook is None:
        return None
    if input_neighbours is None:
        return rulebook if rulebook.neighbour_map is not None and rulebook.neighbour_map.symmetric else None
    return rulebook if _mark_of(input_neighbours, "input") is rulebook else None


def _check_table(name: str, table: Any, rows: int, volume: int, limit: int, limit_name: str) -> None:
    if getattr(table, "dtype", None) is None or table.dtype.kind not in "iu" or table.ndim != 2:
        raise TypeError(f"{name} must be an int32 [rows, K] neighbour table, got "
                        f"{getattr(table, 'dtype', type(table).__name__)} with shape {getattr(table, 'shape', None)}")
    if tuple(table.shape) != (rows, volume):
        raise ValueError(f"{name} must have shape [{rows}, {volume}] (rows, kernel volume K), got "
                         f"{tuple(table.shape)}")
    if table.size and (int(table.min()) < -1 or int(table.max()) >= limit):
        bad = int(table.min()) if int(table.min()) < -1 else int(table.max())
        raise ValueError(f"{name} holds {bad}, outside [-1, {limit}) ({limit_name} = {limit}; -1 = no neighbour)")


def checked_rulebook(output_neighbours: Any, input_neighbours: Any, num_input: int,
                     kernel_size: Sequence[int], identity_offset: int) -> sc.PairMap:
    """The rulebook of neighbour tables that are not the library's own, checked whole (core arrays).

    The tables must be a map the library could have built: entries in range, each
    input row used at most once per offset, the input side the exact inverse of
    the output side (for a symmetric map, given as None: the output side with the
    offsets reversed), and the identity offset, if any, ``i -> i`` for every row.
    Masks and row orders are computed, never taken on trust.

    Returns:
        A trusted `sparsecore.PairMap` (what the CPU passes read) whose ``derived``
        slot holds the checked `sparsecore.neighbour_map.NeighbourMap` (what the GPU
        passes read; `sparsecore.neighbour_map.neighbour_map_of` finds it there).

    Raises:
        TypeError, ValueError: naming the table and what is wrong with it.
    """
    xp = array_module(output_neighbours)
    kernel_size = tuple(int(k) for k in kernel_size)
    volume, num_input, num_output = math.prod(kernel_size), int(num_input), int(output_neighbours.shape[0])
    symmetric = input_neighbours is None
    _check_table("output_neighbours", output_neighbours, num_output, volume, num_input, "input rows")
    if symmetric and num_input != num_output:
        raise ValueError(f"input_neighbours is None (a symmetric, submanifold map) but the map has {num_input} input "
                         f"rows and {num_output} output rows; pass the input side of a non-submanifold map")
    if not symmetric:
        _check_table("input_neighbours", input_neighbours, num_input, volume, num_output, "output rows")
    identity_offset = int(identity_offset)
    if identity_offset >= 0 and (identity_offset >= volume or num_input != num_output or not bool(
            (output_neighbours[:, identity_offset] == xp.arange(num_output, dtype=output_neighbours.dtype)).all())):
        raise ValueError(f"identity_offset {identity_offset} is not an offset pairing every row with itself in "
                         "output_neighbours; pass -1 for a map without one")
    outputs = xp.ascontiguousarray(output_neighbours, dtype=xp.int32)
    provisional = NeighbourMap(outputs, row_masks(xp, outputs), None, None, None, None, num_output, num_output,
                               kernel_size, -1, True)
    pair_input, pair_output, starts = pairs_from_neighbour_map(xp, provisional)
    both = neighbour_map_from_pairs(xp, pair_input, pair_output, starts, num_input, num_output, kernel_size,
                                    identity_offset, symmetric=False)
    expected = outputs[:, ::-1] if symmetric else input_neighbours
    if int((both.input_neighbours >= 0).sum()) != int(pair_input.shape[0]) or \
            not bool((both.input_neighbours == expected).all()):
        raise ValueError(
            "output_neighbours pairs an input row with two output rows through one offset, or does not match "
            + ("itself read backwards (input_neighbours None declares a symmetric, submanifold map)" if symmetric
               else "input_neighbours (each must be the other read backwards)"))
    checked = NeighbourMap(outputs, both.output_masks, None, None, None, None, num_input, num_output, kernel_size,
                           identity_offset, True) if symmetric else both
    pairs = sc.PairMap(pair_input, pair_output, starts, num_input, num_output, kernel_size, identity_offset,
                       trusted=True)
    pairs.derived["neighbour_map"] = checked
    return pairs


class IndiceDict(dict):
    """A SparseConvTensor's ``indice_dict``: ``indice_key`` -> `IndiceData`, plus ``geometry_cache``.

    ``geometry_cache`` holds the canonical entries of the core cache (rulebooks
    by input sites and geometry, see `sparsecore.layer_geometry`) the layers
    before this tensor built; it is handed on copy-on-write like the keys.
    Compares, copies and pickles as the plain dict of its keys.
    """

    def __init__(self, entries: Any = (), geometry_cache: Optional[GeometryCache] = None) -> None:
        super().__init__(entries)
        self.geometry_cache = GeometryCache() if geometry_cache is None else geometry_cache

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # canonical entries name sites by object identity, which a pickle cannot keep
        return (dict, (dict(self),))


def canonical_cache(indice_dict: Any) -> GeometryCache:
    """The canonical part of ``indice_dict``'s core cache (empty for a plain dict)."""
    cache = getattr(indice_dict, "geometry_cache", None)
    return cache if isinstance(cache, GeometryCache) else GeometryCache()


def input_cache(indice_dict: Any, indice_key: Optional[str]) -> GeometryCache:
    """The core cache of a tensor's ``indice_dict``: its `IndiceData` keys and canonical entries.

    Raises:
        TypeError: an entry under ``indice_key`` that is not an `IndiceData`.
    """
    saved = indice_dict.get(indice_key) if indice_key is not None else None
    if saved is not None and not isinstance(saved, IndiceData):
        raise TypeError(f"indice_dict[{indice_key!r}] is a {type(saved).__name__}, not a sparsecore IndiceData")
    aliases = {key: data.rulebook for key, data in indice_dict.items() if isinstance(data, IndiceData)}
    return GeometryCache.from_aliases(aliases, canonical_cache(indice_dict))


def layer_data(rulebook: sc.Rulebook, indices: torch.Tensor, saved: Any, kind: str, algo: Any,
               neighbour_tensors: bool) -> IndiceData:
    """The `IndiceData` of a layer's rulebook, found for input sites ``indices`` (torch).

    The one ``saved`` under the layer's key when it is this rulebook on these sites; for an
    inverse conv (``kind``), a view back onto the paired layer's input sites; else a new one.
    Its output sites, and its neighbour tensors if asked, are made here (eagerly: outside
    compiled graphs).
    """
    if isinstance(saved, IndiceData) and saved.rulebook is rulebook and saved.indices is indices:
        data = saved
    elif kind == "inverse":
        data = IndiceData(rulebook, indices, saved.indices, algo)
        paired = saved.__dict__.get("neighbour_map")  # the paired layer's map, read backwards: nothing derived
        if paired is not None and rulebook.input_indices is saved.rulebook.output_indices:
            data.__dict__["neighbour_map"] = paired.swapped()
    else:
        data = IndiceData(rulebook, indices, indices if kind == "subm" else None, algo)
    _ = data.out_indices
    if neighbour_tensors:
        _ = (data.output_neighbours, data.input_neighbours)
    return data


def output_indice_dict(indice_dict: Any, cache: GeometryCache, indice_key: Optional[str], kind: str,
                       data: IndiceData) -> IndiceDict:
    """The output's ``indice_dict``: a copy of the input's with the layer's key added (not an inverse conv's,
    nor a key already there) and the canonical entries of ``cache`` (spconv's copy-on-write)."""
    out = IndiceDict(indice_dict, cache)
    if indice_key is not None and kind != "inverse" and indice_key not in out:
        out[indice_key] = data
    return out
