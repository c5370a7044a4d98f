"""``precision="int8"`` for `export_onnx`: a model converted by the INT8 workflow, as libspconv int8 nodes.

The converted model (``convert_fx`` + `transform_qdq`, a ``torch.fx.GraphModule``)
runs once on the example input under an ``fx.Interpreter`` that follows, for
each graph value, which tensor of the file it is and how the torch model holds
it (float, int8 with a scale, an int8 tensor dequantized, or a float tensor
an int8 layer quantizes on reading). Each int8 conv becomes a
``SparseConvolution`` with libspconv's int8 attributes (see docs/deployment.md):

- ``precision``: ``"int8"`` when its input tensor is int8 in the file, ``"fp16"``
  when it quantizes a float tensor on reading (the first layer);
- ``input_dynamic_range = 127 * input_scale``; ``weight_dynamic_ranges[c] =
  127 * weight_scales[c]`` (each the float32 nearest to it whose ``range / 127``
  in float32 gives back the model's scale, so that libspconv and
  `sparsecore.runtime` quantize with the very scales of the model; where no
  float32 range does, which happens for a few scales, the nearest range,
  whose scale is the float32 next to the model's);
- ``output_precision``: ``"int8"`` when int8 layers read the output, ``"fp16"``
  when only float readers do (the graph output): libspconv then returns the
  layer's float result, which the torch model rounds to its output scale first;
- weights: FP16 (the format's only initializer type) holding
  ``weight_int8 * weight_scales``, which libspconv quantizes back to the very
  int8 weights (checked here: an export whose FP16 weights would not give them
  back is refused); biases FP16.

A fused conv-add-ReLU (`SparseConvAddReLU`) becomes the conv (FP16 output, no
activation), an int8 ``Add`` (``input0_dynamic_range = 0``: the conv's float
result; ``input1_dynamic_range``: the residual's range) and a ``Relu``. A
dequantize followed by a quantize to another scale (the residual's
``SparseIdentity``) has no node in the format: readers read the int8 tensor at
its producer's scale. Float layers the qconfig left out are written as FP16
nodes. A tensor read both by int8 and float layers, or as int8 with two
scales, has no single type in the format and is refused.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.fx
from torch import nn

from ._export_trace import ConvRecord, ExportError, OpRecord, Trace
from ._int8_ranges import check_fp16_weight, dynamic_range, dynamic_ranges
from ._onnx_steps import PlannedConv, PlannedStep
from .conv import SparseConvolution
from .modules import SparseIdentity, SparseReLU
from .quantization import graph as qgraph
from .quantization import intrinsic as fused
from .quantization.quantized import conv as quantized
from .spconv_rules import effective_weight
from .tensor import SparseConvTensor

__all__ = ["plan_int8"]

_FLOAT, _INT8, _QUANTIZED, _DEQUANTIZED, _DENSE = "float", "int8", "quantized", "dequantized", "dense"
_RELUS = (nn.ReLU, SparseReLU)


@dataclass
class _Pending:
    """A planned node whose ``output_precision`` waits for its readers: set from ``int8_output``'s readers."""

    item: Any
    where: str
    attributes: dict
    int8_output: Optional[str]


@dataclass(frozen=True)
class _View:
    """An fx value seen from the file: its tensor, how torch holds it, and the int8 scale where there is one."""

    tensor: str
    form: str
    scale: Optional[float] = None


