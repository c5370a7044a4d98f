"""libspconv graphs written by hand with ``onnx.helper`` for the runtime's tests, and their dense oracles.

`GraphBuilder` collects nodes and FP16 initializers; `base_model` is a two-layer
graph (subm 4 -> 8 with ReLU, then a strided 8 -> 6 conv) whose expected output
`base_expected` computes with the dense float64 oracle (tests/dense_oracle.py),
never with sparsecore. `int8_model` is one int8 conv whose ranges describe its
weights; `int8_expected` is the integer reference of tests/int8_reference.py.
"""

from __future__ import annotations

import numpy as np
import torch
from onnx import helper

from tests.dense_oracle import densify, dense_conv, make_rng, occupancy, random_features, random_indices, read_sites

FP16 = helper.TensorProto.FLOAT16
SHAPE, BATCH = (9, 11, 7), 2


class GraphBuilder:
    """Collects nodes and FP16 initializers of a libspconv graph."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list = []
        self.initializers: list = []
        self.weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def conv(self, name: str, source: str, target: str, in_channels: int, out_channels: int, *, kind: str = "subm",
             kernel: int = 3, stride: int = 1, padding: int = 0, rulebook: str = "", activation: str = "None",
             ndim: int = 3, scale: float = 1.0, **extra) -> None:
        weight = (self.rng.standard_normal((out_channels, *(kernel,) * ndim, in_channels)) * scale
                  / np.sqrt(in_channels * 9)).astype(np.float16)
        bias = self.rng.uniform(-0.3, 0.3, out_channels).astype(np.float16)
        self.weights[name] = (weight.astype(np.float64), bias.astype(np.float64))
        for suffix, value in (("weight", weight), ("bias", bias)):
            self.initializers.append(helper.make_tensor(f"{name}.{suffix}", FP16, list(value.shape), value.tobytes(),
                                                        raw=True))
        self.nodes.append(helper.make_node(
            "SparseConvolution", [source, f"{name}.weight", f"{name}.bias"], [target], name, ndim=ndim,
            in_channels=in_channels, out_channels=out_channels, kernel_size=[kernel] * ndim, stride=[stride] * ndim,
            padding=[padding] * ndim, dilation=[1] * ndim, output_padding=[0] * ndim, groups=1,
            subm=int(kind == "subm"), transposed=int(kind == "transposed"), inverse=int(kind == "inverse"),
            rulebook=rulebook, activation=activation, **{"precision": "fp16", "output_precision": "fp16", **extra}))

    def op(self, op_type: str, inputs: list[str], target: str, name: str, **attributes) -> None:
        self.nodes.append(helper.make_node(op_type, inputs, [target], name, **attributes))

    def model(self, channels: int, output: str):
        graph = helper.make_graph(self.nodes, "scn", [helper.make_tensor_value_info("0", FP16, [None, channels])],
                                  [helper.make_tensor_value_info(output, FP16, [])], self.initializers)
        return helper.make_model(graph, opset_imports=[helper.make_operatorsetid("ai.onnx", 11)])


def dense_subm(dense, weight, bias, mask, relu=False):
    """A subm layer on the dense grid: the dense conv read where the input is active."""
    padding = (weight.shape[1] - 1) // 2  # keeps the grid: a SubM layer's output sites are its input sites
    out = (dense_conv(dense, torch.from_numpy(weight), 1, padding, 1)
           + torch.from_numpy(bias).view(1, -1, 1, 1, 1)) * mask
    return out.clamp(min=0) * mask if relu else out


def case_input(seed: int, shape=SHAPE, batch: int = BATCH, channels: int = 4, num: int = 120):
    """``(rng, indices int32 [N, 4], features float64 [N, C])`` of a seeded random cloud."""
    rng = make_rng(seed)
    indices = random_indices(rng, shape, batch, num=num)
    return rng, indices, random_features(rng, len(indices), channels)


def base_model(rng: np.random.Generator, activation: str = "ReLU", **conv0) -> GraphBuilder:
    """subm 4 -> 8 (``activation``), strided 8 -> 6 (k3 s2 p1): the graph most hostile cases mutate."""
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 8, rulebook="a", activation=activation, **conv0)
    builder.conv("conv1", "1", "2", 8, 6, kind="regular", stride=2, padding=1, rulebook="down")
    return builder


def base_expected(builder: GraphBuilder, features, indices, activation: str = "ReLU", alpha: float = 0.0):
    """The dense oracle of `base_model`: ``(output sites int64 [M, 4] sorted, features float64 [M, 6])``."""
    mask = occupancy(indices, SHAPE, BATCH)
    hidden = dense_subm(densify(features, indices, SHAPE, BATCH), *builder.weights["conv0"], mask)
    if activation == "ReLU":
        hidden = hidden.clamp(min=0)
    elif activation == "LeakyReLU":
        hidden = torch.nn.functional.leaky_relu(hidden, alpha)
    weight, bias = builder.weights["conv1"]
    down_mask = dense_conv(mask, torch.ones(1, 3, 3, 3, 1, dtype=torch.float64), 2, 1, 1) > 0
    down = dense_conv(hidden * mask, torch.from_numpy(weight), 2, 1, 1) + torch.from_numpy(bias).view(1, -1, 1, 1, 1)
    sites = torch.nonzero(down_mask[:, 0]).numpy()
    return sites, read_sites(down, sites).numpy()


def int8_model(rng: np.random.Generator, features: np.ndarray, **overrides):
    """One int8 subm conv 4 -> 6 (float input, float output) whose ranges are the true absolute maxima."""
    builder = GraphBuilder(rng)
    weight_probe = (rng.standard_normal((6, 3, 3, 3, 4)) / 6).astype(np.float16)
    ranges = np.abs(weight_probe.astype(np.float32)).reshape(6, -1).max(axis=1)
    attributes = {"precision": "int8", "output_precision": "fp16",
                  "input_dynamic_range": float(np.abs(features).max()),
                  "weight_dynamic_ranges": [float(value) for value in ranges], **overrides}
    builder.conv("conv0", "0", "1", 4, 6, rulebook="a", **attributes)
    raw = weight_probe.tobytes()
    builder.initializers[0] = helper.make_tensor("conv0.weight", FP16, list(weight_probe.shape), raw, raw=True)
    builder.weights["conv0"] = (weight_probe.astype(np.float64), builder.weights["conv0"][1])
    return builder


def int8_expected(builder: GraphBuilder, features: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """float32 ``[N, 6]``: the integer reference of the int8 conv (sites = input sites, in input order)."""
    import sparsecore as sc
    from tests.int8_reference import integer_sums, reference_epilogue

    node = builder.nodes[0]
    attributes = {attribute.name: helper.get_attribute_value(attribute) for attribute in node.attribute}
    f32 = np.float32
    input_scale = f32(attributes["input_dynamic_range"]) / f32(127)
    weight_scales = np.asarray(attributes["weight_dynamic_ranges"], dtype=f32) / f32(127)
    weight, bias = builder.weights["conv0"]
    quantized_x = np.clip(np.rint(features.astype(f32) / input_scale), -128, 127).astype(np.int8)
    quantized_w = np.clip(np.rint(weight.astype(f32) / weight_scales.reshape(-1, 1, 1, 1, 1)), -128, 127)
    rulebook = sc.build_rulebook(indices, SHAPE, BATCH, sc.ConvGeometry.create(3, 3, kind="subm"))  # sites only
    sums = integer_sums(quantized_x, quantized_w.astype(np.int8), rulebook, 1)
    return reference_epilogue(sums, float(input_scale), weight_scales, None, bias.astype(f32), None, None, False)
