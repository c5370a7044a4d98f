"""``torch.library`` custom ops declared from table entries: one `OpSpec` is one op.

An entry names the op, gives its schema, the core call that computes it, the
shapes of its outputs (the fake kernel ``torch.compile``, ``opcheck`` and
``torch.export`` trace with) and, for a differentiable op, its `Backward`.
`declare_ops` turns entries into ``torch.ops.sparsecore.<name>``:

- the real kernel runs inside `core_context` (torch's stream and memory pool on
  CUDA), hands every tensor argument to the core as a NumPy / CuPy view named
  after the argument (bfloat16 computed in float32), calls ``compute`` with the
  arguments as attributes, and returns the results as torch tensors in the
  dtype each output names;
- the fake kernel allocates empty outputs of the shapes ``shapes`` returns;
- the autograd registration saves the tensors the backward names, records the
  other arguments and every tensor argument's shape and dtype, marks integer
  outputs non-differentiable, and returns the backward's gradients in argument
  order.

Nothing here knows a particular op: the entries live where the ops are used
(`sparsecore.torch.ops`, `sparsecore.torch.exportable`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from ._convert import core_context, core_float_view, to_torch

__all__ = ["Output", "Backward", "OpSpec", "declare_ops", "NAMESPACE"]

#: The ``torch.library`` namespace of every sparsecore op (``torch.ops.sparsecore``).
NAMESPACE = "sparsecore"

_SCHEMA = re.compile(r"^\s*\((.*)\)\s*->\s*\S.*$", re.DOTALL)
_ARGUMENT = re.compile(r"^\s*([A-Za-z_][\w\[\]?]*)\s+([A-Za-z_]\w*)\s*$")


@dataclass(frozen=True)
class Output:
    """One result of an op.

    Attributes:
        name: what a `Backward` calls it when it saves it.
        dtype: the name of a tensor argument whose dtype the result takes (the
            core computes bfloat16 in float32; the result is cast back), or a
            fixed ``torch.dtype`` (row indices, argmax, counts).
    """

    name: str
    dtype: Union[str, torch.dtype]


@dataclass(frozen=True)
class Backward:
    """How an op's inputs get their gradients.

    Attributes:
        saves: names of the tensor arguments and outputs the backward reads
            (saved with ``ctx.save_for_backward``).
        gradients: ``(saved, grad_output) -> {argument name: gradient}``.
            ``saved`` holds the saved tensors and every non-tensor argument as
            attributes, plus ``shapes`` and ``dtypes``: dicts of every tensor
            argument's shape and dtype (``None`` for an absent optional tensor).
            ``grad_output`` is the (contiguous) gradient of the first output;
            the other outputs are integer and not differentiable. Arguments left
            out of the dict get no gradient.
    """

    saves: tuple[str, ...]
    gradients: Callable[[SimpleNamespace, Tensor], Mapping[str, Optional[Tensor]]]


@dataclass(frozen=True)
class OpSpec:
    """One custom op: ``torch.ops.sparsecore.<name>``.

    Attributes:
        name: the op name in the ``sparsecore`` namespace.
        schema: its ``torch.library`` schema, e.g. ``"(Tensor features, SymInt
            num_output) -> Tensor"``; the argument names are the attribute names
            ``compute``, ``shapes`` and the backward read.
        outputs: one `Output` per result, in schema order.
        compute: ``(arguments) -> result or tuple of results``, core arrays;
            tensor arguments arrive as core views, the others unchanged.
        shapes: ``(arguments) -> one shape per output``, from the torch (fake)
            arguments; it may ask ``torch.library.get_ctx()`` for data-dependent sizes.
        backward: the gradient rule, or ``None`` for an op autograd does not differentiate.
    """

    name: str
    schema: str
    outputs: tuple[Output, ...]
    compute: Callable[[SimpleNamespace], Any]
    shapes: Callable[[SimpleNamespace], Sequence[Sequence[Any]]]
    backward: Optional[Backward] = None

    @property
    def argument_names(self) -> tuple[str, ...]:
        """The argument names, in schema order."""
        return tuple(name for _, name in _parse_arguments(self.schema))


def _parse_arguments(schema: str) -> list[tuple[str, str]]:
    match = _SCHEMA.match(schema)
    if match is None:
        raise ValueError(f"op schema {schema!r} must read '(Type name, ...) -> Type' or '-> (Type, ...)'")
    inside = match.group(1)
    arguments = []
    for piece in filter(str.strip, inside.split(",")):
        match = _ARGUMENT.match(piece)
        if match is None:
            raise ValueError(f"op schema {schema!r}: cannot read the argument {piece.strip()!r} (write 'Type name')")
        arguments.append((match.group(1), match.group(2)))
    return arguments


def _device_of(values: Sequence[Any]) -> torch.device:
    return next(value.device for value in values if isinstance(value, Tensor))


def _output_dtype(output: Output, arguments: Mapping[str, Any]) -> torch.dtype:
    return arguments[output.dtype].dtype if isinstance(output.dtype, str) else output.dtype


def _kernel(spec: OpSpec, names: tuple[str, ...]) -> Callable[..., Any]:
    def kernel(*values: Any) -> Any:
        arguments = dict(zip(names, values))
        with core_context(_device_of(values)):
            views = {name: core_float_view(value, name) if isinstance(value, Tensor) else value
                     for name, value in arguments.items()}
            results = spec.compute(SimpleNamespace(**views, torch_arguments=arguments))
            if len(spec.outputs) == 1:
                results = (results,)
            tensors = tuple(to_torch(result, _output_dtype(output, arguments))
                            for output, result in zip(spec.outputs, results))
        return tensors[0] if len(tensors) == 1 else tensors

    kernel.__name__ = spec.name
    return kernel


def _fake(spec: OpSpec, names: tuple[str, ...]) -> Callable[..., Any]:
    def fake(*values: Any) -> Any:
        arguments = dict(zip(names, values))
        reference = next(value for value in values if isinstance(value, Tensor))
        shapes = spec.shapes(SimpleNamespace(**arguments))
        tensors = tuple(reference.new_empty(tuple(shape), dtype=_output_dtype(output, arguments))
                        for output, shape in zip(spec.outputs, shapes))
        return tensors[0] if len(tensors) == 1 else tensors

    return fake


def _register_autograd(op: Any, spec: OpSpec, names: tuple[str, ...]) -> None:
    backward = spec.backward
    output_names = tuple(output.name for output in spec.outputs)

    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        outputs = output if isinstance(output, tuple) else (output,)
        arguments = dict(zip(names, inputs))
        named = {**arguments, **dict(zip(output_names, outputs))}
        ctx.save_for_backward(*(named[name] for name in backward.saves))
        ctx.static = {name: value for name, value in arguments.items()
                      if value is not None and not isinstance(value, Tensor)}
        ctx.shapes = {name: None if value is None else tuple(value.shape) for name, value in arguments.items()
                      if value is None or isinstance(value, Tensor)}
        ctx.dtypes = {name: None if value is None else value.dtype for name, value in arguments.items()
                      if value is None or isinstance(value, Tensor)}
        integer = [tensor for tensor in outputs if not tensor.dtype.is_floating_point]
        if integer:
            ctx.mark_non_differentiable(*integer)

    def gradient(ctx: Any, grad_output: Tensor, *_integer_outputs: Any) -> tuple:
        saved = SimpleNamespace(**ctx.static, **dict(zip(backward.saves, ctx.saved_tensors)), shapes=ctx.shapes,
                                dtypes=ctx.dtypes)
        grads = backward.gradients(saved, grad_output.contiguous())
        return tuple(grads.get(name) for name in names)

    op.register_autograd(gradient, setup_context=setup_context)


def declare_ops(specs: Sequence[OpSpec], namespace: str = NAMESPACE) -> dict[str, Any]:
    """Registers every entry as ``torch.ops.<namespace>.<name>``; returns the op objects by name.

    Args:
        specs: the table.
        namespace: the ``torch.library`` namespace (`NAMESPACE` for the library's ops).

    Raises:
        ValueError: a backward saving a name that is neither an argument nor an output.
    """
    ops = {}
    for spec in specs:
        names = spec.argument_names
        if spec.backward is not None:
            known = set(names) | {output.name for output in spec.outputs}
            unknown = [name for name in spec.backward.saves if name not in known]
            if unknown:
                raise ValueError(f"op {spec.name}: the backward saves {unknown}, which are neither arguments "
                                 f"{list(names)} nor outputs {[o.name for o in spec.outputs]}")
        op = torch.library.custom_op(f"{namespace}::{spec.name}", _kernel(spec, names), mutates_args=(),
                                     schema=spec.schema)
        op.register_fake(_fake(spec, names))
        if spec.backward is not None:
            _register_autograd(op, spec, names)
        ops[spec.name] = op
    return ops
