"""The CPU side of the convolution feature passes: which dataflow runs a layer, on how many threads.

Two dataflows compute a conv pass on the NumPy backend (`sparsecore.conv`):

- per offset: gather the offset's input rows, one BLAS GEMM, scatter-add the
  products (the dataflow every backend runs);
- fused: a compiled output-stationary loop over a neighbour table
  (`sparsecore.backends._cpu_kernels`), each destination row summing its
  offsets in a fixed order, with no intermediate arrays.

`fused_on_cpu` chooses per layer and per stage from the per-group weight
matrix and the groups alone, never from the thread count, so results stay
bitwise identical at every thread count. The thresholds come from interleaved
A/B runs of both dataflows on the real scan (125,562 voxels, SubMConv3d k3,
788,888 pairs; the s2 rows SparseConv3d k3 s2 p1, 422,946 pairs) at one thread
on the shared 2-core machine, wall-time medians of 5-7 runs, forward /
backward in ms (fused vs per offset). The narrow rows (16 and 32 channels) were
measured at 14:13 UTC on 2026-12-03 (1-minute load average 3.3-3.5) with the
narrow kernel and the neighbour tables memoised per rulebook (`neighbour_table`);
the other rows earlier that day (load average 0.8 for the 64 rows, 2.2-2.8 for
the 4, 48 and grouped rows), with the table rebuilt by every fused pass
(8-13 ms of each fused time there):

=================  ===================  ===================
layer              forward              backward
=================  ===================  ===================
4 -> 4             61 vs 20             69 vs 31
16 -> 16           20 vs 31             49 vs 60
16 -> 32           28 vs 51             75 vs 80
32 -> 16           33 vs 48             81 vs 108
32 -> 32           57 vs 86             133 vs 148
32 -> 32 s2        50 vs 48             88 vs 77
48 -> 48           155 vs 221           342 vs 348
64 -> 64           174 vs 183           391 vs 351
64 -> 64 s2        111 vs 96            195 vs 190
64, 64 groups      102 vs 460           500 vs 742
64, 16 groups      121 vs 275           356 vs 486
64, 8 groups       139 vs 270           402 vs 419
64, 4 groups       213 vs 214           419 vs 369
128, 2 groups      378 vs 620           1142 vs 1028
=================  ===================  ===================

Ungrouped layers of 16 to 32 channels run the narrow kernel
(`_cpu_kernels.is_narrow`), which keeps each output column's sum in a register:
it beats the per-offset gathers, GEMMs and scatters in the forward, and in the
backward's d-features when the layer does not widen (16 -> 32 backward was a tie,
75-140 vs 80-122 ms over two runs; the strided 32 -> 32 rows moved either way
between runs, 58 vs 65 and 111 vs 114 ms in the first). Below 16 x 16 the
generic kernel loses to the per-offset dataflow (4 -> 4). Grouped layers run one
small batched GEMM per offset on the per-offset dataflow, which the fused loop
beats. On the CPU, BLAS runs on one thread inside a pass and the per-offset
products run side by side on `sparsecore.threads`' thread count, summed in
offset order.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Any, Callable, Sequence

import numpy as np

from . import threads
from ._conv_products import grouped_outer
from .backends import ArrayBackend, NumpyBackend
from .backends import _cpu_kernels
from .rulebook import PairMap, Rulebook

__all__ = [
    "FUSED_MAX_MATRIX",
    "TILED_MIN_MATRIX",
    "NARROW_FORWARD_MAX_CHANNELS",
    "FUSED_GROUPED_BACKWARD_MAX_MATRIX",
    "dataflow_on_cpu",
    "fused_on_cpu",
    "cpu_blas_threads",
    "pass_workers",
    "map_in_order",
    "waves",
    "neighbour_table",
    "fused_forward",
    "fused_backward",
    "tiled_forward",
    "tiled_backward",
]

FUSED_MAX_MATRIX = 64 * 64
"""Largest per-group weight matrix (``in_per_group * out_per_group``) of a grouped layer run by the
fused CPU kernels; larger ones run per-offset BLAS GEMMs."""

TILED_MIN_MATRIX = 3 * 16
"""Smallest ``in_channels * out_channels`` of an ungrouped layer run by the tiled dataflow; narrower
layers (4 -> 4, 1 -> 4) are bound by their gathers and run per offset."""

NARROW_FORWARD_MAX_CHANNELS = 16
"""An ungrouped layer that widens from at most this many channels to at most 32 (16 -> 32) runs its
forward on the fused narrow kernel rather than the tiled one."""

FUSED_GROUPED_BACKWARD_MAX_MATRIX = 8 * 8
"""A grouped layer's backward runs fused up to this per-group matrix (the per-offset backward was as
fast or faster above it)."""


def dataflow_on_cpu(backend: ArrayBackend, in_channels: int, out_channels: int, groups: int,
                    stage: str = "forward") -> str:
    """Which dataflow runs a layer's pass: ``"per_offset"``, ``"fused"`` or ``"tiled"``.

    Off the NumPy backend always ``"per_offset"``. Ungrouped layers of at least
    `TILED_MIN_MATRIX` run ``"tiled"`` (BLAS on cached tiles, both stages), except the
    forward of narrow layers widening from `NARROW_FORWARD_MAX_CHANNELS` (16 -> 32), which
    runs ``"fused"``; smaller ungrouped layers run ``"per_offset"``. Grouped layers run ``"fused"``
    up to `FUSED_MAX_MATRIX` per group in the forward and up to
    `FUSED_GROUPED_BACKWARD_MAX_MATRIX` in the backward, else ``"per_offset"``. The choice
    depends on sizes only, never on the thread count, so results stay bitwise identical at
    every thread count (the measurements are in this module's docstring).

    Args:
        backend: the layer's backend.
        in_channels: input channels.
        out_channels: output channels.
        groups: channel groups.
        stage: ``"forward"`` or ``"backward"``.

    Returns:
        The dataflow's name.
    """
    if not isinstance(backend, NumpyBackend):
        return "per_offset"
    in_per_group, out_per_group = in_channels // groups, out_channels // groups
    matrix = in_per_group * out_per_group
    if groups == 1:
        if matrix < TILED_MIN_MATRIX:
            return "per_offset"
        if (stage == "forward" and _cpu_kernels.is_narrow(1, in_per_group, out_per_group)
                and in_per_group <= NARROW_FORWARD_MAX_CHANNELS < out_per_group):
            return "fused"
        return "tiled"
    limit = FUSED_GROUPED_BACKWARD_MAX_MATRIX if stage == "backward" else FUSED_MAX_MATRIX
    return "fused" if matrix <= limit else "per_offset"


def fused_on_cpu(backend: ArrayBackend, in_channels: int, out_channels: int, groups: int,
                 stage: str = "forward") -> bool:
    """Whether `dataflow_on_cpu` picks the fused compiled row loops (`sparsecore.backends._cpu_kernels`)."""
    return dataflow_on_cpu(backend, in_channels, out_channels, groups, stage) == "fused"


def cpu_blas_threads(backend: ArrayBackend) -> contextlib.AbstractContextManager[Any]:
    """On the NumPy backend, BLAS on one thread inside the pass; the pass itself runs offsets in parallel.

    OpenBLAS's results for one product differ in the last bits between processes
    started with different thread counts; one BLAS thread per product, with the
    products of several offsets computed side by side (`map_in_order`), keeps
    every CPU pass bitwise identical at every thread count.
    """
    if isinstance(backend, NumpyBackend):
        return threads.blas_threads(1)
    return contextlib.nullcontext()


def pass_workers(backend: ArrayBackend, rulebook: Rulebook | PairMap, in_channels: int, out_channels: int) -> int:
    """How many offsets a pass computes side by side: `sparsecore.threads`' count on the CPU, else 1.

    Layers below `_cpu_kernels.SERIAL_MAX_WORK` (pairs times channels) run on the calling thread:
    starting workers costs more than they save there.
    """
    if not isinstance(backend, NumpyBackend):
        return 1
    if rulebook.num_pairs * (in_channels + out_channels) < _cpu_kernels.SERIAL_MAX_WORK:
        return 1
    return threads.get_num_threads()


def map_in_order(workers: int, function: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """``[function(item) for item in items]``, on ``workers`` threads when more than one (results in order)."""
    if workers <= 1 or len(items) <= 1:
        return [function(item) for item in items]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        return list(pool.map(function, items))


def waves(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    """``items`` cut into consecutive groups of ``size`` (at least 1)."""
    size = max(1, size)
    return [items[start:start + size] for start in range(0, len(items), size)]


def neighbour_table(rulebook: Rulebook | PairMap, direction: str) -> Any:
    """The rulebook's neighbour table (`_cpu_kernels.neighbour_table`), built once per rulebook.

    The table depends on the pairs alone, so it is memoised in the map's ``derived``
    slot: a forward and its backward, and every layer sharing the rulebook (an
    ``indice_key``), build it once (8-13 ms per table on the real scan; about
    ``4 * ceil(N / 64) * 64 * K`` bytes each).

    Args:
        rulebook: the layer's rulebook.
        direction: ``"forward"`` (rows: output sites, entries: input rows) or
            ``"backward"`` (rows: input sites, entries: output rows).

    Returns:
        int32 ``[ceil(rows / ROW_BLOCK), K, ROW_BLOCK]``; read only, never written.
    """
    pair_map = rulebook.pair_map if isinstance(rulebook, Rulebook) else rulebook
    key = f"neighbour_table_{direction}"
    table = pair_map.derived.get(key)
    if table is None:
        if direction == "forward":
            keys, values, rows = pair_map.pair_output, pair_map.pair_input, pair_map.num_output
        elif direction == "backward":
            keys, values, rows = pair_map.pair_input, pair_map.pair_output, pair_map.num_input
        else:
            raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
        table = _cpu_kernels.neighbour_table(keys, values, tuple(pair_map.offset_starts), rows)
        table.setflags(write=False)
        pair_map.derived[key] = table
    return table


def fused_forward(source: Any, matrices: Any, rulebook: Rulebook | PairMap, out: Any) -> None:
    """``out += conv(source)``, output-stationary over the rulebook's neighbour table.

    Args:
        source: ``[N_in, g * a]`` C-contiguous float32/float64.
        matrices: ``[K, g, a, b]`` C-contiguous, ``source``'s dtype.
        rulebook: the layer's rulebook.
        out: ``[N_out, g * b]`` C-contiguous, holding the initial values (zeros or the bias).
    """
    _cpu_kernels.accumulate_rows(source, neighbour_table(rulebook, "forward"), matrices, out, rulebook.num_pairs)


def fused_backward(backend: ArrayBackend, source: Any, grad: Any, matrices: Any,
                   rulebook: Rulebook | PairMap) -> tuple[Any, Any]:
    """d-features input-stationary over the transposed map (fused); d-weights one BLAS GEMM per offset.

    Per-offset ``gathered_source^T @ gathered_grad`` on BLAS beat a compiled
    blocked outer-product kernel 2-4x at 16 and 64 channels.

    Args:
        backend: the NumPy backend.
        source: ``[N_in, g * a]`` the forward's features, C-contiguous.
        grad: ``[N_out, g * b]`` the output gradient, C-contiguous.
        matrices: ``[K, g, a, b]`` C-contiguous.
        rulebook: the layer's rulebook.

    Returns:
        ``(grad_features [N_in, g * a], grad_matrices [K, g, a, b])`` in ``source``'s dtype.
    """
    xp = backend.xp
    starts = tuple(rulebook.offset_starts)
    table = neighbour_table(rulebook, "backward")
    grad_features = xp.zeros(source.shape, dtype=source.dtype)
    transposed = xp.ascontiguousarray(matrices.transpose(0, 1, 3, 2))
    _cpu_kernels.accumulate_rows(grad, table, transposed, grad_features, rulebook.num_pairs)
    groups = matrices.shape[1]
    grad_matrices = xp.zeros(matrices.shape, dtype=source.dtype)

    def outer(offset: int) -> Any:
        if offset == rulebook.identity_offset:  # every row to itself: no gathers
            return grouped_outer(backend, source, grad, groups)
        start, stop = starts[offset], starts[offset + 1]
        gathered_source = backend.gather_rows(source, rulebook.pair_input[start:stop])
        gathered_grad = backend.gather_rows(grad, rulebook.pair_output[start:stop])
        return grouped_outer(backend, gathered_source, gathered_grad, groups)

    offsets = [offset for offset in range(len(starts) - 1) if starts[offset + 1] > starts[offset]]
    workers = pass_workers(backend, rulebook, source.shape[1], grad.shape[1])
    for offset, product in zip(offsets, map_in_order(workers, outer, offsets)):
        grad_matrices[offset] = product
    return grad_features, grad_matrices


def tiled_forward(source: Any, matrices: Any, rulebook: Rulebook | PairMap, out: Any) -> None:
    """``out += conv(source)`` on the tiled dataflow (one group), output-stationary over the forward table.

    Args:
        source: ``[N_in, a]`` C-contiguous float32/float64.
        matrices: ``[K, 1, a, b]``, ``source``'s dtype.
        rulebook: the layer's rulebook.
        out: ``[N_out, b]`` C-contiguous, holding the initial values (zeros or the bias).
    """
    _cpu_kernels.tiled_forward(source, neighbour_table(rulebook, "forward"),
                               np.ascontiguousarray(matrices[:, 0]), out, rulebook.num_pairs)


def tiled_backward(source: Any, grad: Any, matrices: Any, rulebook: Rulebook | PairMap) -> tuple[Any, Any]:
    """Both gradients of `tiled_forward`, input-stationary over the backward table.

    Args:
        source: ``[N_in, a]`` the forward's features, C-contiguous.
        grad: ``[N_out, b]`` the output gradient, C-contiguous.
        matrices: ``[K, 1, a, b]``.
        rulebook: the layer's rulebook.

    Returns:
        ``(grad_features [N_in, a], grad_matrices [K, 1, a, b])`` in ``source``'s dtype.
    """
    grad_features, grad_matrices = _cpu_kernels.tiled_backward(
        source, grad, neighbour_table(rulebook, "backward"), matrices[:, 0], rulebook.num_pairs)
    return grad_features, grad_matrices[:, None]
