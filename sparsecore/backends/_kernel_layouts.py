"""Pair layouts the kernel backend builds in one launch each, where the generic code takes many array operations.

On the GPU every array operation costs host time (about 20 us of CuPy on an
H200's host, 2026-12-04), so layouts that depend on a rulebook's pairs alone
are written by one kernel each (``kernels_cu/rulebook.cu``, sections 3 and 4):

- `chunk_layout`: a chunk of kernel offsets laid out ``[m, W]`` with its
  scatter table (``sc_chunk_layout``), for `sparsecore._conv_products.chunk_layout`;
- `mirrored_pairs`: a submanifold rulebook's pairs from the compacted half
  below the centre (``sc_mirror_pairs``), for `sparsecore.rulebook`, in place of
  a gather, 27 slices and two 27-piece concatenations.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._kernel_pairs import ScatterPlan
from ._launch import KernelDevice, check_integer_vector, check_row_count

__all__ = ["chunk_layout", "mirrored_pairs"]


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


def mirrored_pairs(device: KernelDevice, found_rows: Any, columns: Any, sorted_rows: Any,
                   half_starts: tuple[int, ...], num_sites: int) -> tuple[Any, Any, tuple[int, ...]]:
    """A submanifold rulebook's pairs, grouped by kernel offset, in one ``sc_mirror_pairs`` launch.

    Args:
        device: the kernel device.
        found_rows: int32 ``[H]``, the input row of each pair of the offsets below the centre.
        columns: int32 ``[H]``, the sorted-key position of each such pair's output site.
        sorted_rows: integer ``[N]``, the row of each site in key order.
        half_starts: ``c + 1`` host ints, the first pair of each offset below the centre ``c``.
        num_sites: ``N``.

    Returns:
        ``(pair_input, pair_output, starts)``: int32 ``[2 * H + N]`` each and the ``2 * c + 2``
        offset starts. Offsets below the centre keep their pairs, the centre is the identity,
        and offset ``K - 1 - o`` is offset ``o`` with inputs and outputs swapped.
    """
    xp = device.xp
    check_integer_vector(found_rows, "found_rows", "mirrored_pairs")
    check_integer_vector(columns, "columns", "mirrored_pairs")
    half, num_sites, centre = int(found_rows.shape[0]), int(num_sites), len(half_starts) - 1
    if centre < 0 or half_starts[0] != 0 or half_starts[-1] != half or int(columns.shape[0]) != half:
        raise ValueError(f"mirrored_pairs: half_starts must run from 0 to {half} (the pairs found), "
                         f"got {tuple(half_starts)} for {int(columns.shape[0])} columns")
    total = 2 * half + num_sites
    check_row_count(total, "pairs", "mirrored_pairs")
    lengths = [stop - start for start, stop in zip(half_starts[:-1], half_starts[1:])]
    starts = list(half_starts) + [half + num_sites]
    for length in reversed(lengths):
        starts.append(starts[-1] + length)
    pair_input = xp.empty(total, dtype=xp.int32)
    pair_output = xp.empty(total, dtype=xp.int32)
    if total:
        device.run("sc_mirror_pairs", (), half + num_sites,
                   (xp.ascontiguousarray(found_rows, dtype=xp.int32), xp.ascontiguousarray(columns, dtype=xp.int32),
                    xp.ascontiguousarray(sorted_rows, dtype=xp.int64),
                    xp.asarray(np.asarray(half_starts, dtype=np.int64)), np.int32(centre), np.int64(half),
                    np.int64(num_sites), pair_input, pair_output))
    return pair_input, pair_output, tuple(starts)
