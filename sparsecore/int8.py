"""Real int8 sparse convolution and pooling: int8 x int8 products, int32 sums, requantization.

Quantization is symmetric with zero point 0 (spconv's and torch's ``qint8``
scheme): a float ``x`` with scale ``s`` is stored as
``q = clip(rint(x / s), -128, 127)`` and stands for ``q * s``. Weights carry
one scale per output channel, activations one per tensor.

`int8_conv_forward` computes, for each output row ``o`` and output channel
``c``, the exact integer sum over the rulebook's pairs ``(i, o)`` of offset
``k`` and the input channels ``j`` of its group::

    acc[o, c] = sum features[i, j] * weight[c, k, j]          (int32, exact)

then the epilogue, in float32, each step rounded once to nearest even (never
fused into an FMA), in this order::

    m[c] = float32(input_scale) * float32(weight_scales[c])  (one float32 product)
    y    = float32(acc) * m[c]                                (int32 -> float32 rounds to nearest even)
    y    = y + bias[c]                                        (if bias is given)
    y    = y + float32(residual[o, c]) * float32(residual_scale)   (if residual: product, then sum)
    y    = 0 where y < 0                                      (if relu)
    out  = clip(rint(y / float32(output_scale)), -128, 127) as int8   (if output_scale), else y

`quantize` (defined with `dequantize` and `requant_parameters` in
`sparsecore.int8_scales`, re-exported here) uses that same last step, so a
requantized output equals ``quantize(y, output_scale)``. The NumPy backend (int32 sums in a compiled
numba kernel, or the float32 conv pass on values whose sums it proves exact, chosen per layer by
`sparsecore.int8_cpu_dataflow`; exact float32 GEMMs with int32 spills past ``2^24``, see
`sparsecore.backends._numpy_int8`) and the GPU kernel (``kernels_cu/int8.cu``:
``__dp4a`` with int32 sums, the epilogue with ``__fmul_rn`` / ``__fadd_rn`` /
``__fdiv_rn``) give the same bits; one exception, on the GPU only: CuPy
compiles with flush-to-zero, so a float32 intermediate below ``2^-126`` in
magnitude becomes 0 there (an int8 output is unaffected: such values quantize
to 0; a float32 output can differ in those subnormal values only).

The int32 sum is exact as long as ``(C_in / groups) * kernel_volume * 2^14``
fits in int32 (up to ~4,800 input channels per group for a 3x3x3 kernel);
wider layers are refused. Rows with no pairs have ``acc = 0``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._dispatch import check_same_device, to_core_array
from ._chunks import check_padded_pairs
from .backends import ArrayBackend, NumpyBackend, backend_for
from .backends._numpy_int8 import Int8Epilogue
from .int8_cpu_dataflow import int8_conv_on_cpu
from .int8_scales import (
    RequantParameters,
    as_bias,
    as_channel_scales,
    as_scale,
    dequantize,
    quantize,
    requant_parameters,
)
from .rulebook import PairMap, Rulebook
from .threads import serialised_kernels

__all__ = [
    "quantize",
    "dequantize",
    "RequantParameters",
    "requant_parameters",
    "int8_conv_forward",
    "int8_max_pool_forward",
]

_INT32_MAX = 2**31 - 1
_LARGEST_PRODUCT = 128 * 128  # |int8 x int8| <= 2^14


def _as_int8(array: Any, name: str, rows: int | None, what: str) -> Any:
    array = to_core_array(array, name)
    if array.ndim != 2:
        raise ValueError(f"{name} must be 2-D [N, C] int8, got shape {tuple(array.shape)}")
    if array.dtype != np.int8:
        raise TypeError(
            f"{name} must be int8 (quantized) for the int8 pass, got dtype {array.dtype}; quantize it "
            f"with sparsecore.int8.quantize(x, scale), or use the float layer"
        )
    if rows is not None and array.shape[0] != rows:
        raise ValueError(f"{name} has {array.shape[0]} rows but {rows} are expected: one per {what}")
    return array


def _check_int8_weight(weight: Any, rulebook: Rulebook | PairMap, in_channels: int, groups: int) -> Any:
    weight = to_core_array(weight, "weight")
    kernel_size = tuple(rulebook.kernel_size)
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    if weight.ndim != 2 + len(kernel_size) or tuple(weight.shape[1:-1]) != kernel_size:
        raise ValueError(
            f"weight must be int8 [out_channels, *kernel_size, in_channels // groups] (spconv's layout) "
            f"with kernel_size {kernel_size}, got shape {tuple(weight.shape)}"
        )
    if weight.dtype != np.int8:
        raise TypeError(
            f"weight must be int8 (quantized per output channel) for the int8 pass, got dtype {weight.dtype}; "
            "quantize it with sparsecore.int8.quantize(weight, weight_scales, axis=0)"
        )
    out_channels = weight.shape[0]
    if in_channels % groups or out_channels % groups:
        raise ValueError(
            f"groups={groups} must divide both in_channels ({in_channels}) and out_channels ({out_channels})")
    if weight.shape[-1] != in_channels // groups:
        raise ValueError(
            f"weight's last axis is {weight.shape[-1]} but the features have {in_channels} channels and "
            f"groups={groups}, so it must be {in_channels // groups}; check the layer's in_channels"
        )
    volume = int(np.prod(kernel_size))
    if (in_channels // groups) * volume * _LARGEST_PRODUCT > _INT32_MAX:
        raise ValueError(
            f"an int8 conv with {in_channels // groups} input channels per group and {volume} kernel offsets "
            "can overflow its int32 sums; use more groups or the float layer"
        )
    return weight


def int8_conv_forward(features: Any, weight: Any, rulebook: Rulebook | PairMap, *, input_scale: float,
                      weight_scales: Any, output_scale: float | None = None, bias: Any | None = None,
                      residual: Any | None = None, residual_scale: float | None = None, relu: bool = False,
                      groups: int = 1, backend: ArrayBackend | None = None) -> Any:
    """int8 sparse convolution with int32 sums and a fused float32 epilogue (see the module docstring).

    Args:
        features: int8 ``[N_in, C_in]``, quantized with ``input_scale``.
        weight: int8 ``[C_out, *kernel_size, C_in // groups]`` (spconv layout),
            quantized per output channel with ``weight_scales``.
        rulebook: any `Rulebook` or `PairMap` the float conv takes (subm,
            regular, transposed, inverse).
        input_scale: the features' scale (positive float).
        weight_scales: float32 ``[C_out]`` (or one float).
        output_scale: requantize to int8 with this scale; None returns float32.
        bias: float ``[C_out]`` or None.
        residual: int8 ``[N_out, C_out]`` added before the ReLU, or None.
        residual_scale: the residual's scale (required with ``residual``).
        relu: apply a ReLU last (before requantization).
        groups: channel groups.
        backend: the primitives to run on; by default the backend of ``features``.

    Returns:
        int8 ``[N_out, C_out]`` with ``output_scale``, else float32 ``[N_out, C_out]``.
    """
    features = _as_int8(features, "features", rulebook.num_input,
                        "input site of the rulebook; features and the rulebook must come from the same sites")
    weight = _check_int8_weight(weight, rulebook, features.shape[1], groups)
    out_channels = weight.shape[0]
    if residual is not None:
        residual = _as_int8(residual, "residual", rulebook.num_output, "output site of the rulebook")
        if residual.shape[1] != out_channels:
            raise ValueError(f"residual has {residual.shape[1]} channels but the layer has {out_channels} outputs")
        if residual_scale is None:
            raise ValueError("residual is given without residual_scale; pass the residual's quantization scale")
    elif residual_scale is not None:
        raise ValueError("residual_scale is given without a residual; pass both or neither")
    check_same_device(features=features, weight=weight, residual=residual, indices=rulebook.pair_input)
    backend = backend if backend is not None else backend_for(features)
    check_padded_pairs(rulebook, backend)
    xp = backend.xp
    input_scale_32 = as_scale(input_scale, "input_scale")
    scales = as_channel_scales(weight_scales, "weight_scales", out_channels, xp, check_values=False)
    multiplier = xp.multiply(scales, input_scale_32, dtype=xp.float32)
    bias = None if bias is None else as_bias(bias, out_channels, xp, check_values=False)
    _check_multiplier_and_bias(xp, weight_scales, multiplier, bias, out_channels)
    epilogue = Int8Epilogue(
        multiplier=multiplier,
        bias=bias,
        residual=residual,
        residual_scale=np.float32(1) if residual_scale is None else as_scale(residual_scale, "residual_scale"),
        relu=bool(relu),
        output_scale=None if output_scale is None else as_scale(output_scale, "output_scale"),
    )
    if isinstance(backend, NumpyBackend):  # the compiled int8 kernel or the exact float32 pass, by layer
        with serialised_kernels(features):  # numba's workqueue layer: one thread at a time (sparsecore.threads)
            return int8_conv_on_cpu(backend, features, weight, rulebook, groups, epilogue)
    return backend.int8_conv_pairs(features, weight, rulebook.pair_input, rulebook.pair_output,
                                   tuple(rulebook.offset_starts), rulebook.num_output,
                                   rulebook.identity_offset, groups, epilogue)


def _check_multiplier_and_bias(xp: Any, weight_scales: Any, multiplier: Any, bias: Any | None, count: int) -> None:
    """One check (one host synchronisation on the GPU) of the scales' product and the bias; details on failure."""
    if not count:
        return
    smallest_normal = np.finfo(np.float32).tiny  # the GPU flushes smaller (subnormal) values to zero
    valid = xp.all((multiplier >= smallest_normal) & xp.isfinite(multiplier))
    if bias is not None:
        valid = valid & xp.all(xp.isfinite(bias))
    if bool(valid):
        return
    as_channel_scales(weight_scales, "weight_scales", count, xp)  # raises for a bad scale
    if bias is not None:
        as_bias(bias, count, xp)  # raises for a non-finite bias
    raise ValueError(
        f"input_scale * weight_scales leaves the normal float32 range [{smallest_normal:.3g}, "
        f"{np.finfo(np.float32).max:.3g}] for some channel; check the scales")


def int8_max_pool_forward(features: Any, rulebook: Rulebook | PairMap, *,
                          backend: ArrayBackend | None = None) -> Any:
    """Maximum over each output's active inputs, on int8 values (scale unchanged).

    Args:
        features: int8 ``[N_in, C]``.
        rulebook: a pooling (or conv) rulebook with ``num_input == N_in``.
        backend: the primitives to run on; by default the backend of ``features``.

    Returns:
        int8 ``[N_out, C]``; 0 for an output without inputs. The output keeps
        the input's scale (max commutes with a positive scale).
    """
    features = _as_int8(features, "features", rulebook.num_input, "input site of the rulebook")
    check_same_device(features=features, indices=rulebook.pair_input)
    backend = backend if backend is not None else backend_for(features)
    check_padded_pairs(rulebook, backend)
    with serialised_kernels(features):
        return backend.int8_max_pool_pairs(backend.xp.ascontiguousarray(features), rulebook.pair_input,
                                           rulebook.pair_output, tuple(rulebook.offset_starts), rulebook.num_output)
