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
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from .interop import INT32_MAX, as_batch_size, as_indices, as_spatial_shape, check_indices_in_range
from .backends import ArrayBackend, backend_for
from .geometry import ConvGeometry, PerAxis
from .hashing import check_packable, key_strides, pack_keys, unpack_keys
from .memory_budget import check_rulebook_build
from .threads import serialised_kernels

__all__ = [
    "PairMap",
    "Rulebook",
    "build_rulebook",
    "build_pool_rulebook",
    "inverse_rulebook",
]


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


def _read_from_pair_map(name: str, doc: str) -> property:
    """A read-only `Rulebook` property that reads ``name`` of its `PairMap`."""
    return property(lambda rulebook: getattr(rulebook.pair_map, name), doc=doc)


@dataclass(frozen=True, eq=False)
class Rulebook:
    """A layer's `PairMap` with the sites and grids it maps between: the one rulebook form.

    A pair ``(i, o)`` of offset ``k`` means ``output[o] += features[i] @ W_k``
    where ``W_k = weight[:, k, :].T`` with the weight's kernel axes flattened
    row-major. Within one offset, input rows are unique and output rows are
    unique (the map is injective), so a per-offset scatter needs no atomics.

    Attributes:
        geometry: the layer geometry the rulebook was built for.
        input_spatial_shape: grid shape of the input sites.
        output_spatial_shape: grid shape of the output sites.
        batch_size: number of batch elements.
        input_indices: int32 ``[N_in, 1 + D]``, the sites it was built from.
        output_indices: int32 ``[N_out, 1 + D]``, the output sites.
        pair_map: the pairs, grouped by kernel offset (what the feature passes
            read); ``pair_input``, ``pair_output``, ``offset_starts``,
            ``identity_offset``, ``num_pairs``, ``kernel_volume``,
            ``offset_counts`` and ``pairs(k)`` read it.
    """

    geometry: ConvGeometry
    input_spatial_shape: tuple[int, ...]
    output_spatial_shape: tuple[int, ...]
    batch_size: int
    input_indices: Any = dataclasses.field(repr=False)
    output_indices: Any = dataclasses.field(repr=False)
    pair_map: PairMap = dataclasses.field(repr=False)

    pair_input = _read_from_pair_map("pair_input", "int32 ``[P]`` input rows, grouped by kernel offset.")
    pair_output = _read_from_pair_map("pair_output", "int32 ``[P]`` output rows, grouped by kernel offset.")
    offset_starts = _read_from_pair_map(
        "offset_starts", "``K + 1`` ints; offset ``k`` owns pairs ``[offset_starts[k], offset_starts[k + 1])``.")
    identity_offset = _read_from_pair_map(
        "identity_offset", "An offset whose pairs are ``i -> i`` for every row (a subm kernel's centre), or -1.")
    num_input = _read_from_pair_map("num_input", "Number of input sites.")
    num_output = _read_from_pair_map("num_output", "Number of output sites.")
    num_pairs = _read_from_pair_map("num_pairs", "Total number of (input, output) pairs over all offsets.")
    kernel_volume = _read_from_pair_map("kernel_volume", "Number of kernel offsets.")

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
    return Rulebook(geometry, input_shape, output_shape, batch, input_indices, output_indices, pair_map)


def _raise_duplicate(indices: Any, rows: tuple[int, int], name: str) -> None:
    first, second = sorted(rows)
    raise ValueError(
        f"{name} contains duplicate sites: rows {first} and {second} are both "
        f"{indices[first].tolist()}. Each active site must appear once; merge duplicate "
        "points first (for example with sparsecore.voxelize, or by summing their features)"
    )


def _prepare(indices: Any, spatial_shape: Any, batch_size: Any, ndim: int,
             trusted: bool) -> tuple[Any, tuple[int, ...], int]:
    shape = as_spatial_shape(spatial_shape)
    if len(shape) != ndim:
        raise ValueError(
            f"spatial_shape {shape} has {len(shape)} axes but the layer has {ndim} "
            "spatial dimensions"
        )
    batch = as_batch_size(batch_size)
    indices = as_indices(indices, ndim)
    if not trusted:
        check_indices_in_range(indices, shape, batch)
    return indices, shape, batch


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
        _raise_duplicate(indices, duplicate, "indices")
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
    # Offsets before the centre, looked up in one pass into a [centre, N] table
    # of input rows, compacted in one pass.
    found = backend.hash_lookup_offsets(table, sorted_keys, deltas[:centre])
    columns, found_rows, row_starts = backend.compact_pairs(found)
    mirrored = getattr(backend, "mirrored_pairs", None)
    if mirrored is not None:  # the kernel backend: the pairs below the centre, mirrored, in one launch
        pair_input, pair_output, starts = mirrored(found_rows, columns, sorted_rows, row_starts, indices.shape[0])
        return _made_rulebook(geometry, shape, shape, batch, indices, indices, pair_input, pair_output,
                              starts, identity_offset=centre)
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


