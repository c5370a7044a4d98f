"""The operators a ``.pt2`` program from elsewhere may call, and the sizes its allocations may take.

A ``torch.export`` graph names its operators by string (``"target":
"torch.ops.aten.from_file.default"``), and torch runs whatever it names: a file
could read, overwrite or create files (``aten.from_file(path, shared=True)``
then ``aten.fill_``), write into memory it did not allocate (in-place ops on a
parameter or input), or draw from the RNG. `check_targets` reads the graph's
JSON before torch deserializes it and refuses, naming the node, any operator
outside `ALLOWED`: sparsecore's three export ops and the pure (functional,
side-effect free, no I/O, no RNG) aten ops its exports produce, found by
exporting the project's own test networks (convs, BatchNorm, ReLU, adds,
``.dense()``, views, pools; tests/test_torch_export.py), plus the elementwise
and shape ops such models commonly add (listed in `_PURE_EXTRA`). A node
holding a subgraph (a higher-order op) is refused with it.

`check_allocations` then reads the deserialized graph: every node whose output
has sizes the file fixes (plain ints, no symbol from the input) and every
``new_zeros``/``zeros``/``full``-like node's ``size`` argument is held to the
memory budget (`sparsecore.memory_budget.check_bytes`) at load, so an
``aten.new_zeros`` of 11.8 GB is refused naming the node instead of
allocating when the module first runs. Sizes that grow with the input (the
number of sites) are bounded when the module runs, by the core's budget.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch

from sparsecore.memory_budget import check_bytes

__all__ = ["ALLOWED", "check_targets", "check_allocations"]

_SPARSECORE = ("torch.ops.sparsecore.export_rulebook.default", "torch.ops.sparsecore.export_conv.default",
               "torch.ops.sparsecore.export_pool.default")
# what exporting tests/test_torch_export.py's SecondStyle, Residual and Pooled networks calls (torch 2.13)
_PRODUCED = (
    "_operator.getitem", "_operator.ge", "torch.ops.aten._assert_scalar.default",
    "torch.ops.aten._assert_tensor_metadata.default", "torch.ops.aten.add.Tensor",
    "torch.ops.aten.batch_norm.default", "torch.ops.aten.index_put.default", "torch.ops.aten.movedim.int",
    "torch.ops.aten.new_zeros.default", "torch.ops.aten.permute.default", "torch.ops.aten.relu.default",
    "torch.ops.aten.reshape.default", "torch.ops.aten.sym_size.int", "torch.ops.aten.t.default",
    "torch.ops.aten.to.dtype", "torch.ops.aten.to.dtype_layout", "torch.ops.aten.unbind.int",
    "torch.ops.aten.view.default",
)
# pure ops of the same kinds that other sparsecore models' exports (epilogues, heads, comparisons of sizes) use
_PURE_EXTRA = (
    "_operator.le", "_operator.lt", "_operator.gt", "_operator.eq", "_operator.add", "_operator.sub",
    "_operator.mul", "_operator.floordiv",
    "torch.ops.aten.add.Scalar", "torch.ops.aten.sub.Tensor", "torch.ops.aten.sub.Scalar",
    "torch.ops.aten.mul.Tensor", "torch.ops.aten.mul.Scalar", "torch.ops.aten.div.Tensor",
    "torch.ops.aten.div.Scalar", "torch.ops.aten.neg.default", "torch.ops.aten.abs.default",
    "torch.ops.aten.leaky_relu.default", "torch.ops.aten.sigmoid.default", "torch.ops.aten.tanh.default",
    "torch.ops.aten.silu.default", "torch.ops.aten.gelu.default", "torch.ops.aten.hardtanh.default",
    "torch.ops.aten.clamp.default", "torch.ops.aten.maximum.default", "torch.ops.aten.minimum.default",
    "torch.ops.aten._native_batch_norm_legit_no_training.default", "torch.ops.aten.linear.default",
    "torch.ops.aten.addmm.default", "torch.ops.aten.mm.default", "torch.ops.aten.cat.default",
    "torch.ops.aten.clone.default", "torch.ops.aten.contiguous.default", "torch.ops.aten.flatten.using_ints",
    "torch.ops.aten.squeeze.dim", "torch.ops.aten.unsqueeze.default", "torch.ops.aten.transpose.int",
    "torch.ops.aten.slice.Tensor", "torch.ops.aten.select.int", "torch.ops.aten.expand.default",
    "torch.ops.aten.sum.dim_IntList", "torch.ops.aten.mean.dim", "torch.ops.aten.amax.default",
)
#: Every operator a program from elsewhere may call (the serialized target strings).
ALLOWED = frozenset(_SPARSECORE + _PRODUCED + _PURE_EXTRA)
_SIZED = {"torch.ops.aten.new_zeros.default": "size", "torch.ops.aten.new_empty.default": "size",
          "torch.ops.aten.new_full.default": "size", "torch.ops.aten.new_ones.default": "size",
          "torch.ops.aten.expand.default": "size"}


def _fix() -> str:
    return ("export the program again with sparsecore.torch from a model of sparsecore layers and pure torch ops; "
            "load only files you trust with torch.export.load")


def _why(target: str) -> str:
    parts = target.split(".")
    op, overload = (parts[3], parts[4]) if len(parts) == 5 and target.startswith("torch.ops.") else (target, "")
    if any(word in op for word in ("file", "save", "load", "print", "_foreach")):
        return "it reads or writes files or other state outside the program"
    if op.endswith("_") or overload.startswith("out"):
        return "it writes in place into memory the program may not own"
    if any(word in target for word in ("rand", "normal", "bernoulli", "dropout", "seed", "generator")):
        return "it reads or changes the random number generator's state"
    return "it is not one of the pure operators a sparsecore program calls"


def _subgraphs(argument: Any) -> bool:
    """Whether a serialized argument holds a graph (a higher-order op's body)."""
    if isinstance(argument, dict):
        return "as_graph" in argument or any(_subgraphs(value) for value in argument.values())
    if isinstance(argument, list):
        return any(_subgraphs(value) for value in argument)
    return False


def check_targets(where: str, nodes: Iterable[Any]) -> None:
    """Refuses the first serialized node that calls an operator outside `ALLOWED` or holds a subgraph.

    Args:
        where: the file and member, for the message.
        nodes: the graph's serialized nodes (``graph_module.graph.nodes`` of ``models/model.json``).

    Raises:
        ValueError: naming the node, its operator and why it is refused.
    """
    for position, node in enumerate(nodes):
        if not isinstance(node, dict):
            raise ValueError(f"{where}: node {position} is {type(node).__name__}, not a node object; {_fix()}")
        target, name = node.get("target"), node.get("name", f"#{position}")
        if not isinstance(target, str) or target not in ALLOWED:
            raise ValueError(f"{where}: node {name!r} calls {target!r}, which a program from elsewhere may not "
                             f"call ({_why(str(target))}); it is refused before anything runs. sparsecore's "
                             f"load_program runs only sparsecore's ops and pure aten ops "
                             f"(sparsecore.torch.op_allowlist.ALLOWED); {_fix()}")
        if _subgraphs(node.get("inputs")):
            raise ValueError(f"{where}: node {name!r} ({target}) holds a subgraph; {_fix()}")


def _static_numel(sizes: Any) -> int:
    """The element count of sizes that are all plain ints, else -1 (sizes that follow the input)."""
    values = list(sizes)
    if not all(isinstance(value, int) and not isinstance(value, bool) for value in values):
        return -1
    return math.prod(values) if values else 1


def check_allocations(where: str, program: torch.export.ExportedProgram) -> None:
    """Holds every output and allocation of fixed size to the memory budget (see the module docstring).

    Raises:
        ValueError: naming the node, for a size argument that is negative.
        sparsecore.memory_budget.MemoryBudgetError: naming the node and the size, beyond the budget.
    """
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        target = f"torch.ops.{node.target}" if isinstance(node.target, torch._ops.OpOverload) else ""
        checks = []
        value = node.meta.get("val")
        for tensor in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(tensor, torch.Tensor):
                checks.append((_static_numel(tensor.shape), tensor.element_size(), "its output"))
        argument = _SIZED.get(target)
        if argument is not None:
            sizes = node.kwargs.get(argument, node.args[1] if len(node.args) > 1 else ())
            sizes = [size for size in sizes if not (target.endswith("expand.default") and size == -1)]
            if any(isinstance(size, int) and size < 0 for size in sizes):
                raise ValueError(f"{where}: node {node.name!r} ({node.target}) asks for the size {list(sizes)}; "
                                 f"sizes are not negative. {_fix()}")
            if not target.endswith("expand.default"):  # expand allocates nothing; its output is counted above
                itemsize = value.element_size() if isinstance(value, torch.Tensor) else 8
                checks.append((_static_numel(sizes), itemsize, f"its size argument {list(sizes)}"))
        for numel, itemsize, what in checks:
            if numel > 0:
                check_bytes(
                    numel * itemsize, f"{where}: node {node.name!r} ({node.target}) allocating {what} "
                    f"({numel} elements)", "The file fixes this size: it was edited, or made for a machine with "
                    "more memory.")
