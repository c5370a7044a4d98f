"""int8 scales: quantize and dequantize, and the requantization parameters of an int8 layer.

Quantization is symmetric with zero point 0 (spconv's and torch's ``qint8``
scheme): ``q = clip(rint(x / s), -128, 127)`` stands for ``q * s``, with one
scale per tensor or one per channel along an axis. `requant_parameters`
folds an int8 conv's scales and bias into the float32 epilogue of
`sparsecore.int8.int8_conv_forward` (whose docstring gives the exact
arithmetic). The checks of scales and biases used by `sparsecore.int8` live
here too. Everything public is re-exported by `sparsecore.int8`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._dispatch import array_module, to_core_array
from .backends._numpy_int8 import requantize

__all__ = [
    "quantize",
    "dequantize",
    "RequantParameters",
    "requant_parameters",
    "as_scale",
    "as_channel_scales",
    "as_bias",
    "on_host",
]


def as_scale(value: Any, name: str) -> np.float32:
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


def as_channel_scales(value: Any, name: str, count: int, xp: Any, check_values: bool = True) -> Any:
    """Positive, finite per-channel scales as a float32 ``[count]`` array of ``xp`` (a scalar broadcasts).

    ``check_values=False`` leaves out the value check (a host synchronisation on the
    GPU) for a caller that checks a product of the scales instead.
    """
    if isinstance(value, (bool, int, float, np.generic)):
        return xp.full(count, as_scale(value, name), dtype=xp.float32)
    array = to_core_array(value, name)
    if array.ndim == 0:
        return xp.full(count, as_scale(float(array), name), dtype=xp.float32)
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


def scale_array(scale: Any, x: Any, axis: int, name: str) -> Any:
    """A scale broadcasting against ``x``: a float32 scalar, or per-channel along ``axis``."""
    xp = array_module(x)
    if isinstance(scale, (bool, int, float, np.generic)) or (hasattr(scale, "ndim") and scale.ndim == 0):
        return as_scale(scale, name)
    if x.ndim == 0:
        raise ValueError(f"{name}: a per-channel scale needs an array with a channel axis, got a scalar")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis={axis} is out of range for an array of {x.ndim} axes")
    scales = as_channel_scales(scale, name, x.shape[axis], xp)
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
    scales = scale_array(scale, x, axis, "scale")
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
    scales = scale_array(scale, q, axis, "scale")
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
    input_scale_32 = as_scale(input_scale, "input_scale")
    scales = on_host(weight_scales, "weight_scales")
    host_bias = None if bias is None else on_host(bias, "bias")
    count = scales.shape[0] if scales.ndim == 1 else (host_bias.shape[0] if host_bias is not None and
                                                       host_bias.ndim == 1 else 1)
    scales = as_channel_scales(scales, "weight_scales", count, np)
    bias_values = np.zeros(count, dtype=np.float32) if host_bias is None else as_bias(host_bias, count, np)
    divisor = 1.0 if output_scale is None else float(as_scale(output_scale, "output_scale"))
    multiplier = (float(input_scale_32) * scales.astype(np.float64) / divisor).astype(np.float32)
    return RequantParameters(float(input_scale_32), scales, None if output_scale is None else divisor,
                             multiplier, (bias_values.astype(np.float64) / divisor).astype(np.float32))


def on_host(value: Any, name: str) -> np.ndarray:
    """A NumPy copy of a (small) array given on any device."""
    array = to_core_array(value, name)
    return np.asarray(array.get() if hasattr(array, "get") and not isinstance(array, np.ndarray) else array)


def as_bias(bias: Any, count: int, xp: Any, check_values: bool = True) -> Any:
    bias = to_core_array(bias, "bias")
    if bias.shape != (count,):
        raise ValueError(f"bias must have shape [{count}] (out_channels), got {tuple(bias.shape)}")
    if bias.dtype.kind != "f":
        raise TypeError(f"bias must be a float array (the layer's float bias), got dtype {bias.dtype}")
    bias = xp.asarray(bias, dtype=xp.float32)
    if check_values and count and not bool(xp.isfinite(bias).all()):
        raise ValueError("bias holds NaN or infinity; an int8 layer needs a finite bias")
    return bias
