"""Mutations of a valid libspconv ModelProto for the hostile-model cases (tests/hostile_cases.py).

Each helper changes one thing of the model in place and returns it, so a case is one lambda;
`BASE_MUTATIONS` lists the cases made from the base model (tests/runtime_graphs.py): its name, class,
mutation and the error a sound runtime raises (type, message pattern).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper


def _node(model: Any, name: str) -> Any:
    return next(node for node in model.graph.node if node.name == name)


def _set(model: Any, node_name: str, **attributes) -> Any:
    node = _node(model, node_name)
    kept = [attribute for attribute in node.attribute if attribute.name not in attributes]
    del node.attribute[:]
    node.attribute.extend(kept + [helper.make_attribute(key, value) for key, value in attributes.items()])
    return model


def _tensor(model: Any, name: str) -> Any:
    return next(tensor for tensor in model.graph.initializer if tensor.name == name)


def _poke(model: Any, name: str, value: float, at: int = 0) -> Any:
    tensor = _tensor(model, name)
    array = numpy_helper.to_array(tensor).copy()
    array.reshape(-1)[at] = value
    tensor.CopyFrom(numpy_helper.from_array(array, name))
    return model


def _extra_initializer(model: Any, name: str) -> Any:
    clone = copy.deepcopy(_tensor(model, name))
    array = numpy_helper.to_array(clone) * 20
    model.graph.initializer.append(numpy_helper.from_array(array, name))
    return model


def _rewire(model: Any, node_name: str, output: str) -> Any:
    _node(model, node_name).output[0] = output
    return model


def _float_weight(model: Any, name: str, factor: float) -> Any:
    tensor = _tensor(model, name)
    array = numpy_helper.to_array(tensor).astype(np.float32) * np.float32(factor)
    tensor.CopyFrom(numpy_helper.from_array(array, name))
    return model


def _declare_channels(model: Any, channels: int) -> Any:
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = channels
    return model


def _append(container: Any, item: Any, model: Any) -> Any:
    container.append(item)
    return model


def _dims(model: Any, name: str, dims: list[int]) -> Any:
    tensor = _tensor(model, name)
    del tensor.dims[:]
    tensor.dims.extend(dims)
    return model


CONV = "node [0-9]+ 'conv[01]' \\(SparseConvolution\\)"
# (name, class, mutation of the base model, (error type, pattern)); the base model: conv0 subm 4 -> 8 ReLU, conv1 s2
BASE_MUTATIONS: list[tuple[str, str, Callable[[Any], Any], tuple[str, str]]] = [
    ("duplicate_initializer", "silent: names", lambda m: _extra_initializer(m, "conv1.weight"),
     ("GraphError", "two initializers are named 'conv1.weight'")),
    ("duplicate_node_name", "silent: names", lambda m: setattr(_node(m, "conv1"), "name", "conv0") or m,
     ("GraphError", "node 1 'conv0'.*has the name of node 0 'conv0'")),
    ("value_written_twice", "silent: names", lambda m: _rewire(m, "conv1", "1"),
     ("GraphError", "node 1 'conv1'.*writes '1', which node 0 'conv0'")),
    ("writes_an_initializer", "silent: names", lambda m: _rewire(m, "conv1", "conv0.bias"),
     ("GraphError", "node 1 'conv1'.*writes 'conv0.bias', which initializer 'conv0.bias'")),
    ("nodes_out_of_order", "structure", lambda m: m.graph.node.reverse() or m,
     ("GraphError", "'conv1'.*input '1' is neither the graph input")),
    ("nan_weight", "silent: non-finite", lambda m: _poke(m, "conv0.weight", np.nan, 17),
     ("GraphError", f"{CONV}: the weight 'conv0.weight' holds 1 non-finite value")),
    ("inf_weight", "silent: non-finite", lambda m: _poke(m, "conv1.weight", np.inf, 3),
     ("GraphError", "'conv1'.*the weight 'conv1.weight' holds 1 non-finite value.*inf")),
    ("nan_bias", "silent: non-finite", lambda m: _poke(m, "conv0.bias", np.nan),
     ("GraphError", "'conv0'.*the bias 'conv0.bias' holds")),
    ("inf_bias", "silent: non-finite", lambda m: _poke(m, "conv1.bias", -np.inf, 2),
     ("GraphError", "'conv1'.*the bias 'conv1.bias' holds.*-inf")),
    ("nan_act_alpha", "silent: non-finite", lambda m: _set(m, "conv0", activation="LeakyReLU", act_alpha=np.nan),
     ("GraphError", "'conv0'.*the attribute 'act_alpha' holds 1 non-finite")),
    ("inf_act_alpha", "silent: non-finite", lambda m: _set(m, "conv0", activation="LeakyReLU", act_alpha=np.inf),
     ("GraphError", "'conv0'.*the attribute 'act_alpha' holds")),
    ("contradictory_flags", "silent: flags", lambda m: _set(m, "conv1", subm=-1, transposed=1, inverse=1),
     ("GraphError", "'conv1'.*the flag 'subm' must be 0 or 1, got -1")),
    ("flag_two", "silent: flags", lambda m: _set(m, "conv0", subm=2),
     ("GraphError", "'conv0'.*the flag 'subm' must be 0 or 1, got 2")),
    ("two_flags_set", "silent: flags", lambda m: _set(m, "conv1", transposed=1, inverse=1),
     ("GraphError", "'conv1'.*at most one may be set")),
    ("unknown_activation", "flags and enums", lambda m: _set(m, "conv0", activation="GELU"),
     ("GraphError", "'conv0'.*'activation' must be one of")),
    ("unknown_precision", "flags and enums", lambda m: _set(m, "conv1", precision="int4"),
     ("GraphError", "'conv1'.*'precision' must be one of")),
    ("ndim_five", "flags and enums", lambda m: _set(m, "conv0", ndim=5),
     ("GraphError", "'conv0'.*ndim must be 1 to 4, got 5")),
    ("negative_weight_dims", "silent: dims", lambda m: _dims(m, "conv0.weight", [-8, 3, 3, 3, 4]),
     ("GraphError", "onnx.checker.*Negative dimension.*conv0.weight")),
    ("zero_kernel", "dims", lambda m: _set(m, "conv1", kernel_size=[0, 3, 3]),
     ("GraphError", "'conv1'.*'kernel_size' must be >= 1")),
    ("zero_stride", "dims", lambda m: _set(m, "conv1", stride=[2, 0, 2]),
     ("GraphError", "'conv1'.*'stride' must be >= 1")),
    ("negative_padding", "dims", lambda m: _set(m, "conv1", padding=[1, -1, 1]),
     ("GraphError", "'conv1'.*'padding' must be >= 0")),
    ("zero_out_channels", "dims", lambda m: _set(m, "conv1", out_channels=0),
     ("GraphError", "'conv1'.*out_channels=0 must be >= 1")),
    ("size_claim_2gb", "memory", lambda m: _dims(m, "conv0.weight", [2**31]),
     ("GraphError", "onnx.checker.*conv0.weight.*raw_data size")),
    ("declared_7_channels", "wrong blame", lambda m: _declare_channels(m, 7),
     ("GraphError", "'conv0'.*takes 4 input channels.*input '0' has 7 \\(the graph input '0', declared \\[N, 7\\]\\)")),
    ("weight_shape_vs_attributes", "structure", lambda m: _set(m, "conv0", out_channels=5),
     ("GraphError", "'conv0'.*the weight 'conv0.weight' has shape \\(8, 3, 3, 3, 4\\)")),
    ("missing_kernel_size", "structure",
     lambda m: _node(m, "conv1").attribute.remove(next(a for a in _node(m, "conv1").attribute
                                                       if a.name == "kernel_size")) or m,
     ("GraphError", "'conv1'.*'kernel_size' is missing")),
    ("int64_weight", "structure",
     lambda m: _tensor(m, "conv0.bias").CopyFrom(numpy_helper.from_array(np.arange(8, dtype=np.int64), "conv0.bias"))
     or m, ("GraphError", "initializer 'conv0.bias' has ONNX data type 7")),
    ("truncated_raw_data", "structure",
     lambda m: setattr(_tensor(m, "conv1.weight"), "raw_data", _tensor(m, "conv1.weight").raw_data[:100]) or m,
     ("GraphError", "onnx.checker.*conv1.weight.*raw_data size")),
    ("foreign_op", "structure", lambda m: setattr(_node(m, "conv1"), "op_type", "Conv") or m,
     ("GraphError", "node 1 'conv1' \\(Conv\\).*not part of libspconv")),
    ("output_not_produced", "structure", lambda m: setattr(m.graph.output[0], "name", "99") or m,
     ("GraphError", "the graph output '99' is not written by any node")),
    ("ir_version_3", "structure", lambda m: setattr(m, "ir_version", 3) or m,
     ("GraphError", "onnx.checker.*in initializer but not in graph input")),
    ("two_graph_inputs", "structure",
     lambda m: _append(m.graph.input, helper.make_tensor_value_info("extra", onnx.TensorProto.FLOAT16, [None, 4]), m),
     ("GraphError", "one input.*'extra'")),
]
