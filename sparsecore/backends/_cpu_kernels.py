"""Compiled CPU kernels of the convolution feature passes (numba, compiled on first use).

The NumPy backend's fused and tiled dataflows (`sparsecore.cpu_dataflow`) run on these kernels:

- `neighbour_table`: a rulebook's pairs as a dense int32 table, for each
  destination row ``d`` and offset ``k`` the source row paired with it (or -1),
  blocked by `ROW_BLOCK` destination rows so one work item's entries are
  contiguous. Built from the forward pairs it drives the forward
  (output-stationary); built from the reversed pairs it drives the backward
  d-features (input-stationary over the transposed map).
- `accumulate_rows`: ``out[d] += sum_k source[table[k, d]] @ M_k`` for every
  destination row: gather, multiply and scatter fused, each row read once and
  written once. Work is split into fixed blocks of destination rows; each row
  sums its offsets in offset order, so the result is bitwise identical at
  every thread count (no atomics, no order that depends on scheduling).
- `tile_plan`, `tiled_forward`, `tiled_backward`: the tiled dataflow
  (`_tile_kernel_sources`): the pairs grouped by work item and offset once per
  rulebook, each run copied into a cached tile and multiplied on BLAS.

The fused dataflow's weight gradient stays on BLAS (one ``gathered_input^T @ gathered_grad``
per offset, `sparsecore.cpu_dataflow`): a compiled blocked outer-product kernel was
2-4x slower than that at 16 and 64 channels (docs/performance_history.md).

The fused row kernels (grouped layers) compile their channel counts in as
constants (one compiled kernel per ``(groups, in_per_group, out_per_group)``)
only for layers of at least
`SPECIALISE_MIN_PAIR_FLOPS`: there the constant sizes let LLVM keep a row's
accumulator in vector registers (about 2x at 64 channels). Smaller layers use
one generic kernel per dtype. All kernels use numba's on-disk cache
(``cache=True``), so a process pays the compile (seconds) only the first time
a shape is seen on a machine. ``import sparsecore`` does not import numba.
Tile plans and tiled passes of at most `NUMPY_MAX_WORK` run NumPy twins
(`_tile_twins`) instead, so a small cloud's first call compiles nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Iterator, Optional

import numpy as np

from .._compile_notice import numba_for_kernels
from . import _tile_twins
from ..threads import numba_module

__all__ = [
    "ROW_BLOCK",
    "SPECIALISE_MIN_PAIR_FLOPS",
    "SERIAL_MAX_WORK",
    "NUMPY_MAX_WORK",
    "compiled_kernel",
    "kernel_threads",
    "neighbour_table",
    "accumulate_rows",
    "TILE_ITEMS",
    "TILE_PARTIAL_MAX_BYTES",
    "TILE_MIN_WORKS",
    "TILE_MIN_PAIRS_PER_OFFSET",
    "tile_items",
    "SMALL_GEMM_WORK",
    "SMALL_GEMM_MIN_ROWS",
    "gemm_chunk_rows",
    "TilePlan",
    "tile_plan",
    "tiled_forward",
    "tiled_backward",
    "numba_module",
]

ROW_BLOCK = 64
"""Destination rows per work item of `accumulate_rows` (a fixed split, not a per-thread one)."""

SPECIALISE_MIN_PAIR_FLOPS = 200_000_000
"""A layer's ``2 * pairs * in_channels * out_channels / groups`` from which its channel counts are
compiled in as constants; below it the generic kernel runs (no compile per shape)."""


SERIAL_MAX_WORK = 4_000_000
"""Most ``pairs * (in_channels + out_channels)`` run on the calling thread alone: waking the pool
costs more than it saves on small layers, and a loaded machine can make every wake-up wait for a
descheduled worker (the results are the same either way)."""


NUMPY_MAX_WORK = 1 << 18
"""Most work (as `kernel_threads` counts it) that the wrappers of the tiled conv and rulebook kernels run as
NumPy twins instead: a small cloud's first call compiles nothing (the README's example compiled 11
kernels, 19 s of a 20 s first run on the 2-core machine), and below this size the twins take about as
long as the compiled kernels on one thread. The choice depends on the sizes alone."""


def compiled_kernel(work: int, compiled: Optional[bool] = None) -> bool:
    """Whether a kernel of ``work`` runs compiled: above `NUMPY_MAX_WORK`, unless ``compiled`` says
    (the tests run both)."""
    return work > NUMPY_MAX_WORK if compiled is None else bool(compiled)


@contextlib.contextmanager
def kernel_threads(work: int) -> Iterator[int]:
    """Numba's threads for a kernel of ``work``: one below `SERIAL_MAX_WORK`, else unchanged.

    Yields:
        The number of threads the kernel runs (its ``lanes`` argument: one loop iteration per
        thread, each claiming work items from a shared counter, `_work_queue`).
    """
    numba = numba_module()
    previous = numba.get_num_threads()
    if work >= SERIAL_MAX_WORK or previous == 1:
        yield previous
        return
    numba.set_num_threads(1)
    try:
        yield 1
    finally:
        numba.set_num_threads(previous)


def _sources() -> Any:
    numba_for_kernels()
    from . import _cpu_kernel_sources

    return _cpu_kernel_sources


def _tile_sources() -> Any:
    numba_for_kernels()
    from . import _tile_kernel_sources

    return _tile_kernel_sources


def neighbour_table(keys: np.ndarray, values: np.ndarray, offset_starts: tuple[int, ...],
                    num_rows: int) -> np.ndarray:
    """Pairs grouped by offset as a dense table blocked by destination rows.

    ``table[d // ROW_BLOCK, k, d % ROW_BLOCK]`` is the source row paired with destination
    row ``d`` through offset ``k`` (``d = keys[p]``, source ``values[p]``), or -1: the
    entries one work item of `accumulate_rows` reads (``ROW_BLOCK`` rows, every offset)
    are contiguous.

    Args:
        keys: int32 ``[P]`` destination rows (in ``[0, num_rows)``), unique within each offset.
        values: int32 ``[P]`` source rows.
        offset_starts: ``K + 1`` ints delimiting the offsets' pairs.
        num_rows: destination rows.

    Returns:
        int32 ``[ceil(num_rows / ROW_BLOCK), K, ROW_BLOCK]``, -1 where a row has no pair through an
        offset; read only.

    Raises:
        ValueError: when a destination row repeats within one offset (a pair map that is not
            injective per offset, which no rulebook builder produces).
    """
    volume = len(offset_starts) - 1
    table = np.full((-(-num_rows // ROW_BLOCK), volume, ROW_BLOCK), -1, dtype=np.int32)
    collisions = np.zeros(volume, dtype=np.int64)
    if volume and num_rows and offset_starts[-1]:
        with kernel_threads(2 * int(offset_starts[-1])) as lanes:
            _sources().fill_table(keys, values, np.asarray(offset_starts, dtype=np.int64), table, collisions, lanes)
    table.setflags(write=False)
    if collisions.any():
        offset = int(np.flatnonzero(collisions)[0])
        raise ValueError(
            f"the pair map repeats a row within kernel offset {offset} ({int(collisions[offset])} repeats): "
            "within one offset every input row and every output row may appear once; rebuild it with "
            "sparsecore.build_rulebook or check the pair arrays"
        )
    return table


# ---------------------------------------------------------------- fused rows


@functools.lru_cache(maxsize=None)
def _rows_kernel(groups: int, in_per_group: int, out_per_group: int) -> Any:
    return _sources().make_rows_kernel(groups, in_per_group, out_per_group, ROW_BLOCK)


def _specialise(pairs: int, groups: int, in_per_group: int, out_per_group: int) -> bool:
    return 2 * pairs * groups * in_per_group * out_per_group >= SPECIALISE_MIN_PAIR_FLOPS


def accumulate_rows(source: np.ndarray, table: np.ndarray, matrices: np.ndarray, out: np.ndarray,
                    pairs: int) -> None:
    """``out[d] += sum_k source[table[k, d]] @ block-diagonal(matrices[k])`` for every row ``d``, in place.

    Args:
        source: ``[N_src, groups * a]`` C-contiguous, float32 or float64.
        table: int32 ``[ceil(N_dst / ROW_BLOCK), K, ROW_BLOCK]`` from `neighbour_table` (-1: no pair).
        matrices: ``[K, groups, a, b]`` C-contiguous, ``source``'s dtype.
        out: ``[N_dst, groups * b]`` C-contiguous, ``source``'s dtype, holding the initial values
            (zeros or a bias); each row is read once and written once.
        pairs: the number of pairs (decides whether the channel counts are compiled in).
    """
    if out.shape[0] == 0 or table.shape[1] == 0 or out.shape[1] == 0:
        return
    _, groups, in_per_group, out_per_group = matrices.shape
    specialised = _specialise(pairs, groups, in_per_group, out_per_group)
    kernel = _rows_kernel(groups, in_per_group, out_per_group) if specialised else _rows_kernel(0, 0, 0)
    with kernel_threads(pairs * (source.shape[1] + out.shape[1])) as lanes:
        kernel(source, table, matrices, out, lanes)


# ---------------------------------------------------------------- tiled rows (BLAS on cached tiles)

TILE_ITEMS = 32
"""Neighbour-table blocks (`ROW_BLOCK` rows each) per work item of the tiled kernels: 2,048
destination rows, whose tiles stay in a core's cache (`tile_items` adjusts it for small clouds and
for the backward's d-weights shares)."""

TILE_PARTIAL_MAX_BYTES = 32 * 2**20
"""Most bytes of per-work-item d-weights (``items x K x a x b``) the tiled backward keeps at once."""

TILE_MIN_PAIRS_PER_OFFSET = 64
"""The backward's work items each write a whole ``K x a x b`` share of the d-weights: a layer is cut into
at most ``pairs / (64 K)`` items, so that write stays small beside the items' GEMMs (a 212-site
224 -> 256 layer of the basic network: 4 items wrote 28 MB of shares for 1,662 pairs)."""

TILE_MIN_WORKS = 8
"""Fewest work items a tiled pass is cut into where its table allows (smaller items for small clouds,
so that every thread gets work: the basic network's deep layers have 212 to 3,561 sites)."""


def tile_items(blocks: int, volume: int = 0, in_channels: int = 0, out_channels: int = 0, itemsize: int = 0,
               pairs: int = 0) -> int:
    """Table blocks per tiled work item, from the sizes only (never the thread count, so the sums' order
    does not depend on it either).

    `TILE_ITEMS`, halved while that leaves fewer than `TILE_MIN_WORKS` items; in the backward
    (``pairs`` given) at most ``pairs / (TILE_MIN_PAIRS_PER_OFFSET * volume)`` items, and doubled while
    the partial d-weights (``ceil(blocks / items) x volume x in x out x itemsize`` bytes) pass
    `TILE_PARTIAL_MAX_BYTES`. The forward passes the blocks alone.
    """
    most_works = max(1, pairs // (TILE_MIN_PAIRS_PER_OFFSET * volume)) if pairs and volume else blocks
    items = TILE_ITEMS
    while items > 1 and -(-blocks // items) < TILE_MIN_WORKS and -(-blocks // (items // 2)) <= most_works:
        items //= 2
    while items < blocks and (-(-blocks // items) > most_works or -(-blocks // items) * volume * in_channels
                              * out_channels * itemsize > TILE_PARTIAL_MAX_BYTES):
        items *= 2
    return items


SMALL_GEMM_WORK = 1_000_000
"""Most multiply-adds (``rows x a x b``) of one GEMM of the tiled kernels: OpenBLAS runs products up to
10^6 on its small-matrix kernels where it has them (AVX-512 builds), 1.2x-1.5x faster at 64 to 128 channels
on the test machine (`_tile_kernel_sources`; docs/performance_history.md)."""

SMALL_GEMM_MIN_ROWS = 32
"""Fewest rows of a GEMM slice: wider layers (``a x b`` above ``SMALL_GEMM_WORK / 32``, about 176 x 176)
keep whole products (slices of 15 rows ran the 256 x 256 d-weights at 81 GFLOP/s against 98 whole)."""


def gemm_chunk_rows(in_channels: int, out_channels: int) -> int:
    """Rows per GEMM slice of the tiled kernels, from the channel counts alone (never the thread count).

    ``SMALL_GEMM_WORK // (a * b)`` where that is at least `SMALL_GEMM_MIN_ROWS`, else no slicing
    (``2**31 - 1``).
    """
    rows = SMALL_GEMM_WORK // max(1, in_channels * out_channels)
    return rows if rows >= SMALL_GEMM_MIN_ROWS else 2**31 - 1


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """A rulebook's pairs grouped for the tiled kernels: by work item (``capacity`` destination rows),
    then by offset.

    Attributes:
        starts: int64 ``[W * K + 1]``; work item ``w``'s pairs through offset ``k`` lie at
            ``starts[w * K + k]:starts[w * K + k + 1]``.
        sources: int32 ``[P]`` each pair's source row.
        local_rows: int32 ``[P]`` each pair's destination row minus its work item's first row.
        capacity: destination rows per work item (``items * ROW_BLOCK``, a power of two).
        most: the most pairs of one ``(work item, offset)`` range (the tiles' rows).
    """

    starts: np.ndarray
    sources: np.ndarray
    local_rows: np.ndarray
    capacity: int
    most: int


def tile_plan(keys: np.ndarray, values: np.ndarray, offset_starts: tuple[int, ...], num_rows: int,
              items: int, compiled: Optional[bool] = None) -> TilePlan:
    """The `TilePlan` of pairs ``(values[p] -> keys[p])`` grouped by offset, ``items * ROW_BLOCK`` keys per
    work item; within a range the pairs keep their order.

    Args:
        keys: int32 ``[P]`` destination rows in ``[0, num_rows)``.
        values: int32 ``[P]`` source rows.
        offset_starts: ``K + 1`` ints delimiting the offsets' pairs.
        num_rows: destination rows.
        items: table blocks per work item (`tile_items`), a power of two.
        compiled: the compiled kernels or their NumPy twin, the same plan (default: `compiled_kernel`).

    Returns:
        The plan (its arrays read only).
    """
    if items < 1 or items & (items - 1):
        raise ValueError(f"items must be a power of two (from tile_items), got {items}")
    volume = len(offset_starts) - 1
    capacity = items * ROW_BLOCK
    shift = capacity.bit_length() - 1
    works = -(-num_rows // capacity)
    pairs = int(offset_starts[-1]) if volume else 0
    counts = np.zeros((volume, works), dtype=np.int64)
    sources = np.empty(pairs, dtype=np.int32)
    local_rows = np.empty(pairs, dtype=np.int32)
    starts = np.zeros(works * volume + 1, dtype=np.int64)
    if pairs and works and compiled_kernel(2 * pairs, compiled):
        starts_array = np.asarray(offset_starts, dtype=np.int64)
        kernels = _tile_sources()
        with kernel_threads(2 * pairs) as lanes:
            kernels.count_plan(keys, starts_array, shift, counts, lanes)
            np.cumsum(counts.T.ravel(), out=starts[1:])
            kernels.fill_plan(keys, values, starts_array, shift, starts, sources, local_rows, lanes)
    elif pairs and works:  # the NumPy twin: the same plan
        counts = _tile_twins.fill_plan(keys, values, offset_starts, shift, starts, sources, local_rows)
    for array in (starts, sources, local_rows):
        array.setflags(write=False)
    return TilePlan(starts, sources, local_rows, capacity, int(counts.max()) if counts.size else 0)


def tiled_forward(source: np.ndarray, plan: TilePlan, matrices: np.ndarray, out: np.ndarray,
                  pairs: int, compiled: Optional[bool] = None) -> None:
    """``out[d] += sum_k source[s] @ matrices[k]`` over the plan's pairs, on BLAS over cached tiles, in place.

    Args:
        source: ``[N_src, a]`` C-contiguous float32/float64.
        plan: the forward pairs' `tile_plan` (keys: destination rows), ``tile_items(ceil(N_dst / ROW_BLOCK))``.
        matrices: ``[K, a, b]`` C-contiguous, ``source``'s dtype.
        out: ``[N_dst, b]`` C-contiguous, holding the initial values (zeros or a bias).
        pairs: the number of pairs (small layers run on the calling thread).
        compiled: the compiled kernel or its NumPy twin (default: `compiled_kernel` of the work).
    """
    if out.shape[0] == 0 or matrices.shape[0] == 0 or out.shape[1] == 0 or pairs == 0:
        return
    if not compiled_kernel(pairs * (source.shape[1] + out.shape[1]), compiled):
        _tile_twins.tiled_forward(source, plan, matrices, out)
        return
    with kernel_threads(pairs * (source.shape[1] + out.shape[1])) as lanes:
        _tile_sources().tiled_forward_kernel(source, plan.starts, plan.sources, plan.local_rows, matrices, out,
                                             plan.capacity, plan.most, gemm_chunk_rows(*matrices.shape[1:]), lanes)


def tiled_backward(source: np.ndarray, grad: np.ndarray, plan: TilePlan, matrices: np.ndarray,
                   pairs: int, compiled: Optional[bool] = None) -> tuple[np.ndarray, np.ndarray]:
    """The tiled forward's gradients: d-features input-stationary, d-weights summed per work item in order.

    Args:
        source: ``[N_src, a]`` the forward's input, C-contiguous float32/float64.
        grad: ``[N_dst, b]`` the output gradient, C-contiguous, ``source``'s dtype.
        plan: the reversed pairs' `tile_plan` (keys: source rows), ``tile_items`` of the backward's sizes.
        matrices: ``[K, a, b]``, ``source``'s dtype.
        pairs: the number of pairs.
        compiled: the compiled kernels or their NumPy twin (default: `compiled_kernel` of the work).

    Returns:
        ``(grad_source [N_src, a], grad_matrices [K, a, b])``.
    """
    volume, in_channels, out_channels = matrices.shape
    grad_matrices = np.zeros(matrices.shape, dtype=source.dtype)
    if source.shape[0] == 0 or volume == 0 or pairs == 0 or in_channels == 0 or out_channels == 0:
        return np.zeros(source.shape, dtype=source.dtype), grad_matrices
    if not compiled_kernel(pairs * (in_channels + out_channels), compiled):
        return _tile_twins.tiled_backward(source, grad, plan, matrices)
    grad_source = np.empty(source.shape, dtype=source.dtype)
    partial = np.empty(((plan.starts.shape[0] - 1) // volume, volume, in_channels, out_channels), dtype=source.dtype)
    transposed = np.ascontiguousarray(matrices.transpose(0, 2, 1))
    kernels = _tile_sources()
    with kernel_threads(pairs * (in_channels + out_channels)) as lanes:
        kernels.tiled_backward_kernel(source, grad, plan.starts, plan.sources, plan.local_rows, transposed, grad_source,
                                      partial, plan.capacity, plan.most, gemm_chunk_rows(in_channels, out_channels),
                                      lanes)
    with kernel_threads(partial.size) as lanes:  # a sum of a few MB: the calling thread alone (no wake-up)
        kernels.sum_partials(partial, grad_matrices, lanes)
    return grad_source, grad_matrices
