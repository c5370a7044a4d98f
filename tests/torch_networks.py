"""Small sparsecore.torch networks and their seeded set-up, shared by the torch tests.

The fx, quantization and export tests build the same pieces: a seeded random
`SparseConvTensor`, random BatchNorm statistics (so that folding and fusion are
exercised, never the identity), and spconv's fusable residual block. The data
come from tests/dense_oracle.py's generators, so they are fresh, seeded and
never zero.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from torch import nn

import sparsecore.torch as spconv
from tests.dense_oracle import make_rng, random_features, random_indices


def sparse_input(seed: int, shape: Sequence[int], batch_size: int, channels: int, num: Optional[int] = None,
                 dtype=np.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded ``(features [N, channels], indices [N, 1 + D] int32)`` torch tensors.

    Args:
        seed: the case's seed.
        shape: the spatial shape.
        batch_size: batch elements.
        channels: feature channels.
        num: exact number of sites (a random density when None).
        dtype: the features' NumPy dtype.
    """
    rng = make_rng(seed)
    indices = random_indices(rng, shape, batch_size, num=num)
    features = random_features(rng, indices.shape[0], channels, dtype)
    return torch.from_numpy(features), torch.from_numpy(indices)


def randomize_batch_norms(model: nn.Module, seed: int, mean_std: float, variance_low: float,
                          variance_width: float) -> nn.Module:
    """Gives every batch norm of ``model`` seeded random statistics and affine parameters; returns ``model``.

    Means are normal with standard deviation ``mean_std``, variances uniform in
    ``[variance_low, variance_low + variance_width)``, weights uniform in [0.5, 1.5),
    biases normal with standard deviation 0.2.
    """
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                module.running_mean.copy_(torch.randn(module.num_features, generator=generator) * mean_std)
                variance = torch.rand(module.num_features, generator=generator) * variance_width + variance_low
                module.running_var.copy_(variance)
                module.weight.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
                module.bias.copy_(torch.randn(module.num_features, generator=generator) * 0.2)
    return model


class FusableResidualBlock(spconv.SparseModule):
    """spconv's fusable residual block (its INT8 guide): conv-bn-relu, conv-bn, + identity, ReLU.

    Args:
        channels: input and output channels.
        conv: the submanifold conv class (``SubMConv2d``, ``SubMConv3d``, ...).
        indice_key: the key both convs share (None: each builds its own rulebook).
    """

    def __init__(self, channels: int, conv: type = spconv.SubMConv3d, indice_key: Optional[str] = None) -> None:
        super().__init__()
        self.conv1_bn_relu = spconv.SparseSequential(
            conv=conv(channels, channels, 3, 1, 1, bias=False, indice_key=indice_key),
            bn=nn.BatchNorm1d(channels), relu=nn.ReLU(inplace=True))
        self.conv2_bn = spconv.SparseSequential(
            conv=conv(channels, channels, 3, 1, 1, bias=False, indice_key=indice_key), bn=nn.BatchNorm1d(channels))
        self.relu = spconv.SparseReLU(inplace=True)
        self.iden_for_fx_match = spconv.SparseIdentity()

    def forward(self, x: spconv.SparseConvTensor) -> spconv.SparseConvTensor:
        identity = self.iden_for_fx_match(x)
        out = self.conv1_bn_relu(x)
        out = self.conv2_bn(out)
        return self.relu(out + identity)
