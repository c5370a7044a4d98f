"""Folding a batch norm into the sparse convolution before it (``fuse_spconv_bn_eval``)."""

from __future__ import annotations

import copy
from typing import Optional

import torch
from torch import nn

from ..conv import SparseConvolution, spconv_1x1_weight

__all__ = ["fuse_spconv_bn_weights", "fuse_spconv_bn_eval", "clone_sparse_conv", "effective_weight",
           "layer_indice_key", "DocumentedLayoutConv"]


class DocumentedLayoutConv(SparseConvolution):
    """A `SparseConvolution` that always reads its weight as documented (``[out, *kernel, in]``).

    sparsecore's 1x1 layers read their stored weight as spconv does (``view(in, out)``,
    spconv issue #450); the quantization passes work on the weight the layer
    effectively multiplies with, so their float copies store that and read it as is.
    """

    @property
    def reads_weight_as_spconv_1x1(self) -> bool:
        return False


def effective_weight(layer: SparseConvolution, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The ``[out, *kernel, in // groups]`` weight ``layer`` multiplies with (its 1x1 reading applied)."""
    weight = layer.weight if weight is None else weight
    if getattr(layer, "reads_weight_as_spconv_1x1", False):
        return spconv_1x1_weight(weight, layer.in_channels, layer.out_channels)
    return weight


def layer_indice_key(layer: SparseConvolution) -> Optional[str]:
    """The key the layer reads and saves its rulebook under (a submanifold 1x1 layer ignores its key)."""
    return None if layer.conv1x1 and layer.subm else layer.indice_key


def fuse_spconv_bn_weights(weight: torch.Tensor, bias: Optional[torch.Tensor], running_mean: torch.Tensor,
                           running_var: torch.Tensor, eps: float, bn_weight: Optional[torch.Tensor],
                           bn_bias: Optional[torch.Tensor]) -> tuple[nn.Parameter, nn.Parameter]:
    """The weight ``[out, *kernel, in]`` and bias ``[out]`` of ``bn(conv(x))`` as one conv.

    ``w' = w * g / sqrt(var + eps)`` per output channel (axis 0) and
    ``b' = (b - mean) * g / sqrt(var + eps) + beta`` (``b = 0`` without a conv bias).
    """
    if bias is None:
        bias = torch.zeros_like(running_mean)
    if bn_weight is None:
        bn_weight = torch.ones_like(running_mean)
    if bn_bias is None:
        bn_bias = torch.zeros_like(running_mean)
    scale = bn_weight * torch.rsqrt(running_var + eps)
    fused_weight = weight * scale.reshape([-1] + [1] * (weight.dim() - 1)).to(weight.dtype)
    fused_bias = ((bias - running_mean) * scale + bn_bias).to(weight.dtype)
    return nn.Parameter(fused_weight, weight.requires_grad), nn.Parameter(fused_bias, weight.requires_grad)


def clone_sparse_conv(conv: SparseConvolution) -> SparseConvolution:
    """A `DocumentedLayoutConv` with ``conv``'s configuration, computing what ``conv`` computes.

    Its stored weight is ``conv``'s effective weight (`effective_weight`).
    """
    if not isinstance(conv, SparseConvolution):
        raise TypeError(f"expected a sparse convolution layer, got {type(conv).__name__}")
    out = DocumentedLayoutConv(conv.ndim, conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                            conv.padding, conv.dilation, conv.groups, conv.bias is not None, subm=conv.subm,
                            output_padding=conv.output_padding, transposed=conv.transposed,
                            inverse=conv.inverse, indice_key=conv.indice_key, algo=conv.algo,
                            fp32_accum=conv.fp32_accum, record_voxel_count=conv.record_voxel_count,
                            act_type=conv.act_type, act_alpha=conv.act_alpha, act_beta=conv.act_beta,
                            name=conv.name, device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(effective_weight(conv))
        if conv.bias is not None:
            out.bias.copy_(conv.bias)
    for name, buffer in conv.named_buffers(recurse=False):
        setattr(out, name, buffer.clone())
    out.train(conv.training)
    return out


def fuse_spconv_bn_eval(conv: SparseConvolution, bn: nn.modules.batchnorm._BatchNorm) -> SparseConvolution:
    """A copy of ``conv`` (same class) computing ``bn(conv(x))`` with ``bn``'s running statistics (eval mode).

    The copy keeps ``conv``'s class, so qconfig rules by type still apply after fusion;
    a 1x1 layer's weight is folded in its stored (spconv) layout.

    Raises:
        ValueError: when ``conv`` or ``bn`` is in training mode, or their channels differ.
    """
    if conv.training or bn.training:
        raise ValueError("fuse_spconv_bn_eval folds eval-mode layers only: call .eval() on the model first "
                         f"(conv training={conv.training}, bn training={bn.training})")
    if bn.num_features != conv.out_channels:
        raise ValueError(f"batch norm has {bn.num_features} features but the conv has {conv.out_channels} "
                         "output channels")
    if not bn.track_running_stats or bn.running_mean is None:
        raise ValueError("cannot fold a batch norm without running statistics (track_running_stats=False)")
    weight, bias = fuse_spconv_bn_weights(
        effective_weight(conv).detach(), None if conv.bias is None else conv.bias.detach(), bn.running_mean,
        bn.running_var, bn.eps, None if bn.weight is None else bn.weight.detach(),
        None if bn.bias is None else bn.bias.detach())
    if getattr(conv, "reads_weight_as_spconv_1x1", False):
        # back to the stored layout: the layer reads stored.reshape(in, out).T as its [out, 1.., in] weight
        stored = weight.detach().reshape(conv.out_channels, conv.in_channels).t().reshape(conv.weight.shape)
        weight = nn.Parameter(stored.contiguous(), weight.requires_grad)
    fused = copy.deepcopy(conv)
    fused.weight = weight
    fused.bias = bias
    return fused
