"""Whole-graph checks of a libspconv ONNX model, run by `sparsecore.runtime.load` before the first run.

A file made elsewhere is input: every problem is found when it is loaded, and
named (the node by position, name and op type, the initializer or attribute),
instead of surfacing at run time as another error or as a wrong answer.

- `check_structure`, on the ``ModelProto``: string attributes valid UTF-8
  (`check_text_attributes`), unique initializer and node names,
  every value written once (the graph input, an initializer or one node's
  output), then ``onnx.checker`` with ``full_check=True`` (SSA form, node
  order, initializer sizes, types, ir version). libspconv's op types exist in
  no ONNX opset, so the checker sees a copy with them in the ``spconv`` domain
  (as `sparsecore.torch.export_onnx` writes them), and with a shape field on
  graph outputs that declare none (neither libspconv nor the runtime reads an
  output's declared type).
- `check_values`, on the parsed nodes: the channel counts chained from the
  declared graph input through every node (a conv takes what its input holds,
  an ``Add`` adds equal counts, ``ScatterDense``'s traced shape agrees), and one
  spatial dimensionality for every layer.
- `check_finite`: weights, biases and float attributes hold no NaN or infinity.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from .nodes import (DOMAINS, SUPPORTED_OPS, AddNode, ConvNode, GraphError, Node, ReshapeNode, ScatterDenseNode,
                    TransposeNode)

__all__ = ["CHECKER_DOMAIN", "describe_node", "check_structure", "check_text_attributes", "check_with_onnx",
           "check_finite", "check_values"]

CHECKER_DOMAIN = "spconv"
"""The domain libspconv's ops are checked in (the one `sparsecore.torch.export_onnx` writes)."""


def describe_node(position: int, node: Any) -> str:
    """``node 3 'conv1' (SparseConvolution)``: how every error names a node."""
    return f"node {position} {node.name or '<unnamed>'!r} ({node.op_type})"


def check_structure(model: Any) -> None:
    """Unique names, values read after they are written and written once, then `check_with_onnx`.

    Raises:
        GraphError: naming the two initializers or nodes that share a name, the node that reads a value
            no one wrote before it, or the node that writes a value already written (by the graph input,
            an initializer or an earlier node).
    """
    graph = model.graph
    writers: dict[str, str] = {}
    for tensor in graph.initializer:
        if tensor.name in writers:
            raise GraphError(f"two initializers are named {tensor.name!r}; a node reading that name would get only "
                             "one of them (the last), so initializer names must be unique")
        writers[tensor.name] = f"initializer {tensor.name!r}"
    for value in graph.input:  # an initializer may also be listed as a graph input (ONNX before ir version 4)
        writers.setdefault(value.name, f"the graph input {value.name!r}")
    names: dict[str, str] = {}
    for position, node in enumerate(graph.node):
        where = describe_node(position, node)
        check_text_attributes(where, node)
        if node.name:
            if node.name in names:
                raise GraphError(f"{where} has the name of {names[node.name]}; node names must be unique (the "
                                 "runtime keys each node's weights and errors by name)")
            names[node.name] = where
        for source in node.input:
            if source and source not in writers:
                raise GraphError(f"{where}: its input {source!r} is neither the graph input, an initializer nor the "
                                 "output of an earlier node (every value is read after it is written: the nodes "
                                 "must be in execution order)")
        for output in node.output:
            if not output:
                raise GraphError(f"{where}: an output without a name")
            if output in writers:
                raise GraphError(f"{where} writes {output!r}, which {writers[output]} already writes; every value "
                                 "of a graph is written once")
            writers[output] = where
    for value in graph.output:
        if value.name not in writers:
            raise GraphError(f"the graph output {value.name!r} is not written by any node (nor is it the graph input "
                             "or an initializer)")
    check_with_onnx(model)


def check_text_attributes(where: str, node: Any) -> None:
    """Refuses a string attribute whose bytes are not valid UTF-8 (read leniently, two different byte strings
    could name one rulebook: spconv's ``indice_key`` must be text).

    Raises:
        GraphError: naming the node and the attribute.
    """
    for attribute in node.attribute:
        for value in ([attribute.s] if attribute.s else []) + list(attribute.strings):
            try:
                value.decode("utf-8")
            except UnicodeDecodeError as error:
                raise GraphError(f"{where}: the attribute {attribute.name!r} holds {value[:40]!r}, which is not valid "
                                 f"UTF-8 ({error.reason} at byte {error.start}); string attributes such as the "
                                 "rulebook (indice_key) are text: write them as UTF-8") from None


