"""Records what a sparsecore.torch model computes on one input, for the ONNX exporter.

The recorder needs no ``torch.fx`` support from the model: it runs the model
once and watches it through three windows, all removed when it finishes:

- forward hooks on every submodule: each sparse conv is recorded whole (its
  own internal torch calls are not), pooling and table layers the format has
  no node for are refused by type, and the innermost running module is known
  for error messages;
- a ``TorchFunctionMode`` that sees every torch call touching a recorded
  feature tensor: ``+`` (``Add``), ReLU (``Relu``), eval ``batch_norm``,
  ``view`` / ``reshape`` (``Reshape``), ``permute`` (``Transpose``) and
  aliasing calls (``contiguous``, ``float``, ...); any other call on recorded
  data (a custom layer's arithmetic, ``torch.cat``, ...) or a conversion of it to
  a Python value (data-dependent control flow: ``if x.sum() > 0``) is an
  `ExportError` naming the module and its type;
- ``SparseConvTensor.dense`` wrapped for the duration of the run (``ScatterDense``).

Values are identified as NVIDIA's exporter does: a `SparseConvTensor` by its
features tensor.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .conv import SparseConvolution
from .pool import SparseAvgPool, SparseGlobalAvgPool, SparseGlobalMaxPool, SparseMaxPool
from .tables import AddTableMisaligned, JoinTable
from .tensor import SparseConvTensor

__all__ = ["ExportError", "ConvRecord", "OpRecord", "BatchNormRecord", "Trace", "record"]

_REFUSED = {
    SparseMaxPool: "libspconv's format has no pooling node (use a strided SparseConv3d instead)",
    SparseAvgPool: "libspconv's format has no pooling node (use a strided SparseConv3d instead)",
    SparseGlobalMaxPool: "libspconv's format has no global pooling node",
    SparseGlobalAvgPool: "libspconv's format has no global pooling node",
    JoinTable: "libspconv's format has no channel concatenation node",
    AddTableMisaligned: "libspconv's Add needs both inputs on the same sites (use AddTable / '+')",
}
_ADD = {"add", "__add__", "__radd__", "__iadd__", "add_"}
_RELU = {"relu", "relu_"}
_RESHAPE = {"view", "reshape"}
_ALIAS = {"contiguous", "float", "half", "to", "detach", "clone", "type_as", "requires_grad_"}
_TO_PYTHON = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "__complex__", "numpy"}


class ExportError(ValueError):
    """The model cannot be written in libspconv's format; the message names the module and its type."""


@dataclass(frozen=True)
class ConvRecord:
    """One sparse conv call: the module, its values, and the traced shapes."""

    module_name: str
    module: SparseConvolution
    input: str
    output: str
    add_input: Optional[str]
    input_shape: tuple[int, int]
    output_shape: tuple[int, int]
    input_spatial_shape: tuple[int, ...]
    output_spatial_shape: tuple[int, ...]


@dataclass(frozen=True)
class BatchNormRecord:
    """An eval-mode ``batch_norm`` on a recorded feature tensor (to be folded into the conv before it)."""

    module_name: str
    input: str
    output: str
    mean: torch.Tensor
    variance: torch.Tensor
    weight: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    eps: float


@dataclass(frozen=True)
class OpRecord:
    """``add`` (two inputs), ``relu``, ``dense`` (attrs: spatial shape), ``reshape`` / ``transpose`` (attrs: dims).

    ``output_shape`` is the traced shape of the output (``[N, C]`` for sparse values).
    """

    kind: str
    module_name: str
    inputs: tuple[str, ...]
    output: str
    attrs: tuple[int, ...]
    output_shape: tuple[int, ...]


@dataclass(frozen=True)
class Trace:
    """What one run recorded: the input value, the records in call order, the output value."""

    input: str
    input_shape: tuple[int, int]
    records: tuple[Any, ...]
    output: str
    output_is_dense: bool
    output_shape: tuple[int, ...]


def _describe(name: str, module: nn.Module) -> str:
    return f"module {name or '<root>'!r} ({type(module).__module__}.{type(module).__qualname__})"


def _flatten(values: Any) -> Iterator[Any]:
    if isinstance(values, (list, tuple)):
        for value in values:
            yield from _flatten(value)
    elif isinstance(values, dict):
        for value in values.values():
            yield from _flatten(value)
    else:
        yield values


def _dims(args: tuple) -> tuple[int, ...]:
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        args = tuple(args[0])
    return tuple(int(d) for d in args)


