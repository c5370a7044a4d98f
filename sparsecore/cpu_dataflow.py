"""The CPU side of the convolution feature passes: which dataflow runs a layer, on how many threads.

Three dataflows compute a conv pass on the NumPy backend (`sparsecore.conv`):

- per offset: gather the offset's input rows, one BLAS GEMM, scatter-add the
  products (the dataflow every backend runs);
- tiled: per fixed block of 2,048 destination rows and per offset, the paired
  rows copied into a tile that stays in cache, BLAS GEMMs (in slices of at most
  10^6 multiply-adds, `_cpu_kernels.gemm_chunk_rows`), the products
  added into the block (`sparsecore.backends._tile_kernel_sources`), over a
  tile plan built once per rulebook (`tile_plan`); the backward runs
  input-stationary and adds each block's d-weights share in block order;
- fused: a compiled output-stationary loop over a neighbour table
  (`sparsecore.backends._cpu_kernels`), each destination row summing its
  offsets in a fixed order, with no intermediate arrays.

`dataflow_on_cpu` chooses per layer and per stage from the channel counts and
the groups alone, never from the thread count, so results stay bitwise
identical at every thread count. Every ungrouped layer runs tiled: interleaved
A/B runs of the three dataflows, forced per layer, on the real scan (125,562
voxels, SubMConv3d k3, 788,888 pairs; "s2": SparseConv3d k3 s2 p1, 422,946
pairs) at one thread on the 2-core machine, 2026-12-03 20:10 UTC, medians of
3 x 3 runs, forward / backward in ms:

=================  ===============  ===============  ===============
layer              per offset       fused            tiled
=================  ===============  ===============  ===============
4 -> 4             8.5 / 12.1       18.1 / 23.9      7.6 / 11.6
1 -> 4             12.5 / 11.1      17.5 / 26.7      8.6 / 11.7
1 -> 16            56.9 / 22.0      17.6 / 38.2      11.0 / 14.8
3 -> 16            36.8 / 42.9      19.6 / 77.8      13.4 / 21.5
8 -> 8             23.5 / 46.2      23.5 / 41.9      13.5 / 21.0
16 -> 16           52.1 / 86.9      24.3 / 72.4      17.8 / 26.1
16 -> 32           80.5 / 129.7     35.6 / 100.0     28.4 / 41.8
32 -> 32           107.6 / 188.8    53.1 / 153.2     38.5 / 66.0
32 -> 32 s2        60.3 / 102.5     46.8 / 101.6     24.6 / 37.5
=================  ===============  ===============  ===============

(A second run at one thread: 4 -> 4 15.2 / 20.1 per offset, 13.9 / 20.3
tiled; 1 -> 4 18.9 / 13.2 and 8.4 / 11.4. At two threads the per-offset
passes lost 2-14x: 4 -> 4 36.6 / 51.8 against 6.6 / 9.5 tiled.) Wider layers
were measured before (16:00 UTC, tiled against per offset: 64 -> 64 115.0 /
234.1 vs 225.8 / 394.5; 128 -> 128 353.1 / 815.0 vs 612.4 / 975.3; 64 -> 128
s2 107.1 / 197.5 vs 207.7 / 311.1). Until the tile plan (2026-12-03 19:40)
the tiled passes listed their pairs from a neighbour table on every pass, and
the narrowest layers (below 3 x 16) ran per offset, the 16 -> 32 forward on a
narrow fused kernel.

Grouped layers keep the earlier rule (fused forward up to 64 x 64 per group,
fused backward up to 8 x 8; measured before the tiled dataflow existed:
depthwise 64 channels fused 102 / 500 ms against 460 / 742 per offset). On
the CPU, BLAS runs on one thread inside a pass; the tiled and fused kernels
split work into fixed blocks of rows on `sparsecore.threads`' thread count,
and the per-offset products run side by side on it, summed in offset order.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Any, Callable, Sequence

import numpy as np

from . import memory_budget, threads
from ._conv_products import grouped_outer
from .backends import ArrayBackend, NumpyBackend
from .backends import _cpu_kernels
from .rulebook import PairMap, Rulebook

__all__ = [
    "FUSED_MAX_MATRIX",
    "FUSED_GROUPED_BACKWARD_MAX_MATRIX",
    "dataflow_on_cpu",
    "fused_on_cpu",
    "cpu_blas_threads",
    "pass_workers",
    "map_in_order",
    "waves",
    "neighbour_table",
    "tile_plan",
    "fused_forward",
    "fused_backward",
    "tiled_forward",
    "tiled_backward",
]

FUSED_MAX_MATRIX = 64 * 64
"""Largest per-group weight matrix (``in_per_group * out_per_group``) of a grouped layer run by the
fused CPU kernels; larger ones run per-offset BLAS GEMMs."""

FUSED_GROUPED_BACKWARD_MAX_MATRIX = 8 * 8
"""A grouped layer's backward runs fused up to this per-group matrix (the per-offset backward was as
fast or faster above it)."""


def dataflow_on_cpu(backend: ArrayBackend, in_channels: int, out_channels: int, groups: int,
                    stage: str = "forward") -> str:
    """Which dataflow runs a layer's pass: ``"per_offset"``, ``"fused"`` or ``"tiled"``.

    Off the NumPy backend always ``"per_offset"``. Ungrouped layers run ``"tiled"`` (BLAS on
    cached tiles, both stages). Grouped layers run ``"fused"`` up to `FUSED_MAX_MATRIX` per
    group in the forward and up to `FUSED_GROUPED_BACKWARD_MAX_MATRIX` in the backward, else
    ``"per_offset"``. The choice depends on sizes only, never on the thread count, so results
    stay bitwise identical at every thread count (the measurements are in this module's
    docstring).

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
    if groups == 1:
        return "tiled"
    matrix = (in_channels // groups) * (out_channels // groups)
    limit = FUSED_GROUPED_BACKWARD_MAX_MATRIX if stage == "backward" else FUSED_MAX_MATRIX
    return "fused" if matrix <= limit else "per_offset"


def fused_on_cpu(backend: ArrayBackend, in_channels: int, out_channels: int, groups: int,
                 stage: str = "forward") -> bool:
    """Whether `dataflow_on_cpu` picks the fused compiled row loops (`sparsecore.backends._cpu_kernels`)."""
    return dataflow_on_cpu(backend, in_channels, out_channels, groups, stage) == "fused"


def cpu_blas_threads(backend: ArrayBackend) -> contextlib.AbstractContextManager[Any]:
    """On the NumPy backend, BLAS on one thread inside the pass; the pass itself runs offsets in parallel.

    Also warns once where the OpenMP runtime spins on a busy machine (`threads.warn_if_spinning_under_load`).

    OpenBLAS's results for one product differ in the last bits between processes
    started with different thread counts; one BLAS thread per product, with the
    products of several offsets computed side by side (`map_in_order`), keeps
    every CPU pass bitwise identical at every thread count.
    """
    if isinstance(backend, NumpyBackend):
        threads.warn_if_spinning_under_load()
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
    return _derived_layout(rulebook, direction, f"neighbour_table_{direction}", _cpu_kernels.neighbour_table)


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


def tile_plan(rulebook: Rulebook | PairMap, direction: str, items: int) -> _cpu_kernels.TilePlan:
    """The rulebook's pairs grouped for the tiled kernels (`_cpu_kernels.tile_plan`), built once per
    rulebook, direction and work-item size.

    Memoised in the map's ``derived`` slot as `neighbour_table`: a forward and every layer sharing the
    rulebook build it once. It holds the pairs themselves (``8 * P`` bytes and ``8 * W * K``), not a
    table with a slot per row and offset, and the passes read each work item's pairs of an offset as
    one run instead of listing them from a table on every pass.

    Args:
        rulebook: the layer's rulebook.
        direction: ``"forward"`` (keys: output rows, sources: input rows) or ``"backward"`` (keys:
            input rows, sources: output rows).
        items: table blocks per work item (`_cpu_kernels.tile_items`).

    Returns:
        The plan; read only.
    """
    return _derived_layout(rulebook, direction, f"tile_plan_{direction}_{items}",
                           lambda keys, values, offset_starts, rows: _cpu_kernels.tile_plan(
                               keys, values, offset_starts, rows, items), items * _cpu_kernels.ROW_BLOCK)


def _derived_layout(rulebook: Rulebook | PairMap, direction: str, key: str, build: Callable[..., Any],
                    rows_per_item: int = 0) -> Any:
    """``pair_map.derived[key]``, first built by ``build(keys, values, offset_starts, rows)`` from the
    pairs seen from ``direction`` (forward: keyed by output rows; backward: by input rows); a tile plan
    (``rows_per_item`` > 0) or a neighbour table, refused beyond `sparsecore.memory_budget`'s budget."""
    pair_map = rulebook.pair_map if isinstance(rulebook, Rulebook) else rulebook
    layout = pair_map.derived.get(key)
    if layout is None:
        if direction == "forward":
            keys, values, rows = pair_map.pair_output, pair_map.pair_input, pair_map.num_output
        elif direction == "backward":
            keys, values, rows = pair_map.pair_input, pair_map.pair_output, pair_map.num_input
        else:
            raise ValueError(f"direction must be 'forward' or 'backward', got {direction!r}")
        # refused before it allocates when it would pass the memory budget
        memory_budget.check_layout("tile plan" if rows_per_item else "neighbour table", rows,
                                   pair_map.kernel_volume, pair_map.num_pairs, rows_per_item)
        layout = build(keys, values, tuple(pair_map.offset_starts), rows)
        pair_map.derived[key] = layout
    return layout


def tiled_forward(source: Any, matrices: Any, rulebook: Rulebook | PairMap, out: Any) -> None:
    """``out += conv(source)`` on the tiled dataflow (one group), output-stationary over the forward plan.

    Args:
        source: ``[N_in, a]`` C-contiguous float32/float64.
        matrices: ``[K, 1, a, b]``, ``source``'s dtype.
        rulebook: the layer's rulebook.
        out: ``[N_out, b]`` C-contiguous, holding the initial values (zeros or the bias).
    """
    items = _cpu_kernels.tile_items(-(-rulebook.num_output // _cpu_kernels.ROW_BLOCK))
    _cpu_kernels.tiled_forward(source, tile_plan(rulebook, "forward", items),
                               np.ascontiguousarray(matrices[:, 0]), out, rulebook.num_pairs)


def tiled_backward(source: Any, grad: Any, matrices: Any, rulebook: Rulebook | PairMap) -> tuple[Any, Any]:
    """Both gradients of `tiled_forward`, input-stationary over the backward plan.

    Args:
        source: ``[N_in, a]`` the forward's features, C-contiguous.
        grad: ``[N_out, b]`` the output gradient, C-contiguous.
        matrices: ``[K, 1, a, b]``.
        rulebook: the layer's rulebook.

    Returns:
        ``(grad_features [N_in, a], grad_matrices [K, 1, a, b])`` in ``source``'s dtype.
    """
    volume, _, in_channels, out_channels = matrices.shape
    items = _cpu_kernels.tile_items(-(-rulebook.num_input // _cpu_kernels.ROW_BLOCK), volume, in_channels,
                                    out_channels, source.itemsize, rulebook.num_pairs)
    grad_features, grad_matrices = _cpu_kernels.tiled_backward(
        source, grad, tile_plan(rulebook, "backward", items), matrices[:, 0], rulebook.num_pairs)
    return grad_features, grad_matrices[:, None]
