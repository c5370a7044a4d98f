"""The kernel backend's int8 passes: ``sc_int8_conv`` (dp4a, fused epilogue) and ``sc_int8_max_pool``.

Functions of a `KernelDevice` (a kernel backend's ``xp`` and launch settings).
The pairs are grouped by output with a stable
``xp.argsort`` (`group_starts`: pairs of one output in kernel-offset order,
padding rows of -1 dropped), so each output element is one thread's int32
sum, without atomics. The operands are packed on the device with ``xp``
(see ``kernels_cu/int8.cu``): each group's input channels zero-padded to a
multiple of four bytes and read as int32 words, the weight transposed to
``[K, words, C_out]`` so consecutive threads (output channels) read
consecutive words. No host synchronisation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ._launch import KernelDevice, check_integer_vector, check_row_count
from ._sorting import group_starts

if TYPE_CHECKING:  # pragma: no cover
    from ._numpy_int8 import Int8Epilogue

__all__ = ["pack_words", "pack_features", "pack_weight", "conv_pairs", "max_pool_pairs"]


def pack_words(xp: Any, values: Any) -> Any:
    """int8 ``[..., g, a]`` zero-padded to ``[..., g, 4 * words]`` and read as int32 ``[..., g * words]``."""
    width = values.shape[-1]
    words = max(1, -(-width // 4))
    padded = xp.zeros(values.shape[:-1] + (4 * words,), dtype=xp.int8)
    padded[..., :width] = values
    return padded.view(xp.int32).reshape(values.shape[:-2] + (values.shape[-2] * words,))


def pack_features(xp: Any, features: Any, groups: int) -> Any:
    """int8 ``[N, C_in]`` as int32 ``[N, groups * words]``."""
    count, channels = features.shape
    return xp.ascontiguousarray(pack_words(xp, features.reshape(count, groups, channels // groups)))


def pack_weight(xp: Any, weight: Any) -> Any:
    """int8 ``[C_out, *kernel, a]`` as int32 ``[K, words, C_out]``."""
    out_channels, width = weight.shape[0], weight.shape[-1]
    volume = int(np.prod(weight.shape[1:-1]))
    flat = weight.reshape(out_channels, volume, 1, width)  # [C_out, K, 1, a]
    words = pack_words(xp, flat)  # [C_out, K, words]
    return xp.ascontiguousarray(words.transpose(1, 2, 0))


def _pair_offsets(xp: Any, run_starts: tuple[int, ...]) -> Any:
    """int32 ``[P]``: the kernel offset of each pair, from the host offset starts (computed on the device)."""
    ends = xp.asarray(np.asarray(run_starts[1:], dtype=np.int64))
    return xp.searchsorted(ends, xp.arange(run_starts[-1], dtype=xp.int64), side="right").astype(xp.int32)


def _check_pairs(features: Any, pair_input: Any, pair_output: Any, num_output: int, function: str) -> None:
    check_integer_vector(pair_input, "pair_input", function)
    check_integer_vector(pair_output, "pair_output", function, int(pair_input.shape[0]))
    check_row_count(int(features.shape[0]), "features", function)
    check_row_count(int(num_output), "the output (num_output)", function)


def _grouped_by_output(xp: Any, pair_input: Any, pair_output: Any, num_output: int) -> tuple[Any, Any, Any]:
    order, output_starts = group_starts(xp, pair_output, num_output)
    grouped_input = xp.ascontiguousarray(xp.take(pair_input, order), dtype=xp.int32)
    return order, grouped_input, output_starts


def conv_pairs(device: KernelDevice, features: Any, weight: Any, pair_input: Any, pair_output: Any,
               run_starts: tuple[int, ...], num_output: int, groups: int, epilogue: "Int8Epilogue") -> Any:
    """int8 conv with one ``sc_int8_conv`` launch (see `ArrayBackend.int8_conv_pairs`)."""
    xp = device.xp
    if features.dtype != np.int8 or weight.dtype != np.int8:
        raise TypeError(f"int8_conv_pairs: features and weight must be int8, got {features.dtype} and {weight.dtype}")
    _check_pairs(features, pair_input, pair_output, num_output, "int8_conv_pairs")
    num_output, out_channels = int(num_output), int(weight.shape[0])
    integer = epilogue.output_scale is not None
    out = xp.empty((num_output, out_channels), dtype=xp.int8 if integer else xp.float32)
    if num_output * out_channels == 0:
        return out
    in_per_group = int(weight.shape[-1])
    words = max(1, -(-in_per_group // 4))
    x_packed = pack_features(xp, xp.ascontiguousarray(features), groups)
    w_packed = pack_weight(xp, xp.ascontiguousarray(weight))
    order, grouped_input, output_starts = _grouped_by_output(xp, pair_input, pair_output, num_output)
    grouped_offsets = xp.ascontiguousarray(xp.take(_pair_offsets(xp, run_starts), order), dtype=xp.int32)
    bias = epilogue.bias if epilogue.bias is not None else xp.zeros(1, dtype=xp.float32)
    residual = epilogue.residual if epilogue.residual is not None else xp.zeros((1, 1), dtype=xp.int8)
    output_scale = epilogue.output_scale if integer else np.float32(1)
    device.run("sc_int8_conv", ("signed char" if integer else "float",), num_output * out_channels,
               (x_packed, w_packed, grouped_input, grouped_offsets, output_starts, np.int64(num_output),
                np.int64(out_channels), np.int64(out_channels // groups), np.int32(words),
                xp.ascontiguousarray(epilogue.multiplier, dtype=xp.float32),
                xp.ascontiguousarray(bias, dtype=xp.float32), np.int32(epilogue.bias is not None),
                xp.ascontiguousarray(residual), np.int32(epilogue.residual is not None),
                np.float32(epilogue.residual_scale), np.int32(epilogue.relu), np.float32(output_scale), out))
    return out


def max_pool_pairs(device: KernelDevice, features: Any, pair_input: Any, pair_output: Any,
                   num_output: int) -> Any:
    """int8 max pool with one ``sc_int8_max_pool`` launch (see `ArrayBackend.int8_max_pool_pairs`)."""
    xp = device.xp
    if features.ndim != 2 or features.dtype != np.int8:
        raise TypeError(f"int8_max_pool_pairs: features must be int8 [N, C], got {features.dtype} "
                        f"{tuple(features.shape)}")
    _check_pairs(features, pair_input, pair_output, num_output, "int8_max_pool_pairs")
    num_output, channels = int(num_output), int(features.shape[1])
    out = xp.zeros((num_output, channels), dtype=xp.int8)
    if num_output * channels == 0 or pair_input.shape[0] == 0:
        return out
    _, grouped_input, output_starts = _grouped_by_output(xp, pair_input, pair_output, num_output)
    device.run("sc_int8_max_pool", (), num_output * channels,
               (xp.ascontiguousarray(features), grouped_input, output_starts, np.int64(num_output),
                np.int64(channels), out))
    return out
