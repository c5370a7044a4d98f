"""Per-layer int8 parameters for a deployment engine (TensorRT plugins, the int8 ONNX export).

`tensorrt_parameters` walks a model after `transform_qdq` and returns, for
each int8 sparse conv, a frozen `Int8LayerParameters`: the int8 weight and its
per-channel scales, the float bias, the scales of the input, output and
residual, and what spconv's implicit-GEMM epilogue takes::

    gemm_scale[c] = input_scale * weight_scales[c] / output_scale
    gemm_bias[c]  = bias[c] / output_scale

(so ``int8_out = saturate(round(acc * gemm_scale + gemm_bias [+ residual *
residual_scale / output_scale]))``, with ReLU before rounding when ``relu``).
Dynamic ranges are the absolute maxima TensorRT's ``setDynamicRange(-r, r)``
takes, ``r = 127 * scale`` (TensorRT's scale is ``r / 127``, so it then uses
the very scale the model was converted with).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch
import torch.fx

from .graph import is_quantize_node, modules_in_graph
from .quantized import conv as quantized

__all__ = ["Int8LayerParameters", "tensorrt_parameters", "input_scale_of"]

_PASS_THROUGH = (quantized.QuantizedSparseMaxPool,)


@dataclasses.dataclass(frozen=True)
class Int8LayerParameters:
    """What a deployment engine needs for one int8 sparse conv layer.

    Attributes:
        name: the layer's qualified name in the model.
        kind: its class name (``SparseConv``, ``SparseConvReLU``, ``SparseConvAddReLU``).
        relu: a ReLU is fused.
        input_scale, output_scale: per-tensor activation scales (floats).
        residual_scale: the residual input's scale (conv-add-relu), else None.
        weight_int8: int8 ``[out, *kernel, in // groups]``.
        weight_scales: float32 ``[out]``.
        bias: float32 ``[out]`` or None.
        gemm_scale: float32 ``[out]``, ``input_scale * weight_scales / output_scale``.
        gemm_bias: float32 ``[out]``, ``bias / output_scale`` (zeros without a bias).
        input_dynamic_range, output_dynamic_range: ``127 * scale`` (TensorRT's absolute maxima).
        residual_dynamic_range: likewise for the residual, or None.
    """

    name: str
    kind: str
    relu: bool
    input_scale: float
    output_scale: float
    residual_scale: Optional[float]
    weight_int8: np.ndarray
    weight_scales: np.ndarray
    bias: Optional[np.ndarray]
    gemm_scale: np.ndarray
    gemm_bias: np.ndarray
    input_dynamic_range: float
    output_dynamic_range: float
    residual_dynamic_range: Optional[float]


def input_scale_of(model: torch.fx.GraphModule, node: object) -> Optional[float]:
    """The quantization scale of the value ``node`` computes, or None when it is float."""
    while isinstance(node, torch.fx.Node):
        if is_quantize_node(node):
            scale = node.args[1]
            return float(getattr(model, scale.target) if isinstance(scale, torch.fx.Node) else scale)
        if node.op != "call_module":
            return None
        module = model.get_submodule(node.target)
        if isinstance(module, (quantized.SparseConv, quantized.LinearPerChannelWeight)):
            return float(module.scale)
        if not isinstance(module, _PASS_THROUGH):
            return None
        node = node.args[0]
    return None


def tensorrt_parameters(model: torch.fx.GraphModule) -> list[Int8LayerParameters]:
    """The `Int8LayerParameters` of every int8 sparse conv in ``model``, in graph order.

    Args:
        model: the GraphModule after ``convert_fx`` and `transform_qdq` (and optionally
            `remove_conv_add_dq`).

    Raises:
        TypeError: for a model that is not a GraphModule.
        ValueError: naming the layer, when its input is not int8 (its scale unknown).
    """
    layers = []
    for node, module in modules_in_graph(model, quantized.SparseConv,
                                         "tensorrt_parameters takes the converted GraphModule"):
        input_scale = input_scale_of(model, node.args[0])
        if input_scale is None:
            raise ValueError(f"layer {node.target}: its input is not int8 in the graph, so its input scale is "
                             "unknown; run transform_qdq on the converted model first")
        residual_scale = None
        if isinstance(module, quantized.SparseConvAddReLU) and len(node.args) > 1:
            residual = node.args[1]
            if residual.op == "call_method" and residual.target == "dequantize":
                residual = residual.args[0]
            residual_scale = input_scale_of(model, residual)
        output_scale = float(module.scale)
        weight_scales = module.weight_scales.detach().cpu().numpy().astype(np.float32)
        bias = None if module.bias_float is None else module.bias_float.detach().cpu().numpy().astype(np.float32)
        gemm_scale = (np.float32(input_scale) * weight_scales / np.float32(output_scale)).astype(np.float32)
        gemm_bias = (np.zeros_like(weight_scales) if bias is None else bias / np.float32(output_scale))
        layers.append(Int8LayerParameters(
            name=str(node.target), kind=type(module).__name__, relu=bool(module._RELU), input_scale=input_scale,
            output_scale=output_scale, residual_scale=residual_scale,
            weight_int8=module.weight_int8.detach().cpu().numpy(), weight_scales=weight_scales, bias=bias,
            gemm_scale=gemm_scale, gemm_bias=gemm_bias.astype(np.float32),
            input_dynamic_range=127.0 * input_scale, output_dynamic_range=127.0 * output_scale,
            residual_dynamic_range=None if residual_scale is None else 127.0 * residual_scale))
    return layers