def _strided(indices: Any, shape: tuple[int, ...], batch: int, geometry: ConvGeometry,
             backend: ArrayBackend, assume_unique: bool) -> Rulebook:
    xp = backend.xp
    out_shape = geometry.output_spatial_shape(shape)
    if max(out_shape) > INT32_MAX:
        raise ValueError(
            f"the output spatial shape {out_shape} of this {geometry.describe()} on input "
            f"spatial shape {shape} has coordinates beyond the int32 range of indices "
            f"({INT32_MAX}); use a smaller grid or a coarser voxel size"
        )
    check_packable(out_shape, batch)
    if not assume_unique and indices.shape[0] > 1:
        keys = pack_keys(indices, shape, batch, assume_in_range=True, backend=backend)
        _, duplicate = backend.hash_build(keys, xp.arange(indices.shape[0], dtype=xp.int64))
        if duplicate is not None:
            _raise_duplicate(indices, duplicate, "indices")
    pair_input, candidate_keys, starts = backend.conv_candidate_pairs(indices, geometry, out_shape)
    output_keys, inverse = backend.unique_inverse(candidate_keys)
    output_indices = unpack_keys(output_keys, out_shape, backend=backend)
    return _made_rulebook(geometry, shape, out_shape, batch, indices, output_indices,
                          pair_input, inverse.astype(xp.int32), starts)


def build_rulebook(indices: Any, spatial_shape: Sequence[int], batch_size: int,
                   geometry: ConvGeometry, *, assume_unique: bool = False,
                   backend: ArrayBackend | None = None) -> Rulebook:
    """Builds the rulebook of a subm, regular or transposed layer.

    Args:
        indices: integer ``[N, 1 + D]`` sites (NumPy or CuPy), batch first.
        spatial_shape: the input grid, ``D`` positive ints.
        batch_size: number of batch elements.
        geometry: a `ConvGeometry` of kind ``"subm"``, ``"regular"`` or ``"transposed"``.
        assume_unique: skip the range and duplicate-site checks, for sites the
            library produced itself (outputs of a previous layer).
        backend: the primitives to run on; by default the backend of ``indices``.

    Returns:
        The `Rulebook`.

    Raises:
        ValueError: on out-of-range or duplicate sites, mismatched dimensions, an
            empty output grid, keys that overflow int64, or an inverse geometry.
        MemoryBudgetError: the build would allocate beyond `sparsecore.memory_budget`'s budget.
    """
    if not isinstance(geometry, ConvGeometry):
        raise TypeError(f"geometry must be a ConvGeometry, got {type(geometry).__name__}")
    indices, shape, batch = _prepare(indices, spatial_shape, batch_size, geometry.ndim, assume_unique)
    check_rulebook_build(geometry, indices, shape, batch)  # sparsecore.memory_budget
    backend = backend if backend is not None else backend_for(indices)
    with serialised_kernels(indices):  # numba's workqueue layer: one thread at a time (sparsecore.threads)
        if geometry.kind == "subm":
            return _submanifold(indices, shape, batch, geometry, backend, assume_unique)
        if geometry.kind in ("regular", "transposed"):
            return _strided(indices, shape, batch, geometry, backend, assume_unique)
    raise ValueError(
        "an inverse conv reverses the rulebook of a regular conv: build it with "
        "inverse_rulebook(saved_rulebook), not build_rulebook"
    )


def build_pool_rulebook(indices: Any, spatial_shape: Sequence[int], batch_size: int,
                        kernel_size: PerAxis, stride: PerAxis | None = None, padding: PerAxis = 0,
                        dilation: PerAxis = 1, *, subm: bool = False,
                        assume_unique: bool = False,
                        backend: ArrayBackend | None = None) -> Rulebook:
    """The rulebook of a pooling window (stride defaults to the kernel size, as in spconv).

    With ``subm=True`` the outputs are the input sites (odd kernels only).
    """
    ndim = as_indices(indices, len(as_spatial_shape(spatial_shape))).shape[1] - 1
    geometry = ConvGeometry.create(
        ndim, kernel_size, kernel_size if stride is None else stride, padding, dilation,
        kind="subm" if subm else "regular",
    )
    return build_rulebook(indices, spatial_shape, batch_size, geometry, assume_unique=assume_unique,
                          backend=backend)


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
    return _made_rulebook(geometry, rulebook.output_spatial_shape, rulebook.input_spatial_shape,
                          rulebook.batch_size, rulebook.output_indices, rulebook.input_indices,
                          rulebook.pair_output, rulebook.pair_input, rulebook.offset_starts)