def check_with_onnx(model: Any) -> None:
    """``onnx.checker.check_model(full_check=True)`` on a copy with libspconv's ops in `CHECKER_DOMAIN`.

    Raises:
        GraphError: with the checker's message.
    """
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        if node.op_type in SUPPORTED_OPS and node.domain in DOMAINS:
            node.domain = CHECKER_DOMAIN
    if not any(entry.domain == CHECKER_DOMAIN for entry in copy.opset_import):
        copy.opset_import.append(onnx.helper.make_operatorsetid(CHECKER_DOMAIN, 1))
    for value in copy.graph.output:  # the checker wants a shape field; nothing reads an output's declared type
        if value.type.HasField("tensor_type") and not value.type.tensor_type.HasField("shape"):
            value.type.tensor_type.shape.SetInParent()
    try:
        onnx.checker.check_model(copy, full_check=True)
    except Exception as error:  # ValidationError, InferenceError, or a proto too large to check
        message = " ".join(str(error).split())
        raise GraphError(f"onnx.checker (full check) refuses the model: {message}") from None


def check_finite(where: str, what: str, values: Any) -> None:
    """Refuses NaN or infinity in ``values`` (an array or a float), naming ``what`` and the first bad entry."""
    array = np.asarray(values, dtype=np.float64 if np.ndim(values) == 0 else None)
    if array.size == 0 or array.dtype.kind != "f":
        return
    finite = np.isfinite(array)
    if finite.all():
        return
    bad = np.argwhere(~finite)[0]
    value = array[tuple(bad)] if array.ndim else array
    at = f" at {list(int(i) for i in bad)}" if array.ndim else ""
    count = int(array.size - finite.sum())
    raise GraphError(f"{where}: {what} holds {count} non-finite value(s) (first: {float(value)!r}{at}); a model's "
                     "weights and attributes must be finite numbers")


def _sources(node: Node) -> tuple[str, ...]:
    return node.inputs if isinstance(node, AddNode) else (node.input,)


def check_values(nodes: Sequence[Node], wheres: Sequence[str], graph_input: str,
                 declared: Optional[int]) -> tuple[int, int]:
    """Chains the channel counts from the graph input and finds the layers' one spatial dimensionality.

    Args:
        nodes: the parsed nodes, in execution order (each reads defined values: checked before).
        wheres: each node's description.
        graph_input: the features input's name.
        declared: the channels the graph input declares (``[N, C]``), or None when it states none.

    Returns:
        ``(input_channels, ndim)``: the graph input's channels (declared, else the first conv's) and the
        spatial dimensionality of the layers (0 when no node states one).

    Raises:
        GraphError: naming the node, for a conv whose input holds another channel count than its weight
            takes, an ``Add`` of different channel counts, a ``ScatterDense`` traced shape that
            disagrees, or layers of different dimensionality.
    """
    first_conv = next((node for node in nodes if isinstance(node, ConvNode)), None)
    if declared is None:
        if first_conv is None or first_conv.input != graph_input:
            raise GraphError(f"the graph input {graph_input!r} states no [N, C] shape, and no conv reads it "
                             "directly to take the channels from")
        declared = first_conv.in_channels
    channels: dict[str, Optional[int]] = {graph_input: declared}
    origin = {graph_input: f"the graph input {graph_input!r}, declared [N, {declared}]"}
    ndim, ndim_origin = 0, ""
    for node, where in zip(nodes, wheres):
        held = [channels.get(source) for source in _sources(node)]
        if isinstance(node, ConvNode):
            if held[0] is not None and held[0] != node.in_channels:
                raise GraphError(f"{where} takes {node.in_channels} input channels (its weight is "
                                 f"{list(node.weight.shape)} with groups={node.groups}), but its input "
                                 f"{node.input!r} has {held[0]} ({origin[node.input]}); the model does not chain")
            dimension = node.geometry.ndim
            out: Optional[int] = node.out_channels
        elif isinstance(node, AddNode):
            if held[0] is not None and held[1] is not None and held[0] != held[1]:
                raise GraphError(f"{where} adds {node.inputs[0]!r} ({held[0]} channels, {origin[node.inputs[0]]}) "
                                 f"and {node.inputs[1]!r} ({held[1]} channels, {origin[node.inputs[1]]}); an Add "
                                 "needs equal channel counts")
            dimension, out = 0, held[0]
        elif isinstance(node, ScatterDenseNode):
            shape = node.traced_output_shape
            if shape and held[0] is not None and (len(shape) < 3 or shape[1] != held[0]):
                raise GraphError(f"{where}: its traced output_shape {list(shape)} must be [B, C, *spatial] with "
                                 f"C = {held[0]}, the channels of its input {node.input!r} ({origin[node.input]})")
            dimension, out = (len(shape) - 2 if shape else 0), None
        elif isinstance(node, (ReshapeNode, TransposeNode)):
            dimension, out = 0, None
        else:  # Relu
            dimension, out = 0, held[0]
        if dimension:
            if ndim and dimension != ndim:
                raise GraphError(f"{where} is {dimension}-D, but {ndim_origin} is {ndim}-D; the layers of one "
                                 "graph share the sites' dimensionality")
            ndim, ndim_origin = dimension, where
        channels[node.output] = out
        origin[node.output] = f"the output of {where}"
    return declared, ndim
