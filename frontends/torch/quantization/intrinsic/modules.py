"""Fused float modules: what ``prepare_fx`` puts in place of a matched conv -> bn -> relu chain.

They compute exactly what the unfused sequence computes (for PTQ the batch norm
is already folded into the conv's weight and bias, see `fusion`); QAT swaps
them for the modules of `sparsecore.torch.quantization.intrinsic.qat`, and
conversion for the int8 modules of `...intrinsic.quantized`. The ``AddReLU``
variants take ``forward(input, add_input)``: ``relu(conv(input) + add_input)``.
"""

from __future__ import annotations

import torch.ao.nn.intrinsic as nni
from torch import nn

from ...conv import SparseConvolution
from ...modules import SparseBatchNorm, SparseSyncBatchNorm
from ...tensor import SparseConvTensor

__all__ = ["SpconvReLUNd", "SpconvBnNd", "SpconvBnReLUNd", "SpconvBnAddReLUNd", "SpconvAddReLUNd",
           "BATCH_NORM_TYPES", "RELU_TYPES"]

BATCH_NORM_TYPES = (nn.BatchNorm1d, SparseBatchNorm, SparseSyncBatchNorm, nn.SyncBatchNorm)
RELU_TYPES = (nn.ReLU,)


def _on_features(module: nn.Module, x: SparseConvTensor) -> SparseConvTensor:
    if x.features.shape[0] == 0:
        return x
    return x.replace_feature(module(x.features))


def _check(name: str, conv: nn.Module, bn: nn.Module = None, relu: nn.Module = None, with_bn: bool = False,
           with_relu: bool = False) -> None:
    if not isinstance(conv, SparseConvolution):
        raise TypeError(f"{name} needs a sparse convolution first, got {type(conv).__name__}")
    if with_bn and not isinstance(bn, BATCH_NORM_TYPES):
        raise TypeError(f"{name} needs a batch norm second, got {type(bn).__name__}")
    if with_relu and not isinstance(relu, RELU_TYPES):
        raise TypeError(f"{name} needs a ReLU last, got {type(relu).__name__}")


class _FusedSparseModule(nni._FusedModule):
    def forward(self, input: SparseConvTensor) -> SparseConvTensor:
        x = self[0](input)
        for module in list(self)[1:]:
            x = _on_features(module, x)
        return x


class SpconvReLUNd(_FusedSparseModule):
    """``relu(conv(x))`` (conv, ReLU)."""

    def __init__(self, conv: SparseConvolution, relu: nn.ReLU) -> None:
        _check(type(self).__name__, conv, relu=relu, with_relu=True)
        super().__init__(conv, relu)


class SpconvBnNd(_FusedSparseModule):
    """``bn(conv(x))`` (conv, batch norm), the QAT form; PTQ folds the batch norm instead."""

    def __init__(self, conv: SparseConvolution, bn: nn.Module) -> None:
        _check(type(self).__name__, conv, bn, with_bn=True)
        super().__init__(conv, bn)


class SpconvBnReLUNd(_FusedSparseModule):
    """``relu(bn(conv(x)))`` (conv, batch norm, ReLU)."""

    def __init__(self, conv: SparseConvolution, bn: nn.Module, relu: nn.ReLU) -> None:
        _check(type(self).__name__, conv, bn, relu, with_bn=True, with_relu=True)
        super().__init__(conv, bn, relu)


class SpconvBnAddReLUNd(_FusedSparseModule):
    """``relu(bn(conv(input)) + add_input)`` (conv, batch norm, ReLU) for residual blocks."""

    def __init__(self, conv: SparseConvolution, bn: nn.Module, relu: nn.ReLU) -> None:
        _check(type(self).__name__, conv, bn, relu, with_bn=True, with_relu=True)
        super().__init__(conv, bn, relu)

    def forward(self, input: SparseConvTensor, add_input: SparseConvTensor) -> SparseConvTensor:
        x = _on_features(self[1], self[0](input))
        return x.replace_feature(self[2](x.features + add_input.features))


class SpconvAddReLUNd(_FusedSparseModule):
    """``relu(conv(input) + add_input)`` (conv, ReLU) for residual blocks."""

    def __init__(self, conv: SparseConvolution, relu: nn.ReLU) -> None:
        _check(type(self).__name__, conv, relu=relu, with_relu=True)
        super().__init__(conv, relu)

    def forward(self, input: SparseConvTensor, add_input: SparseConvTensor) -> SparseConvTensor:
        x = self[0](input)
        return x.replace_feature(self[1](x.features + add_input.features))


