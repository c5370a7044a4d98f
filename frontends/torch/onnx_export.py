"""`export_onnx`: a sparsecore.torch model to the ONNX format NVIDIA's libspconv reads.

The model runs once on an example input while `_export_trace.record` watches
it; then each eval-mode BatchNorm is folded into the sparse conv before it
(weight scaled per output channel by ``gamma / sqrt(var + eps)``, bias ``(b -
mean) * gamma / sqrt(var + eps) + beta``), a ReLU that alone reads a conv's
output becomes the conv's ``activation``, and the graph is written with
NVIDIA's node types and attribute names: ``SparseConvolution`` (``rulebook``
is the layer's ``indice_key``), ``Add``, ``Relu``, ``ScatterDense`` for
``.dense()``, ``Reshape`` / ``Transpose`` for ``view`` / ``permute`` on the
dense tensor. Weights are FP16 ``raw_data`` in the layer's ``[out, *kernel,
in]`` layout; a layer without bias gets a zero bias (the parser always reads
input 2). Values are named by consecutive integers, the input ``"0"``.

``precision="int8"`` takes a model converted by the INT8 workflow (a
``GraphModule`` with int8 sparse convs) and writes libspconv's int8
attributes from its own scales (`_onnx_int8`; docs/deployment.md).

The non-standard ops are written in the ``spconv`` domain (libspconv's parser
reads op types only) so that the file passes ``onnx.checker``. Everything is
checked before the file is written.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Union

import numpy as np
import torch
from torch import nn

from ._export_trace import BatchNormRecord, ConvRecord, ExportError, OpRecord, Trace, record
from ._onnx_int8 import plan_int8
from ._onnx_steps import PlannedConv as _Conv
from ._onnx_steps import PlannedStep as _Step
from .exportable import effective_weight, layer_rulebook_key

__all__ = ["export_onnx", "ExportError", "PRECISIONS", "DEFAULT_OUTPUT_BOUND", "CUSTOM_DOMAIN"]

PRECISIONS = ("fp16", "fp32", "int8")
DEFAULT_OUTPUT_BOUND = 200000  # NVIDIA's exporter's default capacity of output sites
CUSTOM_DOMAIN = "spconv"
_ACTIVATION_NAMES = {None: "None", "relu": "ReLU", "sigmoid": "Sigmoid", "leaky_relu": "LeakyReLU"}


def _consumers(trace: Trace) -> dict[str, int]:
    counts: dict[str, int] = {trace.output: 1}
    for entry in trace.records:
        sources = (entry.input,) if isinstance(entry, (ConvRecord, BatchNormRecord)) else entry.inputs
        if isinstance(entry, ConvRecord) and entry.add_input is not None:
            sources = sources + (entry.add_input,)
        for source in sources:
            counts[source] = counts.get(source, 0) + 1
    return counts


def _rulebook_name(module: Any, index: int) -> str:
    """The key the layer uses (`layer_rulebook_key`), or a name of its own (``auto.conv{i}``)."""
    return layer_rulebook_key(module) or f"auto.conv{index}"


def _conv_steps(entry: ConvRecord) -> list[_Step]:
    module = entry.module
    weight = effective_weight(module).detach().to(torch.float64).cpu().numpy()
    bias = (np.zeros(module.out_channels) if module.bias is None
            else module.bias.detach().to(torch.float64).cpu().numpy())
    activation = module._activation
    if entry.add_input is None:
        return [_Step(_Conv(entry, weight, bias, activation, entry.output))]
    # conv(x) + add_input, then the activation: an explicit Add (and Relu) as in NVIDIA's residual blocks
    if activation not in (None, "relu"):
        raise ExportError(f"module {entry.module_name!r} ({type(module).__qualname__}) fuses an add_input with a "
                          f"{activation} activation; libspconv has Add and Relu nodes only")
    conv_out, add_out = f"{entry.output}.conv", f"{entry.output}.add" if activation else entry.output
    steps = [_Step(_Conv(entry, weight, bias, None, conv_out)),
             _Step(OpRecord("add", entry.module_name, (conv_out, entry.add_input), add_out, (), entry.output_shape))]
    if activation:
        steps.append(_Step(OpRecord("relu", entry.module_name, (add_out,), entry.output, (), entry.output_shape)))
    return steps


def _fold(conv: _Conv, norm: BatchNormRecord) -> _Conv:
    mean, variance = norm.mean.double().cpu().numpy(), norm.variance.double().cpu().numpy()
    gamma = np.ones_like(mean) if norm.weight is None else norm.weight.double().cpu().numpy()
    beta = np.zeros_like(mean) if norm.bias is None else norm.bias.double().cpu().numpy()
    scale = gamma / np.sqrt(variance + norm.eps)
    weight = conv.weight * scale.reshape((-1,) + (1,) * (conv.weight.ndim - 1))
    return dataclasses.replace(conv, weight=weight, bias=(conv.bias - mean) * scale + beta, output=norm.output)


def _plan(trace: Trace) -> list[_Step]:
    """Folds BatchNorms, fuses ReLUs, and keeps the steps the output depends on."""
    consumers = _consumers(trace)
    steps: list[_Step] = []
    producer: dict[str, int] = {}
    for entry in trace.records:
        if isinstance(entry, ConvRecord):
            for step in _conv_steps(entry):
                producer[step.output] = len(steps)
                steps.append(step)
            continue
        source = entry.input if isinstance(entry, BatchNormRecord) else entry.inputs[0]
        position = producer.get(source)
        previous = steps[position].item if position is not None else None
        foldable = (isinstance(previous, _Conv) and previous.activation is None and consumers.get(source, 0) == 1)
        if isinstance(entry, BatchNormRecord):
            if not foldable:
                raise ExportError(
                    f"{entry.module_name}: this BatchNorm cannot be folded, because its input is not the output of a "
                    "sparse conv (without activation) that only the BatchNorm reads; libspconv has no "
                    "BatchNorm node. Put each BatchNorm right after a sparse conv"
                )
            steps[position] = _Step(_fold(previous, entry))
            producer[entry.output] = position
            continue
        if entry.kind == "relu" and foldable:
            steps[position] = _Step(dataclasses.replace(previous, activation="relu", output=entry.output))
            producer[entry.output] = position
            continue
        producer[entry.output] = len(steps)
        steps.append(_Step(entry))
    needed, kept = {trace.output}, []
    for step in reversed(steps):
        if step.output in needed:
            needed.update(step.inputs)
            kept.append(step)
    return kept[::-1]


def _check_strict(steps: list[_Step], precision: str) -> None:
    if precision == "fp32":
        raise ExportError("precision='fp32' writes FLOAT initializers, which libspconv's parser refuses; pass "
                          "strict=False to write a file for sparsecore.runtime only")
    for step in steps:
        if not isinstance(step.item, _Conv):
            continue
        module, name = step.item.record.module, step.item.record.module_name
        problems = []
        if module.transposed:
            problems.append("a transposed conv (libspconv's parser reads no 'transposed' attribute and would run "
                            "it as a regular conv)")
        if module.groups != 1:
            problems.append(f"groups={module.groups} (libspconv runs groups=1 only)")
        if module.ndim != 3:
            problems.append(f"a {module.ndim}-D conv (libspconv runs 3-D convs)")
        if problems:
            raise ExportError(f"module {name!r} ({type(module).__qualname__}) is {'; '.join(problems)}. Pass "
                              "strict=False to write it anyway, for sparsecore.runtime")


def _initializer(helper: Any, name: str, value: np.ndarray, precision: str) -> Any:
    """FLOAT16 ``raw_data`` (fp16 and int8 files: libspconv quantizes int8 weights from FP16), FLOAT for fp32."""
    dtype, code = (np.float32, helper.TensorProto.FLOAT) if precision == "fp32" else (np.float16,
                                                                                      helper.TensorProto.FLOAT16)
    array = np.ascontiguousarray(value.astype(dtype))
    return helper.make_tensor(name, code, list(array.shape), array.tobytes(), raw=True)


def _conv_node(helper: Any, conv: _Conv, index: int, names: dict[str, str], precision: str,
               initializers: list, extra: dict[str, Any]) -> Any:
    entry, module = conv.record, conv.record.module
    weight_name, bias_name = f"spconv{index}.weight", f"spconv{index}.bias"
    initializers += [_initializer(helper, weight_name, conv.weight, precision),
                     _initializer(helper, bias_name, conv.bias, precision)]
    attributes = dict(
        ndim=module.ndim, input_spatial_shape=list(entry.input_spatial_shape),
        output_spatial_shape=list(entry.output_spatial_shape), in_channels=module.in_channels,
        out_channels=module.out_channels, kernel_size=list(module.kernel_size),
        output_bound=int(getattr(module, "output_bound", DEFAULT_OUTPUT_BOUND)), stride=list(module.stride),
        dilation=list(module.dilation), padding=list(module.padding), transposed=int(bool(module.transposed)),
        inverse=int(bool(module.inverse)), output_padding=list(module.output_padding), groups=module.groups,
        subm=int(bool(module.subm)), rulebook=_rulebook_name(module, index),
        activation=_ACTIVATION_NAMES[conv.activation], input_shape=list(entry.input_shape),
        output_shape=list(entry.output_shape), precision=precision, output_precision=precision,
    )
    if conv.activation == "leaky_relu":
        attributes["act_alpha"] = float(module.act_alpha)
    attributes.update(extra)
    return helper.make_node("SparseConvolution", [names[entry.input], weight_name, bias_name],
                            [names[conv.output]], f"conv{index}", doc_string=entry.module_name,
                            domain=CUSTOM_DOMAIN, **attributes)


def _op_node(helper: Any, op: OpRecord, index: int, names: dict[str, str], extra: dict[str, Any]) -> Any:
    inputs, outputs = [names[value] for value in op.inputs], [names[op.output]]
    if op.kind == "add":  # with int8 attributes in the custom domain: ONNX's Add has none
        return helper.make_node("Add", inputs, outputs, f"add{index}", doc_string=op.module_name,
                                domain=CUSTOM_DOMAIN if extra else "", **extra)
    if op.kind == "relu":
        return helper.make_node("Relu", inputs, outputs, f"relu{index}", doc_string=op.module_name)
    if op.kind == "dense":
        return helper.make_node("ScatterDense", inputs, outputs, f"scatter{index}", doc_string=op.module_name,
                                domain=CUSTOM_DOMAIN, input_spatial_shape=list(op.attrs), format="zyx",
                                output_shape=list(op.output_shape), output_layout="NCHW", **extra)
    op_type = "Reshape" if op.kind == "reshape" else "Transpose"
    return helper.make_node(op_type, inputs, outputs, f"{op.kind}{index}", doc_string=op.module_name,
                            domain=CUSTOM_DOMAIN, dims=list(op.attrs))


def _build_model(trace: Trace, steps: list[_Step], precision: str) -> Any:
    from onnx import helper

    names = {trace.input: "0"}
    for position, step in enumerate(steps, start=1):
        names[step.output] = str(position)
    nodes, initializers, counters = [], [], {}
    for step in steps:
        kind = "conv" if isinstance(step.item, _Conv) else step.item.kind
        index = counters.get(kind, 0)
        counters[kind] = index + 1
        if isinstance(step.item, _Conv):
            nodes.append(_conv_node(helper, step.item, index, names, precision, initializers,
                                    dict(step.attributes)))
        else:
            nodes.append(_op_node(helper, step.item, index, names, dict(step.attributes)))
    element = helper.TensorProto.FLOAT if precision == "fp32" else helper.TensorProto.FLOAT16
    graph = helper.make_graph(
        nodes, "scn", [helper.make_tensor_value_info("0", element, list(trace.input_shape))],
        [helper.make_tensor_value_info(names[trace.output], element, list(trace.output_shape))], initializers)
    opsets = [helper.make_operatorsetid("", 11), helper.make_operatorsetid(CUSTOM_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, producer_name="sparsecore", ir_version=7)


def export_onnx(model: nn.Module, example_input: Any, path: Union[str, os.PathLike], *,
                precision: str = "fp16", strict: bool = True) -> Any:
    """Writes ``model`` as a libspconv ONNX file at ``path``.

    Args:
        model: a sparsecore.torch model in eval mode (sparse convs, BatchNorm, ReLU, ``+``,
            ``.dense()``, ``view`` / ``permute`` of the dense tensor).
        example_input: a non-empty `SparseConvTensor` (or a tuple of the model's arguments
            holding one); the model runs on it once.
        path: the file to write.
        precision: ``"fp16"`` (libspconv's FP16 weights), ``"fp32"`` (FLOAT weights, for
            ``sparsecore.runtime`` only; needs ``strict=False``) or ``"int8"`` (``model`` converted
            by the INT8 workflow: ``precision`` / ``output_precision``, ``input_dynamic_range`` and
            ``weight_dynamic_ranges`` on each int8 conv, the add's ranges, FP16 weights that
            quantize back to the int8 weights).
        strict: refuse what libspconv cannot run (transposed convs, groups > 1, non-3-D layers,
            float32 weights). ``strict=False`` writes them for ``sparsecore.runtime``.

    Returns:
        The written ``onnx.ModelProto``.

    Raises:
        ExportError: naming the module and its type, for anything the format cannot express
            (pooling, concatenation, a custom layer's arithmetic, a BatchNorm not after a conv,
            data-dependent control flow), a model in training mode, or an empty example; with
            ``precision="int8"``, a model that is not converted, or a tensor the format would
            need two precisions or two scales for; raised before anything is written.
        ImportError: the ``onnx`` package is missing (``pip install 'sparsecore-conv[onnx]'``).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    try:
        import onnx
    except ImportError:
        raise ImportError("export_onnx writes ONNX with the 'onnx' package: pip install 'sparsecore-conv[onnx]'") from None
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if precision == "int8":
        trace, steps = plan_int8(model, example_input)
    else:
        trace = record(model, example_input)
        steps = _plan(trace)
    if strict:
        _check_strict(steps, precision)
    built = _build_model(trace, steps, precision)
    onnx.checker.check_model(built)
    onnx.save(built, os.fspath(path))
    return built
