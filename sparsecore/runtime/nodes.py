"""The values of a parsed libspconv graph: frozen node records, the `Graph`, and `GraphError`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import numpy as np

from ..geometry import ConvGeometry

__all__ = [
    "GraphError",
    "NonFiniteError",
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


class NonFiniteError(FloatingPointError):
    """A run whose float values overflowed (inf) or became NaN: the message names the first node whose
    output is not finite (`sparsecore.runtime.Session`'s ``check_finite``, on for float16 sessions)."""


@dataclass(frozen=True)
class _OneInputNode:
    """The fields every node that reads one value carries: its name, its input and its output."""

    name: str
    input: str
    output: str


# the ConvNode attributes that read its geometry (kept as attributes for callers of the node tables)
_GEOMETRY_FIELDS = ("kind", "kernel_size", "stride", "padding", "dilation", "output_padding")


@dataclass(frozen=True)
class ConvNode(_OneInputNode):
    """A ``SparseConvolution`` node.

    Attributes:
        name, input, output: the node's name and value names.
        weight: ``[out, *kernel, in // groups]`` as stored (float16 or float32).
        bias: ``[out]`` (zeros where the layer had none).
        geometry: the layer's validated `ConvGeometry` (kind ``"subm"``, ``"regular"``,
            ``"transposed"`` or ``"inverse"``; per-axis kernel size, stride, padding,
            dilation and output padding, as the file states them). ``node.kind``,
            ``node.kernel_size``, ``node.stride``, ``node.padding``, ``node.dilation`` and
            ``node.output_padding`` read it.
        groups: channel groups.
        rulebook: the geometry key (spconv's ``indice_key``).
        activation: one of `ACTIVATIONS`, applied after the bias.
        activation_alpha: LeakyReLU's negative slope.
        precision, output_precision: ``"fp16"``, ``"fp32"`` or ``"int8"``.
        input_dynamic_range: int8 input range (absolute maximum), 0 when absent.
        weight_dynamic_ranges: int8 per-output-channel weight ranges, empty when absent.
    """

    weight: np.ndarray
    bias: np.ndarray
    geometry: ConvGeometry
    groups: int
    rulebook: str
    activation: str
    activation_alpha: float
    precision: str
    output_precision: str
    input_dynamic_range: float
    weight_dynamic_ranges: tuple[float, ...]

    def __getattr__(self, name: str) -> Any:
        if name in _GEOMETRY_FIELDS:
            return getattr(self.geometry, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

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
    """``Add`` / ``QuantAdd``: the sum of two sparse values on the same sites (or two dense arrays).

    ``precision`` / ``output_precision`` (``"fp16"`` or ``"int8"``) and
    ``input_dynamic_ranges`` (the file's ``input0_dynamic_range`` and
    ``input1_dynamic_range``, 0 when absent) are libspconv's int8 attributes.
    """

    name: str
    inputs: tuple[str, str]
    output: str
    precision: str = "fp16"
    output_precision: str = "fp16"
    input_dynamic_ranges: tuple[float, float] = (0.0, 0.0)


@dataclass(frozen=True)
class ReluNode(_OneInputNode):
    """``Relu`` of a sparse value's features or of a dense array."""


@dataclass(frozen=True)
class ScatterDenseNode(_OneInputNode):
    """``ScatterDense``: a sparse value to a dense ``[B, C, *spatial]`` array (spconv's ``.dense()``).

    ``input_dynamic_range``: the int8 input's range (absolute maximum), 0 when absent.
    """

    traced_output_shape: tuple[int, ...]
    input_dynamic_range: float = 0.0


@dataclass(frozen=True)
class ReshapeNode(_OneInputNode):
    """``Reshape`` of a dense array to ``dims`` (torch ``view`` semantics; -1 allowed once)."""

    dims: tuple[int, ...]


@dataclass(frozen=True)
class TransposeNode(_OneInputNode):
    """``Transpose`` of a dense array by the axis order ``dims`` (torch ``permute``)."""

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
        ndim: the spatial dimensionality of the layers (the sites are ``[N, 1 + ndim]``), 0 when no
            node states one.
    """

    input: str
    input_channels: int
    output: str
    nodes: tuple[Node, ...]
    output_is_dense: bool
    ndim: int = 0
