"""Runs a parsed libspconv graph on NumPy (CPU) or CuPy (GPU) arrays through the core's public API.

int8 nodes (``precision`` / ``output_precision`` ``"int8"``) run the core's
int8 passes with libspconv's reading of the dynamic ranges (see
`sparsecore.runtime.quantized`); float nodes run in the session's dtype.
Before a run allocates, each step is held to `sparsecore.memory_budget`'s
budget (the session's ``memory_budget``, else the process-wide one): a step
beyond it raises `MemoryBudgetError` naming the node and the size. A float16
session checks every float node's output and raises `NonFiniteError` naming
the first node whose output holds infinity or NaN (float16 ends at 65504);
``check_finite=True`` does the same in float32. Runs are safe from several
threads at once: under numba's ``workqueue`` layer, which is not, a run holds
`sparsecore.threads.serialised_kernels`' lock.
A session converts each weight to its dtype (and device) once, at its first
use, and shares the converted array between all the nodes that read the same
initializer; the bytes it keeps so are held, all together, to the memory
budget (a `MemoryBudgetError` naming the node whose weight would pass it).
Each run starts a fresh rulebook cache: layers naming the same ``rulebook``
(spconv's ``indice_key``) share one geometry, built once per run, exactly as
the torch model's ``indice_dict`` does; an inverse conv reverses the rulebook
of the strided conv under its key. Nothing here imports torch or jax, and
CuPy is touched only when CuPy arrays arrive.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from .._dispatch import array_module, to_core_array
from ..functional import sparse_conv
from ..memory_budget import MemoryBudgetError, budget, parse_budget
from ..tensor import SparseTensor
from ..threads import serialised_kernels
from .capture import CapturedRuns
from .nodes import (AddNode, ConvNode, Graph, GraphError, NonFiniteError, ReluNode, ReshapeNode, ScatterDenseNode,
                    TransposeNode)
from .quantized import (Int8Value, computes_int8, int8_add, int8_conv, residual_fusions,
                        tensor_scales)
from .weight_cache import WeightCache

__all__ = ["Session", "RuntimeOutput", "DTYPES"]

DTYPES = ("float32", "float16")


@dataclass(frozen=True)
class RuntimeOutput:
    """What one run returns.

    Attributes:
        dense: the dense output array (``[B, C, *spatial]`` after ``ScatterDense``, or its
            reshaped / transposed view) when the graph ends densely, else None.
        sparse: the output `sparsecore.SparseTensor` (``features [N, C]``, ``indices
            [N, 1 + D]`` int32, ``spatial_shape``) when the graph ends on sparse sites, else None.
    """

    dense: Any
    sparse: Union[SparseTensor, None]

    @property
    def value(self) -> Any:
        """The dense array, or the sparse tensor."""
        return self.sparse if self.dense is None else self.dense


def _activate(node: ConvNode, features: Any) -> Any:
    """The node's activation, in place: ``features`` is the conv's fresh output, read by no one else."""
    xp = array_module(features)
    if node.activation == "ReLU":
        return xp.maximum(features, features.dtype.type(0), out=features)
    if node.activation == "Sigmoid":
        return (1 / (1 + xp.exp(-features.astype(np.float32)))).astype(features.dtype)
    if node.activation == "LeakyReLU":
        negative = features < 0
        features[negative] *= features.dtype.type(node.activation_alpha)
        return features
    return features


class Session:
    """An executable graph (see `sparsecore.runtime.load`).

    Args:
        graph: the parsed graph.
        dtype: ``"float32"`` (weights widened from FP16) or ``"float16"`` (FP16 storage, float32
            accumulation in the core's products).
        memory_budget: the most bytes one step of a run may allocate (bytes, ``"8G"`` or ``"30%"``,
            `sparsecore.memory_budget.parse_budget`); None: the process-wide budget.
        check_finite: raise `NonFiniteError` naming the first float node whose output is not finite;
            None (default): on for float16 sessions, off for float32 and for ``capture``.
        capture: run in capacity mode and, on CuPy, record one CUDA graph per input capacity and replay it
            (`sparsecore.runtime.capture`; docs/capture.md). Float nodes only.

    Raises:
        GraphError: in a float16 session, a float conv's weight or bias beyond float16's range (named).
    """

    def __init__(self, graph: Graph, dtype: str = "float32", *, memory_budget: Union[int, str, None] = None,
                 check_finite: Optional[bool] = None, capture: bool = False) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        self.graph = graph
        self.memory_budget = None if memory_budget is None else parse_budget(memory_budget, "memory_budget")
        self.check_finite = dtype == "float16" and not capture if check_finite is None else bool(check_finite)
        if capture and self.check_finite:
            raise ValueError("check_finite reads every node's output back, which a captured run cannot: "
                             "pass check_finite=False with capture=True")
        self.captured = CapturedRuns() if capture else None
        # libspconv's tensor_name -> scale of the values read as int8 (checked here, before any run)
        self._scales = tensor_scales(graph)
        self._fusions = residual_fusions(graph)  # int8 conv -> Add -> Relu run as one int8 pass
        self.dtype = np.dtype(dtype)
        self._weights = WeightCache(self.dtype, self.memory_budget)  # converted once, counted by the budget
        self._released = self._released_after()  # per node position, the values no later node reads
        if self.dtype == np.float16:
            self._check_float16_weights()

    def _check_float16_weights(self) -> None:
        limit = float(np.finfo(np.float16).max)
        for node in self.graph.nodes:
            if not isinstance(node, ConvNode) or computes_int8(node):
                continue
            for what, values in (("weight", node.weight), ("bias", node.bias)):
                largest = float(np.abs(values).max()) if values.size else 0.0
                if largest > limit:
                    raise GraphError(f"node {node.name!r} (SparseConvolution): its {what} holds {largest:.6g}, "
                                     f"beyond float16's largest value {limit:g}; run this model with "
                                     "dtype='float32'")

    def _parameters(self, node: ConvNode, like: Any) -> Any:
        return self._weights.parameters(node, like)

    def _float(self, value: Any) -> Any:
        """A value for a float node: an int8 value dequantized; sparse features in the session's dtype."""
        if isinstance(value, Int8Value):
            value = value.dequantized()
        if isinstance(value, SparseTensor) and value.core_features.dtype != self.dtype:
            value = value.replace(value.core_features.astype(self.dtype))
        return value

    def _conv(self, node: ConvNode, x: Any, residual: Any = None) -> Any:
        if computes_int8(node):
            like = x.values if isinstance(x, Int8Value) else x.core_features
            out = int8_conv(node, x, self._scales, self._parameters(node, like), array_module(like), residual,
                            self._fusions.get(id(node)) if residual is not None else None)
            return out if isinstance(out, Int8Value) else self._float(out)
        x = self._float(x)
        if x.num_channels != node.in_channels:
            raise GraphError(f"node {node.name!r} (SparseConvolution) expects {node.in_channels} input channels, "
                             f"its input {node.input!r} has {x.num_channels}")
        weight, bias = self._parameters(node, x.features)
        try:
            out = sparse_conv(x, weight, bias, kind=node.kind, stride=node.stride, padding=node.padding,
                              dilation=node.dilation, output_padding=node.output_padding, groups=node.groups,
                              indice_key=node.rulebook or None)
        except ValueError as error:
            raise GraphError(f"node {node.name!r} (SparseConvolution, {node.kind}, rulebook "
                             f"{node.rulebook!r}): {error}") from error
        return out.replace(_activate(node, out.features))

    @staticmethod
    def _add(node: AddNode, first: Any, second: Any) -> Any:
        if isinstance(first, SparseTensor):
            same = first.indices is second.indices or (
                first.indices.shape == second.indices.shape
                and bool(array_module(first.indices).array_equal(first.indices, second.indices)))
            if not same or first.num_channels != second.num_channels:
                raise GraphError(
                    f"node {node.name!r} (Add) adds {node.inputs[0]!r} ({first.num_active} sites, "
                    f"{first.num_channels} channels) and {node.inputs[1]!r} ({second.num_active} sites, "
                    f"{second.num_channels} channels): libspconv's Add needs the same sites and channels"
                )
            return first.replace(first.features + second.features)
        if first.shape != second.shape:
            raise GraphError(f"node {node.name!r} (Add) adds arrays of shapes {first.shape} and {second.shape}")
        return first + second

    def _add_node(self, node: AddNode, first: Any, second: Any) -> Any:
        if computes_int8(node):
            out = int8_add(node, first, second, self._scales, self._add)
            return out if isinstance(out, Int8Value) else self._float(out)
        return self._add(node, self._float(first), self._float(second))

    @staticmethod
    def _dense_op(node: Union[ReshapeNode, TransposeNode], array: Any) -> Any:
        xp = array_module(array)
        try:
            if isinstance(node, ReshapeNode):
                return xp.reshape(array, node.dims)
            return xp.ascontiguousarray(xp.transpose(array, node.dims))
        except ValueError as error:
            op = type(node).__name__.replace("Node", "")
            raise GraphError(
                f"node {node.name!r} ({op}, dims {list(node.dims)}) cannot act on the array of shape "
                f"{tuple(array.shape)}: {error}. The dims were recorded at export for the traced batch "
                "size and grid; run with the same batch size and spatial_shape"
            ) from None

    def _released_after(self) -> list[tuple[str, ...]]:
        """Per node position, the values no node after it reads (the graph's output excepted)."""
        last_read: dict[str, int] = {}
        for position, node in enumerate(self.graph.nodes):
            for name in (node.inputs if isinstance(node, AddNode) else (node.input,)):
                last_read[name] = position
        released: list[list[str]] = [[] for _ in self.graph.nodes]
        for name, position in last_read.items():
            if name != self.graph.output:
                released[position].append(name)
        return [tuple(names) for names in released]

    def run(self, features: Any, indices: Any, batch_size: int, spatial_shape: Any) -> RuntimeOutput:
        """Runs the graph on one batch of voxels.

        Args:
            features: ``[N, C]`` float array (NumPy or CuPy; any DLPack array), C the graph input's channels.
            indices: int ``[N, 1 + D]`` (batch, then coordinates in ``spatial_shape``'s order, zyx for 3D),
                unique sites, on the features' device; D the graph's dimensionality.
            batch_size: ``B``.
            spatial_shape: ``D`` ints, the input grid.

        Returns:
            A `RuntimeOutput`: the dense array or the sparse tensor the graph ends with, in the
            session's dtype, on the input's device.

        Raises:
            ValueError: bad inputs (named), or a `GraphError` naming the node that cannot run.
            MemoryBudgetError: a node's step beyond the memory budget (the node and the size named).
            NonFiniteError: with ``check_finite``, the first float node whose output is not finite.
        """
        features = to_core_array(features, "features")
        if features.ndim != 2 or features.shape[1] != self.graph.input_channels:
            raise ValueError(
                f"features must be [N, {self.graph.input_channels}] (the graph input's channels), got "
                f"shape {tuple(features.shape)}"
            )
        if features.dtype.kind != "f":
            raise TypeError(f"features must be a float array, got dtype {features.dtype}")
        self._check_sites(indices, spatial_shape)
        features = features.astype(self.dtype, copy=False)
        chosen = budget(self.memory_budget) if self.memory_budget is not None else contextlib.nullcontext()
        with chosen, serialised_kernels(features):
            if self.captured is not None:
                return self.captured.run(features, to_core_array(indices, "indices"), batch_size, spatial_shape,
                                         lambda first: self._run(first, keep_rulebooks=True))
            return self._run(SparseTensor(features, indices, spatial_shape, batch_size))

    def _check_sites(self, indices: Any, spatial_shape: Any) -> None:
        ndim = self.graph.ndim
        if not ndim:
            return
        shape = tuple(getattr(indices, "shape", ()))
        if len(shape) == 2 and shape[1] != 1 + ndim:
            raise ValueError(f"indices must be [N, {1 + ndim}] (batch index, then {ndim} coordinates): this graph's "
                             f"layers are {ndim}-D, but the sites given are {shape[1] - 1}-D (indices of shape "
                             f"{shape})")
        try:
            axes = len(spatial_shape)
        except TypeError:
            return
        if axes != ndim:
            raise ValueError(f"spatial_shape must have {ndim} entries (this graph's layers are {ndim}-D), got "
                             f"{tuple(spatial_shape)}")

    def _run(self, first: SparseTensor, keep_rulebooks: bool = False) -> Any:
        """The nodes on ``first``: a `RuntimeOutput`, with ``keep_rulebooks`` also the rulebooks the layers used."""
        values: dict[str, Any] = {self.graph.input: first}
        rulebooks: list = []
        fused: set[int] = set()  # the Add and Relu nodes a fused conv has computed
        for position, node in enumerate(self.graph.nodes):
            for name in self._released[position - 1] if position else ():
                values.pop(name, None)  # read by no later node: its memory goes back before the next pass
            if id(node) in fused:
                continue
            try:
                written = self._node(node, values, fused)
            except MemoryBudgetError as error:
                raise MemoryBudgetError(f"node {node.name!r} ({_op_name(node)}): {error}") from None
            if self.check_finite:
                self._check_output(node, values[written])
            if keep_rulebooks and isinstance(values[written], SparseTensor):
                cache = values[written].rulebooks.value
                rulebooks += [*cache.aliases.values(), *cache.canonical.values()]
        output = self._float(values[self.graph.output])
        result = RuntimeOutput(None, output) if isinstance(output, SparseTensor) else RuntimeOutput(output, None)
        return (result, rulebooks) if keep_rulebooks else result

    def _node(self, node: Any, values: dict[str, Any], fused: set[int]) -> str:
        """Runs one node into ``values``; returns the name it wrote."""
        fusion = self._fusions.get(id(node))
        if fusion is not None and fusion.add.inputs[1] in values:
            values[fusion.relu.output] = self._conv(node, values[node.input], values[fusion.add.inputs[1]])
            fused.update((id(fusion.add), id(fusion.relu)))
            return fusion.relu.output
        if isinstance(node, ConvNode):
            result = self._conv(node, values[node.input])
        elif isinstance(node, AddNode):
            result = self._add_node(node, values[node.inputs[0]], values[node.inputs[1]])
        elif isinstance(node, ReluNode):
            value = values[node.input]
            if isinstance(value, Int8Value):  # max(q, 0) keeps the scale
                result = Int8Value(value.sites, array_module(value.values).maximum(value.values, 0), value.scale)
            elif isinstance(value, SparseTensor):
                result = value.replace(array_module(value.features).maximum(value.features, 0))
            else:
                result = array_module(value).maximum(value, value.dtype.type(0))
        elif isinstance(node, ScatterDenseNode):
            result = self._float(values[node.input]).dense(channels_first=True)
        else:
            result = self._dense_op(node, values[node.input])
        values[node.output] = result
        return node.output

    @staticmethod
    def _check_output(node: Any, value: Any) -> None:
        if isinstance(value, Int8Value):
            return
        array = value.core_features if isinstance(value, SparseTensor) else value
        xp = array_module(array)
        finite = xp.isfinite(array)
        if array.size == 0 or bool(finite.all()):
            return
        count = int(array.size - int(finite.sum()))
        raise NonFiniteError(
            f"node {node.name!r} ({_op_name(node)}) wrote {count} non-finite value(s) (inf or NaN) of "
            f"{array.size} in its {array.dtype} output: the first node whose output is not finite"
            + (" (float16 holds at most 65504; run with dtype='float32')" if array.dtype == np.float16 else
               " (check the input features for inf or NaN)"))

    def describe(self) -> str:
        """A table of the nodes: name, op type, value names, and each conv's kind, shape and rulebook."""
        rows = [("node", "op", "input", "output", "details")]
        for node in self.graph.nodes:
            if isinstance(node, ConvNode):
                details = (f"{node.kind} {node.in_channels}->{node.out_channels} k{list(node.kernel_size)} "
                           f"s{list(node.stride)} p{list(node.padding)} rulebook={node.rulebook!r} "
                           f"act={node.activation}" + (f" {node.precision}->{node.output_precision}"
                                                       if computes_int8(node) else ""))
                op, source = "SparseConvolution", node.input
            elif isinstance(node, AddNode):
                details, op, source = "", "Add", " + ".join(node.inputs)
            elif isinstance(node, ReluNode):
                details, op, source = "", "Relu", node.input
            elif isinstance(node, ScatterDenseNode):
                details, op, source = f"traced {list(node.traced_output_shape)}", "ScatterDense", node.input
            else:
                details, op, source = f"dims {list(node.dims)}", type(node).__name__[:-4], node.input
            rows.append((node.name, op, source, node.output, details))
        widths = [max(len(row[column]) for row in rows) for column in range(4)]
        return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row[:4], widths)) + "  " + row[4]
                         for row in rows)


def _op_name(node: Any) -> str:
    return {ConvNode: "SparseConvolution", AddNode: "Add", ReluNode: "Relu", ScatterDenseNode: "ScatterDense",
            ReshapeNode: "Reshape", TransposeNode: "Transpose"}[type(node)]

