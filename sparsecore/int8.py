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

`quantize` uses that same last step, so a requantized output equals
``quantize(y, output_scale)``. The NumPy backend (int32 sums in a compiled
numba kernel, or exact float32 GEMMs without numba, see
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

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._dispatch import array_module, check_same_device, to_core_array
from ._chunks import check_padded_pairs
from .backends import ArrayBackend, backend_for
from .backends._numpy_int8 import Int8Epilogue, requantize
from .rulebook import PairMap, Rulebook

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


def _as_scale(value: Any, name: str) -> np.float32:
    """A positive, finite scale as a float32 scalar."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a positive float (a quantization scale), got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a positive float (a quantization scale), got {value!r}") from None
    scale = np.float32(number)
    if not math.isfinite(number) or not np.isfinite(scale) or scale <= 0:
        raise ValueError(
            f"{name} must be a positive, finite float32 scale, got {value!r}; a scale is "
            "max|x| / 127 for a tensor of absolute maximum max|x| (observers give it)"
        )
    return scale


def _as_channel_scales(value: Any, name: str, count: int, xp: Any, check_values: bool = True) -> Any:
    """Positive, finite per-channel scales as a float32 ``[count]`` array of ``xp`` (a scalar broadcasts).

    ``check_values=False`` leaves out the value check (a host synchronisation on the
    GPU) for a caller that checks a product of the scales instead.
    """
    if isinstance(value, (bool, int, float, np.generic)):
        return xp.full(count, _as_scale(value, name), dtype=xp.float32)
    array = to_core_array(value, name)
    if array.ndim == 0:
        return xp.full(count, _as_scale(float(array), name), dtype=xp.float32)
    if array.shape != (count,):
        raise ValueError(
            f"{name} must have shape [{count}] (one scale per output channel) or be a single float, "
            f"got shape {tuple(array.shape)}"
        )
    if array.dtype.kind != "f":
        raise TypeError(f"{name} must be a float array, got dtype {array.dtype}")
    scales = xp.asarray(array, dtype=xp.float32)
    if check_values and count and not bool(xp.all(xp.isfinite(scales) & (scales > 0))):
        bad = int(xp.argmax(~(xp.isfinite(scales) & (scales > 0))))
        raise ValueError(
            f"{name}[{bad}] = {float(scales[bad])!r}: every scale must be positive and finite in float32; "
            "check the observer or the weight of that output channel"
        )
    return scales


def _scale_array(scale: Any, x: Any, axis: int, name: str) -> Any:
    """A scale broadcasting against ``x``: a float32 scalar, or per-channel along ``axis``."""
    xp = array_module(x)
    if isinstance(scale, (bool, int, float, np.generic)) or (hasattr(scale, "ndim") and scale.ndim == 0):
        return _as_scale(scale, name)
    if x.ndim == 0:
        raise ValueError(f"{name}: a per-channel scale needs an array with a channel axis, got a scalar")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis={axis} is out of range for an array of {x.ndim} axes")
    scales = _as_channel_scales(scale, name, x.shape[axis], xp)
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    return scales.reshape(shape)


def quantize(x: Any, scale: Any, axis: int = -1) -> Any:
    """``clip(rint(x / scale), -128, 127)`` as int8 (symmetric, zero point 0; torch's qint8 rule).

    ``x`` is converted to float32 first; the division is float32, rounded to
    nearest even, and ``rint`` sends ties to even.

    Args:
        x: float array, any shape (NumPy, CuPy, or any DLPack array).
        scale: a positive float, or positive float32 ``[x.shape[axis]]`` per-channel scales.
        axis: the channel axis of per-channel scales (default: the last).

    Returns:
        int8 array shaped like ``x`` (NumPy or CuPy).

    Raises:
        TypeError: for a non-float ``x``.
        ValueError: for NaN in ``x`` or a bad scale.
    """
    x = to_core_array(x, "x")
    if x.dtype.kind != "f":
        raise TypeError(f"x must be a float array to quantize, got dtype {x.dtype}; int8 data is already quantized")
    xp = array_module(x)
    scales = _scale_array(scale, x, axis, "scale")
    values = xp.array(x, dtype=xp.float32, copy=True)
    if values.size and bool(xp.isnan(values).any()):
        raise ValueError("x holds NaN, which has no int8 value; clean the input before quantizing")
    return requantize(xp, values, scales)


def dequantize(q: Any, scale: Any, axis: int = -1) -> Any:
    """``float32(q) * scale`` in float32 (one rounding per element).

    Args:
        q: int8 array, any shape.
        scale: a positive float, or positive float32 ``[q.shape[axis]]`` per-channel scales.
        axis: the channel axis of per-channel scales (default: the last).

    Returns:
        float32 array shaped like ``q``.
    """
    q = to_core_array(q, "q")
    if q.dtype != np.int8:
        raise TypeError(f"q must be an int8 array (from quantize), got dtype {q.dtype}")
    xp = array_module(q)
    scales = _scale_array(scale, q, axis, "scale")
    values = q.astype(xp.float32)
    xp.multiply(values, scales, out=values)
    return values


@dataclass(frozen=True, eq=False)
class RequantParameters:
    """Per-output-channel parameters of a quantized conv in the form deployment engines take.

    ``y_int8 = clip(rint(acc * output_multiplier[c] + output_bias[c]), -128, 127)``
    with ``acc`` the layer's int32 sum: TensorRT's and most int8 runtimes' form.
    Computed in float64 and rounded once to float32; sparsecore's own
    `int8_conv_forward` applies the scales step by step instead (see the module
    docstring), so the two can differ by a rounding on values that fall on a tie.

    Attributes:
        input_scale: the input activation's scale.
        weight_scales: float32 ``[C_out]`` per-channel weight scales.
        output_scale: the output activation's scale, or None for a dequantized (float) output.
        output_multiplier: float32 ``[C_out]``, ``input_scale * weight_scales[c] / output_scale``
            (without ``output_scale``: ``input_scale * weight_scales[c]``).
        output_bias: float32 ``[C_out]``, ``bias / output_scale`` (zeros without a bias;
            without ``output_scale``: the bias).
    """

    input_scale: float
    weight_scales: np.ndarray
    output_scale: float | None
    output_multiplier: np.ndarray
    output_bias: np.ndarray

    @property
    def input_dynamic_range(self) -> float:
        """The input's absolute maximum, ``127 * input_scale`` (TensorRT's ``setDynamicRange``)."""
        return 127.0 * self.input_scale

    @property
    def output_dynamic_range(self) -> float | None:
        """The output's absolute maximum, ``127 * output_scale``, or None for a float output."""
        return None if self.output_scale is None else 127.0 * self.output_scale

    @property
    def weight_dynamic_ranges(self) -> np.ndarray:
        """float32 ``[C_out]`` absolute maxima of the weight's channels, ``127 * weight_scales``."""
        return (127.0 * self.weight_scales.astype(np.float64)).astype(np.float32)


def requant_parameters(input_scale: float, weight_scales: Any, output_scale: float | None = None,
                       bias: Any | None = None) -> RequantParameters:
    """The deployment-ready scales and biases of one quantized conv layer (host NumPy).

    Args:
        input_scale: the input activation's scale.
        weight_scales: ``[C_out]`` per-channel weight scales (or one float).
        output_scale: the output's scale, or None for a float output.
        bias: float ``[C_out]`` or None.

    Returns:
        `RequantParameters`.
    """
    input_scale_32 = _as_scale(input_scale, "input_scale")
    scales = _on_host(weight_scales, "weight_scales")
    host_bias = None if bias is None else _on_host(bias, "bias")
    count = scales.shape[0] if scales.ndim == 1 else (host_bias.shape[0] if host_bias is not None and
                                                       host_bias.ndim == 1 else 1)
    scales = _as_channel_scales(scales, "weight_scales", count, np)
    bias_values = np.zeros(count, dtype=np.float32) if host_bias is None else _as_bias(host_bias, count, np)
    divisor = 1.0 if output_scale is None else float(_as_scale(output_scale, "output_scale"))
    multiplier = (float(input_scale_32) * scales.astype(np.float64) / divisor).astype(np.float32)
    return RequantParameters(float(input_scale_32), scales, None if output_scale is None else divisor,
                             multiplier, (bias_values.astype(np.float64) / divisor).astype(np.float32))


def _on_host(value: Any, name: str) -> np.ndarray:
    """A NumPy copy of a (small) array given on any device."""
    array = to_core_array(value, name)
    return np.asarray(array.get() if hasattr(array, "get") and not isinstance(array, np.ndarray) else array)


def _as_bias(bias: Any, count: int, xp: Any, check_values: bool = True) -> Any:
    bias = to_core_array(bias, "bias")
    if bias.shape != (count,):
        raise ValueError(f"bias must have shape [{count}] (out_channels), got {tuple(bias.shape)}")
    if bias.dtype.kind != "f":
        raise TypeError(f"bias must be a float array (the layer's float bias), got dtype {bias.dtype}")
    bias = xp.asarray(bias, dtype=xp.float32)
    if check_values and count and not bool(xp.isfinite(bias).all()):
        raise ValueError("bias holds NaN or infinity; an int8 layer needs a finite bias")
    return bias


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
    input_scale_32 = _as_scale(input_scale, "input_scale")
    scales = _as_channel_scales(weight_scales, "weight_scales", out_channels, xp, check_values=False)
    multiplier = xp.multiply(scales, input_scale_32, dtype=xp.float32)
    bias = None if bias is None else _as_bias(bias, out_channels, xp, check_values=False)
    _check_multiplier_and_bias(xp, weight_scales, multiplier, bias, out_channels)
    epilogue = Int8Epilogue(
        multiplier=multiplier,
        bias=bias,
        residual=residual,
        residual_scale=np.float32(1) if residual_scale is None else _as_scale(residual_scale, "residual_scale"),
        relu=bool(relu),
        output_scale=None if output_scale is None else _as_scale(output_scale, "output_scale"),
    )
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
    _as_channel_scales(weight_scales, "weight_scales", count, xp)  # raises for a bad scale
    if bias is not None:
        _as_bias(bias, count, xp)  # raises for a non-finite bias
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
    return backend.int8_max_pool_pairs(backend.xp.ascontiguousarray(features), rulebook.pair_input,
                                       rulebook.pair_output, tuple(rulebook.offset_starts), rulebook.num_output)
