"""Capacity builds (`sparsecore.capacity`): a rulebook whose output rows are allocated at a capacity.

`sparsecore.rulebook.build_rulebook` calls `capacity_rulebook` when asked for a
capacity. Two ways, one result (a `Rulebook` of ``capacity`` output rows, the
true rows first, padding after: sites of -1, no pairs):

- a kernel backend (the GPU, and its g++ emulation) builds the padded neighbour
  map directly (`sparsecore.backends._kernel_maps`, ``sc_map_strided_capacity``):
  the count and the first layer's site checks stay on the device in the
  rulebook's `CapacityStatus`; nothing is read back;
- the NumPy backend keeps its exact builders: it builds the exact rulebook of
  the true rows (their number read on the host, where a read costs nothing) and
  pads it; the CPU passes run on that exact rulebook (``Rulebook.exact``), so
  the true rows are bitwise those of exact mode. A count beyond the capacity is
  recorded (as on the GPU) and its extra rows dropped.
"""

from __future__ import annotations

from typing import Any, Callable

from .backends import ArrayBackend
from .capacity import CapacityStatus, true_rows
from .geometry import ConvGeometry
from .hashing import check_packable
from .neighbour_map import ROW_PLAN, NeighbourMap
from .pair_map import PairMap

__all__ = ["capacity_rulebook", "exact_of", "padded_rows"]


