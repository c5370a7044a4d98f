"""Launch wrappers for ``kernels_cu/int8.cu``, written from the kernel's comments alone.

They pack the operands (byte lanes assembled into int32 words with shifts,
each group's channels zero-padded to whole words), group the pairs by output
with a NumPy ``lexsort`` and launch the kernels directly, without the
backend's `_kernel_int8` code: an independent reading of the kernel contract.
The tests run them on the CPU emulation (NumPy arrays) against the integer
reference. ``get_function(file, expression)`` is `harness.load_module(file).get_function`
or a CuPy RawModule's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from sparsecore.backends import kernel_registry

__all__ = ["Int8Launcher", "pack_lanes", "pairs_by_output"]


def pack_lanes(values: np.ndarray, groups: int) -> np.ndarray:
    """int8 ``[R, groups * a]`` -> int32 ``[R, groups * words]``: byte ``j`` of a group in lane ``j % 4`` of word ``j // 4``."""
    rows, channels = values.shape
    width = channels // groups
    words = max(1, -(-width // 4))
    padded = np.zeros((rows, groups, 4 * words), dtype=np.int64)
    padded[:, :, :width] = values.reshape(rows, groups, width).astype(np.uint8)
    lanes = padded.reshape(rows, groups, words, 4)
    packed = lanes[..., 0] | (lanes[..., 1] << 8) | (lanes[..., 2] << 16) | (lanes[..., 3] << 24)
    return packed.astype(np.uint32).view(np.int32).reshape(rows, groups * words)


def pairs_by_output(pair_input: np.ndarray, pair_output: np.ndarray, offset_starts: tuple[int, ...],
                    num_output: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(input_rows, pair_offsets, output_starts)``: pairs sorted by (output, offset), -1 outputs dropped."""
    offsets = np.repeat(np.arange(len(offset_starts) - 1), np.diff(offset_starts))
    keep = np.flatnonzero(np.asarray(pair_output) >= 0)
    order = keep[np.lexsort((offsets[keep], np.asarray(pair_output)[keep]))]
    counts = np.bincount(np.asarray(pair_output)[order], minlength=num_output)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return (np.asarray(pair_input)[order].astype(np.int32), offsets[order].astype(np.int32), starts)


@dataclass(frozen=True)
class Int8Launcher:
    """Launches ``sc_int8_conv`` and ``sc_int8_max_pool`` on NumPy arrays.

    Attributes:
        get_function: ``(file, name expression) -> kernel``.
        block: threads per block.
        max_blocks: grid cap (grid-stride loops cover the rest).
    """

    get_function: Callable[[str, str], Any]
    block: int = 32
    max_blocks: int = 3

    def _launch(self, expression: str, work: int, args: tuple[Any, ...]) -> None:
        if work <= 0:
            return
        kernel = self.get_function(kernel_registry.file_of_kernel(expression.split("<")[0]), expression)
        kernel((max(1, min(-(-work // self.block), self.max_blocks)),), (self.block,), args)

    def conv(self, features: np.ndarray, weight: np.ndarray, rulebook: Any, groups: int, multiplier: np.ndarray,
             bias: np.ndarray | None, residual: np.ndarray | None, residual_scale: float, relu: bool,
             output_scale: float | None) -> np.ndarray:
        """``sc_int8_conv`` over a rulebook; int8 output with ``output_scale``, else float32."""
        out_channels, width = weight.shape[0], weight.shape[-1]
        words = max(1, -(-width // 4))
        x_packed = pack_lanes(features, groups)
        w_words = pack_lanes(weight.reshape(-1, width), 1).reshape(out_channels, -1, words)  # [C_out, K, words]
        w_packed = np.ascontiguousarray(w_words.transpose(1, 2, 0))
        rows, offsets, starts = pairs_by_output(rulebook.pair_input, rulebook.pair_output, rulebook.offset_starts,
                                                rulebook.num_output)
        integer = output_scale is not None
        out = np.empty((rulebook.num_output, out_channels), dtype=np.int8 if integer else np.float32)
        self._launch(f"sc_int8_conv<{'signed char' if integer else 'float'}>", out.size,
                     (x_packed, w_packed, rows, offsets, starts, np.int64(rulebook.num_output),
                      np.int64(out_channels), np.int64(out_channels // groups), np.int32(words),
                      np.ascontiguousarray(multiplier, dtype=np.float32),
                      np.ascontiguousarray(bias if bias is not None else np.zeros(1), dtype=np.float32),
                      np.int32(bias is not None),
                      np.ascontiguousarray(residual if residual is not None else np.zeros((1, 1)), dtype=np.int8),
                      np.int32(residual is not None), np.float32(residual_scale), np.int32(relu),
                      np.float32(output_scale if integer else 1.0), out))
        return out

    def max_pool(self, features: np.ndarray, rulebook: Any) -> np.ndarray:
        """``sc_int8_max_pool`` over a rulebook."""
        rows, _, starts = pairs_by_output(rulebook.pair_input, rulebook.pair_output, rulebook.offset_starts,
                                          rulebook.num_output)
        out = np.zeros((rulebook.num_output, features.shape[1]), dtype=np.int8)
        self._launch("sc_int8_max_pool", out.size,
                     (np.ascontiguousarray(features), rows, starts, np.int64(rulebook.num_output),
                      np.int64(features.shape[1]), out))
        return out
