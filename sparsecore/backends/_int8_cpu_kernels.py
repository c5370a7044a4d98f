"""Compiled CPU kernel of the int8 conv (numba, compiled on first use).

`int8_rows` computes, for every output row ``d``,
``acc[d] = sum_k x[table[d, k]] @ block-diagonal(W_k)`` with int8 inputs, int16
weights and int32 accumulators, then the float32 epilogue of `sparsecore.int8`
(the same steps as `_numpy_int8.apply_epilogue`, each rounded once): output-stationary (each row's neighbours read
once, its sums kept in a row buffer, written once), no intermediate arrays,
exact (the int32 bound is checked by `sparsecore.int8`), bitwise identical at
every thread count (a row is one thread's; the threads claim fixed blocks of rows,
`_work_queue`; small layers run on the calling thread, `_cpu_kernels.kernel_threads`).
Channel counts become compile-time constants for layers of at least
`SPECIALISE_MIN_PAIR_MACS` multiply-adds, where they let LLVM keep a row's
sums in vector registers; smaller layers share one generic kernel. `epilogue` runs
that same epilogue alone, in one pass, on float32 sums computed elsewhere (the
exact float32 pass of `sparsecore.int8_cpu_dataflow`). Kernels
use numba's on-disk cache. numba is imported only when a kernel is first
needed; `available` says whether it can be. Threads: numba's pool, as set by
`sparsecore.set_num_threads` (the result does not depend on it).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ._cpu_kernels import kernel_threads

__all__ = ["ROW_BLOCK", "SPECIALISE_MIN_PAIR_MACS", "available", "neighbour_table", "int8_rows", "epilogue"]

ROW_BLOCK = 64
"""Output rows per work item (a fixed split, independent of the thread count)."""

SPECIALISE_MIN_PAIR_MACS = 100_000_000
"""A layer's ``pairs * in_per_group * out_channels`` from which its channel counts are compiled in."""


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether numba imports here (loaded as the float passes load it, so its thread pool is
    sized by `sparsecore.threads` whichever pass comes first)."""
    from ..threads import numba_module

    try:
        numba_module()
    except ImportError:
        return False
    return True


def neighbour_table(pair_input: np.ndarray, pair_output: np.ndarray, offset_starts: tuple[int, ...],
                    num_output: int) -> np.ndarray:
    """int32 ``[num_output, K]``: the input row paired with each output row through each offset, or -1."""
    volume = len(offset_starts) - 1
    table = np.full((num_output, volume), -1, dtype=np.int32)
    counts = np.diff(np.asarray(offset_starts, dtype=np.int64))
    offsets = np.repeat(np.arange(volume, dtype=np.intp), counts)
    np.put(table, pair_output.astype(np.intp) * volume + offsets, pair_input)  # a flat put: ~4x a 2-D fancy store
    return table


@functools.lru_cache(maxsize=None)
def _rows_kernel(groups: int, in_per_group: int, out_per_group: int, quantize: bool) -> Any:
    from .._compile_notice import numba_for_kernels

    numba_for_kernels()  # sizes numba's thread pool before the kernels' module imports numba
    from . import _cpu_kernel_sources

    return _cpu_kernel_sources.make_int8_rows_kernel(groups, in_per_group, out_per_group, ROW_BLOCK, quantize)


def int8_rows(source: np.ndarray, table: np.ndarray, matrices: np.ndarray, pairs: int, epilogue: Any) -> np.ndarray:
    """The int8 conv of every output row, sums and epilogue fused.

    ``acc[d] = sum_k source[table[d, k]] @ block-diagonal(matrices[k])`` in int32, then the
    epilogue of `sparsecore.int8` (``epilogue``: a `_numpy_int8.Int8Epilogue` on NumPy arrays).

    Args:
        source: int8 ``[N, groups * a]``, C-contiguous.
        table: int32 ``[M, K]`` from `neighbour_table`.
        matrices: int16 ``[K, groups, a, b]``, C-contiguous.
        pairs: the number of pairs (decides whether the channel counts are compiled in).
        epilogue: scales, bias, residual, relu and output scale.

    Returns:
        int8 ``[M, groups * b]`` with ``epilogue.output_scale``, else float32.
    """
    _, groups, in_per_group, out_per_group = matrices.shape
    quantize = epilogue.output_scale is not None
    out = np.empty((table.shape[0], groups * out_per_group), dtype=np.int8 if quantize else np.float32)
    if out.size == 0:
        return out
    constants = (groups, in_per_group, out_per_group)
    if pairs * in_per_group * groups * out_per_group < SPECIALISE_MIN_PAIR_MACS:
        constants = (0, 0, 0)
    kernel = _rows_kernel(*constants, quantize)
    has_bias, has_residual = epilogue.bias is not None, epilogue.residual is not None
    with kernel_threads(pairs * groups * (in_per_group + out_per_group)) as lanes:
        kernel(source, table, matrices, np.ascontiguousarray(epilogue.multiplier, dtype=np.float32),
               np.ascontiguousarray(epilogue.bias if has_bias else np.zeros(1), dtype=np.float32), has_bias,
               np.ascontiguousarray(epilogue.residual if has_residual else np.zeros((1, 1)), dtype=np.int8),
               has_residual, np.float32(epilogue.residual_scale), bool(epilogue.relu),
               np.float32(epilogue.output_scale if quantize else 1), out, lanes)
    return out


def _epilogue_kernel() -> Any:
    from .._compile_notice import numba_for_kernels

    numba_for_kernels()  # sizes numba's thread pool before the kernel's module imports numba
    from ._int8_epilogue_source import int8_epilogue

    return int8_epilogue


def epilogue(values: np.ndarray, epilogue_steps: Any) -> np.ndarray:
    """The epilogue of `sparsecore.int8` on float32 sums, one compiled pass (the twin: `_numpy_int8.apply_epilogue`).

    Args:
        values: float32 ``[M, C_out]``, ``float32(acc)`` (an exact integer sum, rounded once).
        epilogue_steps: a `_numpy_int8.Int8Epilogue` on NumPy arrays.

    Returns:
        int8 ``[M, C_out]`` with ``epilogue_steps.output_scale``, else float32 (``values``, overwritten).
    """
    quantize = epilogue_steps.output_scale is not None
    values = np.ascontiguousarray(values, dtype=np.float32)
    out = np.empty(values.shape, dtype=np.int8) if quantize else values
    if values.size == 0:
        return out
    has_bias, has_residual = epilogue_steps.bias is not None, epilogue_steps.residual is not None
    _epilogue_kernel()(
        values, np.ascontiguousarray(epilogue_steps.multiplier, dtype=np.float32),
        np.ascontiguousarray(epilogue_steps.bias if has_bias else np.zeros(1), dtype=np.float32), has_bias,
        np.ascontiguousarray(epilogue_steps.residual if has_residual else np.zeros((1, 1)), dtype=np.int8),
        has_residual, np.float32(epilogue_steps.residual_scale), bool(epilogue_steps.relu),
        np.float32(epilogue_steps.output_scale if quantize else 1), quantize, out)
    return out
