"""The int8 conv on AVX-512 VNNI (``vpdpbusd``): the wrapper of `_int8_vnni_sources.conv_kernel`.

`conv` lays the layer out for the kernel (the weights in quads of input
channels, padded, with their sums; the source as ``x + 128``, padded to quads
where a group's channel count is not a multiple of 4) and runs
it over a forward tile plan of `sparsecore.cpu_dataflow`. The result is the
exact int32 sum of `sparsecore.int8` followed by its float32 epilogue: the
same bits as every other int8 route, at every thread count.

Call it only where `sparsecore.backends.x86_features.uses("avx512_vnni")`:
the kernel module is imported (and compiled, seconds, then cached on disk by
numba) on the first call.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ._cpu_kernels import TilePlan, kernel_threads

__all__ = ["padded_sizes", "pack_weights", "quad_source", "unsigned_source", "conv"]


def padded_sizes(in_per_group: int, out_per_group: int) -> tuple[int, int]:
    """``(quads, padded_out)``: input channels per group in quads of 4 (rounded up), outputs per group
    rounded up to 16 (one vector)."""
    return -(-in_per_group // 4), -(-out_per_group // 16) * 16


def pack_weights(weight: np.ndarray, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's weights and their corrections.

    Args:
        weight: int8 ``[C_out, *kernel_size, C_in // groups]``.
        groups: channel groups.

    Returns:
        ``(weights, corrections)``: int8 ``[K, groups, quads, padded_out, 4]`` (0 in padded lanes) and
        int32 ``[K, groups, padded_out]``, ``128 * sum_i w[c, k, i]``; both flat and C-contiguous.
    """
    out_channels, in_per_group = weight.shape[0], weight.shape[-1]
    out_per_group = out_channels // groups
    volume = int(np.prod(weight.shape[1:-1], dtype=np.int64))
    quads, padded_out = padded_sizes(in_per_group, out_per_group)
    grouped = weight.reshape(groups, out_per_group, volume, in_per_group).transpose(2, 0, 1, 3)  # [K, g, b, a]
    packed = np.zeros((volume, groups, padded_out, 4 * quads), dtype=np.int8)
    packed[:, :, :out_per_group, :in_per_group] = grouped
    corrections = np.zeros((volume, groups, padded_out), dtype=np.int32)
    corrections[:, :, :out_per_group] = 128 * grouped.sum(axis=3, dtype=np.int32)
    packed = packed.reshape(volume, groups, padded_out, quads, 4).transpose(0, 1, 3, 2, 4)
    return np.ascontiguousarray(packed).reshape(-1), corrections.reshape(-1)


def quad_source(features: np.ndarray, groups: int) -> np.ndarray:
    """int8 ``[N, groups * 4 * quads]`` C-contiguous: ``features``, each group's channels padded to whole
    quads with 0 (the kernel's input; it flips the sign bits itself, as `unsigned_source` does here)."""
    rows, in_channels = features.shape
    in_per_group = in_channels // groups
    quads = -(-in_per_group // 4)
    if 4 * quads == in_per_group:
        return np.ascontiguousarray(features)
    padded = np.zeros((rows, groups, 4 * quads), dtype=np.int8)
    padded[:, :, :in_per_group] = features.reshape(rows, groups, in_per_group)
    return padded.reshape(rows, groups * 4 * quads)


def unsigned_source(features: np.ndarray, groups: int) -> np.ndarray:
    """uint8 ``[N, groups * 4 * quads]``: ``x + 128`` (the sign bit flipped) of `quad_source` (padded lanes
    128, that is ``x = 0``; the padded weights are 0 anyway): the NumPy twin of the kernel's own flip."""
    return np.bitwise_xor(quad_source(features, groups).view(np.uint8), np.uint8(0x80))


@functools.lru_cache(maxsize=1)
def _sources() -> Any:
    from .._compile_notice import numba_for_kernels

    numba_for_kernels()  # sizes numba's thread pool before the kernels' module imports numba
    from . import _int8_vnni_sources

    return _int8_vnni_sources


def conv(features: np.ndarray, weight: np.ndarray, plan: TilePlan, num_output: int, pairs: int, groups: int,
         epilogue: Any) -> np.ndarray:
    """The int8 conv of `sparsecore.int8` on ``vpdpbusd``, sums and epilogue fused.

    Args:
        features: int8 ``[N_in, C_in]``.
        weight: int8 ``[C_out, *kernel_size, C_in // groups]``.
        plan: the rulebook's forward `TilePlan` (`sparsecore.cpu_dataflow.tile_plan`).
        num_output: output rows.
        pairs: the rulebook's pair count (small layers run on the calling thread).
        groups: channel groups.
        epilogue: a `_numpy_int8.Int8Epilogue` on NumPy arrays.

    Returns:
        int8 ``[num_output, C_out]`` with ``epilogue.output_scale``, else float32.
    """
    out_channels, in_per_group = weight.shape[0], weight.shape[-1]
    volume = int(np.prod(weight.shape[1:-1], dtype=np.int64))
    quantize = epilogue.output_scale is not None
    out = np.empty((num_output, out_channels), dtype=np.int8 if quantize else np.float32)
    if out.size == 0:
        return out
    quads, padded_out = padded_sizes(in_per_group, out_channels // groups)
    kernels = _sources()
    weights, corrections = pack_weights(weight, groups)
    has_bias, has_residual = epilogue.bias is not None, epilogue.residual is not None
    with kernel_threads(pairs * (features.shape[1] + out_channels)) as lanes:
        kernels.conv_kernel(
            quad_source(features, groups), plan.starts, plan.sources, plan.local_rows, weights, corrections,
            volume, groups, quads, out_channels // groups, padded_out, plan.capacity,
            np.ascontiguousarray(epilogue.multiplier, dtype=np.float32),
            np.ascontiguousarray(epilogue.bias if has_bias else np.zeros(1), dtype=np.float32), has_bias,
            np.ascontiguousarray(epilogue.residual if has_residual else np.zeros((1, 1)), dtype=np.int8),
            has_residual, np.float32(epilogue.residual_scale), bool(epilogue.relu),
            np.float32(epilogue.output_scale if quantize else 1), quantize, out, lanes)
    return out
