"""int8 execution of libspconv nodes: the tensor scales, int8 values, and the int8 conv and add.

libspconv's reading of the int8 attributes (see docs/deployment.md), which
`Session` follows:

- A tensor's scale is ``dynamic_range / 127`` (float32), keyed by the tensor's
  name and registered by the nodes that read it: a ``SparseConvolution``
  computing in int8 registers its input with ``input_dynamic_range``, an int8
  ``Add`` its inputs with ``input0_dynamic_range`` / ``input1_dynamic_range``
  (a range of 0 registers nothing: that input is read as float), a
  ``ScatterDense`` its input with ``input_dynamic_range``. Two readers that
  register different scales for one tensor are a `GraphError` naming both.
- A ``SparseConvolution`` computes in int8 when ``precision`` or
  ``output_precision`` is ``"int8"``: its input is quantized with its
  registered scale when it arrives as float (``precision="fp16"``, the first
  layer), the weight (FP16 in the file) is quantized per output channel with
  ``weight_dynamic_ranges[c] / 127``, and `sparsecore.int8.int8_conv_forward`
  runs the int8 x int8 products with int32 sums, the bias and a fused ReLU; the
  output is requantized with the scale registered for the output tensor when
  ``output_precision="int8"``, else returned as float32.
- An ``Add`` sums in float32 (an int8 input dequantized with its scale; a float
  input of an int8 add read through its range: quantized, then dequantized)
  and requantizes when ``output_precision="int8"``.
- ``Relu`` keeps int8 values int8 (same scale); ``ScatterDense`` and float
  nodes dequantize an int8 input.
- A conv whose float result only an int8 ``Add`` reads (input 0, range 0),
  whose output only a ``Relu`` reads (spconv's fused conv-add-ReLU as
  `export_onnx` writes it), runs as one `int8_conv_forward` with the residual
  and the ReLU fused: the same values as the three nodes, in one pass.

Nothing here imports torch or jax.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

import numpy as np

from ..functional import layer_rulebook
from ..geometry import ConvGeometry
from ..int8 import dequantize, int8_conv_forward, quantize
from ..tensor import SparseTensor
from .nodes import AddNode, ConvNode, Graph, GraphError, ReluNode, ScatterDenseNode

__all__ = ["Int8Value", "range_scale", "tensor_scales", "computes_int8", "Int8Parameters", "int8_parameters",
           "ResidualFusion", "residual_fusions", "int8_conv", "read_float", "int8_add"]

INT8 = "int8"


def range_scale(dynamic_range: float) -> np.float32:
    """libspconv's scale of a dynamic range: ``float32(range) / 127`` in float32."""
    return np.float32(dynamic_range) / np.float32(127)


@dataclass(frozen=True)
class Int8Value:
    """A sparse value held as int8.

    Attributes:
        sites: the value's sites and rulebook cache (its features a ``[N, 0]`` placeholder).
        values: int8 ``[N, C]``.
        scale: float32, the value stands for ``values * scale``.
    """

    sites: SparseTensor
    values: Any
    scale: np.float32

    @property
    def num_channels(self) -> int:
        """Channels ``C``."""
        return int(self.values.shape[1])

    def dequantized(self) -> SparseTensor:
        """The float32 sparse tensor ``values * scale``."""
        return self.sites.replace(dequantize(self.values, self.scale))


def computes_int8(node: Union[ConvNode, AddNode]) -> bool:
    """True when the node reads or writes int8 (``precision`` or ``output_precision`` is ``"int8"``)."""
    return INT8 in (node.precision, node.output_precision)


def _register(scales: dict, owners: dict, tensor: str, dynamic_range: float, node: str, attribute: str) -> None:
    scale = range_scale(dynamic_range)
    if tensor in scales and scales[tensor] != scale:
        raise GraphError(
            f"node {node!r} reads tensor {tensor!r} as int8 with {attribute}={dynamic_range!r} (scale "
            f"{float(scale):.9g}), but {owners[tensor]} gives it scale {float(scales[tensor]):.9g}; an int8 tensor "
            "has one scale, so every node that reads it must state the same dynamic range"
        )
    scales[tensor] = scale
    owners[tensor] = f"node {node!r} ({attribute})"


