"""The feature passes as ``torch.library`` custom ops, with fake kernels and autograd.

Each op takes the features (and weights) as tensors and the rulebook as
int32 pair tensors plus Python ints (``offset_starts``, sizes), rebuilds a
core `sparsecore.PairMap` and calls the core pass (``sparsecore.conv_forward``
and friends): no algorithm lives here. Because they are custom ops with
``register_fake`` and ``register_autograd`` (not ``autograd.Function``\\ s),
``torch.compile(fullgraph=True)`` traces straight through them, and
``torch.autograd.gradcheck`` / ``torch.library.opcheck`` apply.

The ops are declared from one table, `OPS`: an entry gives the name, the
schema, the core call, the output shapes of the fake kernel and the backward
(see `sparsecore.torch._op_table`), so a new op is one entry.

Ops (all under the ``sparsecore`` namespace):

========================  ==============================================
``conv_forward``          gather-GEMM-scatter (+ bias), any conv kind
``conv_backward``         ``(d features, d weight)``
``max_pool_forward``      ``(out, argmax)`` over a pooling rulebook
``max_pool_backward``     scatter by argmax (global max pool)
``max_pool_pairs_backward`` gradient of a windowed max pool, summed per input over its pairs
``avg_pool_forward``      mean over the active inputs of each window
``avg_pool_backward``
``global_max_pool``       ``(out [B, C], argmax [B, C])``
``global_avg_pool``       ``[B, C]``
``global_avg_pool_backward``
========================  ==============================================

The helpers at the bottom (`sparse_conv_features`, ...) take an
`IndiceData` and call the ops with its tensors.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch import Tensor

import sparsecore as sc

from ._op_table import Backward, OpSpec, Output, declare_ops
from .indice_data import library_pair_map

if TYPE_CHECKING:
    from .tensor import IndiceData

__all__ = [
    "OPS",
    "autocast_inputs",
    "sparse_conv_features",
    "max_pool_features",
    "avg_pool_features",
    "global_max_pool_features",
    "global_avg_pool_features",
    "get_conv_output_size",
    "get_deconv_output_size",
]


def _pairs(a: SimpleNamespace, num_input: int, num_output: int) -> sc.PairMap:
    """The core `sparsecore.PairMap` of an op's rulebook arguments (core views and ints).

    When the pair tensors are an `IndiceData`'s untouched views of a library-built map
    that agrees with every other argument, that map itself (`library_pair_map`: its
    rows checked once, its CPU neighbour tables shared by every pass); else a new one,
    checked.
    """
    starts = tuple(int(s) for s in a.offset_starts)
    kernel_size = tuple(int(k) for k in a.kernel_size)
    identity_offset = int(getattr(a, "identity_offset", -1))
    tensors = getattr(a, "torch_arguments", {})
    known = library_pair_map(tensors.get("pair_input"), tensors.get("pair_output"))
    if (known is not None and tuple(known.offset_starts) == starts and known.num_input == int(num_input)
            and known.num_output == int(num_output) and tuple(known.kernel_size) == kernel_size
            and known.identity_offset == identity_offset):
        return known
    return sc.PairMap(a.pair_input, a.pair_output, starts, int(num_input), int(num_output), kernel_size,
                      identity_offset)


def _conv_gradients(saved: SimpleNamespace, grad_output: Tensor) -> dict[str, Tensor]:
    grad_features, grad_weight = DECLARED["conv_backward"](
        grad_output, saved.features, saved.weight, saved.pair_input, saved.pair_output, list(saved.offset_starts),
        list(saved.kernel_size), saved.identity_offset, saved.groups)
    grads = {"features": grad_features, "weight": grad_weight}
    if saved.dtypes["bias"] is not None:
        grads["bias"] = grad_output.sum(0).to(saved.dtypes["bias"])
    return grads


def _max_pool_gradients(saved: SimpleNamespace, grad_output: Tensor) -> dict[str, Tensor]:
    return {"features": DECLARED["max_pool_pairs_backward"](
        grad_output, saved.argmax, saved.pair_input, saved.pair_output, list(saved.offset_starts),
        saved.shapes["features"][0], list(saved.kernel_size))}


def _avg_pool_gradients(saved: SimpleNamespace, grad_output: Tensor) -> dict[str, Tensor]:
    return {"features": DECLARED["avg_pool_backward"](
        grad_output, saved.pair_input, saved.pair_output, list(saved.offset_starts), saved.shapes["features"][0],
        list(saved.kernel_size))}


def _global_max_gradients(saved: SimpleNamespace, grad_output: Tensor) -> dict[str, Tensor]:
    return {"features": DECLARED["max_pool_backward"](grad_output, saved.argmax,
                                                               saved.shapes["features"][0])}


def _global_avg_gradients(saved: SimpleNamespace, grad_output: Tensor) -> dict[str, Tensor]:
    return {"features": DECLARED["global_avg_pool_backward"](grad_output, saved.indices,
                                                                      saved.batch_size)}


_RULEBOOK = "Tensor pair_input, Tensor pair_output, SymInt[] offset_starts"
_OUT = (Output("out", "features"),)
_GRAD = (Output("grad", "grad_output"),)
_WITH_ARGMAX = (Output("out", "features"), Output("argmax", torch.int32))

#: The feature passes, one entry an op (see `_op_table.OpSpec`).
OPS = (
    OpSpec("conv_forward",
           f"(Tensor features, Tensor weight, Tensor? bias, {_RULEBOOK}, SymInt num_output, SymInt[] kernel_size, "
           "SymInt identity_offset, SymInt groups) -> Tensor", _OUT,
           lambda a: sc.conv_forward(a.features, a.weight, _pairs(a, a.features.shape[0], a.num_output),
                                     bias=a.bias, groups=a.groups),
           lambda a: [(a.num_output, a.weight.shape[0])],
           Backward(("features", "weight", "pair_input", "pair_output"), _conv_gradients)),
    OpSpec("conv_backward",
           f"(Tensor grad_output, Tensor features, Tensor weight, {_RULEBOOK}, SymInt[] kernel_size, "
           "SymInt identity_offset, SymInt groups) -> (Tensor, Tensor)",
           (Output("grad_features", "features"), Output("grad_weight", "weight")),
           lambda a: sc.conv_backward(a.grad_output, a.features, a.weight,
                                      _pairs(a, a.features.shape[0], a.grad_output.shape[0]), groups=a.groups),
           lambda a: [a.features.shape, a.weight.shape]),
    OpSpec("max_pool_forward",
           f"(Tensor features, {_RULEBOOK}, SymInt num_output, SymInt[] kernel_size) -> (Tensor, Tensor)",
           _WITH_ARGMAX,
           lambda a: sc.max_pool_forward(a.features, _pairs(a, a.features.shape[0], a.num_output)),
           lambda a: [(a.num_output, a.features.shape[1])] * 2,
           Backward(("argmax", "pair_input", "pair_output"), _max_pool_gradients)),
    OpSpec("max_pool_backward", "(Tensor grad_output, Tensor argmax, SymInt num_input) -> Tensor", _GRAD,
           lambda a: sc.max_pool_backward(a.grad_output, a.argmax, a.num_input),
           lambda a: [(a.num_input, a.grad_output.shape[1])]),
    OpSpec("max_pool_pairs_backward",
           f"(Tensor grad_output, Tensor argmax, {_RULEBOOK}, SymInt num_input, SymInt[] kernel_size) -> Tensor",
           _GRAD,
           lambda a: sc.max_pool_backward(a.grad_output, a.argmax, a.num_input,
                                          rulebook=_pairs(a, a.num_input, a.grad_output.shape[0])),
           lambda a: [(a.num_input, a.grad_output.shape[1])]),
    OpSpec("avg_pool_forward", f"(Tensor features, {_RULEBOOK}, SymInt num_output, SymInt[] kernel_size) -> Tensor",
           _OUT,
           lambda a: sc.avg_pool_forward(a.features, _pairs(a, a.features.shape[0], a.num_output)),
           lambda a: [(a.num_output, a.features.shape[1])],
           Backward(("pair_input", "pair_output"), _avg_pool_gradients)),
    OpSpec("avg_pool_backward",
           f"(Tensor grad_output, {_RULEBOOK}, SymInt num_input, SymInt[] kernel_size) -> Tensor", _GRAD,
           lambda a: sc.avg_pool_backward(a.grad_output, _pairs(a, a.num_input, a.grad_output.shape[0])),
           lambda a: [(a.num_input, a.grad_output.shape[1])]),
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


def autocast_inputs(*tensors: Optional[Tensor]) -> tuple[Optional[Tensor], ...]:
    """Casts float32 tensors to the autocast dtype when autocast is on for their device.

    The core then multiplies in that dtype's storage with float32 accumulation.
    """
    first = next(t for t in tensors if t is not None)
    device_type = first.device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None and t.dtype == torch.float32 else t for t in tensors)


def sparse_conv_features(features: Tensor, weight: Tensor, bias: Optional[Tensor], data: "IndiceData",
                         groups: int = 1) -> Tensor:
    """Output features of a conv layer whose rulebook is ``data``."""
    return DECLARED["conv_forward"](
        features, weight, bias, data.pair_input, data.pair_output, data.offset_starts, data.num_output,
        data.kernel_size, data.identity_offset, groups)


def max_pool_features(features: Tensor, data: "IndiceData") -> Tensor:
    """Output features of a max pool layer whose rulebook is ``data``."""
    out, _ = DECLARED["max_pool_forward"](
        features, data.pair_input, data.pair_output, data.offset_starts, data.num_output, data.kernel_size)
    return out


def avg_pool_features(features: Tensor, data: "IndiceData") -> Tensor:
    """Output features of an average pool layer whose rulebook is ``data``."""
    return DECLARED["avg_pool_forward"](
        features, data.pair_input, data.pair_output, data.offset_starts, data.num_output, data.kernel_size)


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
