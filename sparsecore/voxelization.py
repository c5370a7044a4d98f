"""Points to voxels and back: everything spconv's ``PointToVoxel`` does, plus batches.

Semantics
---------
* **Points** are ``[P, F]`` float32 or float64 with ``F >= D``; the first ``D``
  columns are the coordinates (x, y, z[, w]), all ``F`` columns are stored.
  Any array library is accepted (NumPy, CuPy, torch, JAX, DLPack); results are
  NumPy arrays for host input and CuPy arrays for CUDA input.
* **Grid.** ``voxel_size`` has ``D`` entries (xyz), ``coordinate_range`` has
  ``2D`` (``min_x, min_y, min_z, max_x, max_y, max_z`` for ``D = 3``).
  ``grid_size`` is in **reversed (zyx)** order, ``round((max - min) / size)``
  per axis computed like spconv (float32 arithmetic, halves rounded up).
* **In range** means ``min <= x < max`` on every axis, and additionally the
  voxel coordinate ``floor((x - min) / size)`` is below ``grid_size`` (float
  round-off can push a point just under ``max`` into cell ``grid_size``; it is
  dropped). The arithmetic runs in the points' dtype with the bounds and sizes
  rounded to it; for float32 this reproduces spconv's coordinates exactly.
  NaN and infinite coordinates are out of range. spconv tests only the voxel
  coordinate, so when ``(max - min) / size`` is not an integer and rounds up,
  spconv also keeps points in ``[max, min + grid_size * size)``; sparsecore
  does not (it honours ``coordinate_range``).
* **Order (deterministic).** Voxels are numbered by the input position of
  their first point. Within a voxel, points keep input order and the first
  ``max_num_points_per_voxel`` are stored in ``voxels``; the rest are not stored
  but still belong to the voxel: their ``point_voxel_id`` is the voxel's row
  (spconv's CPU ``generate_voxel_with_id`` does the same). Voxels beyond
  ``max_num_voxels`` in first-seen order are dropped; their points get ``-1``,
  as do out-of-range points. spconv's CPU build numbers voxels the same way.
* **Padding.** Empty slots of ``voxels`` are zero, or with ``empty_mean=True``
  the voxel's mean point (the mean of its stored points). spconv 2.3.8's CPU
  build does not reset its mean accumulator between voxels (voxel k is filled
  with ``(fill of voxel k-1 + sum of voxel k) / count``), so only its first
  voxel is right; sparsecore fills each voxel with its own mean.
* **Dtypes.** ``voxels`` keeps the points' dtype (spconv always gives float32);
  ``indices`` and ``num_points_per_voxel`` are int32, ``point_voxel_id`` int64.
* **Batches.** :func:`voxelize_batch` voxelizes each cloud as :func:`voxelize`
  would (``max_num_voxels`` applies per cloud) and stacks the rows cloud after
  cloud, with the cloud's index in column 0 of ``indices``.
* **Back to points.** :func:`voxel_means` gives each voxel's mean stored point;
  :func:`gather_voxel_features` hands any per-voxel rows back to the points
  through ``point_voxel_id`` (dropped points get ``invalid_value``).
* **Memory** is O(points): voxels are found through a hash table of packed
  int64 keys on the CPU (one serial numba pass, `sparsecore._voxel_hashing`)
  and by sorting the keys on the GPU (`sparsecore._voxel_math`), never by
  allocating a dense grid of ``prod(grid_size)`` cells (spconv's CPU
  build allocates one, 781 MiB for a 0.1 m grid over 160 m x 160 m x 8 m).
  ``batch_size * prod(grid_size)`` must fit in int64 and every axis in int32.
* **Empty input** (no points, or none in range) gives ``M = 0`` outputs of the
  right shapes and dtypes.
* **Errors.** Malformed points or parameters raise ``ValueError`` or
  ``TypeError`` naming the argument, what was expected and what was given.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Sequence

from . import _voxel_hashing, _voxel_math
from .voxels import BatchedVoxels, Voxels, gather_voxel_features, voxel_means
from .interop import INT32_MAX, INT64_MAX, array_module, check_same_device, to_core_array

__all__ = [
    "VoxelGrid",
    "Voxels",
    "BatchedVoxels",
    "voxelize",
    "voxelize_batch",
    "voxel_means",
    "gather_voxel_features",
]

_AXIS_NAMES = ("x", "y", "z", "w")
_INT32_MAX = INT32_MAX  # coordinates of voxel indices


def _as_float_tuple(value: Any, name: str) -> tuple[float, ...]:
    try:
        if hasattr(value, "tolist"):
            value = value.tolist()
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise TypeError
        return tuple(float(item) for item in value)
    except (TypeError, ValueError):
        raise TypeError(
            f"{name} must be a sequence of numbers (xyz order), got {value!r} "
            f"({type(value).__name__}). Pass e.g. {name}=(0.1, 0.1, 0.2)."
        ) from None


@dataclass(frozen=True)
class VoxelGrid:
    """The static voxelization configuration; validated on construction.

    Attributes:
        voxel_size: ``D`` positive finite voxel edge lengths, xyz order (``1 <= D <= 4``).
        coordinate_range: ``2D`` numbers, ``(min_x, ..., max_x, ...)``; ``min < max``.
    """

    voxel_size: tuple[float, ...]
    coordinate_range: tuple[float, ...]
    _grid_size: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        size = _as_float_tuple(self.voxel_size, "voxel_size")
        bounds = _as_float_tuple(self.coordinate_range, "coordinate_range")
        ndim = len(size)
        if not 1 <= ndim <= 4:
            raise ValueError(
                f"voxel_size must have 1 to 4 entries (one per spatial axis, xyz), got {ndim}: {size}."
            )
        for axis, edge in enumerate(size):
            if not (math.isfinite(edge) and edge > 0 and _voxel_math.float32(edge) > 0):
                raise ValueError(
                    f"voxel_size must be {ndim} positive finite numbers (xyz), got {size}: "
                    f"axis {_AXIS_NAMES[axis]} is {edge}."
                )
        names = [f"min_{a}" for a in _AXIS_NAMES[:ndim]] + [f"max_{a}" for a in _AXIS_NAMES[:ndim]]
        layout = f"({', '.join(names)})"
        if len(bounds) != 2 * ndim:
            raise ValueError(
                f"coordinate_range must have 2 * {ndim} = {2 * ndim} numbers {layout} for a "
                f"{ndim}-D voxel_size {size}, got {len(bounds)}: {bounds}."
            )
        for name, bound in zip(names, bounds):
            if not math.isfinite(_voxel_math.float32(bound)):
                raise ValueError(
                    f"coordinate_range must be finite numbers within float32 range, got {bounds}: "
                    f"{name} is {bound}."
                )
        for axis in range(ndim):
            lo, hi = bounds[axis], bounds[ndim + axis]
            if not lo < hi:
                raise ValueError(
                    f"coordinate_range min_{_AXIS_NAMES[axis]} ({lo}) must be less than "
                    f"max_{_AXIS_NAMES[axis]} ({hi}); the layout is {layout}, got {bounds}."
                )
        object.__setattr__(self, "voxel_size", size)
        object.__setattr__(self, "coordinate_range", bounds)
        cells_xyz = _voxel_math.grid_cells(size, bounds)
        object.__setattr__(self, "_grid_size", tuple(reversed(cells_xyz)))
        for axis, cells in enumerate(cells_xyz):
            name = _AXIS_NAMES[axis]
            if cells < 1:
                raise ValueError(
                    f"coordinate_range spans {bounds[ndim + axis] - bounds[axis]} on axis {name}, "
                    f"less than half a voxel ({size[axis]}), so the grid has 0 cells there. "
                    "Widen the range or use a smaller voxel_size."
                )
            if cells > _INT32_MAX:
                raise ValueError(
                    f"the grid has {cells} cells on axis {name}, beyond int32 voxel indices "
                    f"(2^31 - 1). Use a larger voxel_size ({size[axis]}) or a narrower range."
                )

    @property
    def ndim(self) -> int:
        """Number of spatial axes ``D``."""
        return len(self.voxel_size)

    @property
    def lower(self) -> tuple[float, ...]:
        """``(min_x, min_y, ...)``."""
        return self.coordinate_range[: self.ndim]

    @property
    def upper(self) -> tuple[float, ...]:
        """``(max_x, max_y, ...)``."""
        return self.coordinate_range[self.ndim :]

    @property
    def grid_size(self) -> tuple[int, ...]:
        """Cells per axis in **zyx** order: ``round((max - min) / size)`` in float32, like spconv."""
        return self._grid_size

    def check_key_capacity(self, batch_size: int = 1) -> None:
        """Raises ValueError when ``batch_size * prod(grid_size)`` keys overflow int64."""
        cells = _voxel_math.cell_count(self.grid_size)
        if batch_size * cells > INT64_MAX:
            raise ValueError(
                f"voxel keys overflow int64: batch_size {batch_size} x grid_size {self.grid_size} "
                f"(zyx) = {batch_size * cells} cells > 2^63 - 1 (voxel_size {self.voxel_size}, "
                f"coordinate_range {self.coordinate_range}). Use a larger voxel_size, a smaller "
                "coordinate_range, or fewer clouds per call."
            )


def _check_count(value: Any, name: str, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{name} must be an integer >= 1 ({meaning}), got {value!r} ({type(value).__name__})."
        )
    if value < 1:
        raise ValueError(f"{name} must be an integer >= 1 ({meaning}), got {value}.")
    return int(value)


def _as_points(points: Any, ndim: int, name: str) -> Any:
    array = to_core_array(points, name)
    if array.ndim != 2:
        raise ValueError(
            f"{name} must be 2-D [num_points, {ndim} + extra features] (xyz first), got shape "
            f"{tuple(array.shape)}. Reshape it, e.g. {name}.reshape(-1, num_features)."
        )
    if array.dtype.kind != "f" or array.dtype.itemsize not in (4, 8):
        raise TypeError(
            f"{name} must be float32 or float64, got {array.dtype}. Convert it first, "
            f"e.g. {name}.astype(numpy.float32)."
        )
    if array.shape[1] < ndim:
        raise ValueError(
            f"{name} has {array.shape[1]} columns but voxel_size is {ndim}-D: the first {ndim} "
            f"columns must be the coordinates, so {name} needs shape [P, >= {ndim}], got "
            f"{tuple(array.shape)}."
        )
    return array


def _prepare(voxel_size: Any, coordinate_range: Any, max_num_points_per_voxel: Any,
             max_num_voxels: Any) -> tuple[VoxelGrid, int, int]:
    grid = VoxelGrid(voxel_size, coordinate_range)
    max_points = _check_count(max_num_points_per_voxel, "max_num_points_per_voxel", "points stored per voxel")
    max_voxels = _check_count(max_num_voxels, "max_num_voxels", "voxels kept per cloud")
    return grid, max_points, max_voxels


def _voxelize_points(xp: Any, points: Any, cloud_sizes: tuple[int, ...], grid: VoxelGrid, max_points: int,
                     max_voxels: int, empty_mean: bool) -> _voxel_math.VoxelArrays:
    # Host arrays take the hash-table pass (no sort); CUDA arrays, and host arrays in a
    # non-native byte order (which numba does not take), the xp-generic sorting pass.
    if xp.__name__ == "numpy" and points.dtype.isnative:
        return _voxel_hashing.voxelize_points(points, cloud_sizes, grid, max_points, max_voxels, empty_mean)
    return _voxel_math.voxelize_points(xp, points, cloud_sizes, grid, max_points, max_voxels, empty_mean)


def voxelize(points: Any, voxel_size: Sequence[float], coordinate_range: Sequence[float],
             max_num_points_per_voxel: int, max_num_voxels: int, *, empty_mean: bool = False) -> Voxels:
    """Groups the points of one cloud into voxels (spconv ``PointToVoxel.generate_voxel_with_id``).

    Args:
        points: ``[P, F]`` float32/float64, ``F >= D``; columns ``0..D-1`` are xyz.
        voxel_size: ``D`` positive voxel edge lengths, xyz.
        coordinate_range: ``(min_x, min_y, min_z, max_x, max_y, max_z)`` for ``D = 3``.
        max_num_points_per_voxel: points stored per voxel (later ones are not stored but
            keep the voxel's id in ``point_voxel_id``).
        max_num_voxels: voxels kept, in first-seen order; the points of later voxels get -1.
        empty_mean: fill empty slots with the voxel's mean point instead of zeros.

    Returns:
        :class:`Voxels` (see the module docstring for the exact semantics).

    Raises:
        ValueError, TypeError: for malformed points or parameters, naming the argument.
    """
    grid, max_points, max_voxels = _prepare(
        voxel_size, coordinate_range, max_num_points_per_voxel, max_num_voxels
    )
    array = _as_points(points, grid.ndim, "points")
    grid.check_key_capacity(1)
    result = _voxelize_points(
        array_module(array), array, (int(array.shape[0]),), grid, max_points, max_voxels, bool(empty_mean)
    )
    return Voxels(
        result.voxels, result.indices, result.num_points_per_voxel, result.point_voxel_id, grid.grid_size
    )


def voxelize_batch(point_clouds: Sequence[Any], voxel_size: Sequence[float],
                   coordinate_range: Sequence[float], max_num_points_per_voxel: int,
                   max_num_voxels: int, *, empty_mean: bool = False) -> BatchedVoxels:
    """Voxelizes several clouds in one pass; cloud ``b``'s rows come after cloud ``b - 1``'s.

    Args:
        point_clouds: ``B >= 1`` arrays ``[P_b, F]``, one dtype and ``F`` for all, on one device.
        voxel_size, coordinate_range, max_num_points_per_voxel, empty_mean: as in :func:`voxelize`.
        max_num_voxels: voxels kept **per cloud**, in first-seen order.

    Returns:
        :class:`BatchedVoxels`; ``indices[:, 0]`` is the cloud, ``point_voxel_id[b]`` has ``P_b`` rows.

    Raises:
        ValueError, TypeError: as :func:`voxelize`, or for clouds that disagree in F, dtype or device.
    """
    grid, max_points, max_voxels = _prepare(
        voxel_size, coordinate_range, max_num_points_per_voxel, max_num_voxels
    )
    is_sequence = isinstance(point_clouds, Sequence) and not isinstance(point_clouds, (str, bytes))
    if not is_sequence or len(point_clouds) == 0:
        raise ValueError(
            "point_clouds must be a non-empty list or tuple of [P_b, F] point arrays, got "
            f"{point_clouds!r:.80}. For a single cloud use voxelize(points, ...)."
        )
    clouds = [_as_points(cloud, grid.ndim, f"point_clouds[{b}]") for b, cloud in enumerate(point_clouds)]
    check_same_device(**{f"point_clouds[{b}]": cloud for b, cloud in enumerate(clouds)})
    first = clouds[0]
    for b, cloud in enumerate(clouds[1:], start=1):
        if cloud.shape[1] != first.shape[1] or cloud.dtype != first.dtype:
            raise ValueError(
                f"all point_clouds must share feature count and dtype: point_clouds[0] is "
                f"[{first.shape[0]}, {first.shape[1]}] {first.dtype}, point_clouds[{b}] is "
                f"[{cloud.shape[0]}, {cloud.shape[1]}] {cloud.dtype}. Convert them to one layout first."
            )
    batch_size = len(clouds)
    grid.check_key_capacity(batch_size)
    xp = array_module(first)
    points = first if batch_size == 1 else xp.concatenate(clouds, axis=0)
    sizes = tuple(int(cloud.shape[0]) for cloud in clouds)
    result = _voxelize_points(xp, points, sizes, grid, max_points, max_voxels, bool(empty_mean))
    indices = xp.concatenate([result.batch[:, None], result.indices], axis=1)
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    ids = tuple(result.point_voxel_id[bounds[b] : bounds[b + 1]] for b in range(batch_size))
    return BatchedVoxels(result.voxels, indices, result.num_points_per_voxel, ids, batch_size, grid.grid_size)