def tensor_scales(graph: Graph) -> dict[str, np.float32]:
    """The scale of every tensor the graph reads as int8, checked (see the module docstring).

    Raises:
        GraphError: naming the node, for an int8 conv without an input range or with
            weight ranges that do not give one positive range per output channel, two
            readers stating different ranges for one tensor, or an int8 output that no
            node reads with a range (its scale unknown).
    """
    scales: dict[str, np.float32] = {}
    owners: dict[str, str] = {}
    for node in graph.nodes:
        if isinstance(node, ConvNode) and computes_int8(node):
            if not node.input_dynamic_range > 0:
                raise GraphError(f"node {node.name!r} (SparseConvolution) is int8 but has no positive "
                                 f"input_dynamic_range (got {node.input_dynamic_range!r}); int8 needs the input's "
                                 "absolute maximum")
            ranges = node.weight_dynamic_ranges
            if len(ranges) != node.out_channels or not all(value > 0 for value in ranges):
                raise GraphError(
                    f"node {node.name!r} (SparseConvolution) is int8 and needs weight_dynamic_ranges with one "
                    f"positive range per output channel ({node.out_channels}), got {len(ranges)} values "
                    f"(smallest {min(ranges) if ranges else None!r})")
            _register(scales, owners, node.input, node.input_dynamic_range, node.name, "input_dynamic_range")
        elif isinstance(node, AddNode) and node.precision == INT8:
            for position, (tensor, dynamic_range) in enumerate(zip(node.inputs, node.input_dynamic_ranges)):
                if dynamic_range > 0:
                    _register(scales, owners, tensor, dynamic_range, node.name, f"input{position}_dynamic_range")
        elif isinstance(node, ScatterDenseNode) and node.input_dynamic_range > 0:
            _register(scales, owners, node.input, node.input_dynamic_range, node.name, "input_dynamic_range")
    for node in reversed(graph.nodes):  # libspconv fuses Add + Relu: the Relu's scale is the add's output's
        if isinstance(node, ReluNode) and node.output in scales and node.input not in scales:
            scales[node.input] = scales[node.output]
    for node in graph.nodes:
        if isinstance(node, (ConvNode, AddNode)) and node.output_precision == INT8 and node.output not in scales:
            raise GraphError(
                f"node {node.name!r} writes its output {node.output!r} as int8 (output_precision='int8'), but no "
                "node reads that tensor with a dynamic range, so its scale is unknown; the graph's last node "
                "writes output_precision='fp16'")
    return scales


@dataclass(frozen=True, eq=False)
class Int8Parameters:
    """A node's int8 weight ``[out, *kernel, in // groups]``, float32 weight scales ``[out]`` and bias ``[out]``."""

    weight: Any
    weight_scales: Any
    bias: Any


def int8_parameters(node: ConvNode, xp: Any) -> Int8Parameters:
    """The node's FP16 weight quantized per output channel with ``weight_dynamic_ranges / 127`` (on ``xp``)."""
    scales = range_scale(np.asarray(node.weight_dynamic_ranges, dtype=np.float64))
    weight = quantize(node.weight.astype(np.float32), scales, axis=0)
    return Int8Parameters(xp.asarray(weight), xp.asarray(scales), xp.asarray(node.bias.astype(np.float32)))


def _geometry(node: ConvNode, ndim: int) -> ConvGeometry:
    if node.kind == "inverse":  # as sparsecore.functional.sparse_conv: the paired layer's rulebook decides
        regular = ConvGeometry.create(ndim, node.kernel_size, kind="regular")
        return ConvGeometry("inverse", regular.kernel_size, regular.stride, regular.padding, regular.dilation,
                            regular.output_padding)
    return node.geometry


def _activate(node: ConvNode, features: Any, xp: Any) -> Any:
    if node.activation == "Sigmoid":
        return (1 / (1 + xp.exp(-features))).astype(np.float32)
    if node.activation == "LeakyReLU":
        return xp.where(features < 0, features * np.float32(node.activation_alpha), features).astype(np.float32)
    return features


@dataclass(frozen=True)
class ResidualFusion:
    """A conv (int8, float output, no activation) whose only reader is an int8 ``Add`` (the conv's float result
    as input 0, range 0; an int8 residual as input 1) whose only reader is a ``Relu``: spconv's conv-add-ReLU,
    run as one `int8_conv_forward` with ``residual`` and ``relu`` (the same values as the three nodes)."""

    add: AddNode
    relu: ReluNode


def residual_fusions(graph: Graph) -> dict[int, ResidualFusion]:
    """The fusable conv -> Add -> Relu chains, keyed by the conv node's ``id``."""
    readers: dict[str, list] = {graph.output: [None]}
    for node in graph.nodes:
        for source in (node.inputs if isinstance(node, AddNode) else (node.input,)):
            readers.setdefault(source, []).append(node)
    fusions = {}
    for node in graph.nodes:
        if not (isinstance(node, ConvNode) and computes_int8(node) and node.output_precision != INT8
                and node.activation == "None"):
            continue
        conv_readers = readers.get(node.output, [])
        add = conv_readers[0] if len(conv_readers) == 1 else None
        if not (isinstance(add, AddNode) and add.precision == INT8 and add.output_precision == INT8
                and add.inputs[0] == node.output and add.input_dynamic_ranges[0] == 0
                and add.input_dynamic_ranges[1] > 0 and len(readers.get(add.output, [])) == 1):
            continue
        relu = readers[add.output][0]
        if isinstance(relu, ReluNode):
            fusions[id(node)] = ResidualFusion(add, relu)
    return fusions


