"""The kernel backend's pair primitives: compaction, conv candidates, pair scatters, max and average pooling.

Functions of a `KernelDevice` (a kernel backend's ``xp`` and launch settings),
kept apart from the hashing and row primitives of `kernel_backend` so each
module has one concern. Each makes its inputs contiguous, checks them, launches registered
``sc_*`` kernels (never a zero-block grid) and uses ``xp`` for sorts and
scans. None needs atomics, so every result is bitwise reproducible, and none
synchronises with the host except where a size must be known to allocate
(`compact_pairs`' total).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ._launch import (INT32_MAX, KernelDevice, check_float, check_integer_vector, check_row_count, check_scatter,
                      vector_width)
from ._sorting import group_starts

__all__ = ["compact_pairs", "conv_candidate_pairs", "scatter_add_rows", "scatter_add_pairs", "ScatterPlan",
           "scatter_plan", "scatter_add_planned", "max_pool_pairs", "max_pool_backward_pairs",
           "avg_pool_pairs", "avg_pool_backward_pairs"]

# Entries of a compaction tile per thread: a tile is this many times the block.
_TILE_ENTRIES_PER_THREAD = 8


def compact_pairs(device: KernelDevice, table: Any) -> tuple[Any, Any, tuple[int, ...]]:
    """Entries ``>= 0`` of an integer ``[R, L]`` table, in row-major order (see `ArrayBackend.compact_pairs`).

    Two passes of ``rulebook.cu``: ``sc_compact_count`` counts each tile's
    entries, ``xp.cumsum`` turns counts into positions, ``sc_compact_write``
    writes them; one device-to-host copy brings the per-row counts.
    """
    xp = device.xp
    if table.ndim != 2 or table.dtype.kind not in "iu":
        raise ValueError(f"compact_pairs: table must be a 2-D integer array, got {table.dtype} {tuple(table.shape)}")
    num_rows, row_length = (int(size) for size in table.shape)
    if row_length > INT32_MAX:
        raise ValueError(f"compact_pairs: rows of {row_length} entries exceed the int32 column numbers")
    values = xp.ascontiguousarray(table, dtype=xp.int32)  # entries are rows or -1: int32 holds them
    if num_rows == 0 or row_length == 0:
        empty = xp.zeros(0, dtype=xp.int32)
        return empty, empty.copy(), (0,) * (num_rows + 1)
    tile_size = device.block_threads * _TILE_ENTRIES_PER_THREAD
    tiles_per_row = -(-row_length // tile_size)
    num_tiles = num_rows * tiles_per_row
    tile_counts = xp.empty(num_tiles, dtype=xp.int64)
    device.run("sc_compact_count", (), num_tiles * device.block_threads,
               (values, np.int64(num_rows), np.int64(row_length), np.int64(tile_size), tile_counts))
    tile_offsets = xp.cumsum(tile_counts) - tile_counts
    row_counts = tile_counts.reshape(num_rows, tiles_per_row).sum(axis=1).tolist()
    starts = [0]
    for count in row_counts:
        starts.append(starts[-1] + int(count))
    columns = xp.empty(starts[-1], dtype=xp.int32)
    found = xp.empty(starts[-1], dtype=xp.int32)
    if starts[-1]:
        device.run("sc_compact_write", (), num_tiles * device.block_threads,
                   (values, np.int64(num_rows), np.int64(row_length), np.int64(tile_size), tile_offsets,
                    columns, found))
    return columns, found, tuple(starts)


def conv_candidate_pairs(device: KernelDevice, indices: Any, geometry: Any,
                         output_spatial_shape: tuple[int, ...]) -> tuple[Any, Any, tuple[int, ...]]:
    """Input rows and output keys of every valid (site, offset) pair (see `ArrayBackend.conv_candidate_pairs`).

    ``sc_regular_conv_candidates`` / ``sc_transposed_conv_candidates`` fill a
    ``[K, N]`` key table in one launch; `compact_pairs` over a table holding the
    offset where the key is valid keeps the pairs grouped by offset, rows
    increasing.
    """
    xp = device.xp
    if geometry.kind not in ("regular", "transposed"):
        raise ValueError(f"conv_candidate_pairs: geometry must be regular or transposed, got {geometry.kind!r}")
    ndim = geometry.ndim
    if indices.ndim != 2 or indices.shape[1] != ndim + 1:
        raise ValueError(f"conv_candidate_pairs: indices must be [N, {ndim + 1}], got {tuple(indices.shape)}")
    count, volume = int(indices.shape[0]), int(geometry.kernel_volume)
    check_row_count(count, "indices", "conv_candidate_pairs")
    if max(output_spatial_shape, default=0) > INT32_MAX:
        raise ValueError(f"conv_candidate_pairs: output grid {tuple(output_spatial_shape)} exceeds int32 coordinates")
    positions = np.indices(geometry.kernel_size).reshape(ndim, -1).T
    parameters = np.array([geometry.stride, geometry.padding, geometry.dilation, tuple(output_spatial_shape)])
    keys = xp.empty((volume, count), dtype=xp.int64)
    kernel = "sc_transposed_conv_candidates" if geometry.kind == "transposed" else "sc_regular_conv_candidates"
    device.run(kernel, (), volume * count,
               (xp.ascontiguousarray(indices, dtype=xp.int32), np.int64(count), np.int32(ndim),
                xp.asarray(np.ascontiguousarray(positions, dtype=np.int32)), np.int32(volume),
                xp.asarray(np.ascontiguousarray(parameters, dtype=np.int32)), keys))
    offset_of_valid = xp.where(keys >= 0, xp.arange(volume, dtype=xp.int32)[:, None], xp.int32(-1))
    rows, offsets, starts = compact_pairs(device, offset_of_valid)
    pair_keys = xp.take(keys.reshape(-1), offsets.astype(xp.int64) * count + rows)
    return rows, pair_keys, starts


def scatter_add_rows(device: KernelDevice, target: Any, rows: Any, values: Any) -> None:
    """``target[rows] += values`` in place with ``sc_scatter_add_rows_unique<T>``.

    Args:
        target: ``[N, C]`` float32/float64/float16/bfloat16, updated in place
            (a non-contiguous target is updated through a contiguous copy).
        rows: integer ``[M]`` in ``[0, N)``, unique within the call.
        values: ``[M, C]``, cast to ``target``'s dtype.
    """
    xp = device.xp
    dtype_name, count, channels = check_scatter(target, rows, values, "scatter_add_rows")
    contiguous_target = target if target.flags.c_contiguous else xp.ascontiguousarray(target)
    values = xp.ascontiguousarray(values, dtype=target.dtype)
    rows = xp.ascontiguousarray(rows, dtype=xp.int32)
    vector = vector_width(channels, target.dtype.itemsize, values, contiguous_target)
    device.run("sc_scatter_add_rows_unique", (dtype_name,), count * channels // vector,
               (values, rows, np.int64(count), np.int64(channels), np.int32(vector), contiguous_target))
    if contiguous_target is not target:
        target[...] = contiguous_target


@dataclass(frozen=True)
class ScatterPlan:
    """Where `scatter_add_planned` adds each entry: built once from the rows, reused for every values.

    Attributes:
        count: ``M``, the entries (pairs) the plan scatters.
        num_rows: ``N``, the target's rows.
        rows: int32 ``[M]`` contiguous, for a single run (``sc_scatter_add_rows_unique``); else None.
        slots: int32 ``[runs, N + 1]`` (the entry feeding each target row in each run, -1 where
            none; the last column takes the padding rows of -1), for several runs; else None.
    """

    count: int
    num_rows: int
    rows: Any
    slots: Any


def scatter_plan(device: KernelDevice, rows: Any, run_starts: tuple[int, ...], num_rows: int,
                 operation: str = "scatter_plan") -> ScatterPlan:
    """The `ScatterPlan` of ``rows`` (see `ArrayBackend.scatter_plan`): a few array operations, no launch.

    ``operation`` names the public call in error messages.
    """
    xp = device.xp
    check_integer_vector(rows, "rows", operation)
    check_row_count(int(num_rows), "num_rows", operation)
    count, num_rows = int(rows.shape[0]), int(num_rows)
    if not run_starts or run_starts[0] != 0 or run_starts[-1] != count:
        raise ValueError(f"{operation}: run_starts must run from 0 to {count} (the length of rows), got "
                         f"{tuple(run_starts)}; pass the offset starts of these rows' pairs")
    lengths = [stop - start for start, stop in zip(run_starts[:-1], run_starts[1:])]
    if sum(1 for length in lengths if length) <= 1:
        return ScatterPlan(count, num_rows, xp.ascontiguousarray(rows, dtype=xp.int32), None)
    if len(set(lengths)) == 1:  # uniform runs (the [m, W] layout; at least two are non-empty, so W > 0)
        run_of_pair = xp.arange(count, dtype=xp.int64) // lengths[0]
    else:
        run_of_pair = xp.repeat(xp.arange(len(lengths), dtype=xp.int64), lengths)
    slot_stride = num_rows + 1
    slots = xp.full((len(lengths), slot_stride), -1, dtype=xp.int32)
    column = xp.where(rows >= 0, rows, num_rows).astype(xp.int64)
    slots.reshape(-1)[run_of_pair * slot_stride + column] = xp.arange(count, dtype=xp.int32)
    slots[:, num_rows] = -1  # the spare column took the padding entries
    return ScatterPlan(count, num_rows, None, slots)


def scatter_add_planned(device: KernelDevice, target: Any, plan: ScatterPlan, values: Any,
                        operation: str = "scatter_add_planned") -> None:
    """``target[rows[p]] += values[p]`` over a `ScatterPlan`: one launch (see `scatter_add_pairs`).

    ``operation`` names the public call in error messages.
    """
    xp = device.xp
    if not isinstance(plan, ScatterPlan):
        raise TypeError(f"{operation}: plan must come from scatter_plan, got {type(plan).__name__}")
    if plan.rows is not None:
        scatter_add_rows(device, target, plan.rows, values)
        return
    dtype_name = check_float(target, "target", operation)
    channels = int(target.shape[1])
    if int(target.shape[0]) != plan.num_rows or tuple(values.shape) != (plan.count, channels):
        raise ValueError(
            f"{operation}: the plan scatters {plan.count} rows into {plan.num_rows}; got values of "
            f"shape {tuple(values.shape)} and a target of shape {tuple(target.shape)}"
        )
    if not target.flags.c_contiguous:
        raise ValueError(f"{operation}: target must be C-contiguous (it is updated in place), got strides "
                         f"{tuple(target.strides)}; pass a contiguous copy and read the result from it")
    values = xp.ascontiguousarray(values, dtype=target.dtype)
    vector = vector_width(channels, target.dtype.itemsize, values, target)
    runs, slot_stride = (int(size) for size in plan.slots.shape)
    device.run("sc_sum_run_rows", (dtype_name,), plan.num_rows * channels // vector,
               (values, plan.slots, np.int64(runs), np.int64(slot_stride), np.int64(plan.num_rows),
                np.int64(channels), np.int32(vector), target))


def scatter_add_pairs(device: KernelDevice, target: Any, rows: Any, values: Any,
                      run_starts: tuple[int, ...]) -> None:
    """``target[rows[p]] += values[p]`` (see `ArrayBackend.scatter_add_pairs`).

    One run: ``sc_scatter_add_rows_unique``. Several: one scatter fills a
    ``[runs, N + 1]`` table of slots (the pair feeding each target row in each
    run, -1 where none; rows of -1, padding, land in the spare last column),
    and ``sc_sum_run_rows`` adds each row's values in run order in the
    accumulator type (float32 for 16-bit storage), rounding once. No sort, no
    atomics, no host synchronisation. The table is `scatter_plan`'s: a pass that
    scatters through the same rows again keeps the plan (`scatter_add_planned`).
    """
    check_scatter(target, rows, values, "scatter_add_pairs")
    plan = scatter_plan(device, rows, run_starts, int(target.shape[0]), "scatter_add_pairs")
    scatter_add_planned(device, target, plan, values, "scatter_add_pairs")


def max_pool_pairs(device: KernelDevice, features: Any, pair_input: Any, pair_output: Any,
                   num_output: int) -> tuple[Any, Any]:
    """Per-output maxima over the pairs with ``sc_max_pool_forward`` (see `ArrayBackend.max_pool_pairs`).

    A stable ``xp.argsort`` of ``pair_output`` groups the pairs by output in
    pair (kernel-offset) order, so the kernel's "earliest wins ties" is the
    earliest offset's.
    """
    xp = device.xp
    dtype_name = check_float(features, "features", "max_pool_pairs")
    check_integer_vector(pair_input, "pair_input", "max_pool_pairs")
    check_integer_vector(pair_output, "pair_output", "max_pool_pairs", int(pair_input.shape[0]))
    check_row_count(int(features.shape[0]), "features", "max_pool_pairs")
    num_output, channels = int(num_output), int(features.shape[1])
    check_row_count(num_output, "the output (num_output)", "max_pool_pairs")
    out = xp.zeros((num_output, channels), dtype=features.dtype)
    argmax = xp.full((num_output, channels), -1, dtype=xp.int32)
    if pair_input.shape[0] == 0:
        return out, argmax
    order, output_starts = group_starts(xp, pair_output, num_output)
    grouped_input = xp.ascontiguousarray(xp.take(pair_input, order), dtype=xp.int32)
    device.run("sc_max_pool_forward", (dtype_name,), num_output * channels,
               (xp.ascontiguousarray(features), grouped_input, output_starts, np.int64(num_output),
                np.int64(channels), out, argmax))
    return out, argmax


def max_pool_backward_pairs(device: KernelDevice, grad_output: Any, argmax: Any, pair_input: Any,
                            pair_output: Any, num_input: int) -> Any:
    """Max-pool gradient by input with ``sc_max_pool_backward`` (see `ArrayBackend.max_pool_backward_pairs`).

    A stable ``xp.argsort`` of ``pair_input`` groups the pairs by input (pairs
    with a negative input row, padding, fall before the first group and are
    never read); each input row's gradient is summed over its group in order.
    """
    xp = device.xp
    dtype_name = check_float(grad_output, "grad_output", "max_pool_backward_pairs")
    check_integer_vector(pair_input, "pair_input", "max_pool_backward_pairs")
    check_integer_vector(pair_output, "pair_output", "max_pool_backward_pairs", int(pair_input.shape[0]))
    if tuple(argmax.shape) != tuple(grad_output.shape):
        raise ValueError(f"max_pool_backward_pairs: argmax has shape {tuple(argmax.shape)}, grad_output "
                         f"{tuple(grad_output.shape)}; they must match")
    num_input, channels = int(num_input), int(grad_output.shape[1])
    check_row_count(num_input, "the input (num_input)", "max_pool_backward_pairs")
    grad = xp.zeros((num_input, channels), dtype=grad_output.dtype)
    if pair_input.shape[0] == 0:
        return grad
    order, input_starts = group_starts(xp, pair_input, num_input)
    grouped_output = xp.ascontiguousarray(xp.take(pair_output, order), dtype=xp.int32)
    device.run("sc_max_pool_backward", (dtype_name,), num_input * channels,
               (xp.ascontiguousarray(grad_output), xp.ascontiguousarray(argmax, dtype=xp.int32), grouped_output,
                input_starts, np.int64(num_input), np.int64(channels), grad))
    return grad


def _window_starts(xp: Any, pair_input: Any, pair_output: Any, num_output: int) -> tuple[Any, Any]:
    """The pairs grouped by output, those without an input (padding) left out: ``(order, starts)``.

    ``starts[o + 1] - starts[o]`` is output ``o``'s count of active inputs, the divisor
    ``sc_avg_pool_forward`` and ``sc_avg_pool_backward`` use.
    """
    keys = xp.where(pair_input >= 0, pair_output, -1)
    return group_starts(xp, keys, num_output)


def _check_pool_pairs(features: Any, pair_input: Any, pair_output: Any, rows: int, function: str) -> str:
    dtype_name = check_float(features, "features", function)
    check_integer_vector(pair_input, "pair_input", function)
    check_integer_vector(pair_output, "pair_output", function, int(pair_input.shape[0]))
    check_row_count(rows, "the result", function)
    return dtype_name


def avg_pool_pairs(device: KernelDevice, features: Any, pair_input: Any, pair_output: Any,
                   num_output: int) -> Any:
    """Mean over each output's active inputs with ``sc_avg_pool_forward`` (see `ArrayBackend.avg_pool_pairs`).

    A stable ``xp.argsort`` groups the pairs by output in pair (kernel-offset)
    order; one thread per output element sums its group in the accumulator
    type and divides by the group's size. No gathered copy of the rows, no
    atomics, no host synchronisation.
    """
    xp = device.xp
    dtype_name = _check_pool_pairs(features, pair_input, pair_output, int(num_output), "avg_pool_pairs")
    num_output, channels = int(num_output), int(features.shape[1])
    out = xp.zeros((num_output, channels), dtype=features.dtype)
    if pair_input.shape[0] == 0:
        return out
    order, output_starts = _window_starts(xp, pair_input, pair_output, num_output)
    grouped_input = xp.ascontiguousarray(xp.take(pair_input, order), dtype=xp.int32)
    device.run("sc_avg_pool_forward", (dtype_name,), num_output * channels,
               (xp.ascontiguousarray(features), grouped_input, output_starts, np.int64(num_output),
                np.int64(channels), out))
    return out


def avg_pool_backward_pairs(device: KernelDevice, grad_output: Any, pair_input: Any, pair_output: Any,
                            num_input: int) -> Any:
    """Average-pool gradient by input with ``sc_avg_pool_backward`` (see `ArrayBackend.avg_pool_backward_pairs`).

    The pairs grouped by input (a stable ``xp.argsort``; padding falls before
    the first group) give each input's outputs in pair order; the forward's
    grouping by output gives each output's divisor.
    """
    xp = device.xp
    dtype_name = _check_pool_pairs(grad_output, pair_input, pair_output, int(num_input), "avg_pool_backward_pairs")
    num_input, num_output, channels = int(num_input), int(grad_output.shape[0]), int(grad_output.shape[1])
    grad = xp.zeros((num_input, channels), dtype=grad_output.dtype)
    if pair_input.shape[0] == 0:
        return grad
    _, output_starts = _window_starts(xp, pair_input, pair_output, num_output)
    order, input_starts = group_starts(xp, xp.where(pair_output >= 0, pair_input, -1), num_input)
    grouped_output = xp.ascontiguousarray(xp.take(pair_output, order), dtype=xp.int32)
    device.run("sc_avg_pool_backward", (dtype_name,), num_input * channels,
               (xp.ascontiguousarray(grad_output), grouped_output, input_starts, output_starts,
                np.int64(num_input), np.int64(channels), grad))
    return grad
