"""The values of a parsed libspconv graph: frozen node records, the `Graph`, and `GraphError`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

__all__ = [
    "GraphError",
    "SUPPORTED_OPS",
    "DOMAINS",
    "ACTIVATIONS",
    "PRECISIONS",
    "ConvNode",
    "AddNode",
    "ReluNode",
    "ScatterDenseNode",
    "ReshapeNode",
    "TransposeNode",
    "Node",
    "Graph",
]

SUPPORTED_OPS = ("SparseConvolution", "Add", "QuantAdd", "Relu", "ScatterDense", "Reshape", "Transpose")
ACTIVATIONS = ("None", "ReLU", "Sigmoid", "LeakyReLU")
PRECISIONS = ("fp16", "fp32", "int8")
# libspconv's parser reads op types only; NVIDIA's exporter writes the default domain, sparsecore's
# exporter puts the non-standard ops in "spconv" (as AIMET does) so that onnx.checker accepts the file
DOMAINS = ("", "ai.onnx", "spconv")


class GraphError(ValueError):
    """A graph the runtime cannot run: the message names the node and what is wrong."""


@dataclass(frozen=True)
class ConvNode:
    """A ``SparseConvolution`` node.

    Attributes:
        name, input, output: the node's name and value names.
        weight: ``[out, *kernel, in // groups]`` as stored (float16 or float32).
        bias: ``[out]`` (zeros where the layer had none).
        kind: ``"subm"``, ``"regular"``, ``"transposed"`` or ``"inverse"``.
        kernel_size, stride, padding, dilation, output_padding: per axis.
        groups: channel groups.
        rulebook: the geometry key (spconv's ``indice_key``).
        activation: one of `ACTIVATIONS`, applied after the bias.
        activation_alpha: LeakyReLU's negative slope.
        precision, output_precision: ``"fp16"``, ``"fp32"`` or ``"int8"``.
        input_dynamic_range: int8 input range (absolute maximum), 0 when absent.
        weight_dynamic_ranges: int8 per-output-channel weight ranges, empty when absent.
    """

    name: str
    input: str
    output: str
    weight: np.ndarray
    bias: np.ndarray
    kind: str
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    output_padding: tuple[int, ...]
    groups: int
    rulebook: str
    activation: str
    activation_alpha: float
    precision: str
    output_precision: str
    input_dynamic_range: float
    weight_dynamic_ranges: tuple[float, ...]

    @property
    def in_channels(self) -> int:
        """Input channels."""
        return int(self.weight.shape[-1]) * self.groups

    @property
    def out_channels(self) -> int:
        """Output channels."""
        return int(self.weight.shape[0])


@dataclass(frozen=True)
class AddNode:
    """``Add`` / ``QuantAdd``: the sum of two sparse values on the same sites (or two dense arrays)."""

    name: str
    inputs: tuple[str, str]
    output: str


@dataclass(frozen=True)
class ReluNode:
    """``Relu`` of a sparse value's features or of a dense array."""

    name: str
    input: str
    output: str


@dataclass(frozen=True)
class ScatterDenseNode:
    """``ScatterDense``: a sparse value to a dense ``[B, C, *spatial]`` array (spconv's ``.dense()``)."""

    name: str
    input: str
    output: str
    traced_output_shape: tuple[int, ...]


@dataclass(frozen=True)
class ReshapeNode:
    """``Reshape`` of a dense array to ``dims`` (torch ``view`` semantics; -1 allowed once)."""

    name: str
    input: str
    output: str
    dims: tuple[int, ...]


@dataclass(frozen=True)
class TransposeNode:
    """``Transpose`` of a dense array by the axis order ``dims`` (torch ``permute``)."""

    name: str
    input: str
    output: str
    dims: tuple[int, ...]


Node = Union[ConvNode, AddNode, ReluNode, ScatterDenseNode, ReshapeNode, TransposeNode]


@dataclass(frozen=True)
class Graph:
    """A validated graph: nodes in execution order.

    Attributes:
        input: the features input's name.
        input_channels: channels of the features input (from the graph input or the first conv).
        output: the graph output's name.
        nodes: the nodes, each reading only the input or earlier nodes' outputs.
        output_is_dense: True when the output is a dense array (after ``ScatterDense``).
    """

    input: str
    input_channels: int
    output: str
    nodes: tuple[Node, ...]
    output_is_dense: bool
