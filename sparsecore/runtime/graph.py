"""The graph of a libspconv ONNX file, parsed and validated into frozen node values.

libspconv's format (NVIDIA's 3DSparseConvolution; see docs/deployment.md) has
one graph input, the voxel features ``[N, C]``, and six node types:
``SparseConvolution``, ``Add`` (or ``QuantAdd``), ``Relu``, ``ScatterDense``,
``Reshape`` and ``Transpose``. The indices, batch size and spatial shape are
run-time inputs, not part of the graph. Every problem found here is a
`GraphError` naming the node (its name, position and op type) and the
attribute or initializer. `parse_model` validates the whole graph before a
session exists: `sparsecore.runtime.checks` (names, single writers,
``onnx.checker``, finite values, channels chained from the declared input, one
dimensionality), each node's attributes here (flags 0 or 1, enums in their
sets, sizes positive), and `sparsecore.runtime.int8_checks` (dynamic ranges).

Parsing needs the ``onnx`` package (the ``onnx`` extra); nothing here imports
torch or jax.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..geometry import ConvGeometry
from .checks import check_finite, check_structure, check_values, describe_node
from .files import read_model
from .int8_checks import check_int8_ranges
from .nodes import (
    ACTIVATIONS,
    DOMAINS,
    PRECISIONS,
    SUPPORTED_OPS,
    AddNode,
    ConvNode,
    Graph,
    GraphError,
    Node,
    ReluNode,
    ReshapeNode,
    ScatterDenseNode,
    TransposeNode,
)

__all__ = ["parse_model", "read_model"]

# ONNX TensorProto data types the runtime reads as initializers
_FLOAT16, _FLOAT = 10, 1

def _attributes(node: Any) -> dict[str, Any]:
    import onnx.helper

    values = {}
    for attribute in node.attribute:
        value = onnx.helper.get_attribute_value(attribute)
        if isinstance(value, bytes):
            value = value.decode("utf-8", errors="replace")
        elif isinstance(value, list):
            value = [item.decode("utf-8", errors="replace") if isinstance(item, bytes) else item for item in value]
        values[attribute.name] = value
    return values


class _Reader:
    """Reads one node's attributes, raising a `GraphError` that names the node."""

    def __init__(self, where: str, attributes: dict[str, Any]) -> None:
        self.where = where
        self.attributes = attributes

    def fail(self, problem: str) -> GraphError:
        return GraphError(f"{self.where}: {problem}")

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.attributes.get(key, default)
        if value is None:
            raise self.fail(f"the attribute {key!r} is missing (an int is expected)")
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise self.fail(f"the attribute {key!r} must be an int, got {value!r}")
        return int(value)

    def flag(self, key: str) -> int:
        """A 0 / 1 flag (0 when absent)."""
        value = self.integer(key, 0)
        if value not in (0, 1):
            raise self.fail(f"the flag {key!r} must be 0 or 1, got {value}")
        return value

    def integers(self, key: str, length: int | None = None, default: Sequence[int] | None = None,
                 minimum: int | None = None) -> tuple[int, ...]:
        value = self.attributes.get(key, default)
        if value is None:
            raise self.fail(f"the attribute {key!r} is missing (a list of ints is expected)")
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, (int, np.integer)) for v in value):
            raise self.fail(f"the attribute {key!r} must be a list of ints, got {value!r}")
        values = tuple(int(v) for v in value)
        if length is not None and len(values) != length:
            raise self.fail(f"the attribute {key!r} must have {length} entries (one per spatial axis), got {values}")
        if minimum is not None and any(v < minimum for v in values):
            raise self.fail(f"the attribute {key!r} must be >= {minimum} on every axis, got {values}")
        return values

    def text(self, key: str, default: str | None = None, choices: Sequence[str] | None = None) -> str:
        value = self.attributes.get(key, default)
        if value is None:
            raise self.fail(f"the attribute {key!r} is missing (a string is expected)")
        if not isinstance(value, str):
            raise self.fail(f"the attribute {key!r} must be a string, got {value!r}")
        if choices is not None and value not in choices:
            raise self.fail(f"the attribute {key!r} must be one of {list(choices)}, got {value!r}")
        return value

    def real(self, key: str, default: float = 0.0) -> float:
        value = self.attributes.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
            raise self.fail(f"the attribute {key!r} must be a float, got {value!r}")
        check_finite(self.where, f"the attribute {key!r}", float(value))
        return float(value)

    def reals(self, key: str) -> tuple[float, ...]:
        value = self.attributes.get(key, [])
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool) for v in value):
            raise self.fail(f"the attribute {key!r} must be a list of floats, got {value!r}")
        values = tuple(float(v) for v in value)
        if not all(np.isfinite(v) and v >= 0 for v in values):
            raise self.fail(f"the attribute {key!r} holds dynamic ranges (absolute maxima), which must be finite "
                            f"and >= 0, got {list(values)}")
        return values

    def range(self, key: str) -> float:
        """A dynamic range (absolute maximum, 0 when absent): finite and >= 0."""
        value = self.real(key, 0.0)
        if not np.isfinite(value) or value < 0:
            raise self.fail(f"the attribute {key!r} is a dynamic range (absolute maximum), which must be finite "
                            f"and >= 0, got {value!r}")
        return value


