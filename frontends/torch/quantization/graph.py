"""Graph passes after ``convert_fx``: `transform_qdq` (lowering to int8 modules) and `remove_conv_add_dq`.

``convert_fx`` leaves each observed sparse layer as a *reference* pattern:
``quantize -> dequantize -> SpConv (float) -> quantize``. `transform_qdq`
makes every quantize node accept a `SparseConvTensor` (`quantize_per_tensor`),
and lowers ``dequantize -> reference sparse conv -> quantize`` to one int8
module (`quantized.SparseConv`, `SparseConvReLU`, `SparseConvAddReLU`) and
``dequantize -> SparseMaxPool -> quantize`` to `QuantizedSparseMaxPool`, so
int8 features flow between them. `remove_conv_add_dq` then feeds the residual
of each fused conv-add-relu as int8 (its dequantize dropped).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
import torch.fx
from torch import nn

from ..pool import SparseMaxPool
from ..tensor import SparseConvTensor
from . import intrinsic as fused
from .quantized import conv as quantized
from .quantized.reference import SpConv
from ._torch_notices import torch_notices_silenced

__all__ = ["quantize_per_tensor", "quantized_add", "quantized_add_relu", "transform_qdq", "remove_conv_add_dq",
           "is_dequantize_node", "is_quantize_node", "modules_in_graph"]

Quantizable = Union[SparseConvTensor, torch.Tensor]


def _fx_function(function):
    """Records ``function`` as one ``call_function`` node when called on fx Proxies (a saved GraphModule
    is re-traced when it is loaded), and runs it otherwise."""
    import functools

    from ..fx import active_tracer

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        tracer = active_tracer(args, kwargs)
        if tracer is not None:
            return tracer.create_proxy("call_function", wrapper, args, kwargs)
        return function(*args, **kwargs)

    return wrapper


@_fx_function
def quantize_per_tensor(value: Union[Quantizable, Sequence[Quantizable]], scale: Any, zero_point: Any,
                        dtype: torch.dtype) -> Any:
    """``torch.quantize_per_tensor`` that also takes SparseConvTensors (their features are quantized).

    Lists / tuples take lists of scales and zero points, as torch's.
    """
    if isinstance(value, (list, tuple)):
        return [quantize_per_tensor(item, scale[i], zero_point[i], dtype) for i, item in enumerate(value)]
    if isinstance(value, SparseConvTensor):
        return value.replace_feature(quantize_per_tensor(value.features, scale, zero_point, dtype))
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"quantize_per_tensor takes a tensor or a SparseConvTensor, got {type(value).__name__}")
    if value.is_quantized:
        raise TypeError("quantize_per_tensor got an already quantized tensor (an int8 tensor into a float "
                        "quantize node): dequantize it first")
    with torch_notices_silenced():
        return torch.quantize_per_tensor(value, float(scale), int(zero_point), dtype)


def _features_and_scale(value: Quantizable, name: str) -> tuple[torch.Tensor, float]:
    features = value.features if isinstance(value, SparseConvTensor) else value
    if not isinstance(features, torch.Tensor) or features.dtype != torch.qint8:
        raise TypeError(f"quantized add: {name} must be qint8, got {getattr(features, 'dtype', type(value))}")
    return features.int_repr().float() * torch.tensor(features.q_scale(), dtype=torch.float32), features.q_scale()


def _quantized_add(x: Quantizable, y: Quantizable, scale: Any, zero_point: Any, relu: bool) -> Quantizable:
    x_float, _ = _features_and_scale(x, "x")
    y_float, _ = _features_and_scale(y, "y")
    if isinstance(x, SparseConvTensor) and isinstance(y, SparseConvTensor):
        x._other_features(y)  # same sites, or a clear error
    total = x_float + y_float
    if relu:
        total = torch.relu(total)
    values = torch.clamp(torch.round(total / torch.tensor(float(scale), dtype=torch.float32)), -128, 127)
    with torch_notices_silenced():
        out = torch._make_per_tensor_quantized_tensor(values.to(torch.int8), float(scale), int(zero_point))
    base = x if isinstance(x, SparseConvTensor) else y
    return base.replace_feature(out) if isinstance(base, SparseConvTensor) else out


@_fx_function
def quantized_add(x: Quantizable, y: Quantizable, scale: Any, zero_point: Any) -> Quantizable:
    """``torch.ops.quantized.add`` for qint8 tensors or SparseConvTensors (float32 sum, round half even)."""
    return _quantized_add(x, y, scale, zero_point, relu=False)


@_fx_function
def quantized_add_relu(x: Quantizable, y: Quantizable, scale: Any, zero_point: Any) -> Quantizable:
    """``torch.ops.quantized.add_relu`` for qint8 tensors or SparseConvTensors."""
    return _quantized_add(x, y, scale, zero_point, relu=True)


def is_dequantize_node(node: Any) -> bool:
    """True for a ``x.dequantize()`` node."""
    return isinstance(node, torch.fx.Node) and node.op == "call_method" and node.target == "dequantize"


def is_quantize_node(node: Any) -> bool:
    """True for a ``quantize_per_tensor`` node (torch's or `quantize_per_tensor`)."""
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and \
        node.target in (torch.quantize_per_tensor, quantize_per_tensor)


def _set_module(model: nn.Module, target: str, module: nn.Module) -> None:
    parent, _, name = target.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


def _lowered_class(module: nn.Module) -> Optional[type]:
    if type(module) is SpConv:
        return quantized.SparseConv
    if type(module) is fused.SpconvReLUNd and type(module[0]) is SpConv:
        return quantized.SparseConvReLU
    if type(module) is fused.SpconvAddReLUNd and type(module[0]) is SpConv:
        return quantized.SparseConvAddReLU
    if isinstance(module, SparseMaxPool):
        return quantized.QuantizedSparseMaxPool
    return None


def modules_in_graph(model: Any, types: Union[type, tuple[type, ...]], taker: str
                     ) -> list[tuple[torch.fx.Node, nn.Module]]:
    """The ``call_module`` nodes of ``model`` whose module is one of ``types``, with their modules, in graph order.

    Args:
        model: a ``torch.fx.GraphModule``.
        types: the module classes to keep (``isinstance``).
        taker: the caller and what it takes, for the error (``"transform_qdq takes the GraphModule
            that convert_fx returns"``).

    Raises:
        TypeError: ``"<taker>, got <type>"`` when ``model`` is not a GraphModule.
    """
    if not isinstance(model, torch.fx.GraphModule):
        raise TypeError(f"{taker}, got {type(model).__name__}")
    found = []
    for node in model.graph.nodes:
        if node.op == "call_module":
            module = model.get_submodule(node.target)
            if isinstance(module, types):
                found.append((node, module))
    return found


def _only_quantize_user(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    users = list(node.users)
    if len(users) == 1 and is_quantize_node(users[0]) and users[0].args[0] is node:
        return users[0]
    return None


def transform_qdq(model: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Makes a ``convert_fx`` result run int8 sparse layers (see the module docstring); returns ``model``.

    Raises:
        TypeError: when ``model`` is not a ``torch.fx.GraphModule``.
    """
    if not isinstance(model, torch.fx.GraphModule):
        raise TypeError(f"transform_qdq takes the GraphModule that convert_fx returns, got {type(model).__name__}")
    graph = model.graph
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch.quantize_per_tensor:
            node.target = quantize_per_tensor
        elif node.target is torch.ops.quantized.add or node.target is torch.ops.quantized.add.default:
            node.target = quantized_add
        elif node.target is torch.ops.quantized.add_relu or node.target is torch.ops.quantized.add_relu.default:
            node.target = quantized_add_relu
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        module = model.get_submodule(node.target)
        lowered = _lowered_class(module)
        if lowered is None or not node.args or not is_dequantize_node(node.args[0]):
            continue
        q_node = _only_quantize_user(node)
        if q_node is None:
            continue  # a float output: the reference module stays (float arithmetic on int8-rounded weights)
        if lowered is quantized.QuantizedSparseMaxPool:
            new_module = lowered.from_float(module)
        else:
            _, scale_node, zero_point_node, _ = q_node.args
            scale = getattr(model, scale_node.target) if isinstance(scale_node, torch.fx.Node) else scale_node
            zero_point = getattr(model, zero_point_node.target) if isinstance(zero_point_node, torch.fx.Node) \
                else zero_point_node
            new_module = lowered.from_reference(module, scale, zero_point)
        _set_module(model, node.target, new_module)
        dq_node = node.args[0]
        node.args = (dq_node.args[0],) + tuple(node.args[1:])
        q_node.replace_all_uses_with(node)
        graph.erase_node(q_node)
    graph.eliminate_dead_code()
    graph.lint()
    model.recompile()
    model.delete_all_unused_submodules()
    return model


def remove_conv_add_dq(model: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Feeds each int8 conv-add-relu its residual as int8 (drops the dequantize before it); returns ``model``."""
    for node, module in modules_in_graph(model, quantized.SparseConvAddReLU,
                                         "remove_conv_add_dq takes a GraphModule"):
        if len(node.args) < 2 or type(module) is not quantized.SparseConvAddReLU:
            continue
        residual = node.args[1]
        if is_dequantize_node(residual):
            node.replace_input_with(residual, residual.args[0])
    model.graph.eliminate_dead_code()
    model.graph.lint()
    model.recompile()
    return model
