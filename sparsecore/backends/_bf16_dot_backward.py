"""The bfloat16 conv backward on ``vdpbf16ps`` in one pass, behind `sparsecore.backends._bf16_cpu_kernels`.

Imported on first use where the kernels use AVX-512 BF16. The same dataflow as the AMX backward
(`_bf16_amx_backward`), with the products of `_bf16_kernel_sources` instead of tiles: input-stationary
over the reversed pairs' tile plan, per work item (a block of input rows) and offset,

- the item's share of the weight gradient, ``partial[item, offset]``: the item's own source rows (in
  cache) and the paired gradient rows packed two pairs a word, summed down the pairs by `_dot_columns`;
- then the input gradient, ``sum_k grad[o] @ matrices[k]^T`` (`_dot_rows`), reading the gradient rows the
  packing has just brought into cache, added into the item's float32 sums and written once as bfloat16.

The shares are added in item order afterwards (`_tile_kernel_sources.sum_partials`). A weight gradient
per offset over every pair (removed 2026-12-07) read both rows of every pair from memory once per
offset: on the real scan it alone took longer than the float32 backward at 32 and 64 channels. Work
items are fixed by the sizes: results are bitwise the same at every thread count.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

from ._bf16_kernel_sources import _blocks_at_once, _dot_columns, _dot_rows, _pack_pair, _round_row
from ._tile_kernel_sources import PREFETCH_AHEAD, _prefetch, _work_rows
from ._work_queue import claim, new_counter  # new_counter: no parallel region of its own

__all__ = ["dot_backward_kernel"]

_OPTIONS = {"parallel": True, "cache": True, "nogil": True}


@njit(**_OPTIONS)
def dot_backward_kernel(source: Any, grad: Any, grad_words: Any, starts: Any, destinations: Any, locals_: Any,
                        matrices: Any, grad_source: Any, partial: Any, capacity: int, most: int, lanes: int) -> None:
    """Both gradients of the bfloat16 conv: ``grad_source`` and each work item's weight-gradient share.

    ``source`` uint16 ``[N_in, a]`` and ``grad`` uint16 ``[N_out, b]`` (bfloat16 bits), ``grad_words`` the
    gradient as uint32 ``[N_out, w]`` (two channels a word), the reversed pairs' plan (``starts`` int64
    ``[W * K + 1]``, ``destinations``: output rows, ``locals_``: input rows minus the item's first row, at most
    ``most`` pairs a range), ``matrices`` uint32 ``[K, w, a16]`` (the transposed weights packed),
    ``grad_source`` uint16 ``[N_in, a]`` (every row written), ``partial`` float32 ``[W, K, a16, c]`` (every
    entry written; ``c >= b`` a multiple of 16); ``lanes`` threads claim the work items.
    """
    volume, words, channels_padded = matrices.shape
    columns = partial.shape[3]
    in_channels = source.shape[1]
    rows = grad_source.shape[0]
    works = (starts.shape[0] - 1) // volume
    rows_step, share_step = _blocks_at_once(channels_padded), _blocks_at_once(columns)
    half = (most + 1) // 2
    grad_bytes = grad.shape[1] * 2
    counter = new_counter()
    for lane in prange(min(lanes, works)):  # noqa: B007 (one iteration per thread)
        work = claim(counter)
        while work < works:
            source_pairs = np.zeros((half, channels_padded), dtype=np.uint32)  # [pair pair, channel]
            grad_pairs = np.zeros((half, columns), dtype=np.uint32)  # [pair pair, column]
            channels = np.arange(in_channels).astype(np.int32)
            first_row, count_rows = _work_rows(work, capacity, rows)
            local_source = source[first_row:first_row + count_rows]
            acc = np.zeros((count_rows, channels_padded), dtype=np.float32)
            for offset in range(volume):
                start, stop = starts[work * volume + offset], starts[work * volume + offset + 1]
                share = partial[work, offset]
                share[:] = 0
                count = stop - start
                if count == 0:
                    continue
                pair_words = (count + 1) // 2
                for word in range(pair_words):
                    first = start + 2 * word
                    ahead = first + 2 * PREFETCH_AHEAD
                    if ahead + 1 < stop:
                        for byte in range(0, grad_bytes, 64):
                            _prefetch(grad, destinations[ahead], byte)
                            _prefetch(grad, destinations[ahead + 1], byte)
                    paired = 2 * word + 1 < count
                    _pack_pair(local_source, locals_[first], locals_[first + 1] if paired else -1, source_pairs, word)
                    _pack_pair(grad, destinations[first], destinations[first + 1] if paired else -1, grad_pairs, word)
                _dot_columns(share, channels, source_pairs, in_channels, grad_pairs, pair_words, share_step)
                _dot_rows(acc, locals_[start:stop], grad_words, destinations[start:stop], count, matrices[offset],
                          words, rows_step)
            acc_bits = acc.view(np.uint32)
            for row in range(count_rows):
                _round_row(acc_bits, row, grad_source, first_row + row)
            work = claim(counter)
