"""The bfloat16 conv backward on AMX tiles in one pass, behind `sparsecore.backends._bf16_cpu_kernels`.

Imported on first use where `_bf16_cpu_kernels.amx_available`. Input-stationary over the reversed pairs'
tile plan, as the float32 tiled backward (`_tile_kernel_sources.tiled_backward_kernel`): per work item
(a block of input rows) and offset, the paired output-gradient rows are gathered once into a tile buffer
and serve both products:

- the input gradient: each 16-row block of the buffer times the offset's transposed matrix (tile
  products, `_bf16_amx_sources`), added into the item's float32 sums (vector adds), written once as
  bfloat16;
- the item's share of the weight gradient: the item's own source rows (in cache) and the gathered rows
  packed two pairs a word, the source words transposed in 16 x 16 blocks, one tile product per 16 x 16
  block of ``partial[item, offset]``; the shares are then added in item order
  (`_tile_kernel_sources.sum_partials`).

Reading each gradient row once for both products, and the source rows from the item's block instead of
the whole array per offset, is what makes it faster than two passes (the weight gradient alone streamed
every row once per offset). Work items are fixed by the sizes: results are bitwise the same at every
thread count.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

from ._bf16_amx_sources import _add_vector, _tile_end, _tile_products, _tile_start, _transpose_words
from ._bf16_kernel_sources import _pack_pair, _round_row
from ._tile_kernel_sources import _copy_rows, _work_rows
from ._work_queue import claim, new_counter  # new_counter: no parallel region of its own

__all__ = ["amx_backward_kernel"]

_OPTIONS = {"parallel": True, "cache": True, "nogil": True}


@njit(inline="always")
def _input_gradient(gathered: Any, count: int, depth: int, steps: int, matrices: Any, offset: int, block: Any,
                    locals_: Any, start: int, acc: Any) -> None:
    """``acc[locals_[start + p]] += gathered[p] @ matrices[offset]`` for the run's ``count`` rows, on tiles."""
    words, columns = matrices.shape[1], matrices.shape[2]
    matrix_offset = offset * words * columns * 4
    for first in range(0, count, 16):
        taken = min(16, count - first)
        for column in range(0, columns, 64):
            blocks = min(4, (columns - column) // 16)
            _tile_products(gathered, first * depth * 2, depth * 2, matrices, matrix_offset + column * 4, columns * 4,
                           steps, blocks, block, 0, 256, False)
            for row in range(taken):
                local = locals_[start + first + row] * columns + column
                for part in range(blocks):
                    _add_vector(acc, local + 16 * part, block, row * 64 + 16 * part)


@njit(**_OPTIONS)
def amx_backward_kernel(source: Any, grad: Any, starts: Any, destinations: Any, locals_: Any, matrices: Any,
                        grad_source: Any, partial: Any, capacity: int, most: int, config: Any, lanes: int) -> None:
    """Both gradients of the bfloat16 conv: ``grad_source`` and each work item's weight-gradient share.

    ``source`` uint16 ``[N_in, a]`` and ``grad`` uint16 ``[N_out, b]`` (bfloat16 bits), the reversed pairs' plan
    (``starts`` int64 ``[W * K + 1]``, ``destinations``: output rows, ``locals_``: input rows minus the item's
    first row, at most ``most`` pairs a range), ``matrices`` uint32 ``[K, w, a16]`` (the transposed weights
    packed: ``2 w`` >= ``b`` a multiple of 32), ``grad_source`` uint16 ``[N_in, a]`` (every row written),
    ``partial`` float32 ``[W, K, a16, c]`` (every entry written; ``c >= b``), ``config`` the tile
    configuration; ``lanes`` threads claim the work items.
    """
    volume, words, channels_padded = matrices.shape
    columns = partial.shape[3]
    rows = grad_source.shape[0]
    works = (starts.shape[0] - 1) // volume
    depth, steps = 2 * words, words // 16
    tile_rows = (most + 31) // 32 * 32
    half = tile_rows // 2
    stride = half + 16  # words a transposed row: a multiple of 4 KiB would put a tile's 16 rows in one cache set
    counter = new_counter()
    for lane in prange(min(lanes, works)):  # noqa: B007 (one iteration per thread)
        _tile_start(config)
        work = claim(counter)
        while work < works:
            gathered = np.zeros((tile_rows, depth), dtype=np.uint16)  # padding channels stay 0
            block = np.empty((16, 64), dtype=np.float32)
            source_words = np.zeros((half, channels_padded), dtype=np.uint32)  # [pair pair, channel]
            transposed = np.empty((channels_padded, stride), dtype=np.uint32)  # [channel, pair pair]
            grad_words = np.zeros((half, columns), dtype=np.uint32)  # [pair pair, column]
            first_row, count_rows = _work_rows(work, capacity, rows)
            local_source = source[first_row:first_row + count_rows]
            acc = np.zeros((count_rows, channels_padded), dtype=np.float32)
            for offset in range(volume):
                start, stop = starts[work * volume + offset], starts[work * volume + offset + 1]
                count = stop - start
                if count == 0:
                    partial[work, offset] = 0
                    continue
                _copy_rows(grad, destinations[start:stop], count, gathered)
                for position in range(count, (count + 15) // 16 * 16):  # a partial block's rows: zeros
                    for column in range(grad.shape[1]):
                        gathered[position, column] = 0
                _input_gradient(gathered, count, depth, steps, matrices, offset, block, locals_, start, acc)
                pair_words = (count + 1) // 2
                padded = (pair_words + 15) // 16 * 16
                for word in range(pair_words):
                    paired = 2 * word + 1 < count
                    _pack_pair(local_source, locals_[start + 2 * word], locals_[start + 2 * word + 1] if paired else -1,
                               source_words, word)
                    _pack_pair(gathered, 2 * word, 2 * word + 1 if paired else -1, grad_words, word)
                for word in range(pair_words, padded):  # pairs past the run: zeros
                    for channel in range(channels_padded):
                        source_words[word, channel] = 0
                    for column in range(columns):
                        grad_words[word, column] = 0
                for word in range(0, padded, 16):
                    for channel in range(0, channels_padded, 16):
                        _transpose_words(source_words, (word * channels_padded + channel) * 4, channels_padded * 4,
                                         transposed, (channel * stride + word) * 4, stride * 4)
                base = (work * volume + offset) * channels_padded * columns * 4
                for channel in range(0, channels_padded, 16):
                    for column in range(0, columns, 64):
                        _tile_products(transposed, channel * stride * 4, stride * 4, grad_words, column * 4,
                                       columns * 4, padded // 16, min(4, (columns - column) // 16), partial,
                                       base + (channel * columns + column) * 4, columns * 4, False)
            acc_bits = acc.view(np.uint32)
            for row in range(count_rows):
                _round_row(acc_bits, row, grad_source, first_row + row)
            work = claim(counter)
        _tile_end()
