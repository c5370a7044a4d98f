"""Checks of a loaded ``torch.export`` program's sparsecore ops, before it runs on anything.

A ``.pt2`` file's graph (``models/model.json``) is text anyone can edit: a conv's
``kernel_size`` changed from 3 to 101 still loads, and the first run then builds a
rulebook of 101^3 offsets (over a GiB) before a feature pass notices that the
weight has 3^3. `check_program` reads every ``sparsecore::export_*`` node of the
graph once, at load time, and refuses the program, naming the node, the argument,
what was expected and what was seen, when:

- a rulebook's geometry is not one `sparsecore.ConvGeometry.create` accepts (kind,
  per-axis lengths, signs), or its grid shape or batch size is not positive;
- a conv's ``kernel_size`` differs from its weight's kernel axes (the weight is the
  parameter the file stores, ``[out_channels, *kernel_size, in_channels // groups]``),
  its ``groups`` is not a positive divisor of the weight's channels, or its bias does
  not have one entry per output channel;
- a conv or pool reads pair tensors that are not the outputs of one rulebook
  (its own: pairs of two rulebooks, tensors no rulebook wrote, outputs in
  another order than a forward or an inverse conv reads them), writes onto
  sites other than that rulebook's output sites, or reads a rulebook built for
  another kernel;
- a rulebook declares a grid (``spatial_shape``) other than the grid of the
  sites it builds on (the example input's, or the output grid of the rulebook
  that wrote them): the file is blamed at load, not the user's sites at run time;
- a pool's ``mode`` is neither ``"max"`` nor ``"avg"``.

What the graph leaves to the input (how many sites, how many pairs) is bounded when it
runs, by the core's memory budget (`sparsecore.memory_budget`).
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch

import sparsecore as sc

__all__ = ["check_program"]

_RULEBOOK = "export_rulebook"
_CONV = "export_conv"
_POOL = "export_pool"
_POOL_MODES = ("max", "avg")


def _op_name(node: torch.fx.Node) -> str:
    """'export_rulebook', 'export_conv', 'export_pool', or '' for a node that is not a sparsecore export op."""
    if node.op != "call_function":
        return ""
    name = str(getattr(node.target, "name", lambda: "")()) if hasattr(node.target, "name") else ""
    namespace, _, rest = name.partition("::")
    return rest.split(".")[0] if namespace == "sparsecore" else ""


def _refuse(path: str, node: torch.fx.Node, what: str) -> ValueError:
    return ValueError(f"load_program: {path}: node {node.name!r} ({_op_name(node)}) {what}; the graph "
                      "(models/model.json) was edited or made elsewhere: export the program again with "
                      "sparsecore.torch")


def _ints(value: Any) -> Optional[tuple[int, ...]]:
    """A list of plain ints as a tuple, or None when it is anything else (a symbolic size, a node, a string)."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    return None


def _check_rulebook(path: str, node: torch.fx.Node) -> tuple[tuple[int, ...], Any]:
    """Checks an export_rulebook node's arguments; returns its kernel size and `sparsecore.ConvGeometry`."""
    _, spatial_shape, batch_size, kind, kernel_size, stride, padding, dilation, output_padding = node.args
    shape = _ints(spatial_shape)
    if shape is not None and (not shape or min(shape) < 1):
        raise _refuse(path, node, f"has spatial_shape {list(shape)}; expected positive sizes, one per axis")
    if isinstance(batch_size, int) and batch_size < 1:
        raise _refuse(path, node, f"has batch_size {batch_size}; expected at least 1")
    if kind not in sc.CONV_KINDS:
        raise _refuse(path, node, f"has kind {kind!r}; expected one of {sc.CONV_KINDS}")
    kernel = _ints(kernel_size)
    if kernel is None:
        raise _refuse(path, node, f"has kernel_size {kernel_size!r}; expected a list of ints")
    if shape is not None and len(shape) != len(kernel):
        raise _refuse(path, node, f"has a {len(shape)}-axis spatial_shape {list(shape)} and a {len(kernel)}-axis "
                      f"kernel_size {list(kernel)}; expected one size per axis in both")
    try:
        geometry = sc.ConvGeometry.create(len(kernel), kernel, _ints(stride) or stride, _ints(padding) or padding,
                               _ints(dilation) or dilation, _ints(output_padding) or output_padding, kind=kind)
    except (TypeError, ValueError) as error:
        raise _refuse(path, node, f"has a geometry the core refuses ({error})") from None
    return kernel, geometry


