"""The reference quantized sparse conv: float arithmetic on the int8-rounded weight.

``convert_fx`` puts `SpConv` where an observed sparse conv was, between a
dequantize and a quantize node; `sparsecore.torch.quantization.transform_qdq`
then lowers that pattern to the int8 modules of `..quantized`. A reference
module is also what a deployment tool reads: `SpConv.get_quantized_weight`
(per-channel ``torch.qint8``) and ``bias``.
"""

from __future__ import annotations

from typing import Any

import torch

from ...conv import SparseConvolution
from ...tensor import SparseConvTensor
from .._functional import conv_with_weight
from ..utils import clone_sparse_conv, effective_weight
from .._torch_notices import torch_notices_silenced

__all__ = ["SpConv", "quantize_weight_per_channel"]


def quantize_weight_per_channel(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 ``clip(round_half_even(w / s[c]), -128, 127)`` along the output axis 0."""
    shape = [-1] + [1] * (weight.dim() - 1)
    scaled = weight.detach().float() / scales.float().reshape(shape)
    return torch.clamp(torch.round(scaled), -128, 127).to(torch.int8)


class SpConv(SparseConvolution):
    """A sparse conv whose weight is used as ``dequantize(quantize(w))`` (per-channel symmetric qint8).

    Built by `from_float`; ``weight_scale`` (float32 ``[out]``) holds the scales. The
    stored weight is the layer's effective ``[out, *kernel, in]`` weight (a 1x1 layer's
    spconv reading already applied).
    """

    @property
    def reads_weight_as_spconv_1x1(self) -> bool:
        """False: the stored weight is read as documented."""
        return False

    @classmethod
    def from_float(cls, float_conv: SparseConvolution, weight_qparams: dict[str, Any]) -> "SpConv":
        """The reference module of ``float_conv`` with the weight observer's qparams."""
        if not isinstance(float_conv, SparseConvolution):
            raise TypeError(f"SpConv.from_float takes a sparse convolution, got {type(float_conv).__name__}")
        qscheme = weight_qparams.get("qscheme")
        dtype = weight_qparams.get("dtype")
        if dtype not in (torch.qint8, None) or qscheme not in (torch.per_channel_symmetric,
                                                              torch.per_tensor_symmetric,
                                                              torch.per_channel_affine, None):
            raise ValueError(f"sparse int8 needs symmetric qint8 weights, got dtype {dtype} and qscheme "
                             f"{qscheme}; use get_default_spconv_qconfig_mapping")
        scale = torch.as_tensor(weight_qparams["scale"], dtype=torch.float32).reshape(-1)
        zero_point = torch.as_tensor(weight_qparams.get("zero_point", 0)).reshape(-1)
        if getattr(float_conv, "reads_weight_as_spconv_1x1", False):
            # torch observed the stored tensor, whose axis 0 is not the output channel of spconv's 1x1
            # reading: take the per-channel symmetric scales of the weight the layer multiplies with
            amax = effective_weight(float_conv).detach().abs().flatten(1).amax(dim=1).float()
            scale = torch.clamp(amax / 127.5, min=torch.finfo(torch.float32).eps)
            zero_point = torch.zeros_like(scale, dtype=torch.int64)
        if bool((zero_point != 0).any()):
            raise ValueError(f"sparse int8 needs weight zero points 0 (symmetric), got {zero_point.tolist()}")
        if scale.numel() == 1:
            scale = scale.expand(float_conv.out_channels).clone()
        if scale.numel() != float_conv.out_channels:
            raise ValueError(f"the weight observer has {scale.numel()} scales but the conv has "
                             f"{float_conv.out_channels} output channels (per-channel axis must be 0)")
        ref = clone_sparse_conv(float_conv)
        ref.__class__ = cls  # same state as the float conv; the class adds the int8 weight view
        ref.register_buffer("weight_scale", scale.to(float_conv.weight.device))
        return ref

    def get_quantized_weight(self) -> torch.Tensor:
        """The weight as a per-channel ``torch.qint8`` tensor (axis 0, zero points 0)."""
        zero_points = torch.zeros(self.out_channels, dtype=torch.int64, device=self.weight.device)
        with torch_notices_silenced():
            return torch.quantize_per_channel(self.weight.detach().float(), self.weight_scale.double(),
                                              zero_points, 0, torch.qint8)

    def get_weight(self) -> torch.Tensor:
        """The int8-rounded weight in float (``dequantize(quantize(w))``)."""
        shape = [-1] + [1] * (self.weight.dim() - 1)
        q = quantize_weight_per_channel(self.weight, self.weight_scale)
        return (q.float() * self.weight_scale.reshape(shape)).to(self.weight.dtype)

    def forward(self, input: SparseConvTensor, add_input: SparseConvTensor = None) -> SparseConvTensor:
        out = conv_with_weight(self, input, self.get_weight(), self.bias)
        if add_input is not None:
            out = out.replace_feature(out.features + add_input.features)
        if self._activation is not None:
            out = out.replace_feature(self._apply_activation(out.features))
        return out


