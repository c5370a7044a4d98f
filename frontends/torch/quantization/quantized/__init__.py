"""int8 sparse modules (spconv's ``spconv.pytorch.quantization.quantized``); `reference` holds `SpConv`."""

from . import reference
from .conv import LinearPerChannelWeight, QuantizedSparseMaxPool, SparseConv

__all__ = ["SparseConv", "LinearPerChannelWeight", "QuantizedSparseMaxPool", "reference"]