def _example_grid(program: torch.export.ExportedProgram) -> Optional[tuple[int, ...]]:
    """The spatial_shape of the program's one example SparseConvTensor (None: none, or several)."""
    from .tensor import SparseConvTensor

    inputs = program.example_inputs
    flat = list(inputs[0]) + list(inputs[1].values()) if isinstance(inputs, tuple) and len(inputs) == 2 else []
    tensors = [value for value in flat if isinstance(value, SparseConvTensor)]
    return _ints(list(tensors[0].spatial_shape)) if len(tensors) == 1 else None


def _check_grid(path: str, node: torch.fx.Node, geometry: Any, grids: dict[Any, tuple[tuple[int, ...], str]],
                input_grid: Optional[tuple[int, ...]]) -> None:
    """A rulebook's spatial_shape is the grid of the sites it builds on: the example input's, or the output grid
    of the rulebook that wrote them; its output grid goes to the sites it writes."""
    sites, shape = node.args[0], _ints(node.args[1])
    if shape is None:
        return
    expected = grids.get(sites)
    if expected is None and isinstance(sites, torch.fx.Node) and sites.op == "placeholder" and input_grid:
        expected = (input_grid, "the spatial_shape of the file's example input")
    if expected is not None and expected[0] != shape:
        shown = sites.name if isinstance(sites, torch.fx.Node) else repr(sites)
        raise _refuse(path, node, f"declares spatial_shape {list(shape)} for the sites {shown!r}, whose grid is "
                      f"{list(expected[0])} ({expected[1]}); the grid is the file's, not the input's")
    grids.setdefault(sites, (shape, f"declared by {node.name!r}"))
    output = shape if geometry.kind == "subm" else tuple(int(v) for v in geometry.output_spatial_shape(shape))
    for user in node.users:
        if user.target is operator.getitem and user.args[1] == 0:
            grids[user] = (output, f"the output grid of {node.name!r}")


def _pair_source(node: torch.fx.Node, argument: Any) -> tuple[torch.fx.Node, int]:
    """``(export_rulebook node, output index)`` a pair argument reads; refuses any other source."""
    if isinstance(argument, torch.fx.Node) and argument.target is operator.getitem:
        source, index = argument.args[0], argument.args[1]
        if isinstance(source, torch.fx.Node) and _op_name(source) == _RULEBOOK and index in (1, 2, 3):
            return source, index
    shown = argument.name if isinstance(argument, torch.fx.Node) else repr(argument)
    raise ValueError(f"reads the pair tensor {shown!r}, which no export_rulebook node wrote")


def _check_pairs(path: str, node: torch.fx.Node, kernel: tuple[int, ...],
                 kernels: dict[torch.fx.Node, tuple[int, ...]]) -> None:
    """The pairs and output sites a conv or pool reads all belong to one rulebook, built for its kernel."""
    first = 3 if _op_name(node) == _CONV else 1
    pair_input, pair_output, offset_counts, out_indices = node.args[first:first + 4]
    try:
        sources = [_pair_source(node, argument) for argument in (pair_input, pair_output, offset_counts)]
    except ValueError as error:
        raise _refuse(path, node, str(error)) from None
    rulebooks = sorted({source.name for source, _ in sources})
    if len(rulebooks) != 1:
        raise _refuse(path, node, f"reads pair tensors of several rulebooks ({rulebooks}); a layer reads the pairs "
                      "of its own rulebook (its indice_key's) only")
    rulebook = sources[0][0]
    order = tuple(index for _, index in sources)
    kind = rulebook.args[3]
    if order == (1, 2, 3):  # forward: the rulebook's output sites (a subm rulebook's are its input sites)
        expected_sites = {rulebook.args[0]} if kind == "subm" else set()
        expected_sites |= {user for user in rulebook.users if user.target is operator.getitem and user.args[1] == 0}
    elif order == (2, 1, 3) and _op_name(node) == _CONV and kind == "regular":  # an inverse conv: read backwards
        expected_sites = {rulebook.args[0]}
    else:
        raise _refuse(path, node, f"reads the outputs {list(order)} of {rulebook.name!r} (a {kind} rulebook) as "
                      "(pair_input, pair_output, offset_counts); expected [1, 2, 3], or [2, 1, 3] for the inverse "
                      "of a regular conv")
    if out_indices not in expected_sites:
        shown = out_indices.name if isinstance(out_indices, torch.fx.Node) else repr(out_indices)
        raise _refuse(path, node, f"writes onto the sites {shown!r}, which are not the output sites of the rulebook "
                      f"{rulebook.name!r} whose pairs it reads")
    if kernels[rulebook] != kernel:
        raise _refuse(path, node, f"has kernel_size {list(kernel)} but reads the pairs of {rulebook.name!r}, built "
                      f"for kernel_size {list(kernels[rulebook])}; expected the same kernel")


