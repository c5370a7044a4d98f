"""Pair layouts the kernel backend builds in one launch each, where the generic code takes many array operations.

On the GPU every array operation costs host time (about 20 us of CuPy on an
H200's host, 2026-12-04), so layouts that depend on a rulebook's pairs alone
are written by one kernel (``kernels_cu/rulebook.cu``, section 3):

- `chunk_layout`: a chunk of kernel offsets laid out ``[m, W]`` with its
  scatter table (``sc_chunk_layout``), for `sparsecore._conv_products.chunk_layout`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._kernel_pairs import ScatterPlan
from ._launch import KernelDevice, check_row_count

__all__ = ["chunk_layout"]


def chunk_layout(device: KernelDevice, pair_input: Any, pair_output: Any, starts: tuple[int, ...],
                 counts: tuple[int, ...], width: int, write_output: bool,
                 num_rows: int) -> tuple[Any, Any, ScatterPlan]:
    """A chunk's ``[m, W]`` rows and its `ScatterPlan` in one ``sc_chunk_layout`` launch.

    Args:
        device: the kernel device.
        pair_input, pair_output: int32 ``[P]``, the rulebook's pairs.
        starts, counts: host ints, the first pair and the pair count of each of the ``m`` offsets.
        width: ``W >= max(counts)``.
        write_output: the pass writes output rows (forward) rather than input rows (backward).
        num_rows: the rows the pass writes.

    Returns:
        ``(input_rows [m * W], output_rows [m * W], plan)``, -1 in the padding.
    """
    xp = device.xp
    m, width, num_rows = len(starts), int(width), int(num_rows)
    if len(counts) != m or m == 0 or width < max(counts):
        raise ValueError(f"chunk_layout: {m} starts and {len(counts)} counts (at most {width} each) are needed")
    check_row_count(m * width, "chunk layout", "chunk_layout")
    check_row_count(num_rows, "num_rows", "chunk_layout")
    starts_counts = xp.asarray(np.array([starts, counts], dtype=np.int64))  # one host-to-device copy
    input_rows = xp.empty(m * width, dtype=xp.int32)
    output_rows = xp.empty(m * width, dtype=xp.int32)
    slots = xp.full((m, num_rows + 1), -1, dtype=xp.int32)
    device.run("sc_chunk_layout", (), m * width,
               (xp.ascontiguousarray(pair_input, dtype=xp.int32), xp.ascontiguousarray(pair_output, dtype=xp.int32),
                starts_counts, np.int64(m), np.int64(width), np.int32(int(write_output)), np.int64(num_rows),
                input_rows, output_rows, slots))
    return input_rows, output_rows, ScatterPlan(m * width, num_rows, None, slots)
