"""The feature passes as ``torch.library`` custom ops, with fake kernels and autograd.

Each op takes the features (and weights) as tensors and the rulebook as
int32 pair tensors plus Python ints (``offset_starts``, sizes), rebuilds a
core `sparsecore.PairMap` and calls the core pass (``sparsecore.conv_forward``
and friends): no algorithm lives here. Because they are custom ops with
``register_fake`` and ``register_autograd`` (not ``autograd.Function``\\ s),
``torch.compile(fullgraph=True)`` traces straight through them, and
``torch.autograd.gradcheck`` / ``torch.library.opcheck`` apply.

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

from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch import Tensor

import sparsecore as sc

from ._convert import core_context, core_float_view, core_view, to_torch

if TYPE_CHECKING:
    from .tensor import IndiceData

__all__ = [
    "sparse_conv_features",
    "max_pool_features",
    "avg_pool_features",
    "global_max_pool_features",
    "global_avg_pool_features",
    "get_conv_output_size",
    "get_deconv_output_size",
]


def _pair_map(pair_input: Tensor, pair_output: Tensor, offset_starts: Sequence[int], num_input: int,
              num_output: int, kernel_size: Sequence[int], identity_offset: int = -1) -> sc.PairMap:
    return sc.PairMap(core_view(pair_input, "pair_input"), core_view(pair_output, "pair_output"),
                      tuple(int(s) for s in offset_starts), int(num_input), int(num_output),
                      tuple(int(k) for k in kernel_size), int(identity_offset))


def _optional_view(tensor: Optional[Tensor], name: str):
    return None if tensor is None else core_float_view(tensor, name)


# --------------------------------------------------------------------------- convolution


@torch.library.custom_op("sparsecore::conv_forward", mutates_args=())
def _conv_forward(features: Tensor, weight: Tensor, bias: Optional[Tensor], pair_input: Tensor,
                  pair_output: Tensor, offset_starts: list[int], num_output: int, kernel_size: list[int],
                  identity_offset: int, groups: int) -> Tensor:
    with core_context(features.device):
        pairs = _pair_map(pair_input, pair_output, offset_starts, features.shape[0], num_output,
                          kernel_size, identity_offset)
        out = sc.conv_forward(core_float_view(features, "features"), core_float_view(weight, "weight"),
                              pairs, bias=_optional_view(bias, "bias"), groups=groups)
        return to_torch(out, features.dtype)


@_conv_forward.register_fake
def _(features, weight, bias, pair_input, pair_output, offset_starts, num_output, kernel_size,
      identity_offset, groups):
    return features.new_empty((num_output, weight.shape[0]))


@torch.library.custom_op("sparsecore::conv_backward", mutates_args=())
def _conv_backward(grad_output: Tensor, features: Tensor, weight: Tensor, pair_input: Tensor,
                   pair_output: Tensor, offset_starts: list[int], kernel_size: list[int],
                   identity_offset: int, groups: int) -> tuple[Tensor, Tensor]:
    with core_context(features.device):
        pairs = _pair_map(pair_input, pair_output, offset_starts, features.shape[0], grad_output.shape[0],
                          kernel_size, identity_offset)
        grad_features, grad_weight = sc.conv_backward(
            core_float_view(grad_output, "grad_output"), core_float_view(features, "features"),
            core_float_view(weight, "weight"), pairs, groups=groups)
        return to_torch(grad_features, features.dtype), to_torch(grad_weight, weight.dtype)


@_conv_backward.register_fake
def _(grad_output, features, weight, pair_input, pair_output, offset_starts, kernel_size, identity_offset,
      groups):
    return torch.empty_like(features), torch.empty_like(weight)


def _conv_setup_context(ctx, inputs, output):
    features, weight, bias, pair_input, pair_output, offset_starts, _, kernel_size, identity_offset, groups = inputs
    ctx.save_for_backward(features, weight, pair_input, pair_output)
    ctx.rulebook = (list(offset_starts), list(kernel_size), identity_offset, groups)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _conv_grad(ctx, grad_output):
    features, weight, pair_input, pair_output = ctx.saved_tensors
    offset_starts, kernel_size, identity_offset, groups = ctx.rulebook
    grad_features, grad_weight = torch.ops.sparsecore.conv_backward(
        grad_output.contiguous(), features, weight, pair_input, pair_output, offset_starts, kernel_size,
        identity_offset, groups)
    grad_bias = None
    if ctx.bias_dtype is not None:
        grad_bias = grad_output.sum(0).to(ctx.bias_dtype)
    return grad_features, grad_weight, grad_bias, None, None, None, None, None, None, None


_conv_forward.register_autograd(_conv_grad, setup_context=_conv_setup_context)


# --------------------------------------------------------------------------- pooling


@torch.library.custom_op("sparsecore::max_pool_forward", mutates_args=())
def _max_pool_forward(features: Tensor, pair_input: Tensor, pair_output: Tensor, offset_starts: list[int],
                      num_output: int, kernel_size: list[int]) -> tuple[Tensor, Tensor]:
    with core_context(features.device):
        pairs = _pair_map(pair_input, pair_output, offset_starts, features.shape[0], num_output, kernel_size)
        out, argmax = sc.max_pool_forward(core_float_view(features, "features"), pairs)
        return to_torch(out, features.dtype), to_torch(argmax)


@_max_pool_forward.register_fake
def _(features, pair_input, pair_output, offset_starts, num_output, kernel_size):
    shape = (num_output, features.shape[1])
    return features.new_empty(shape), features.new_empty(shape, dtype=torch.int32)


@torch.library.custom_op("sparsecore::max_pool_backward", mutates_args=())
def _max_pool_backward(grad_output: Tensor, argmax: Tensor, num_input: int) -> Tensor:
    with core_context(grad_output.device):
        grad = sc.max_pool_backward(core_float_view(grad_output, "grad_output"), core_view(argmax, "argmax"),
                                    num_input)
        return to_torch(grad, grad_output.dtype)


@_max_pool_backward.register_fake
def _(grad_output, argmax, num_input):
    return grad_output.new_empty((num_input, grad_output.shape[1]))


@torch.library.custom_op("sparsecore::max_pool_pairs_backward", mutates_args=())
def _max_pool_pairs_backward(grad_output: Tensor, argmax: Tensor, pair_input: Tensor, pair_output: Tensor,
                             offset_starts: list[int], num_input: int, kernel_size: list[int]) -> Tensor:
    with core_context(grad_output.device):
        pairs = _pair_map(pair_input, pair_output, offset_starts, num_input, grad_output.shape[0], kernel_size)
        grad = sc.max_pool_backward(core_float_view(grad_output, "grad_output"), core_view(argmax, "argmax"),
                                    num_input, rulebook=pairs)
        return to_torch(grad, grad_output.dtype)


@_max_pool_pairs_backward.register_fake
def _(grad_output, argmax, pair_input, pair_output, offset_starts, num_input, kernel_size):
    return grad_output.new_empty((num_input, grad_output.shape[1]))


def _max_setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1])
    ctx.num_input = inputs[0].shape[0]
    ctx.mark_non_differentiable(output[1])


def _max_grad(ctx, grad_output, _grad_argmax):
    (argmax,) = ctx.saved_tensors
    grad = torch.ops.sparsecore.max_pool_backward(grad_output.contiguous(), argmax, ctx.num_input)
    return (grad,) + (None,) * (ctx.num_other_inputs)


def _register_max(op, num_other_inputs: int) -> None:
    def setup(ctx, inputs, output):
        _max_setup_context(ctx, inputs, output)
        ctx.num_other_inputs = num_other_inputs

    op.register_autograd(_max_grad, setup_context=setup)


def _max_pairs_setup_context(ctx, inputs, output):
    features, pair_input, pair_output, offset_starts, _, kernel_size = inputs
    ctx.save_for_backward(output[1], pair_input, pair_output)
    ctx.num_input = features.shape[0]
    ctx.offset_starts, ctx.kernel_size = list(offset_starts), list(kernel_size)
    ctx.mark_non_differentiable(output[1])


def _max_pairs_grad(ctx, grad_output, _grad_argmax):
    argmax, pair_input, pair_output = ctx.saved_tensors
    grad = torch.ops.sparsecore.max_pool_pairs_backward(grad_output.contiguous(), argmax, pair_input, pair_output,
                                                        ctx.offset_starts, ctx.num_input, ctx.kernel_size)
    return grad, None, None, None, None, None


_max_pool_forward.register_autograd(_max_pairs_grad, setup_context=_max_pairs_setup_context)


@torch.library.custom_op("sparsecore::avg_pool_forward", mutates_args=())
def _avg_pool_forward(features: Tensor, pair_input: Tensor, pair_output: Tensor, offset_starts: list[int],
                      num_output: int, kernel_size: list[int]) -> Tensor:
    with core_context(features.device):
        pairs = _pair_map(pair_input, pair_output, offset_starts, features.shape[0], num_output, kernel_size)
        return to_torch(sc.avg_pool_forward(core_float_view(features, "features"), pairs), features.dtype)


@_avg_pool_forward.register_fake
def _(features, pair_input, pair_output, offset_starts, num_output, kernel_size):
    return features.new_empty((num_output, features.shape[1]))


@torch.library.custom_op("sparsecore::avg_pool_backward", mutates_args=())
def _avg_pool_backward(grad_output: Tensor, pair_input: Tensor, pair_output: Tensor, offset_starts: list[int],
                       num_input: int, kernel_size: list[int]) -> Tensor:
    with core_context(grad_output.device):
        pairs = _pair_map(pair_input, pair_output, offset_starts, num_input, grad_output.shape[0], kernel_size)
        grad = sc.avg_pool_backward(core_float_view(grad_output, "grad_output"), pairs)
        return to_torch(grad, grad_output.dtype)


@_avg_pool_backward.register_fake
def _(grad_output, pair_input, pair_output, offset_starts, num_input, kernel_size):
    return grad_output.new_empty((num_input, grad_output.shape[1]))


def _avg_setup_context(ctx, inputs, output):
    features, pair_input, pair_output, offset_starts, _, kernel_size = inputs
    ctx.save_for_backward(pair_input, pair_output)
    ctx.rulebook = (list(offset_starts), features.shape[0], list(kernel_size))


def _avg_grad(ctx, grad_output):
    pair_input, pair_output = ctx.saved_tensors
    offset_starts, num_input, kernel_size = ctx.rulebook
    grad = torch.ops.sparsecore.avg_pool_backward(grad_output.contiguous(), pair_input, pair_output,
                                                  offset_starts, num_input, kernel_size)
    return grad, None, None, None, None, None


_avg_pool_forward.register_autograd(_avg_grad, setup_context=_avg_setup_context)


# --------------------------------------------------------------------------- global pooling


@torch.library.custom_op("sparsecore::global_max_pool", mutates_args=())
def _global_max_pool(features: Tensor, indices: Tensor, batch_size: int) -> tuple[Tensor, Tensor]:
    with core_context(features.device):
        out, argmax = sc.global_max_pool_forward(core_float_view(features, "features"),
                                                 core_view(indices, "indices"), batch_size)
        return to_torch(out, features.dtype), to_torch(argmax)


@_global_max_pool.register_fake
def _(features, indices, batch_size):
    shape = (batch_size, features.shape[1])
    return features.new_empty(shape), features.new_empty(shape, dtype=torch.int32)


_register_max(_global_max_pool, 2)


@torch.library.custom_op("sparsecore::global_avg_pool", mutates_args=())
def _global_avg_pool(features: Tensor, indices: Tensor, batch_size: int) -> Tensor:
    with core_context(features.device):
        out = sc.global_avg_pool_forward(core_float_view(features, "features"), core_view(indices, "indices"),
                                         batch_size)
        return to_torch(out, features.dtype)


@_global_avg_pool.register_fake
def _(features, indices, batch_size):
    return features.new_empty((batch_size, features.shape[1]))


@torch.library.custom_op("sparsecore::global_avg_pool_backward", mutates_args=())
def _global_avg_pool_backward(grad_output: Tensor, indices: Tensor, batch_size: int) -> Tensor:
    with core_context(grad_output.device):
        grad = sc.global_avg_pool_backward(core_float_view(grad_output, "grad_output"),
                                           core_view(indices, "indices"), batch_size)
        return to_torch(grad, grad_output.dtype)


@_global_avg_pool_backward.register_fake
def _(grad_output, indices, batch_size):
    return grad_output.new_empty((indices.shape[0], grad_output.shape[1]))


def _global_avg_setup_context(ctx, inputs, output):
    _, indices, batch_size = inputs
    ctx.save_for_backward(indices)
    ctx.batch_size = batch_size


def _global_avg_grad(ctx, grad_output):
    (indices,) = ctx.saved_tensors
    grad = torch.ops.sparsecore.global_avg_pool_backward(grad_output.contiguous(), indices, ctx.batch_size)
    return grad, None, None


_global_avg_pool.register_autograd(_global_avg_grad, setup_context=_global_avg_setup_context)


# --------------------------------------------------------------------------- helpers for the layers


def sparse_conv_features(features: Tensor, weight: Tensor, bias: Optional[Tensor], data: "IndiceData",
                         groups: int = 1) -> Tensor:
    """Output features of a conv layer whose rulebook is ``data``."""
    return torch.ops.sparsecore.conv_forward(
        features, weight, bias, data.pair_input, data.pair_output, data.offset_starts, data.num_output,
        data.kernel_size, data.identity_offset, groups)


def max_pool_features(features: Tensor, data: "IndiceData") -> Tensor:
    """Output features of a max pool layer whose rulebook is ``data``."""
    out, _ = torch.ops.sparsecore.max_pool_forward(
        features, data.pair_input, data.pair_output, data.offset_starts, data.num_output, data.kernel_size)
    return out


def avg_pool_features(features: Tensor, data: "IndiceData") -> Tensor:
    """Output features of an average pool layer whose rulebook is ``data``."""
    return torch.ops.sparsecore.avg_pool_forward(
        features, data.pair_input, data.pair_output, data.offset_starts, data.num_output, data.kernel_size)


def global_max_pool_features(features: Tensor, indices: Tensor, batch_size: int) -> Tensor:
    """``[B, C]`` channel-wise maximum per batch element (0 for an empty element)."""
    out, _ = torch.ops.sparsecore.global_max_pool(features, indices, batch_size)
    return out


def global_avg_pool_features(features: Tensor, indices: Tensor, batch_size: int) -> Tensor:
    """``[B, C]`` channel-wise mean per batch element (0 for an empty element)."""
    return torch.ops.sparsecore.global_avg_pool(features, indices, batch_size)


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