def _tensor_shape(program: torch.export.ExportedProgram, node: Any) -> Optional[tuple[int, ...]]:
    """The stored shape of a parameter or buffer argument, else its traced shape (None when unknown)."""
    if not isinstance(node, torch.fx.Node):
        return None
    signature = program.graph_signature
    target = signature.inputs_to_parameters.get(node.name) or signature.inputs_to_buffers.get(node.name)
    if target is not None and target in program.state_dict:
        return tuple(program.state_dict[target].shape)
    value = node.meta.get("val")
    shape = getattr(value, "shape", None)
    return _ints(list(shape)) if shape is not None else None


def _check_conv(path: str, program: torch.export.ExportedProgram, node: torch.fx.Node,
                kernels: dict[torch.fx.Node, tuple[int, ...]]) -> None:
    _, weight, bias, *_, kernel_size, groups = node.args
    kernel = _ints(kernel_size)
    if kernel is None or not kernel or min(kernel) < 1:
        raise _refuse(path, node, f"has kernel_size {kernel_size!r}; expected a list of positive ints")
    shape = _tensor_shape(program, weight)
    if shape is not None:
        if len(shape) != len(kernel) + 2 or shape[1:-1] != kernel:
            raise _refuse(path, node, f"has kernel_size {list(kernel)} and a weight of shape {list(shape)}; expected "
                          f"a weight [out_channels, {', '.join(map(str, kernel))}, in_channels // groups]")
        if isinstance(groups, int) and (groups < 1 or shape[0] % groups):
            raise _refuse(path, node, f"has groups={groups}; expected a positive divisor of the weight's "
                          f"{shape[0]} output channels")
        bias_shape = _tensor_shape(program, bias)
        if bias_shape is not None and bias_shape != (shape[0],):
            raise _refuse(path, node, f"has a bias of shape {list(bias_shape)}; expected [{shape[0]}], one entry "
                          "per output channel of its weight")
    _check_pairs(path, node, kernel, kernels)


def _check_pool(path: str, node: torch.fx.Node, kernels: dict[torch.fx.Node, tuple[int, ...]]) -> None:
    kernel_size, mode = node.args[-2:]
    if mode not in _POOL_MODES:
        raise _refuse(path, node, f"has mode {mode!r}; expected one of {_POOL_MODES}")
    kernel = _ints(kernel_size)
    if kernel is None or not kernel or min(kernel) < 1:
        raise _refuse(path, node, f"has kernel_size {kernel_size!r}; expected a list of positive ints")
    _check_pairs(path, node, kernel, kernels)


def check_program(program: torch.export.ExportedProgram, path: str) -> None:
    """Checks every sparsecore export op of ``program`` (see the module docstring).

    Args:
        program: a program as ``torch.export.load`` returns it.
        path: the file it came from, for the messages.

    Raises:
        ValueError: naming the first node whose arguments are inconsistent, and the argument.
    """
    kernels: dict[torch.fx.Node, tuple[int, ...]] = {}
    grids: dict[Any, tuple[tuple[int, ...], str]] = {}
    input_grid = _example_grid(program)
    for node in program.graph.nodes:
        name = _op_name(node)
        if name == _RULEBOOK:
            kernels[node], geometry = _check_rulebook(path, node)
            _check_grid(path, node, geometry, grids, input_grid)
        elif name == _CONV:
            _check_conv(path, program, node, kernels)
        elif name == _POOL:
            _check_pool(path, node, kernels)
