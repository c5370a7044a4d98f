"""QAT sparse modules (spconv's ``spconv.pytorch.quantization.intrinsic.qat``)."""

from .modules import (SparseConv, SparseConvAddReLU, SparseConvBn, SparseConvBnAddReLU, SparseConvBnReLU,
                      SparseConvReLU)

__all__ = ["SparseConv", "SparseConvReLU", "SparseConvAddReLU", "SparseConvBn", "SparseConvBnReLU",
           "SparseConvBnAddReLU"]
