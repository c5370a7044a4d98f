"""``torch.fx`` tracing of models built from sparsecore.torch layers.

A `SparseConvTensor` flows through an fx graph as one value: the sparse layers
(convolutions, pools, `ToDense`, `SparseReLU`, `SparseIdentity`,
`SparseBatchNorm`, ...) are *leaf modules*, recorded as ``call_module`` nodes
and run eagerly when the graph runs, while ``x + y`` on two tensors,
``.features``, ``.replace_feature(...)``, ``.dense()`` and the construction
``SparseConvTensor(features, indices, shape, batch_size)`` are ordinary graph
nodes. Plain ``torch.fx.symbolic_trace`` works, because each sparse module
declares itself a leaf to whichever tracer calls it (`FxLeafModule`): torch's
default tracer only treats ``torch.nn`` modules as leaves.

`SparseSequential` is a leaf too for plain tracers (it then runs eagerly, with
its rule of applying plain modules such as ``nn.BatchNorm1d`` to the features
and skipping them on empty inputs). The quantization tracer of
``torch.ao.quantization`` (``prepare_fx`` / ``prepare_qat_fx``) and a
`SparseTracer` built with ``trace_sequential=True`` trace *into* it instead,
so that the conv -> bn -> relu chains inside become separate nodes the
quantization passes can fuse; the plain modules are then recorded as applied
to the `SparseConvTensor` itself, which `SparseConvTensor.__torch_function__`
turns into "apply to the features".

Example::

    import torch.fx
    graph_module = torch.fx.symbolic_trace(model)      # leaves: sparse layers
    graph_module = sparse_symbolic_trace(model, trace_sequential=True)
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.fx
from torch import nn

__all__ = ["FxLeafModule", "SparseTracer", "sparse_symbolic_trace", "active_tracer", "traces_into_containers",
           "ProxyableSparseMeta"]


def active_tracer(args: tuple, kwargs: dict) -> Optional[torch.fx.Tracer]:
    """The fx tracer of the first ``torch.fx.Proxy`` among the call's arguments, or None (eager call)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.fx.Proxy):
            return value.tracer
        if isinstance(value, (tuple, list)):
            for item in value:
                if isinstance(item, torch.fx.Proxy):
                    return item.tracer
    return None


class ProxyableSparseMeta(torch.fx.ProxyableClassMeta):
    """``torch.fx.ProxyableClassMeta`` without its per-construction ``is_fx_tracing`` call (which logs a
    warning in torch 2.13 on every eager construction): constructing with a traced argument records a
    ``call_function`` node; otherwise the class is built as usual."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        tracer = active_tracer(args, kwargs)
        if tracer is not None:
            return tracer.create_proxy("call_function", cls, args, kwargs)
        return type.__call__(cls, *args, **kwargs)


def traces_into_containers(tracer: torch.fx.Tracer) -> bool:
    """True when ``tracer`` records the modules inside a `SparseSequential` rather than the container.

    That is the quantization tracer of ``torch.ao.quantization`` (fusion needs the
    individual conv, bn and relu nodes) and a `SparseTracer` made with
    ``trace_sequential=True``.
    """
    explicit = getattr(tracer, "trace_sequential", None)
    if explicit is not None:
        return bool(explicit)
    from torch.ao.quantization.fx.tracer import QuantizationTracer

    return isinstance(tracer, QuantizationTracer)


class FxLeafModule:
    """Mixin for ``nn.Module`` classes: under any ``torch.fx`` tracer the module is one ``call_module`` node.

    Placed before ``nn.Module`` in the bases. An eager call (no ``torch.fx.Proxy``
    among the arguments) is the ordinary ``nn.Module.__call__`` with its hooks.
    Subclasses may override `fx_is_leaf` (`SparseSequential` does).
    """

    def fx_is_leaf(self, tracer: torch.fx.Tracer) -> bool:
        """Whether ``tracer`` records this module as one node.

        True when the class's ``forward`` is sparsecore's own (every sparse layer, and
        user subclasses that only change the constructor), False for a user module
        deriving from `SparseModule` with its own ``forward`` (a residual block): that
        is traced through, as ``torch.fx`` traces through any user module.
        """
        return _forward_is_library_code(type(self))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tracer = active_tracer(args, kwargs)
        if tracer is None:
            return super().__call__(*args, **kwargs)
        if self.fx_is_leaf(tracer):
            return tracer.call_module(self, _leaf_forward(tracer, self), args, kwargs)
        try:
            return super().__call__(*args, **kwargs)
        except torch.fx.proxy.TraceError as error:
            if _NAMED_MARK in str(error):
                raise
            path = tracer.path_of_module(self)
            raise torch.fx.proxy.TraceError(
                f"{_NAMED_MARK} {path!r} ({type(self).__name__}): {error}. Its forward cannot be traced "
                f"symbolically (control flow or Python values computed from tensors). Either rewrite it, or keep "
                f"it whole as a leaf: for quantization add {type(self).__name__} to "
                "prepare_custom_config.non_traceable_module_classes; with SparseTracer pass it in "
                "leaf_module_classes") from error


_NAMED_MARK = "while tracing module"


def _forward_is_library_code(cls: type) -> bool:
    forward = getattr(cls, "forward", None)
    module = getattr(forward, "__module__", None) or ""
    return module.startswith("sparsecore.") or module.startswith("torch.")


def _leaf_forward(tracer: torch.fx.Tracer, module: nn.Module) -> Callable[..., Any]:
    def emit(*args: Any, **kwargs: Any) -> torch.fx.Proxy:
        return tracer.create_proxy("call_module", tracer.path_of_module(module), args, kwargs)

    return emit


class SparseTracer(torch.fx.Tracer):
    """A ``torch.fx.Tracer`` for sparsecore models.

    Args:
        trace_sequential: record the modules inside each `SparseSequential`
            (needed to fuse conv -> bn -> relu) instead of the container itself.
        leaf_module_classes: further module classes to keep as leaves.
        **kwargs: passed to ``torch.fx.Tracer``.
    """

    def __init__(self, trace_sequential: bool = False,
                 leaf_module_classes: tuple[type, ...] = (), **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trace_sequential = trace_sequential
        self.leaf_module_classes = tuple(leaf_module_classes)

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, self.leaf_module_classes):
            return True
        if isinstance(m, FxLeafModule):
            return m.fx_is_leaf(self)
        return super().is_leaf_module(m, module_qualified_name)


def sparse_symbolic_trace(root: nn.Module, trace_sequential: bool = False,
                          concrete_args: Optional[dict[str, Any]] = None) -> torch.fx.GraphModule:
    """``torch.fx.symbolic_trace`` with a `SparseTracer`.

    Args:
        root: the model.
        trace_sequential: record the modules inside `SparseSequential` containers.
        concrete_args: as for ``torch.fx.symbolic_trace``.

    Returns:
        A ``torch.fx.GraphModule`` computing what ``root`` computes.
    """
    tracer = SparseTracer(trace_sequential=trace_sequential)
    graph = tracer.trace(root, concrete_args)
    name = root.__class__.__name__ if isinstance(root, nn.Module) else root.__name__
    return torch.fx.GraphModule(tracer.root, graph, name)
