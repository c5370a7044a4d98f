"""Hostile ONNX files of issue 39 for sparsecore.runtime: external-data ranges, text attributes, shared weights.

The same form as tests/hostile_cases.py (a `Case` per file, judged by its child's
record): external-data lengths in non-ASCII digits ("²"), ranges that overlap
another initializer's, two rulebook names whose bytes are not UTF-8 (decoded
leniently they would name one rulebook), and two files that must run in their
own capped child: 2000 unused initializers aliasing one 4 MiB range (8 GiB if
read) and one weight shared by 300 conv nodes (one converted copy, not 300).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper

from tests.dense_oracle import make_rng
from tests.hostile_cases import Case, _save_input, _write_external
from tests.runtime_graphs import FP16

__all__ = ["write_data_cases", "aliased_case", "shared_weight_case"]


def _external_entry(model: Any, name: str, key: str, value: str) -> None:
    tensor = next(tensor for tensor in model.graph.initializer if tensor.name == name)
    for entry in tensor.external_data:
        if entry.key == key:
            entry.value = value
            return
    tensor.external_data.add(key=key, value=value)


def _rewrite(path: Path, edit) -> str:
    model = onnx.load(str(path), load_external_data=False)
    edit(model)
    onnx.save_model(model, str(path))
    return str(path)


def write_data_cases(base: Any, folder: Path, inputs: str) -> list[Case]:
    """The grouped cases (none can allocate much once refused): "²", overlapping ranges, non-UTF-8 rulebooks."""
    cases = []
    path = _write_external(base, folder / "ext_superscript")
    cases.append(Case("external_length_superscript", "external data", _rewrite(
        path, lambda m: _external_entry(m, "conv0.weight", "length", "\u00b2")), inputs,
        error=("GraphError", "initializer 'conv0.weight': its external data length '²' must be a non-negative "
                             "integer of bytes written in ASCII digits")))
    path = _write_external(base, folder / "ext_overlap")
    cases.append(Case("external_ranges_overlap", "external data", _rewrite(
        path, lambda m: _external_entry(m, "conv0.bias", "offset", "16")), inputs,
        error=("GraphError", "initializer 'conv0.bias' keeps its data in 'weights.bin' at offset 16 .*inside the "
                             "bytes of initializer 'conv0.weight'.*may not overlap or be reused")))
    model = copy.deepcopy(base)
    for node, key in zip(model.graph.node, (b"\xff\xfe", b"\xff\xfd")):
        attribute = next(a for a in node.attribute if a.name == "rulebook")
        attribute.s = key
    onnx.save(model, str(folder / "indice_key_not_utf8.onnx"))
    cases.append(Case("indice_key_not_utf8", "wrong blame", str(folder / "indice_key_not_utf8.onnx"), inputs,
                      error=("GraphError", "node 0 'conv0' \\(SparseConvolution\\): the attribute 'rulebook' holds "
                                           "b'\\\\xff\\\\xfe', which is not valid UTF-8")))
    return cases


def aliased_case(base: Any, folder: Path, inputs: str, count: int = 2000) -> Case:
    """``count`` unused FLOAT16 initializers, each 4 MiB, all at offset 0 of one 4 MiB file (8 GiB if read)."""
    path = _write_external(base, folder)
    (folder / "big.bin").write_bytes(bytes(4 * 2**20))
    model = onnx.load(str(path), load_external_data=False)
    for index in range(count):
        tensor = model.graph.initializer.add(name=f"alias{index}", data_type=FP16, dims=[2 * 2**20])
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", "big.bin"), ("offset", "0"), ("length", str(4 * 2**20))):
            tensor.external_data.add(key=key, value=value)
    onnx.save_model(model, str(path))
    return Case("external_aliased_8gib", "memory", str(path), inputs,
                error=("GraphError", "initializer 'alias[0-9]+' keeps its data in 'big.bin' at offset 0 \\(length "
                                     "4194304\\), inside the bytes of initializer 'alias[0-9]+'"))


def shared_weight_case(folder: Path, nodes: int = 300, channels: int = 1700) -> Case:
    """One FP16 1x1 weight (a permutation, exact in any dtype) read by ``nodes`` subm convs in a float32 session:
    converted once it takes 11 MiB; once per node it would take 3.2 GiB, beyond the child's cap."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = make_rng(3960)
    permutation = rng.permutation(channels)
    weight = np.zeros((channels, 1, 1, 1, channels), np.float16)
    weight[np.arange(channels), 0, 0, 0, permutation] = 1
    bias = rng.uniform(-1, 1, channels).astype(np.float16)
    initializers = [helper.make_tensor("w", FP16, list(weight.shape), weight.tobytes(), raw=True),
                    helper.make_tensor("b", FP16, [channels], bias.tobytes(), raw=True)]
    graph_nodes = [helper.make_node("SparseConvolution", [str(i), "w", "b"], [str(i + 1)], f"conv{i}", ndim=3,
                                    in_channels=channels, out_channels=channels, kernel_size=[1, 1, 1],
                                    stride=[1, 1, 1], padding=[0, 0, 0], dilation=[1, 1, 1],
                                    output_padding=[0, 0, 0], groups=1, subm=1, rulebook="one")
                   for i in range(nodes)]
    graph = helper.make_graph(graph_nodes, "shared", [helper.make_tensor_value_info("0", FP16, [None, channels])],
                              [helper.make_tensor_value_info(str(nodes), FP16, [])], initializers)
    path = folder / "shared_weight.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_operatorsetid("ai.onnx", 11)]), str(path))
    sites = np.array([[0, 1, 2, 3], [0, 4, 4, 4], [0, 8, 1, 0], [0, 2, 9, 5]], np.int32)
    features = rng.uniform(-1, 1, (len(sites), channels)).astype(np.float32)
    expected = features.astype(np.float64)
    for _ in range(nodes):  # the oracle: y = x W^T + b, W a permutation (y[:, o] = x[:, permutation[o]] + b[o])
        expected = expected[:, permutation] + bias.astype(np.float64)
    inputs = _save_input(folder, "shared_weight", features, sites, 1, (10, 10, 10))

    def check(output: dict) -> bool:
        return "features" in output and np.array_equal(output["indices"], sites) and np.allclose(
            output["features"], expected, rtol=1e-5, atol=1e-3)
    return Case("shared_weight_300_nodes", "memory", str(path), inputs, check=check)
