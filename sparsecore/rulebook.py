"""Rulebooks (kernel maps): which input row feeds which output row through which kernel offset.

A `Rulebook` is the geometry half of a sparse convolution: it depends only on
integer coordinates, is never differentiated, and is reused by every feature
pass of a layer (forward, both backward products) and by layers that share an
``indice_key``. Builders:

- `build_rulebook` for submanifold (``subm``), strided (``regular``) and
  ``transposed`` geometries, and `build_pool_rulebook` for pooling windows;
- `inverse_rulebook`, the reverse of a saved regular rulebook, which restores
  the paired layer's input sites in their original order.

Output sites of the subm builder are the input sites in input order; those of
the regular and transposed builders are sorted by (batch, coordinates).

One rulebook, two views of its pairs: a `PairMap` (pair lists grouped by
offset, `sparsecore.pair_map`) and a `NeighbourMap` (per-row tables,
`sparsecore.neighbour_map`). A rulebook stores the view its backend computes
natively and derives the other when first asked (memoised): the NumPy
backend's compiled builders write pairs (its tile plans are made from them),
the kernel backend's write neighbour maps (`sparsecore._kernel_builds`), so a
GPU network that never asks for pair lists never reads its pair counts back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from . import _kernel_builds
from .interop import INT32_MAX, as_batch_size, as_indices, as_spatial_shape, check_indices_in_range
from .backends import ArrayBackend, backend_for
from .geometry import ConvGeometry, PerAxis
from .hashing import check_packable, key_strides, pack_keys, unpack_keys
from .memory_budget import check_rulebook_build
from .neighbour_map import NeighbourMap
from .pair_map import PairMap
from .threads import serialised_kernels

__all__ = [
    "PairMap",
    "Rulebook",
    "build_rulebook",
    "build_pool_rulebook",
    "inverse_rulebook",
]


def _from_pairs(name: str, doc: str) -> property:
    """A read-only `Rulebook` property that reads ``name`` of its `PairMap` (derived if not stored)."""
    return property(lambda rulebook: getattr(rulebook.pair_map, name), doc=doc)


def _from_stored(name: str, doc: str) -> property:
    """A read-only `Rulebook` property that reads ``name`` of the stored view: never derives pairs."""
    return property(lambda rulebook: getattr(rulebook._stored, name), doc=doc)


@dataclass(frozen=True, eq=False)
class Rulebook:
    """A layer's pairs with the sites and grids it maps between: the one rulebook form.

    A pair ``(i, o)`` of offset ``k`` means ``output[o] += features[i] @ W_k``
    where ``W_k = weight[:, k, :].T`` with the weight's kernel axes flattened
    row-major. Within one offset, input rows are unique and output rows are
    unique (the map is injective), so a per-offset scatter needs no atomics.

    The pairs are stored once, as the builder's backend computes them: a
    `PairMap` (NumPy backend) or a `NeighbourMap` (kernel backend). The other
    view is derived on first use and memoised (`pair_map`, and
    `sparsecore.neighbour_map.neighbour_map_of`); ``num_input``, ``num_output``,
    ``kernel_volume``, ``identity_offset``, ``kernel_size`` and the sites never
    derive anything.

    Attributes:
        geometry: the layer geometry the rulebook was built for.
        input_spatial_shape: grid shape of the input sites.
        output_spatial_shape: grid shape of the output sites.
        batch_size: number of batch elements.
        input_indices: int32 ``[N_in, 1 + D]``, the sites it was built from.
        output_indices: int32 ``[N_out, 1 + D]``, the output sites.
        stored_pairs: the `PairMap`, when the builder wrote pairs; else None.
        stored_map: the `NeighbourMap`, when the builder wrote a map; else None.
        capacity: a capacity build's `sparsecore.capacity.CapacityStatus` (its count and site
            checks, on the device), or None (exact mode, or nothing to report).
        exact: a capacity build on the NumPy backend: the exact rulebook of the true rows, on
            which the CPU passes run (the padded rows sliced off before, added after: the true
            rows are bitwise those of exact mode); else None.
    """

    geometry: ConvGeometry
    input_spatial_shape: tuple[int, ...]
    output_spatial_shape: tuple[int, ...]
    batch_size: int
    input_indices: Any = dataclasses.field(repr=False)
    output_indices: Any = dataclasses.field(repr=False)
    stored_pairs: PairMap | None = dataclasses.field(default=None, repr=False)
    stored_map: NeighbourMap | None = dataclasses.field(default=None, repr=False)
    capacity: Any = dataclasses.field(default=None, repr=False)
    exact: "Rulebook | None" = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.stored_pairs is None and self.stored_map is None:
            raise ValueError("a Rulebook stores its pairs as a PairMap or a NeighbourMap; got neither")

    @property
    def _stored(self) -> PairMap | NeighbourMap:
        return self.stored_map if self.stored_map is not None else self.stored_pairs

    @property
    def pair_map(self) -> PairMap:
        """The pairs grouped by kernel offset (what the CPU passes read): stored, or derived from the
        neighbour map when first read (one read back of the offset counts on the GPU; memoised)."""
        if self.stored_pairs is not None:
            return self.stored_pairs
        derived = self.stored_map.derived
        if "pair_map" not in derived:
            # the [K, N_out] view of the table compacted row by row with the backend's compaction
            # (one read back on the GPU: the per-offset counts): offsets in order, output rows
            # increasing within an offset, as `pairs_from_neighbour_map`, the reference, lists them
            table = self.stored_map.output_neighbours
            output_rows, input_rows, starts = backend_for(table).compact_pairs(table.T)
            derived["pair_map"] = PairMap(input_rows, output_rows, starts, self.num_input, self.num_output,
                                          tuple(self.geometry.kernel_size), self.identity_offset, trusted=True)
        return derived["pair_map"]

    @property
    def neighbour_map(self) -> NeighbourMap | None:
        """The per-row view (what the GPU's fused kernels read): stored, or the one
        `sparsecore.neighbour_map.neighbour_map_of` derived from the pairs; None before that."""
        if self.stored_map is not None:
            return self.stored_map
        return self.stored_pairs.derived.get("neighbour_map")

    pair_input = _from_pairs("pair_input", "int32 ``[P]`` input rows, grouped by kernel offset.")
    pair_output = _from_pairs("pair_output", "int32 ``[P]`` output rows, grouped by kernel offset.")
    offset_starts = _from_pairs(
        "offset_starts", "``K + 1`` ints; offset ``k`` owns pairs ``[offset_starts[k], offset_starts[k + 1])``.")
    num_pairs = _from_pairs("num_pairs", "Total number of (input, output) pairs over all offsets.")
    identity_offset = _from_stored(
        "identity_offset", "An offset whose pairs are ``i -> i`` for every row (a subm kernel's centre), or -1.")
    num_input = _from_stored("num_input", "Number of input sites.")
    num_output = _from_stored("num_output", "Number of output sites.")

    @property
    def kernel_volume(self) -> int:
        """Number of kernel offsets."""
        return self.geometry.kernel_volume

    @property
    def kernel_size(self) -> tuple[int, ...]:
        """Per-axis kernel size of the geometry."""
        return self.geometry.kernel_size

    @property
    def offset_counts(self) -> tuple[int, ...]:
        """Pairs per kernel offset."""
        starts = self.pair_map.offset_starts
        return tuple(b - a for a, b in zip(starts[:-1], starts[1:]))

    def pairs(self, offset: int) -> tuple[Any, Any]:
        """``(input_rows, output_rows)`` int32 arrays of one kernel offset."""
        return self.pair_map.pairs(offset)


def _made_rulebook(geometry: ConvGeometry, input_shape: tuple[int, ...], output_shape: tuple[int, ...],
                   batch: int, input_indices: Any, output_indices: Any, pair_input: Any, pair_output: Any,
                   starts: tuple[int, ...], identity_offset: int = -1) -> Rulebook:
    """A `Rulebook` the library built (its pairs trusted: no range check, no host synchronisation)."""
    pair_map = PairMap(pair_input, pair_output, starts, int(input_indices.shape[0]), int(output_indices.shape[0]),
                       geometry.kernel_size, identity_offset, trusted=True)
    return Rulebook(geometry, input_shape, output_shape, batch, input_indices, output_indices, stored_pairs=pair_map)


def _prepare(indices: Any, spatial_shape: Any, batch_size: Any, ndim: int) -> tuple[Any, tuple[int, ...], int]:
    shape = as_spatial_shape(spatial_shape)
    if len(shape) != ndim:
        raise ValueError(
            f"spatial_shape {shape} has {len(shape)} axes but the layer has {ndim} "
            "spatial dimensions"
        )
    return as_indices(indices, ndim), shape, as_batch_size(batch_size)


def _concatenate_pairs(xp: Any, pieces: list[tuple[Any, Any]]) -> tuple[Any, Any, tuple[int, ...]]:
    starts = [0]
    for input_rows, _ in pieces:
        starts.append(starts[-1] + int(input_rows.shape[0]))
    # one concatenation per array (not a copy per offset): few launches on the GPU
    pair_input = xp.concatenate([input_rows.astype(xp.int32, copy=False) for input_rows, _ in pieces])
    pair_output = xp.concatenate([output_rows.astype(xp.int32, copy=False) for _, output_rows in pieces])
    return pair_input, pair_output, tuple(starts)


def _submanifold(indices: Any, shape: tuple[int, ...], batch: int, geometry: ConvGeometry,
                 backend: ArrayBackend, assume_unique: bool) -> Rulebook:
    xp = backend.xp
    reach = tuple(d * (k - 1) // 2 for k, d in zip(geometry.kernel_size, geometry.dilation))
    keys = pack_keys(indices, shape, batch, margin=reach, assume_in_range=True, backend=backend)
    rows = xp.arange(indices.shape[0], dtype=xp.int64)
    table, duplicate = backend.hash_build(keys, rows, check_duplicates=not assume_unique)
    if duplicate is not None:
        _kernel_builds.raise_duplicate(indices, duplicate, "indices")
    sorted_keys, sorted_rows = backend.hash_items(table)
    strides = key_strides(shape, reach)[1:]
    offsets = geometry.kernel_offsets().astype("int64") * geometry.dilation - reach
    deltas = [int(sum(int(o) * s for o, s in zip(offset, strides))) for offset in offsets]
    volume = geometry.kernel_volume
    centre = volume // 2
    last_size, last_step = geometry.kernel_size[-1], geometry.dilation[-1]
    fused = getattr(backend, "submanifold_pairs", None)
    if fused is not None:  # the NumPy backend: compiled passes, the same pairs in the same order
        pair_input, pair_output, starts = fused(table, xp.asarray(deltas[:centre], dtype=xp.int64),
                                                last_size, last_step)
        return _made_rulebook(geometry, shape, shape, batch, indices, indices, pair_input, pair_output,
                              starts, identity_offset=centre)
    # Any other backend, through the primitive protocol: offsets before the centre,
    # looked up in one pass into a [centre, N] table of input rows, compacted in one pass.
    found = backend.hash_lookup_offsets(table, sorted_keys, deltas[:centre])
    columns, found_rows, row_starts = backend.compact_pairs(found)
    matched_rows = xp.take(sorted_rows, columns).astype(xp.int32)
    pieces: list[tuple[Any, Any] | None] = [None] * volume
    for offset in range(centre):
        start, stop = row_starts[offset], row_starts[offset + 1]
        input_rows, output_rows = found_rows[start:stop], matched_rows[start:stop]
        # offsets k and K-1-k are mirror images: (i, o) at k is (o, i) at K-1-k
        pieces[offset] = (input_rows, output_rows)
        pieces[volume - 1 - offset] = (output_rows, input_rows)
    identity = xp.arange(indices.shape[0], dtype=xp.int32)
    pieces[centre] = (identity, identity)
    pair_input, pair_output, starts = _concatenate_pairs(xp, pieces)  # type: ignore[arg-type]
    return _made_rulebook(geometry, shape, shape, batch, indices, indices, pair_input, pair_output,
                          starts, identity_offset=centre)


def _output_shape(shape: tuple[int, ...], batch: int, geometry: ConvGeometry) -> tuple[int, ...]:
    out_shape = geometry.output_spatial_shape(shape)
    if max(out_shape) > INT32_MAX:
        raise ValueError(
            f"the output spatial shape {out_shape} of this {geometry.describe()} on input "
            f"spatial shape {shape} has coordinates beyond the int32 range of indices "
            f"({INT32_MAX}); use a smaller grid or a coarser voxel size"
        )
    check_packable(out_shape, batch)
    return out_shape


def _strided(indices: Any, shape: tuple[int, ...], batch: int, geometry: ConvGeometry,
             backend: ArrayBackend, assume_unique: bool) -> Rulebook:
    xp = backend.xp
    out_shape = _output_shape(shape, batch, geometry)
    if not assume_unique and indices.shape[0] > 1:
        keys = pack_keys(indices, shape, batch, assume_in_range=True, backend=backend)
        _, duplicate = backend.hash_build(keys, xp.arange(indices.shape[0], dtype=xp.int64))
        if duplicate is not None:
            _kernel_builds.raise_duplicate(indices, duplicate, "indices")
    pair_input, candidate_keys, starts = backend.conv_candidate_pairs(indices, geometry, out_shape)
    output_keys, inverse = backend.unique_inverse(candidate_keys)
    output_indices = unpack_keys(output_keys, out_shape, backend=backend)
    return _made_rulebook(geometry, shape, out_shape, batch, indices, output_indices,
                          pair_input, inverse.astype(xp.int32), starts)


def _mapped(indices: Any, shape: tuple[int, ...], batch: int, geometry: ConvGeometry,
            backend: ArrayBackend, assume_unique: bool) -> Rulebook:
    """A rulebook stored as the neighbour map a kernel backend builds (`sparsecore._kernel_builds`)."""
    if geometry.kind == "subm":
        neighbour_map = _kernel_builds.submanifold_neighbour_map(indices, shape, batch, geometry, backend,
                                                                 check=not assume_unique)
        return Rulebook(geometry, shape, shape, batch, indices, indices, stored_map=neighbour_map)
    out_shape = _output_shape(shape, batch, geometry)
    output_indices, neighbour_map = _kernel_builds.strided_neighbour_map(indices, shape, out_shape, batch, geometry,
                                                                         backend, check=not assume_unique)
    return Rulebook(geometry, shape, out_shape, batch, indices, output_indices, stored_map=neighbour_map)


def build_rulebook(indices: Any, spatial_shape: Sequence[int], batch_size: int,
                   geometry: ConvGeometry, *, assume_unique: bool = False,
                   backend: ArrayBackend | None = None, capacity: int | None = None,
                   layer: str = "") -> Rulebook:
    """Builds the rulebook of a subm, regular or transposed layer.

    Args:
        indices: integer ``[N, 1 + D]`` sites (NumPy or CuPy), batch first.
        spatial_shape: the input grid, ``D`` positive ints.
        batch_size: number of batch elements.
        geometry: a `ConvGeometry` of kind ``"subm"``, ``"regular"`` or ``"transposed"``.
        assume_unique: skip the range and duplicate-site checks, for sites the
            library produced itself (outputs of a previous layer).
        backend: the primitives to run on; by default the backend of ``indices``.
        capacity: None (exact mode), or the output rows of a capacity build
            (`sparsecore.capacity`): a strided or transposed layer's outputs are allocated at
            ``capacity`` rows, padded, with no read back; rows of ``indices`` whose batch index
            is -1 are padding (last). A submanifold layer's output rows are its input's.
        layer: the layer's name in a capacity build's `CapacityStatus`.

    Returns:
        The `Rulebook`.

    Raises:
        ValueError: on out-of-range or duplicate sites, mismatched dimensions, an
            empty output grid, keys that overflow int64, or an inverse geometry.
        MemoryBudgetError: the build would allocate beyond `sparsecore.memory_budget`'s budget.
    """
    if not isinstance(geometry, ConvGeometry):
        raise TypeError(f"geometry must be a ConvGeometry, got {type(geometry).__name__}")
    indices, shape, batch = _prepare(indices, spatial_shape, batch_size, geometry.ndim)
    backend = backend if backend is not None else backend_for(indices)
    maps = _kernel_builds.builds_neighbour_maps(backend)
    if not assume_unique and not maps and capacity is None:  # a kernel backend checks the sites in its build
        check_indices_in_range(indices, shape, batch)
    check_rulebook_build(geometry, indices, shape, batch)  # sparsecore.memory_budget
    if capacity is not None and geometry.kind in ("subm", "regular", "transposed"):
        from ._capacity_builds import capacity_rulebook

        out_shape = shape if geometry.kind == "subm" else _output_shape(shape, batch, geometry)
        exact = None if maps else (lambda sites, checked: build_rulebook(
            sites, shape, batch, geometry, assume_unique=checked, backend=backend))
        return capacity_rulebook(Rulebook, indices, shape, out_shape, batch, geometry, backend, assume_unique, int(capacity),
                                 layer or geometry.describe(), exact)
    if geometry.kind in ("subm", "regular", "transposed"):
        if maps:
            return _mapped(indices, shape, batch, geometry, backend, assume_unique)
        build = _submanifold if geometry.kind == "subm" else _strided
        with serialised_kernels(indices):  # numba's workqueue layer: one thread at a time (sparsecore.threads)
            return build(indices, shape, batch, geometry, backend, assume_unique)
    raise ValueError(
        "an inverse conv reverses the rulebook of a regular conv: build it with "
        "inverse_rulebook(saved_rulebook), not build_rulebook"
    )


def build_pool_rulebook(indices: Any, spatial_shape: Sequence[int], batch_size: int,
                        kernel_size: PerAxis, stride: PerAxis | None = None, padding: PerAxis = 0,
                        dilation: PerAxis = 1, *, subm: bool = False,
                        assume_unique: bool = False,
                        backend: ArrayBackend | None = None, capacity: int | None = None,
                        layer: str = "") -> Rulebook:
    """The rulebook of a pooling window (stride defaults to the kernel size, as in spconv).

    With ``subm=True`` the outputs are the input sites (odd kernels only). ``capacity`` and
    ``layer``: a capacity build, as `build_rulebook`'s.
    """
    ndim = as_indices(indices, len(as_spatial_shape(spatial_shape))).shape[1] - 1
    geometry = ConvGeometry.create(
        ndim, kernel_size, kernel_size if stride is None else stride, padding, dilation,
        kind="subm" if subm else "regular",
    )
    return build_rulebook(indices, spatial_shape, batch_size, geometry, assume_unique=assume_unique,
                          backend=backend, capacity=capacity, layer=layer)


def inverse_rulebook(rulebook: Rulebook) -> Rulebook:
    """The reverse of a regular (strided) rulebook.

    The result maps the regular layer's output sites back onto its input sites:
    pairs swapped, offsets kept (so the same kernel offset and weight slice are
    used), and ``output_indices`` equal to the paired layer's ``input_indices``,
    same rows in the same order.

    Raises:
        ValueError: when ``rulebook`` is not of kind ``"regular"``.
    """
    if rulebook.geometry.kind != "regular":
        raise ValueError(
            f"an inverse conv reverses a regular (strided) sparse conv or pool, but the "
            f"rulebook under this indice_key is a {rulebook.geometry.describe()}; pair the "
            "inverse conv with a SparseConv / SparseMaxPool layer's indice_key"
        )
    geometry = dataclasses.replace(rulebook.geometry, kind="inverse")
    if rulebook.stored_map is not None:  # the regular map with its sides exchanged
        return Rulebook(geometry, rulebook.output_spatial_shape, rulebook.input_spatial_shape, rulebook.batch_size,
                        rulebook.output_indices, rulebook.input_indices, stored_map=rulebook.stored_map.swapped(),
                        capacity=rulebook.capacity)
    inverse = _made_rulebook(geometry, rulebook.output_spatial_shape, rulebook.input_spatial_shape,
                             rulebook.batch_size, rulebook.output_indices, rulebook.input_indices,
                             rulebook.pair_output, rulebook.pair_input, rulebook.offset_starts)
    if rulebook.capacity is None and rulebook.exact is None:
        return inverse
    return dataclasses.replace(inverse, capacity=rulebook.capacity,
                               exact=None if rulebook.exact is None else inverse_rulebook(rulebook.exact))
