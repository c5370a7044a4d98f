"""The feature passes as ``torch.library`` custom ops, with fake kernels and autograd.

Each op takes the features (and weights) as tensors and the rulebook as its
neighbour tables (``output_neighbours`` int32 ``[N_out, K]``; ``input_neighbours``
int32 ``[N_in, K]``, or None for a symmetric, submanifold map: see
`sparsecore.neighbour_map`) plus Python ints (``kernel_size``,
``identity_offset``), and calls the core pass (``sparsecore.conv_forward`` and
friends) on the rulebook those tables stand for (`_rulebook`): no algorithm
lives here, and no host offset starts cross the op boundary. Because they are
custom ops with ``register_fake`` and ``register_autograd`` (not
``autograd.Function``\\ s), ``torch.compile(fullgraph=True)`` traces straight
through them, and ``torch.autograd.gradcheck`` / ``torch.library.opcheck`` apply.

The ops are declared from one table, `OPS`: an entry gives the name, the
schema, the core call, the output shapes of the fake kernel and the backward
(see `sparsecore.torch._op_table`), so a new op is one entry.

Ops (all under the ``sparsecore`` namespace):

============================  ==============================================
``conv_forward``              the convolution (+ bias), any conv kind
``conv_backward``             ``(d features, d weight)``
``max_pool_forward``          ``(out, argmax)`` over a pooling rulebook
``max_pool_backward``         scatter by argmax (global max pool)
``max_pool_window_backward``  gradient of a windowed max pool, summed per input over its windows
``avg_pool_forward``          mean over the active inputs of each window
``avg_pool_backward``
``global_max_pool``           ``(out [B, C], argmax [B, C])``
``global_avg_pool``           ``[B, C]``
``global_avg_pool_backward``
============================  ==============================================

The layers (`sparsecore.torch.layer`) call the ops in `DECLARED` with an
`IndiceData`'s tensors (`IndiceData.op_arguments`).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Sequence

import torch
from torch import Tensor

import sparsecore as sc

from ._op_table import Backward, CoreArguments, OpSpec, Output, declare_ops
from .indice_data import checked_rulebook, library_rulebook

__all__ = [
    "OPS",
    "DECLARED",
    "global_max_pool_features",
    "global_avg_pool_features",
    "get_conv_output_size",
    "get_deconv_output_size",
]


def _rulebook(a: CoreArguments, num_input: int) -> sc.Rulebook | sc.PairMap:
    """The core rulebook an op's neighbour tensors stand for.

    The library's own `sparsecore.Rulebook` when the tensors are an `IndiceData`'s untouched
    tables and every other argument agrees (`library_rulebook`: the tensors are never converted);
    else the tables as core views, checked whole (`checked_rulebook`).
    """
    tensors = a.torch_arguments
    known = library_rulebook(tensors["output_neighbours"], tensors["input_neighbours"])
    kernel_size = tuple(int(k) for k in tensors["kernel_size"])
    identity_offset = int(tensors["identity_offset"])
    if (known is not None and known.num_input == int(num_input) and tuple(known.kernel_size) == kernel_size
            and known.identity_offset == identity_offset):
        return known
    return checked_rulebook(a.output_neighbours, a.input_neighbours, num_input, kernel_size, identity_offset)


def _num_input(a: CoreArguments | SimpleNamespace) -> Any:
    """The input rows of an op's map (the input side's, or the output side's for a symmetric map), read from
    the torch arguments (no conversion)."""
    tensors = a.torch_arguments if isinstance(a, CoreArguments) else vars(a)
    side = tensors["input_neighbours"]
    return (tensors["output_neighbours"] if side is None else side).shape[0]


def _map_arguments(saved: SimpleNamespace) -> tuple:
    return saved.output_neighbours, saved.input_neighbours, list(saved.kernel_size), saved.identity_offset


def _conv_gradients(saved: SimpleNamespace, grad_output: Tensor) -> dict[str, Tensor]:
    grad_features, grad_weight = DECLARED["conv_backward"](grad_output, saved.features, saved.weight,
                                                           *_map_arguments(saved), saved.groups)
    grads = {"features": grad_features, "weight": grad_weight}
    if saved.dtypes["bias"] is not None:
        grads["bias"] = grad_output.sum(0).to(saved.dtypes["bias"])
    return grads


def _max_pool_gradients(saved: SimpleNamespace, grad_output: Tensor) -> dict[str, Tensor]:
    return {"features": DECLARED["max_pool_window_backward"](grad_output, saved.argmax, *_map_arguments(saved))}


def _avg_pool_gradients(saved: SimpleNamespace, grad_output: Tensor) -> dict[str, Tensor]:
    return {"features": DECLARED["avg_pool_backward"](grad_output, *_map_arguments(saved))}


def _global_max_gradients(saved: SimpleNamespace, grad_output: Tensor) -> dict[str, Tensor]:
    return {"features": DECLARED["max_pool_backward"](grad_output, saved.argmax,
                                                               saved.shapes["features"][0])}


def _global_avg_gradients(saved: SimpleNamespace, grad_output: Tensor) -> dict[str, Tensor]:
    return {"features": DECLARED["global_avg_pool_backward"](grad_output, saved.indices,
                                                                      saved.batch_size)}


_MAP = "Tensor output_neighbours, Tensor? input_neighbours, SymInt[] kernel_size, SymInt identity_offset"
_SAVED_MAP = ("output_neighbours", "input_neighbours")
_OUT = (Output("out", "features"),)
_GRAD = (Output("grad", "grad_output"),)
_WITH_ARGMAX = (Output("out", "features"), Output("argmax", torch.int32))

#: The feature passes, one entry an op (see `_op_table.OpSpec`).
OPS = (
    OpSpec("conv_forward",
           f"(Tensor features, Tensor weight, Tensor? bias, {_MAP}, SymInt groups) -> Tensor", _OUT,
           lambda a: sc.conv_forward(a.features, a.weight, _rulebook(a, a.features.shape[0]), bias=a.bias,
                                     groups=a.groups),
           lambda a: [(a.output_neighbours.shape[0], a.weight.shape[0])],
           Backward(("features", "weight") + _SAVED_MAP, _conv_gradients)),
    OpSpec("conv_backward",
           f"(Tensor grad_output, Tensor features, Tensor weight, {_MAP}, SymInt groups) -> (Tensor, Tensor)",
           (Output("grad_features", "features"), Output("grad_weight", "weight")),
           lambda a: sc.conv_backward(a.grad_output, a.features, a.weight, _rulebook(a, a.features.shape[0]),
                                      groups=a.groups),
           lambda a: [a.features.shape, a.weight.shape]),
    OpSpec("max_pool_forward", f"(Tensor features, {_MAP}) -> (Tensor, Tensor)", _WITH_ARGMAX,
           lambda a: sc.max_pool_forward(a.features, _rulebook(a, a.features.shape[0])),
           lambda a: [(a.output_neighbours.shape[0], a.features.shape[1])] * 2,
           Backward(("argmax",) + _SAVED_MAP, _max_pool_gradients)),
    OpSpec("max_pool_backward", "(Tensor grad_output, Tensor argmax, SymInt num_input) -> Tensor", _GRAD,
           lambda a: sc.max_pool_backward(a.grad_output, a.argmax, a.num_input),
           lambda a: [(a.num_input, a.grad_output.shape[1])]),
    OpSpec("max_pool_window_backward", f"(Tensor grad_output, Tensor argmax, {_MAP}) -> Tensor", _GRAD,
           lambda a: sc.max_pool_backward(a.grad_output, a.argmax, _num_input(a),
                                          rulebook=_rulebook(a, _num_input(a))),
           lambda a: [(_num_input(a), a.grad_output.shape[1])]),
    OpSpec("avg_pool_forward", f"(Tensor features, {_MAP}) -> Tensor", _OUT,
           lambda a: sc.avg_pool_forward(a.features, _rulebook(a, a.features.shape[0])),
           lambda a: [(a.output_neighbours.shape[0], a.features.shape[1])],
           Backward(_SAVED_MAP, _avg_pool_gradients)),
    OpSpec("avg_pool_backward", f"(Tensor grad_output, {_MAP}) -> Tensor", _GRAD,
           lambda a: sc.avg_pool_backward(a.grad_output, _rulebook(a, _num_input(a))),
           lambda a: [(_num_input(a), a.grad_output.shape[1])]),
    OpSpec("global_max_pool", "(Tensor features, Tensor indices, SymInt batch_size) -> (Tensor, Tensor)",
           _WITH_ARGMAX,
           lambda a: sc.global_max_pool_forward(a.features, a.indices, a.batch_size),
           lambda a: [(a.batch_size, a.features.shape[1])] * 2,
           Backward(("argmax",), _global_max_gradients)),
    OpSpec("global_avg_pool", "(Tensor features, Tensor indices, SymInt batch_size) -> Tensor", _OUT,
           lambda a: sc.global_avg_pool_forward(a.features, a.indices, a.batch_size),
           lambda a: [(a.batch_size, a.features.shape[1])],
           Backward(("indices",), _global_avg_gradients)),
    OpSpec("global_avg_pool_backward", "(Tensor grad_output, Tensor indices, SymInt batch_size) -> Tensor", _GRAD,
           lambda a: sc.global_avg_pool_backward(a.grad_output, a.indices, a.batch_size),
           lambda a: [(a.indices.shape[0], a.grad_output.shape[1])]),
)

#: The declared ops by name: call these (eager calls skip the dispatcher, `_op_table.DeclaredOp`).
DECLARED = declare_ops(OPS)


# --------------------------------------------------------------------------- helpers for the layers


def global_max_pool_features(features: Tensor, indices: Tensor, batch_size: int) -> Tensor:
    """``[B, C]`` channel-wise maximum per batch element (0 for an empty element)."""
    out, _ = DECLARED["global_max_pool"](features, indices, batch_size)
    return out


def global_avg_pool_features(features: Tensor, indices: Tensor, batch_size: int) -> Tensor:
    """``[B, C]`` channel-wise mean per batch element (0 for an empty element)."""
    return DECLARED["global_avg_pool"](features, indices, batch_size)


# --------------------------------------------------------------------------- spconv.pytorch.ops names


def get_conv_output_size(input_size: Sequence[int], kernel_size, stride, padding, dilation) -> list[int]:
    """Output spatial shape of a regular sparse conv or pool (spconv ``ops.get_conv_output_size``)."""
    geometry = sc.ConvGeometry.create(len(input_size), kernel_size, stride, padding, dilation)
    return list(geometry.output_spatial_shape(input_size))


def get_deconv_output_size(input_size: Sequence[int], kernel_size, stride, padding, dilation,
                           output_padding=0) -> list[int]:
    """Output spatial shape of a transposed sparse conv (the dense ``ConvTranspose`` formula)."""
    geometry = sc.ConvGeometry.create(len(input_size), kernel_size, stride, padding, dilation, output_padding,
                                      kind="transposed")
    return list(geometry.output_spatial_shape(input_size))