class _Recorder(TorchFunctionMode):
    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.names = names
        self.values: dict[int, str] = {}
        self.keep: list[Any] = []  # holds recorded tensors so that their ids are not reused
        self.records: list[Any] = []
        self.stack: list[tuple[str, nn.Module]] = []
        self.quiet = 0  # > 0 inside a layer recorded whole (a conv, dense())
        self.tainted: dict[int, str] = {}  # results of calls with no libspconv node -> "<module> calls <op>"
        self.counter = 0

    # values ---------------------------------------------------------------------------
    def new(self, tensor: torch.Tensor) -> str:
        name = f"v{self.counter}"
        self.counter += 1
        self.values[id(tensor)] = name
        self.keep.append(tensor)
        return name

    def name_of(self, tensor: Any) -> Optional[str]:
        if isinstance(tensor, SparseConvTensor):
            tensor = tensor.features
        return self.values.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None

    def where(self) -> str:
        return _describe(*self.stack[-1]) if self.stack else "the model's forward"

    # module hooks ------------------------------------------------------------------------
    def pre_hook(self, module: nn.Module, args: tuple) -> None:
        name = self.names[id(module)]
        self.stack.append((name, module))
        if self.quiet:
            return
        for refused, reason in _REFUSED.items():
            if isinstance(module, refused):
                raise ExportError(f"{_describe(name, module)} cannot be exported: {reason}")
        if isinstance(module, SparseConvolution):
            self.quiet += 1

    def post_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        name, _ = self.stack.pop()
        if isinstance(module, SparseConvolution) and self.quiet == 1:
            self.quiet -= 1
            self.conv(name, module, args, kwargs, output)

    def conv(self, name: str, module: SparseConvolution, args: tuple, kwargs: dict, output: Any) -> None:
        x = args[0] if args else kwargs.get("input")
        add = args[1] if len(args) > 1 else kwargs.get("add_input")
        source = self.require(x, _describe(name, module))
        added = None if add is None else self.require(add, f"{_describe(name, module)} (its add_input)")
        self.records.append(ConvRecord(
            name, module, source, self.new(output.features), added, tuple(x.features.shape),
            tuple(output.features.shape), tuple(x.spatial_shape), tuple(output.spatial_shape)))

    # dense() --------------------------------------------------------------------------
    def dense(self, original: Any, tensor: SparseConvTensor, channels_first: bool = True) -> torch.Tensor:
        if self.quiet:
            return original(tensor, channels_first)
        source = self.require(tensor, f"{self.where()} (.dense())")
        self.quiet += 1
        try:
            result = original(tensor, channels_first)
        finally:
            self.quiet -= 1
        channels = int(tensor.features.shape[1])
        shape = (tensor.batch_size, channels, *tensor.spatial_shape)
        if channels_first:
            self.records.append(OpRecord("dense", self.where(), (source,), self.new(result),
                                         tuple(tensor.spatial_shape), shape))
        else:  # ScatterDense gives NC*spatial; channels last is a Transpose of it
            middle = f"v{self.counter}"
            self.counter += 1
            self.records.append(OpRecord("dense", self.where(), (source,), middle, tuple(tensor.spatial_shape), shape))
            order = (0, *range(2, len(shape)), 1)
            self.records.append(OpRecord("transpose", self.where(), (middle,), self.new(result), order,
                                         tuple(result.shape)))
        return result

    # torch calls --------------------------------------------------------------------------
    def taint(self, result: Any, origin: str) -> Any:
        for value in _flatten(result):
            if isinstance(value, torch.Tensor):
                self.tainted[id(value)] = origin
                self.keep.append(value)
        return result

    def unsupported(self, origin: str) -> ExportError:
        return ExportError(
            f"{origin} on recorded features; libspconv's format has no node for it (it has SparseConvolution, "
            "Add, Relu, ScatterDense, Reshape and Transpose). Custom layers cannot be exported; rewrite the "
            "layer with sparse convs, BatchNorm, ReLU and '+'"
        )

    def require(self, value: Any, reader: str) -> str:
        """The recorded name of ``value``; an `ExportError` naming where it came from otherwise."""
        tensor = value.features if isinstance(value, SparseConvTensor) else value
        name = self.name_of(tensor)
        if name is not None:
            return name
        if isinstance(tensor, torch.Tensor) and id(tensor) in self.tainted:
            raise self.unsupported(self.tainted[id(tensor)])
        raise ExportError(
            f"{reader} reads a tensor the exporter did not record (not derived from the model input, or made "
            "by code the recorder cannot see). Build it from the model input through sparse convs, "
            "BatchNorm, ReLU and '+' only"
        )

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if self.quiet:
            return func(*args, **kwargs)
        flat = [value for value in _flatten((args, kwargs)) if isinstance(value, torch.Tensor)]
        recorded = [(value, self.values[id(value)]) for value in flat if id(value) in self.values]
        tainted = [self.tainted[id(value)] for value in flat if id(value) in self.tainted]
        if not recorded and not tainted:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if name in _TO_PYTHON:
            origin = f" (computed by {tainted[0].split(' calls ')[-1]} in {tainted[0].split(' calls ')[0]})" \
                if tainted else ""
            raise ExportError(
                f"{self.where()} turns recorded features into a Python value ({name}{origin}): data-dependent "
                "control flow or arithmetic cannot be written as a static graph. Remove the branch (or "
                "move it out of the exported model)"
            )
        result = func(*args, **kwargs)
        if not any(isinstance(value, torch.Tensor) for value in _flatten(result)):
            return result  # shape, dtype, device queries
        if tainted:  # an unsupported result flows on: the error comes where it is used
            return self.taint(result, tainted[0])
        if name in _ADD:
            return self.add(func, args, result)
        if name in _RELU:
            self.records.append(OpRecord("relu", self.where(), (recorded[0][1],), self.new(result), (),
                                         tuple(result.shape)))
            return result
        if func is torch.nn.functional.batch_norm:
            return self.batch_norm(args, kwargs, recorded[0][1], result)
        if name in _RESHAPE or name == "permute":
            kind = "transpose" if name == "permute" else "reshape"
            self.records.append(OpRecord(kind, self.where(), (recorded[0][1],), self.new(result), _dims(args[1:]),
                                         tuple(result.shape)))
            return result
        if name in _ALIAS and isinstance(result, torch.Tensor) and result.shape == args[0].shape:
            self.values[id(result)] = recorded[0][1]
            self.keep.append(result)
            return result
        return self.taint(result, f"{self.where()} calls {name}")

    def add(self, func: Any, args: tuple, result: torch.Tensor) -> torch.Tensor:
        operands = [self.require(value, f"{self.where()} (an add)") for value in args[:2]]
        self.records.append(OpRecord("add", self.where(), tuple(operands), self.new(result), (), tuple(result.shape)))
        return result

    def batch_norm(self, args: tuple, kwargs: dict, source: str, result: torch.Tensor) -> torch.Tensor:
        names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
        bound = dict(zip(names, args))
        bound.update(kwargs)
        if bound.get("training", False) or bound.get("running_mean") is None:
            raise ExportError(f"{self.where()} normalises with batch statistics (training mode or "
                              "track_running_stats=False); only eval-mode BatchNorm can be folded")
        self.records.append(BatchNormRecord(
            self.where(), source, self.new(result), bound["running_mean"].detach(), bound["running_var"].detach(),
            None if bound.get("weight") is None else bound["weight"].detach(),
            None if bound.get("bias") is None else bound["bias"].detach(), float(bound.get("eps", 1e-5))))
        return result