def int8_conv(node: ConvNode, value: Union[SparseTensor, Int8Value], scales: Mapping[str, np.float32],
              parameters: Int8Parameters, xp: Any, residual: Any = None,
              fusion: Optional[ResidualFusion] = None) -> Union[SparseTensor, Int8Value]:
    """Runs an int8 ``SparseConvolution`` node on a float or int8 input (see the module docstring); with a
    ``fusion``, also its ``Add`` of ``residual`` (the add's input 1) and its ``Relu``."""
    input_scale = scales[node.input]
    if isinstance(value, Int8Value):
        if value.scale != input_scale:
            raise GraphError(f"node {node.name!r}: its int8 input {node.input!r} has scale {float(value.scale)!r}, "
                             f"but the node reads it with scale {float(input_scale)!r}")
        sites, values = value.sites, value.values
    else:
        sites, values = value, quantize(value.core_features, input_scale)
    if values.shape[1] != node.in_channels:
        raise GraphError(f"node {node.name!r} (SparseConvolution) expects {node.in_channels} input channels, its "
                         f"input {node.input!r} has {values.shape[1]}")
    try:
        rulebook = layer_rulebook(sites, _geometry(node, sites.ndim), node.rulebook or None)
    except ValueError as error:
        raise GraphError(f"node {node.name!r} (SparseConvolution, {node.kind}, rulebook {node.rulebook!r}): "
                         f"{error}") from error
    output = node.output if fusion is None else fusion.relu.output
    requantize = node.output_precision == INT8 or fusion is not None
    fused = node.activation in ("ReLU", "None")
    residual_values = residual_scale = None
    if isinstance(residual, Int8Value):  # as the unfused add reads it: at its own scale
        residual_values, residual_scale = residual.values, residual.scale
    elif fusion is not None:  # a float residual, read through the add's range
        residual_scale = range_scale(fusion.add.input_dynamic_ranges[1])
        residual_values = quantize(residual.core_features, residual_scale)
    if residual is not None:
        _check_residual_sites(fusion.add, residual.sites if isinstance(residual, Int8Value) else residual,
                              rulebook.output_indices, xp)
    out = int8_conv_forward(values, parameters.weight, rulebook, input_scale=input_scale,
                            weight_scales=parameters.weight_scales,
                            output_scale=scales[output] if requantize and fused else None,
                            bias=parameters.bias, residual=residual_values, residual_scale=residual_scale,
                            relu=node.activation == "ReLU" or fusion is not None, groups=node.groups)
    if not fused:
        out = _activate(node, out, xp)
        if requantize:
            out = quantize(out, scales[node.output])
    empty = xp.zeros((out.shape[0], 0), dtype=np.float32)
    if rulebook.output_indices is sites.core_indices:
        out_sites = sites.replace(empty)
    else:
        out_sites = sites.with_sites(empty, rulebook.output_indices, rulebook.output_spatial_shape,
                                     core_indices=rulebook.output_indices)
    if requantize:
        return Int8Value(out_sites, out, scales[output])
    return out_sites.replace(out)


def _check_residual_sites(add: AddNode, residual: SparseTensor, output_indices: Any, xp: Any) -> None:
    indices = residual.core_indices
    if indices is output_indices or (indices.shape == output_indices.shape
                                     and bool(xp.array_equal(indices, output_indices))):
        return
    raise GraphError(f"node {add.name!r} (Add) adds {add.inputs[0]!r} ({output_indices.shape[0]} sites) and "
                     f"{add.inputs[1]!r} ({indices.shape[0]} sites): libspconv's Add needs the same sites")


def read_float(value: Any, scale: Optional[np.float32] = None) -> Any:
    """A value as float: an int8 value dequantized; a float value through ``scale`` (quantized and
    dequantized, as an int8 reader sees it) when one is given, else as is."""
    if isinstance(value, Int8Value):
        return value.dequantized()
    if scale is None or not isinstance(value, SparseTensor):
        return value
    return value.replace(dequantize(quantize(value.core_features, scale), scale))


def int8_add(node: AddNode, first: Any, second: Any, scales: Mapping[str, np.float32], add: Any) -> Any:
    """An ``Add`` with int8 attributes: the float32 sum by ``add`` (the session's same-site add), requantized
    when ``output_precision="int8"``."""
    reading = node.precision == INT8
    first, second = (read_float(value, range_scale(dynamic_range) if reading and dynamic_range > 0 else None)
                     for value, dynamic_range in zip((first, second), node.input_dynamic_ranges))
    total = add(node, first, second)
    if node.output_precision != INT8:
        return total
    if not isinstance(total, SparseTensor):
        raise GraphError(f"node {node.name!r} (Add) writes int8 but adds dense arrays; int8 values are sparse")
    scale = scales[node.output]
    empty = total.replace(total.core_features[:, :0])
    return Int8Value(empty, quantize(total.core_features, scale), scale)
