"""The two feature passes the quantization modules share: a float conv with a given weight, an int8 conv.

Both take the layer's rulebook the way the float layers do (`layer.convolve` and
`layer.layer_indice_data`: found or built from the input's sites and
``indice_key``), so a quantized model reuses and saves rulebooks exactly as the
float model.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._convert import check_same_device, core_context, core_view, to_torch
from ..conv import SparseConvolution
from ..layer import convolve, layer_indice_data
from ..tensor import SparseConvTensor
from .utils import layer_indice_key
from ._torch_notices import torch_notices_silenced

__all__ = ["conv_with_weight", "int8_conv", "int8_features", "quantized_features", "check_int8_input"]


def conv_with_weight(layer: SparseConvolution, input: SparseConvTensor, weight: torch.Tensor,
                     bias: Optional[torch.Tensor]) -> SparseConvTensor:
    """``layer``'s convolution of ``input`` with ``weight`` (read as documented) and ``bias``."""
    return convolve(layer, input, weight, bias)


def int8_features(layer: str, input: SparseConvTensor) -> tuple[torch.Tensor, float]:
    """The int8 storage ``[N, C]`` and scale of a SparseConvTensor with ``torch.qint8`` features.

    Raises:
        TypeError: naming ``layer``, for float (not quantized) features.
    """
    if not isinstance(input, SparseConvTensor):
        raise TypeError(f"{layer} expects a sparsecore.torch.SparseConvTensor with qint8 features, got "
                        f"{type(input).__name__}")
    features = input.features
    if features.dtype != torch.qint8:
        raise TypeError(
            f"{layer} is a quantized (int8) layer but its input features are {features.dtype}; quantize them "
            "first (the converted graph does: run sparsecore.torch.quantization.transform_qdq on the output "
            "of convert_fx, or call quantize_per_tensor(x, scale, 0, torch.qint8))")
    if features.q_zero_point() != 0:
        raise ValueError(f"{layer} needs symmetric qint8 features (zero point 0), got zero point "
                         f"{features.q_zero_point()}")
    return features.view(torch.int8), float(features.q_scale())  # the int8 storage itself: no copy


def check_int8_input(layer: str, input: SparseConvTensor, values: torch.Tensor, in_channels: Optional[int],
                     ndim: int) -> None:
    """Raises a clear error naming ``layer`` for a channel or dimension mismatch of int8 features."""
    if len(input.spatial_shape) != ndim:
        raise ValueError(f"{layer} is a {ndim}-D layer but the input has {len(input.spatial_shape)} spatial axes")
    if values.ndim != 2 or (in_channels is not None and values.shape[1] != in_channels):
        raise ValueError(f"{layer} has in_channels={in_channels} but the int8 input features have shape "
                         f"{tuple(values.shape)}")


def quantized_features(values: torch.Tensor, scale: float) -> torch.Tensor:
    """int8 storage ``values`` with ``scale`` as a ``torch.qint8`` tensor (zero point 0)."""
    with torch_notices_silenced():
        return torch._make_per_tensor_quantized_tensor(values, float(scale), 0)


def int8_conv(layer: SparseConvolution, input: SparseConvTensor, weight_int8: torch.Tensor,
              weight_scales: torch.Tensor, bias: Optional[torch.Tensor], output_scale: Optional[float],
              relu: bool, residual: Optional[SparseConvTensor] = None) -> SparseConvTensor:
    """An int8 sparse convolution through ``sparsecore.int8.int8_conv_forward``.

    Args:
        layer: the quantized layer (geometry, ``indice_key``, ``groups``, channels).
        input: qint8 features ``[N, in]``.
        weight_int8: int8 ``[out, *kernel, in // groups]``.
        weight_scales: float32 ``[out]``.
        bias: float32 ``[out]`` or None.
        output_scale: requantize to qint8 with this scale; None returns float32 features.
        relu: fused ReLU.
        residual: added before the ReLU: qint8 (fused into the int8 pass) or float (its
            dequantize kept in the graph: the core returns float32, and the add, ReLU and
            requantization follow here, round half to even like the core).

    Returns:
        The output SparseConvTensor (qint8 features, or float32 when ``output_scale`` is None).
    """
    import sparsecore.int8 as core_int8

    name = type(layer).__name__
    values, input_scale = int8_features(name, input)
    check_int8_input(name, input, values, layer.in_channels, layer.ndim)
    check_same_device(name, features=values, indices=input.indices, weight=weight_int8)
    data, indice_dict = layer_indice_data(name, input, layer._geometry, layer_indice_key(layer), layer.algo,
                                          neighbour_tensors=False)
    residual_values = residual_scale = float_residual = None
    if residual is not None:
        if residual.features.shape[0] != data.num_output:
            raise ValueError(f"{name}: the residual input has {residual.features.shape[0]} sites but the conv "
                             f"output has {data.num_output}; they must be the same sites")
        if residual.features.dtype == torch.qint8:
            residual_values, residual_scale = int8_features(name, residual)
        else:
            float_residual = residual.features.float()
    core_output_scale = None if float_residual is not None else output_scale
    with core_context(values.device):
        out = core_int8.int8_conv_forward(
            core_view(values, "features"), core_view(weight_int8, "weight"), data.rulebook,
            input_scale=input_scale, weight_scales=core_view(weight_scales.float().contiguous(), "weight_scales"),
            output_scale=core_output_scale,
            bias=None if bias is None else core_view(bias.float().contiguous(), "bias"),
            residual=None if residual_values is None else core_view(residual_values, "residual"),
            residual_scale=residual_scale, relu=relu and float_residual is None, groups=layer.groups)
        out_features = to_torch(out)
    if float_residual is not None:
        out_features = out_features + float_residual
        if relu:
            out_features = torch.relu(out_features)
        if output_scale is not None:
            out_features = torch.clamp(torch.round(out_features / output_scale), -128, 127).to(torch.int8)
    if output_scale is not None:
        out_features = quantized_features(out_features, output_scale)
    return SparseConvTensor._derived(input, out_features, data.out_indices, data.out_spatial_shape, indice_dict,
                                     core_indices=data.out_core_indices)