class _Planner(torch.fx.Interpreter):
    """Runs the converted model and plans the file's nodes (see the module docstring)."""

    def __init__(self, model: torch.fx.GraphModule) -> None:
        super().__init__(model)
        self.views: dict[torch.fx.Node, _View] = {}
        self.steps: list[_Pending] = []
        self.int8_readers: dict[str, list[str]] = {}
        self.float_readers: dict[str, list[str]] = {}
        self.quantized_reads: dict[str, dict[float, str]] = {}  # float tensors read as int8: scale -> reader
        self.counter = 0
        self.failure: Optional[str] = None
        self.input_shape: Optional[tuple[int, int]] = None
        self.graph_output: Optional[_View] = None
        self.graph_output_shape: tuple[int, ...] = ()

    # bookkeeping ------------------------------------------------------------------------
    def new_tensor(self) -> str:
        self.counter += 1
        return f"v{self.counter}"

    def view(self, node: Any, where: str) -> _View:
        found = self.views.get(node) if isinstance(node, torch.fx.Node) else None
        if found is None:
            raise ExportError(f"{where} reads {node!r}, which is not derived from the model input through nodes "
                              "libspconv's format has (SparseConvolution, Add, Relu, ScatterDense, Reshape, Transpose)")
        return found

    def read_int8(self, view: _View, reader: str) -> tuple[str, float, str]:
        """An int8 reader of ``view``: (tensor, scale, the reader's precision)."""
        if view.form == _INT8:
            self.int8_readers.setdefault(view.tensor, []).append(reader)
            return view.tensor, view.scale, "int8"
        if view.form == _QUANTIZED:
            self.quantized_reads.setdefault(view.tensor, {}).setdefault(float(np.float32(view.scale)), reader)
            return view.tensor, view.scale, "fp16"
        raise ExportError(f"{reader} reads {view.form} features where the model computes in int8")

    def read_float(self, view: _View, reader: str) -> str:
        if view.form == _DEQUANTIZED:
            self.float_readers.setdefault(view.tensor, []).append(reader)
        elif view.form != _FLOAT:
            raise ExportError(f"{reader} is a float layer reading {view.form} features; libspconv's format gives "
                              "each tensor one type")
        return view.tensor

    def add_step(self, item: Any, attributes: Optional[dict] = None, int8_output: Optional[str] = None) -> None:
        where = item.module_name if isinstance(item, OpRecord) else f"module {item.record.module_name!r}"
        self.steps.append(_Pending(item, where, dict(attributes or {}), int8_output))

    # fx -----------------------------------------------------------------------------------
    def run_node(self, node: torch.fx.Node) -> Any:
        result = super().run_node(node)
        try:
            view = self.plan(node, result)
        except ExportError as error:  # kept apart: fx appends its own traceback text to the error it re-raises
            self.failure = str(error)
            raise
        if view is not None:
            self.views[node] = view
        return result

    def plan(self, node: torch.fx.Node, result: Any) -> Optional[_View]:
        where = f"node {node.name!r} ({node.op} {getattr(node.target, '__name__', node.target)!s})"
        if node.op == "placeholder":
            if isinstance(result, SparseConvTensor) and self.input_shape is None:
                self.input_shape = tuple(result.features.shape)
                return _View("v0", _FLOAT)
            raise ExportError(f"{where}: the model's inputs must be one SparseConvTensor")
        if node.op == "get_attr":
            return None
        if node.op == "output":
            self.graph_output = self.view(node.args[0], "the model's output")
            self.graph_output_shape = tuple(result.shape if isinstance(result, torch.Tensor) else result.features.shape)
            if self.graph_output.form == _DEQUANTIZED:
                self.float_readers.setdefault(self.graph_output.tensor, []).append("the graph output")
            elif self.graph_output.form not in (_FLOAT, _DENSE):
                raise ExportError(f"the model returns {self.graph_output.form} features; an exported graph returns "
                                  "float values (dequantize the output, as convert_fx does)")
            return None
        if node.op == "call_module":
            return self.plan_module(node, self.module.get_submodule(node.target), result, where)
        if node.op == "call_method":
            return self.plan_method(node, result, where)
        if not isinstance(result, (torch.Tensor, SparseConvTensor)):
            return None  # a shape or a size read for a view's dims
        return self.plan_function(node, result, where)

    def plan_function(self, node: torch.fx.Node, result: Any, where: str) -> _View:
        target = node.target
        if qgraph.is_quantize_node(node):
            source = self.view(node.args[0], where)
            if source.form == _FLOAT:
                return _View(source.tensor, _QUANTIZED, _q_scale(result))
            if source.form == _DEQUANTIZED:  # a requantization: read at the producer's scale (no node for it)
                return _View(source.tensor, _INT8, source.scale)
            if source.form == _DENSE and source.scale is not None:  # likewise a dense int8 grid (a view's observer)
                return source
            raise ExportError(f"{where} quantizes {source.form} features, which libspconv's format cannot express "
                              "(it has no quantize node)")
        if target is getattr and node.args[1] == "features":
            return self.view(node.args[0], where)
        if target in (qgraph.quantized_add, qgraph.quantized_add_relu):
            first, second = (self.read_int8(self.view(arg, where), where) for arg in node.args[:2])
            return self.add_nodes(where, first, second, _q_scale(result), result,
                                  relu=target is qgraph.quantized_add_relu)
        if target in (operator.add, torch.add):
            inputs = tuple(self.read_float(self.view(arg, where), where) for arg in node.args[:2])
            output = self.new_tensor()
            self.add_step(OpRecord("add", where, inputs, output, (), _shape(result)))
            return _View(output, _FLOAT)
        if target in (torch.relu, nn.functional.relu):
            return self.relu(node.args[0], result, where)
        raise ExportError(f"{where} has no node in libspconv's format (SparseConvolution, Add, Relu, ScatterDense, "
                          "Reshape, Transpose)")

    def plan_method(self, node: torch.fx.Node, result: Any, where: str) -> Optional[_View]:
        source = self.view(node.args[0], where)
        if not isinstance(result, (torch.Tensor, SparseConvTensor)):
            return None  # size(), dim(): read for a view's dims
        if node.target == "dequantize":
            if source.form == _INT8:
                return _View(source.tensor, _DEQUANTIZED, source.scale)
            if source.form == _DENSE:
                return source
            raise ExportError(
                f"{where} dequantizes {source.form} features: the model rounds a float tensor to int8 and back, "
                "which libspconv's format cannot express (it has no quantize node; an int8 tensor is only an int8 "
                "layer's output). A residual block whose identity reads the model's float input does this: put "
                "a conv (a stem) before the block")
        if node.target == "dense" and not node.kwargs and len(node.args) == 1:
            attributes = {}
            if source.form == _DEQUANTIZED:  # ScatterDense reads the int8 tensor with its range
                self.int8_readers.setdefault(source.tensor, []).append(where)
                attributes["input_dynamic_range"] = dynamic_range(source.scale)
            else:
                self.read_float(source, where)
            spatial = tuple(int(size) for size in result.shape[2:])
            output = self.new_tensor()
            self.add_step(OpRecord("dense", where, (source.tensor,), output, spatial, tuple(result.shape)), attributes)
            return _View(output, _DENSE, source.scale if source.form == _DEQUANTIZED else None)
        if node.target in ("view", "reshape", "permute") and source.form == _DENSE:
            dims, _ = self.fetch_args_kwargs_from_env(node)
            dims = dims[1:]
            if len(dims) == 1 and isinstance(dims[0], (tuple, list, torch.Size)):
                dims = tuple(dims[0])
            output = self.new_tensor()
            kind = "transpose" if node.target == "permute" else "reshape"
            self.add_step(OpRecord(kind, where, (source.tensor,), output, tuple(int(d) for d in dims),
                                   tuple(result.shape)))
            return _View(output, _DENSE, source.scale)
        raise ExportError(f"{where} on {source.form} values has no node in libspconv's format")

    def plan_module(self, node: torch.fx.Node, module: nn.Module, result: Any, where: str) -> _View:
        where = f"module {node.target!r} ({type(module).__module__}.{type(module).__qualname__})"
        if isinstance(module, quantized.SparseConv):
            return self.int8_conv(node, module, result, where)
        if isinstance(module, SparseIdentity):
            return self.view(node.args[0], where)
        if isinstance(module, _RELUS):
            return self.relu(node.args[0], result, where)
        activation = None
        conv = module
        if isinstance(module, fused.SpconvReLUNd) and isinstance(module[0], SparseConvolution):
            conv, activation = module[0], "relu"
        if isinstance(conv, SparseConvolution) and len(node.args) == 1:
            activation = activation or conv._activation
            source = self.read_float(self.view(node.args[0], where), where)
            weight = effective_weight(conv).detach().to(torch.float64).cpu().numpy()
            bias = np.zeros(conv.out_channels) if conv.bias is None else conv.bias.detach().double().cpu().numpy()
            output = self.new_tensor()
            record = _conv_record(str(node.target), conv, source, output, self.env[node.args[0]], result)
            self.add_step(PlannedConv(record, weight, bias, activation, output), {"precision": "fp16",
                                                                                 "output_precision": "fp16"})
            return _View(output, _FLOAT)
        raise ExportError(f"{where} cannot be exported with precision='int8': libspconv's format has "
                          "SparseConvolution, Add, Relu, ScatterDense, Reshape and Transpose nodes only")

    # node builders ---------------------------------------------------------------------------
    def relu(self, argument: Any, result: Any, where: str) -> _View:
        source = self.read_float(self.view(argument, where), where)
        output = self.new_tensor()
        self.add_step(OpRecord("relu", where, (source,), output, (), _shape(result)))
        return _View(output, _FLOAT)

    def int8_conv(self, node: torch.fx.Node, module: quantized.SparseConv, result: Any, where: str) -> _View:
        tensor, input_scale, precision = self.read_int8(self.view(node.args[0], where), where)
        weight_scales = module.weight_scales.detach().cpu().numpy().astype(np.float32)
        ranges = dynamic_ranges(weight_scales)
        weight = (module.weight_int8.detach().cpu().numpy().astype(np.float64)
                  * weight_scales.astype(np.float64).reshape((-1,) + (1,) * (module.weight_int8.dim() - 1)))
        check_fp16_weight(where, weight, ranges, module.weight_int8.detach().cpu().numpy())
        bias = (np.zeros(module.out_channels) if module.bias_float is None
                else module.bias_float.detach().double().cpu().numpy())
        output_scale = float(module.scale)
        conv_output = self.new_tensor()
        record = _conv_record(str(node.target), module, tensor, conv_output, self.env[node.args[0]], result)
        attributes = {"precision": precision, "input_dynamic_range": dynamic_range(input_scale),
                      "weight_dynamic_ranges": [float(value) for value in ranges]}
        if not module._ADD:
            self.add_step(PlannedConv(record, weight, bias, "relu" if module._RELU else None, conv_output),
                          attributes, int8_output=conv_output)
            return _View(conv_output, _INT8, output_scale)
        attributes["output_precision"] = "fp16"  # the float sum conv + residual is the add's
        self.add_step(PlannedConv(record, weight, bias, None, conv_output), attributes)
        residual = self.view(node.args[1], where)
        if residual.form == _DEQUANTIZED:  # a float residual: an int8 tensor dequantized
            self.int8_readers.setdefault(residual.tensor, []).append(where)
            second = (residual.tensor, residual.scale, "int8")
        elif residual.form == _FLOAT:
            second = (residual.tensor, None, "fp16")
        else:
            second = self.read_int8(residual, where)
        return self.add_nodes(where, (conv_output, None, "fp16"), second, output_scale, result, relu=True)

    def add_nodes(self, where: str, first: tuple, second: tuple, output_scale: float, result: Any,
                  relu: bool) -> _View:
        """An int8 ``Add`` (input ranges 0 for float inputs), then a ``Relu``; the output is int8."""
        shape = _shape(result)
        output = self.new_tensor()
        attributes = {"precision": "int8"}
        for position, (_, scale, _) in enumerate((first, second)):
            attributes[f"input{position}_dynamic_range"] = 0.0 if scale is None else dynamic_range(scale)
        self.add_step(OpRecord("add", where, (first[0], second[0]), output, (), shape), attributes,
                      int8_output=output)
        last = output
        if relu:
            last = self.new_tensor()
            self.add_step(OpRecord("relu", where, (output,), last, (), shape))
            self.steps[-2].int8_output = last  # the Relu's readers decide the add's output type
        return _View(last, _INT8, output_scale)