def _input_features(example_input: Any) -> torch.Tensor:
    for value in _flatten(example_input):
        if isinstance(value, SparseConvTensor):
            return value.features
    raise ExportError(
        f"example_input must be a SparseConvTensor (or a tuple of arguments holding one), got "
        f"{type(example_input).__name__}"
    )


@contextlib.contextmanager
def _patched_dense(recorder: _Recorder) -> Iterator[None]:
    original = SparseConvTensor.dense

    def dense(tensor: SparseConvTensor, channels_first: bool = True) -> torch.Tensor:
        return recorder.dense(original, tensor, channels_first)

    SparseConvTensor.dense = dense
    try:
        yield
    finally:
        SparseConvTensor.dense = original


def record(model: nn.Module, example_input: Any) -> Trace:
    """Runs ``model`` once on ``example_input`` (under ``torch.no_grad``) and returns what it computed.

    Raises:
        ExportError: a module in training mode, an empty example input, a refused
            module, an operation with no libspconv node, data-dependent control
            flow, or an output that is not one sparse / dense tensor.
    """
    training = [(name, module) for name, module in model.named_modules() if module.training]
    if training:
        raise ExportError(f"{_describe(*training[0])} is in training mode; call model.eval() before exporting "
                          "(BatchNorm is folded with its running statistics)")
    features = _input_features(example_input)
    if features.shape[0] == 0:
        raise ExportError("example_input has no active sites; export from a real, non-empty input "
                          "(layers skipped on empty inputs would be missing from the graph)")
    names = {id(module): name for name, module in model.named_modules()}
    recorder = _Recorder(names)
    input_name = recorder.new(features)
    handles = []
    try:
        for module in model.modules():
            handles.append(module.register_forward_pre_hook(recorder.pre_hook))
            handles.append(module.register_forward_hook(recorder.post_hook, with_kwargs=True))
        with torch.no_grad(), _patched_dense(recorder), recorder:
            args = example_input if isinstance(example_input, tuple) else (example_input,)
            output = model(*args)
    finally:
        for handle in handles:
            handle.remove()
    if isinstance(output, SparseConvTensor):
        value, dense = output.features, False
    elif isinstance(output, torch.Tensor):
        value, dense = output, True
    else:
        raise ExportError(f"the model returned a {type(output).__name__}; libspconv graphs have one output, "
                          "a SparseConvTensor or a dense tensor")
    name = recorder.require(value, "the model's output")
    return Trace(input_name, tuple(features.shape), tuple(recorder.records), name, dense, tuple(value.shape))
