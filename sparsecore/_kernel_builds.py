"""Rulebook builds on the kernel backend: neighbour maps written by kernels, the site checks read back once.

`sparsecore.rulebook.build_rulebook` calls these for a backend that builds
neighbour maps (``submanifold_map`` / ``strided_map``: the kernel backend,
`sparsecore.backends._kernel_maps`). They return the `NeighbourMap` (and a
strided layer's output sites) from which the rulebook is made; its pair lists
are derived only when someone asks for them.

Host work per build (counted on the emulation; each is a host operation on
the GPU): a submanifold map five operations and no read back; a strided,
transposed or pooling map thirteen and one read (the output count). The
first, untrusted layer also checks its sites (inside the grid, no duplicates)
in a kernel, and reads the result back once: a submanifold build's only read,
a strided build's count word. Only when that says something is wrong do the
slow paths run, to raise the same errors as the CPU builders
(`raise_site_problems`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

from .backends import ArrayBackend, backend_for
from .geometry import ConvGeometry
from .hashing import check_packable, pack_keys
from .interop import INT64_MAX, check_indices_in_range, check_unique_sites
from .neighbour_map import ROW_PLAN, NeighbourMap

__all__ = ["builds_neighbour_maps", "submanifold_neighbour_map", "strided_neighbour_map", "check_sites",
           "raise_site_problems", "raise_duplicate"]

# The problem bits of `sparsecore.backends._kernel_maps` (PROBLEM_OUTSIDE, PROBLEM_DUPLICATE).
_OUTSIDE, _DUPLICATE = 1, 2


def builds_neighbour_maps(backend: ArrayBackend) -> bool:
    """Whether ``backend`` builds rulebooks as neighbour maps (the kernel backend)."""
    return getattr(backend, "submanifold_map", None) is not None and getattr(backend, "strided_map", None) is not None


def _contiguous(indices: Any, backend: ArrayBackend) -> Any:
    # an attribute test, not an operation: indices are usually contiguous already
    return indices if indices.flags.c_contiguous else backend.xp.ascontiguousarray(indices)


def _reach(geometry: ConvGeometry) -> tuple[int, ...]:
    return tuple(step * (size - 1) // 2 for size, step in zip(geometry.kernel_size, geometry.dilation))


def submanifold_neighbour_map(indices: Any, shape: tuple[int, ...], batch: int, geometry: ConvGeometry,
                              backend: ArrayBackend, check: bool) -> NeighbourMap:
    """The symmetric map of a submanifold layer (its output sites are ``indices``).

    Args:
        indices: int32 ``[N, 1 + D]`` sites.
        shape: the grid.
        batch: batch elements.
        geometry: a subm `ConvGeometry`.
        backend: a backend that `builds_neighbour_maps`.
        check: check the sites (range, duplicates), reading the verdict back once.

    Raises:
        ValueError: sites outside the grid or duplicate sites (the CPU builders' messages), or keys
            that overflow int64.
    """
    check_packable(shape, batch, _reach(geometry))
    neighbours, masks, problems = backend.submanifold_map(_contiguous(indices, backend), shape, batch,
                                                          geometry.kernel_size, geometry.dilation, check)
    if problems is not None:
        bits = int(problems.tolist()[0])  # the build's one read back, checked builds only
        if bits:
            raise_site_problems(bits, indices, shape, batch, backend, _reach(geometry))
    count = int(indices.shape[0])
    neighbour_map = NeighbourMap(neighbours, masks, None, None, None, None, count, count,
                                 tuple(geometry.kernel_size), geometry.kernel_volume // 2, True)
    # a submanifold map serves convolutions only: its row plan is built with it (two operations)
    neighbour_map.derived[(ROW_PLAN, "output")] = backend.row_plan(masks, geometry.kernel_volume)
    return neighbour_map


def strided_neighbour_map(indices: Any, shape: tuple[int, ...], out_shape: tuple[int, ...], batch: int,
                          geometry: ConvGeometry, backend: ArrayBackend, check: bool) -> tuple[Any, NeighbourMap]:
    """The output sites and map of a regular, transposed or pooling layer (one read back: the output count).

    Args:
        indices: int32 ``[N, 1 + D]`` sites.
        shape: the input grid.
        out_shape: the output grid (checked by the caller to pack into int64 with ``batch``).
        batch: batch elements.
        geometry: a regular or transposed `ConvGeometry`.
        backend: a backend that `builds_neighbour_maps`.
        check: check the sites (range, duplicates); the verdict comes back with the count.

    Returns:
        ``(output_indices int32 [N_out, 1 + D] sorted by (batch, coordinates), map)``.

    Raises:
        ValueError: sites outside the grid or duplicate sites (the CPU builders' messages).
    """
    if check:
        check_packable(shape, batch)
    built = backend.strided_map(_contiguous(indices, backend), shape, batch, geometry, out_shape, check)
    if built.problems:
        raise_site_problems(built.problems, indices, shape, batch, backend, (0,) * len(shape))
    neighbour_map = NeighbourMap(built.output_neighbours, built.output_masks, None, built.input_neighbours,
                                 None, None, int(indices.shape[0]), int(built.output_indices.shape[0]),
                                 tuple(geometry.kernel_size))
    return built.output_indices, neighbour_map


def check_sites(indices: Any, spatial_shape: Sequence[int], batch_size: int, name: str = "indices") -> None:
    """Raises for a site outside the grid or two equal sites, with `sparsecore.interop`'s messages.

    On a backend that `builds_neighbour_maps` the check is one kernel pass with
    one read back (a submanifold build of a one-cell kernel with its site
    checks: 8 host operations), where `check_indices_in_range` and
    `check_unique_sites` read twice and take about thirty; those two run only
    when it finds a problem, to name it. Elsewhere they run as they are.

    Args:
        indices: int32 ``[N, 1 + D]`` core array.
        spatial_shape: ``D`` ints.
        batch_size: batch elements.
        name: the argument's name in messages.
    """
    shape, batch = tuple(int(size) for size in spatial_shape), int(batch_size)
    backend = backend_for(indices)
    fits = batch * math.prod(shape) <= INT64_MAX  # else check_unique_sites names the overflow
    if builds_neighbour_maps(backend) and fits and indices.shape[0] and indices.dtype == backend.xp.int32:
        one = (1,) * len(shape)
        _, _, problems = backend.submanifold_map(_contiguous(indices, backend), shape, batch, one, one, True)
        if not int(problems.tolist()[0]):  # the one read back
            return
    check_indices_in_range(indices, shape, batch, name)
    check_unique_sites(indices, shape, batch, name)


def raise_site_problems(bits: int, indices: Any, shape: tuple[int, ...], batch: int, backend: ArrayBackend,
                        margin: tuple[int, ...]) -> None:
    """Raises the error of a failed site check, found again by the CPU builders' checks (the slow path).

    Args:
        bits: the problem bits (1: a site outside the grid, 2: duplicate sites), not 0.
        indices: int32 ``[N, 1 + D]`` sites.
        shape: the grid.
        batch: batch elements.
        backend: the sites' backend.
        margin: the padding of the grid the duplicates were found on (the same order of keys).

    Raises:
        ValueError: always.
    """
    if bits & _OUTSIDE:
        check_indices_in_range(indices, shape, batch)
    if bits & _DUPLICATE:
        keys = pack_keys(indices, shape, batch, margin=margin, assume_in_range=True, backend=backend)
        _, duplicate = backend.hash_build(keys, backend.xp.arange(indices.shape[0], dtype=backend.xp.int64))
        if duplicate is not None:
            raise_duplicate(indices, duplicate, "indices")
    raise AssertionError(f"the site check reported problems {bits} that the CPU checks did not find")


def raise_duplicate(indices: Any, rows: tuple[int, int], name: str) -> None:
    """Raises the duplicate-sites error naming two rows with the same site."""
    first, second = sorted(rows)
    raise ValueError(
        f"{name} contains duplicate sites: rows {first} and {second} are both "
        f"{indices[first].tolist()}. Each active site must appear once; merge duplicate "
        "points first (for example with sparsecore.voxelize, or by summing their features)"
    )