def _initializer_array(tensor: Any, where: str) -> np.ndarray:
    import onnx.numpy_helper

    if tensor.data_type not in (_FLOAT16, _FLOAT):
        raise GraphError(
            f"{where}: initializer {tensor.name!r} has ONNX data type {tensor.data_type}; libspconv "
            "weights are FLOAT16 (10), or FLOAT (1) in sparsecore's fp32 export"
        )
    try:
        return np.ascontiguousarray(onnx.numpy_helper.to_array(tensor))
    except Exception as error:  # a truncated raw_data buffer, for one
        raise GraphError(f"{where}: initializer {tensor.name!r} cannot be read: {error}") from None


def _conv_node(where: str, node: Any, reader: _Reader, initializers: dict[str, np.ndarray]) -> ConvNode:
    if len(node.input) not in (2, 3) or len(node.output) != 1:
        raise reader.fail(f"a SparseConvolution has inputs (x, weight, bias) and one output, got "
                          f"{len(node.input)} inputs and {len(node.output)} outputs")
    for position in range(1, len(node.input)):
        if node.input[position] not in initializers:
            raise reader.fail(f"input {position} ({node.input[position]!r}) must be an initializer "
                              "(the weight, then the bias)")
    weight = initializers[node.input[1]]
    ndim = reader.integer("ndim")
    if not 1 <= ndim <= 4:
        raise reader.fail(f"ndim must be 1 to 4, got {ndim}")
    kernel_size = reader.integers("kernel_size", ndim, minimum=1)
    groups = reader.integer("groups", 1)
    in_channels, out_channels = reader.integer("in_channels"), reader.integer("out_channels")
    if in_channels < 1 or out_channels < 1:
        raise reader.fail(f"in_channels={in_channels} and out_channels={out_channels} must be >= 1")
    if groups < 1 or in_channels % groups or out_channels % groups:
        raise reader.fail(f"groups={groups} must be >= 1 and divide in_channels={in_channels} and "
                          f"out_channels={out_channels}")
    expected = (out_channels, *kernel_size, in_channels // groups)
    if tuple(weight.shape) != expected:
        raise reader.fail(f"the weight {node.input[1]!r} has shape {tuple(weight.shape)}, but the attributes "
                          f"(out_channels, kernel_size, in_channels / groups) give {expected}")
    check_finite(where, f"the weight {node.input[1]!r}", weight)
    if len(node.input) == 3:
        bias = initializers[node.input[2]]
        if tuple(bias.shape) != (out_channels,):
            raise reader.fail(f"the bias {node.input[2]!r} has shape {tuple(bias.shape)}, expected ({out_channels},)")
        check_finite(where, f"the bias {node.input[2]!r}", bias)
    else:
        bias = np.zeros(out_channels, dtype=weight.dtype)
    subm, transposed, inverse = (reader.flag(key) for key in ("subm", "transposed", "inverse"))
    if subm + transposed + inverse > 1:
        raise reader.fail(f"subm={subm}, transposed={transposed}, inverse={inverse}: at most one may be set")
    kind = "subm" if subm else "transposed" if transposed else "inverse" if inverse else "regular"
    rulebook = reader.text("rulebook", "")
    if kind == "inverse" and not rulebook:
        raise reader.fail("an inverse conv needs the rulebook (indice_key) of the strided conv it reverses")
    dilation = reader.integers("dilation", ndim, (1,) * ndim, minimum=1)
    stride = reader.integers("stride", ndim, (1,) * ndim, minimum=1)
    padding = reader.integers("padding", ndim, (0,) * ndim, minimum=0)
    output_padding = reader.integers("output_padding", ndim, (0,) * ndim, minimum=0)
    try:
        geometry = ConvGeometry(kind, kernel_size, stride, padding, dilation, output_padding)
    except ValueError as error:  # an even submanifold kernel, an output padding out of range
        raise reader.fail(str(error)) from None
    return ConvNode(
        name=node.name, input=node.input[0], output=node.output[0], weight=weight, bias=bias,
        geometry=geometry, groups=groups, rulebook=rulebook,
        activation=reader.text("activation", "None", ACTIVATIONS),
        activation_alpha=reader.real("act_alpha", 0.0),
        precision=reader.text("precision", "fp16", PRECISIONS),
        output_precision=reader.text("output_precision", "fp16", PRECISIONS),
        input_dynamic_range=reader.range("input_dynamic_range"),
        weight_dynamic_ranges=reader.reals("weight_dynamic_ranges"),
    )


def _single_io(node: Any, reader: _Reader, inputs: int = 1) -> None:
    if len(node.input) != inputs or len(node.output) != 1:
        raise reader.fail(f"expects {inputs} input(s) and one output, got {len(node.input)} and {len(node.output)}")


def _make_node(where: str, node: Any, initializers: dict[str, np.ndarray]) -> Node:
    reader = _Reader(where, _attributes(node))
    if node.op_type == "SparseConvolution":
        return _conv_node(where, node, reader, initializers)
    if node.op_type in ("Add", "QuantAdd"):
        _single_io(node, reader, 2)
        return AddNode(node.name, (node.input[0], node.input[1]), node.output[0],
                       precision=reader.text("precision", "fp16", PRECISIONS),
                       output_precision=reader.text("output_precision", "fp16", PRECISIONS),
                       input_dynamic_ranges=(reader.range("input0_dynamic_range"),
                                             reader.range("input1_dynamic_range")))
    _single_io(node, reader)
    if node.op_type == "Relu":
        return ReluNode(node.name, node.input[0], node.output[0])
    if node.op_type == "ScatterDense":
        reader.text("format", "zyx", ("zyx",))
        reader.text("output_layout", "NCHW", ("NCHW",))
        return ScatterDenseNode(node.name, node.input[0], node.output[0],
                                reader.integers("output_shape", default=(), minimum=1),
                                input_dynamic_range=reader.range("input_dynamic_range"))
    dims = reader.integers("dims")
    if node.op_type == "Reshape":
        if sum(1 for d in dims if d == -1) > 1 or any(d < -1 or d == 0 for d in dims):
            raise reader.fail(f"Reshape dims must be positive, with at most one -1, got {dims}")
        return ReshapeNode(node.name, node.input[0], node.output[0], dims)
    if sorted(dims) != list(range(len(dims))):
        raise reader.fail(f"Transpose dims must be a permutation of 0..{len(dims) - 1}, got {dims}")
    return TransposeNode(node.name, node.input[0], node.output[0], dims)


def _check_value_kinds(nodes: Sequence[Node], graph_input: str, wheres: Sequence[str]) -> dict[str, bool]:
    """Checks each node reads defined values of the kind it needs; returns, per value, whether it is dense."""
    dense = {graph_input: False}
    for node, where in zip(nodes, wheres):
        sources = node.inputs if isinstance(node, AddNode) else (node.input,)
        kinds = []
        for source in sources:
            if source not in dense:
                raise GraphError(f"{where}: input {source!r} is neither the graph input nor the output of an "
                                 "earlier node (the nodes must be in execution order)")
            kinds.append(dense[source])
        if isinstance(node, (ConvNode, ScatterDenseNode)) and kinds[0]:
            raise GraphError(f"{where}: its input {sources[0]!r} is a dense array, but it needs a sparse value")
        if isinstance(node, (ReshapeNode, TransposeNode)) and not kinds[0]:
            raise GraphError(f"{where}: its input {sources[0]!r} is sparse; Reshape / Transpose act on the "
                             "dense array after ScatterDense")
        if isinstance(node, AddNode) and kinds[0] != kinds[1]:
            raise GraphError(f"{where}: adds a sparse value and a dense array ({sources})")
        output = node.output
        if output in dense:
            raise GraphError(f"{where}: output {output!r} is already defined earlier in the graph")
        dense[output] = isinstance(node, (ScatterDenseNode, ReshapeNode, TransposeNode)) or kinds[0]
    return dense


def _declared_channels(value: Any) -> int | None:
    """The channels ``C`` of the graph input's declared ``[N, C]`` shape, or None when it states none."""
    tensor_type = value.type.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    dims = tensor_type.shape.dim
    if len(dims) != 2:
        raise GraphError(f"the graph input {value.name!r} is declared with {len(dims)} axes; libspconv's input is "
                         "the voxel features [N, C]")
    if not dims[1].HasField("dim_value"):
        return None
    if dims[1].dim_value < 1:
        raise GraphError(f"the graph input {value.name!r} declares {dims[1].dim_value} channels; it needs >= 1")
    return int(dims[1].dim_value)


def parse_model(model: Any) -> Graph:
    """Validates an ``onnx.ModelProto`` in libspconv's format, whole, and returns its `Graph`.

    Raises:
        GraphError: naming the node and the attribute or initializer, for an unknown op type,
            names that repeat or values written twice (`sparsecore.runtime.checks`), a model
            ``onnx.checker`` refuses, a missing, malformed or non-finite attribute, a flag that is
            not 0 or 1, a non-finite weight or bias, a weight whose shape disagrees with the
            attributes, an undefined input, channel counts that do not chain from the declared
            input, layers of different dimensionality, int8 ranges that describe no tensor or not
            the weights (`sparsecore.runtime.int8_checks`), or a graph without exactly one input
            and one output.
    """
    graph = model.graph
    for position, node in enumerate(graph.node):
        if node.op_type not in SUPPORTED_OPS or node.domain not in DOMAINS:
            raise GraphError(
                f"{describe_node(position, node)}: op type {node.op_type!r}"
                f"{' in domain ' + repr(node.domain) if node.domain else ''} is not part of libspconv's format; "
                f"the runtime runs {list(SUPPORTED_OPS)}"
            )
    check_structure(model)
    initializers = {}
    for tensor in graph.initializer:
        initializers[tensor.name] = _initializer_array(tensor, f"initializer {tensor.name!r}")
    inputs = [value for value in graph.input if value.name not in initializers]
    if len(inputs) != 1 or len(graph.output) != 1:
        raise GraphError(
            f"a libspconv graph has one input (the voxel features [N, C]) and one output; this one has "
            f"inputs {[v.name for v in inputs]} and outputs {[v.name for v in graph.output]}"
        )
    if not graph.node:
        raise GraphError("the graph has no nodes")
    nodes, wheres = [], []
    for position, node in enumerate(graph.node):
        where = describe_node(position, node)
        nodes.append(_make_node(where, node, initializers))
        wheres.append(where)
    kinds = _check_value_kinds(nodes, inputs[0].name, wheres)
    output = graph.output[0].name
    if output not in kinds:
        raise GraphError(f"the graph output {output!r} is not produced by any node")
    channels, ndim = check_values(nodes, wheres, inputs[0].name, _declared_channels(inputs[0]))
    check_int8_ranges(nodes, wheres)
    return Graph(inputs[0].name, channels, output, tuple(nodes), kinds[output], ndim)
