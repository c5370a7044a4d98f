"""int8 fused sparse modules (spconv's ``spconv.pytorch.quantization.intrinsic.quantized``)."""

from ...quantized.conv import LinearPerChannelWeightReLU, SparseConvAddReLU, SparseConvReLU

__all__ = ["SparseConvReLU", "SparseConvAddReLU", "LinearPerChannelWeightReLU"]