def _q_scale(result: Any) -> float:
    """The quantization scale of a qint8 tensor or of a SparseConvTensor's qint8 features."""
    return float((result.features if isinstance(result, SparseConvTensor) else result).q_scale())


def _shape(result: Any) -> tuple[int, ...]:
    value = result.features if isinstance(result, SparseConvTensor) else result
    return tuple(value.shape)


def _conv_record(name: str, module: Any, source: str, output: str, x: SparseConvTensor,
                 result: SparseConvTensor) -> ConvRecord:
    return ConvRecord(name, module, source, output, None, tuple(x.features.shape), tuple(result.features.shape),
                      tuple(x.spatial_shape), tuple(result.spatial_shape))


def plan_int8(model: nn.Module, example_input: Any) -> tuple[Trace, list[PlannedStep]]:
    """The trace and the planned nodes of a converted int8 model on ``example_input``.

    Raises:
        ExportError: a model that is not converted (no int8 layer), a module or an
            operation the format cannot express (named), or a tensor that would need
            two types or two scales; raised before anything is written.
    """
    if not isinstance(model, torch.fx.GraphModule) or not any(
            isinstance(module, quantized.SparseConv) for module in model.modules()):
        raise ExportError(
            f"precision='int8' exports a model converted by the INT8 workflow (prepare_fx, calibration, convert_fx, "
            f"transform_qdq; see docs/quantization.md), whose sparse convs are int8; this {type(model).__name__} "
            "has no int8 sparse conv. Convert it first, or export it with precision='fp16'")
    if not isinstance(example_input, SparseConvTensor) or example_input.features.shape[0] == 0:
        raise ExportError("example_input must be a non-empty SparseConvTensor (the model runs on it once)")
    planner = _Planner(model)
    try:
        with torch.no_grad():
            planner.run(example_input)
    except ExportError:
        if planner.failure is None:
            raise
        raise ExportError(planner.failure) from None
    for tensor, readers in planner.quantized_reads.items():
        if len(readers) > 1:
            described = ", ".join(f"{reader} with scale {scale:.9g}" for scale, reader in readers.items())
            raise ExportError(
                f"the float tensor {tensor!r} is read as int8 with different scales ({described}); libspconv keys a "
                "tensor's scale by its name, so a file can give it one. Put a conv (a stem) before the layers "
                "that quantize it differently")
    steps = []
    for step in planner.steps:
        if step.int8_output is not None:
            int8 = planner.int8_readers.get(step.int8_output, [])
            floats = planner.float_readers.get(step.int8_output, [])
            if int8 and floats:
                raise ExportError(
                    f"the int8 output of {step.where} is read by int8 layers ({int8[0]}) and float layers "
                    f"({floats[0]}); libspconv's format gives a tensor one precision. Quantize the float reader "
                    "too, or exclude the producer from quantization")
            step.attributes["output_precision"] = "int8" if int8 else "fp16"
        steps.append(PlannedStep(step.item, tuple(sorted(step.attributes.items()))))
    output = planner.graph_output
    trace = Trace("v0", planner.input_shape, (), output.tensor, output.form == _DENSE, planner.graph_output_shape)
    return trace, steps
