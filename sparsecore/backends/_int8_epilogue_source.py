"""The compiled stand-alone int8 epilogue of `sparsecore.backends._int8_cpu_kernels` (imported on first use).

A module of its own (importing numba at its top, like `_cpu_kernel_sources`) so
that numba's on-disk cache keys the kernel on plain module globals: the steps
are `_cpu_kernel_sources.int8_epilogue_row`, inlined, the same ones the int8
row kernel runs after its int32 sums.
"""

from __future__ import annotations

from typing import Any

from numba import njit, prange

from ._cpu_kernel_sources import int8_epilogue_row

__all__ = ["ROW_BLOCK", "int8_epilogue"]

ROW_BLOCK = 64
"""Rows per ``prange`` work item (a fixed split: the result does not depend on the thread count)."""


@njit(parallel=True, cache=True, nogil=True)
def int8_epilogue(values: Any, multiplier: Any, bias: Any, has_bias: bool, residual: Any, has_residual: bool,
                  residual_scale: Any, relu: bool, output_scale: Any, quantize: bool, out: Any) -> None:
    """``out[r] = epilogue(values[r])`` for every row (float32 sums in; int8 or float32 ``out``)."""
    rows = values.shape[0]
    for item in prange((rows + ROW_BLOCK - 1) // ROW_BLOCK):
        for row in range(item * ROW_BLOCK, min(rows, (item + 1) * ROW_BLOCK)):
            int8_epilogue_row(values[row], row, multiplier, bias, has_bias, residual, has_residual, residual_scale,
                              relu, output_scale, quantize, out)