def _kernel_rulebook(Rulebook: type, indices: Any, shape: tuple[int, ...], out_shape: tuple[int, ...], batch: int,
                     geometry: ConvGeometry, backend: ArrayBackend, check: bool, capacity: int, layer: str) -> Any:
    indices = indices if indices.flags.c_contiguous else backend.xp.ascontiguousarray(indices)
    count = int(indices.shape[0])
    if geometry.kind == "subm":
        check_packable(shape, batch, tuple(step * (size - 1) // 2
                                           for size, step in zip(geometry.kernel_size, geometry.dilation)))
        neighbours, masks, problems = backend.submanifold_map(indices, shape, batch, geometry.kernel_size,
                                                              geometry.dilation, check, skip_padding=True)
        neighbour_map = NeighbourMap(neighbours, masks, None, None, None, None, count, count,
                                     tuple(geometry.kernel_size), geometry.kernel_volume // 2, True)
        neighbour_map.derived[(ROW_PLAN, "output")] = backend.row_plan(masks, geometry.kernel_volume)
        status = None if problems is None else CapacityStatus(layer, count, None, problems, indices, shape, batch)
        return Rulebook(geometry, shape, shape, batch, indices, indices, stored_map=neighbour_map, capacity=status)
    if check:
        check_packable(shape, batch)
    built = backend.strided_map(indices, shape, batch, geometry, out_shape, check, capacity=capacity)
    neighbour_map = NeighbourMap(built.output_neighbours, built.output_masks, None, built.input_neighbours,
                                 None, None, count, int(capacity), tuple(geometry.kernel_size))
    status = CapacityStatus(layer, int(capacity), built.status, None, indices, shape, batch)
    return Rulebook(geometry, shape, out_shape, batch, indices, built.output_indices, stored_map=neighbour_map,
                    capacity=status)


def _padded_pairs(exact: Any, num_input: int, num_output: int, capacity: int) -> PairMap:
    """The exact rulebook's pairs on padded row counts; pairs to outputs at or past ``capacity`` dropped."""
    pairs = exact.pair_map
    if exact.num_output <= capacity:
        return PairMap(pairs.pair_input, pairs.pair_output, tuple(pairs.offset_starts), num_input, num_output,
                       tuple(exact.kernel_size), -1, trusted=True)
    import numpy as np

    kept = pairs.pair_output < capacity
    starts = [0]
    for begin, end in zip(pairs.offset_starts[:-1], pairs.offset_starts[1:]):
        starts.append(starts[-1] + int(kept[begin:end].sum()))
    return PairMap(np.ascontiguousarray(pairs.pair_input[kept]), np.ascontiguousarray(pairs.pair_output[kept]),
                   tuple(starts), num_input, num_output, tuple(exact.kernel_size), -1, trusted=True)


def _host_rulebook(Rulebook: type, indices: Any, shape: tuple[int, ...], out_shape: tuple[int, ...], batch: int,
                   geometry: ConvGeometry, backend: ArrayBackend, assume_unique: bool, capacity: int, layer: str,
                   exact_build: Callable[[Any, bool], Any]) -> Any:
    xp = backend.xp
    rows = int(indices.shape[0])
    valid = true_rows(indices)
    sites = indices if valid == rows else indices[:valid]
    exact = exact_build(sites, assume_unique)  # the exact builders, their checks (a host read costs nothing)
    if geometry.kind == "subm":
        if valid == rows:
            return exact
        pairs = _padded_pairs(exact, rows, rows, rows)
        return Rulebook(geometry, shape, shape, batch, indices, indices, stored_pairs=pairs, exact=exact)
    needed = int(exact.num_output)
    status = CapacityStatus(layer, int(capacity), xp.asarray([min(needed, 2**31 - 1), 0], dtype=xp.int32), None,
                            indices, shape, batch)
    output_indices = xp.full((int(capacity), indices.shape[1]), -1, dtype=xp.int32)
    kept = min(needed, int(capacity))
    output_indices[:kept] = exact.output_indices[:kept]
    pairs = _padded_pairs(exact, rows, int(capacity), int(capacity))
    return Rulebook(geometry, shape, out_shape, batch, indices, output_indices, stored_pairs=pairs,
                    capacity=status, exact=exact if needed <= capacity else None)


def capacity_rulebook(rulebook_type: type, indices: Any, shape: tuple[int, ...], out_shape: tuple[int, ...], batch: int,
                      geometry: ConvGeometry, backend: ArrayBackend, assume_unique: bool, capacity: int, layer: str,
                      exact_build: Callable[[Any, bool], Any] | None) -> Any:
    """A capacity build's `Rulebook` (see the module docstring).

    Args:
        rulebook_type: `sparsecore.rulebook.Rulebook` (given by its module: no import cycle).
        indices: int32 ``[N, 1 + D]`` sites; rows whose batch index is -1 are padding (last).
        shape, out_shape: the input and output grids.
        batch: batch elements.
        geometry: a subm, regular or transposed `ConvGeometry`.
        backend: the backend.
        assume_unique: the sites are known valid (no site checks).
        capacity: output rows to allocate (strided and transposed layers; a submanifold layer's are its
            input's rows), >= 0.
        layer: the layer's name for its `CapacityStatus`.
        exact_build: ``(sites, assume_unique) -> Rulebook``, the exact build, for a backend that
            does not build neighbour maps; None on a kernel backend.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ValueError(f"capacity must be a non-negative int (the output rows of a capacity build), got "
                         f"{capacity!r}")
    if exact_build is None:
        return _kernel_rulebook(rulebook_type, indices, shape, out_shape, batch, geometry, backend, not assume_unique, capacity,
                                layer)
    return _host_rulebook(rulebook_type, indices, shape, out_shape, batch, geometry, backend, assume_unique, capacity, layer,
                          exact_build)



def exact_of(rulebook: Any) -> Any:
    """The exact rulebook a CPU pass runs on for a padded NumPy capacity build, else None."""
    return getattr(rulebook, "exact", None)


def padded_rows(values: Any, rows: int, fill: Any = 0) -> Any:
    """``values [n, C]`` followed by ``rows - n`` rows of ``fill`` (a scalar or a ``[C]`` row)."""
    import numpy as np

    if values.shape[0] == rows:
        return values
    out = np.empty((rows,) + tuple(values.shape[1:]), dtype=values.dtype)
    out[:values.shape[0]] = values
    out[values.shape[0]:] = fill
    return out
