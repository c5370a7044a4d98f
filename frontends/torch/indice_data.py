"""`IndiceData` (a layer's rulebook under spconv's names) and `IndiceDict` (a tensor's ``indice_dict``).

`IndiceData` is a view over one core `sparsecore.Rulebook`: spconv's attribute
names (``indices``, ``out_indices``, ``spatial_shape``, ``out_spatial_shape``,
``is_subm``, ``ksize``, ``stride``, ``padding``, ``dilation``, ``algo``,
``indice_pairs``, ``indice_pair_num``, ``voxel_num``) and the ones the custom ops read
(``pair_input``, ``pair_output``, ``offset_starts``, ``num_input``,
``num_output``, ``kernel_size``, ``identity_offset``) are read from the
rulebook; its arrays become torch tensors zero-copy (DLPack) when first read,
and that tensor is kept (at most one torch view of each array).

`IndiceDict` is the ``dict`` a SparseConvTensor holds as ``indice_dict``: keys
to `IndiceData`, as in spconv, plus the canonical part of the core's
`sparsecore.layer_geometry.GeometryCache` (rulebooks found by the identity of
their input sites and their geometry, with no key) as ``geometry_cache``. A
plain ``dict`` (given by a user, or ``indice_dict.copy()``) works too: it just
carries no canonical entries.
"""

from __future__ import annotations

from functools import cached_property
from operator import attrgetter
from typing import Any, Callable, Optional

import torch

import sparsecore as sc
from sparsecore.layer_geometry import GeometryCache

from ._convert import to_torch

__all__ = ["IndiceData", "IndiceDict", "canonical_cache", "library_pair_map"]


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
    ``indice_pair_num`` (int32 ``[K]`` pairs per offset), ``voxel_num`` (None).
    sparsecore's own: ``rulebook``, ``pair_input`` / ``pair_output`` (int32 ``[P]``
    torch views of its pairs), ``offset_starts``, ``num_input``, ``num_output``,
    ``kernel_size``, ``identity_offset``, ``out_core_indices`` (the core array of
    the output sites). spconv's ``indice_pairs`` (its ``[2, K, N_in]`` Native
    layout, -1 = no pair) is made from the pairs when first read.
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
    def pair_input(self) -> torch.Tensor:
        """Input rows of the pairs, int32 ``[P]``, grouped by kernel offset."""
        return _marked(to_torch(self.rulebook.pair_input), self.rulebook.pair_map, "input")

    @cached_property
    def pair_output(self) -> torch.Tensor:
        """Output rows of the pairs, int32 ``[P]``, grouped by kernel offset."""
        return _marked(to_torch(self.rulebook.pair_output), self.rulebook.pair_map, "output")

    @cached_property
    def indice_pairs(self) -> torch.Tensor:
        """spconv's Native layout, int32 ``[2, K, N_in]``: row 0 input rows, row 1 output rows of each
        offset's pairs, then -1 (no pair). Made from the pair tensors when first read."""
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
        """Pairs per kernel offset, int32 ``[K]``."""
        return torch.tensor(self.rulebook.offset_counts, dtype=torch.int32)

    # ------------------------------------------------------------ read from the rulebook

    @property
    def out_core_indices(self) -> Any:
        """The core (NumPy / CuPy) array of the output sites (the identity of the output's sites)."""
        return self.rulebook.output_indices

    offset_starts = _read("offset_starts", "``K + 1`` ints delimiting each kernel offset's pairs.", list)
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
        return (f"IndiceData({self.rulebook.geometry.describe()}, {self.num_input} -> {self.num_output} "
                f"sites, {self.rulebook.num_pairs} pairs)")


_PAIR_MAP_MARK = "_sparsecore_pair_map"


class _PairMapMark:
    """What a pair tensor made by `IndiceData` carries: its map, its role and its version then.

    A copy or a pickle of the tensor carries an empty mark (``pair_map`` None): the map
    stays with the tensors made from it, and a checkpoint does not grow by it.
    """

    __slots__ = ("pair_map", "role", "version")

    def __init__(self, pair_map: Optional[sc.PairMap] = None, role: str = "", version: int = -1) -> None:
        self.pair_map, self.role, self.version = pair_map, role, version

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return (_PairMapMark, ())


def _marked(tensor: torch.Tensor, pair_map: sc.PairMap, role: str) -> torch.Tensor:
    """``tensor``, marked as the ``role`` pair view of ``pair_map`` at its current version."""
    setattr(tensor, _PAIR_MAP_MARK, _PairMapMark(pair_map, role, tensor._version))
    return tensor


def library_pair_map(pair_input: Any, pair_output: Any) -> Optional[sc.PairMap]:
    """The core `sparsecore.PairMap` whose pair views these two tensors are, or None.

    The custom ops receive a rulebook as its pair tensors; when both are the
    untouched views an `IndiceData` made of one library-built map, the op can
    use that map itself (its pairs already checked, the CPU neighbour tables it
    memoises shared by every pass and layer) instead of a fresh one. A tensor
    written in place since (its version moved), or any other tensor, gives None.
    """
    marks = [getattr(tensor, _PAIR_MAP_MARK, None) for tensor in (pair_input, pair_output)]
    if not all(isinstance(mark, _PairMapMark) and mark.pair_map is not None for mark in marks):
        return None
    input_mark, output_mark = marks
    if (input_mark.pair_map is not output_mark.pair_map or (input_mark.role, output_mark.role) != ("input", "output")
            or input_mark.version != pair_input._version or output_mark.version != pair_output._version):
        return None
    return input_mark.pair_map


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
