"""Sparse pooling layers with spconv 2.x's names and arguments.

``SparseMaxPool{1,2,3,4}d`` and ``SparseAvgPool{1,2,3,4}d`` pool over the
*active* sites of each window (the average divides by the number of active
inputs, "real point count" as spconv documents); ``stride`` defaults to the
kernel size. The average pool works on the CPU and in 4D (spconv's needs CUDA
and has no 4D class). `SparseGlobalMaxPool` / `SparseGlobalAvgPool` return a
dense ``[B, C]`` tensor (an empty batch element gives 0); the average is taken
over every channel (spconv 2.3.8 keeps only the first, issue #708).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import sparsecore as sc

from ._convert import check_same_device
from .capacity import has_padding, padded_global_pool
from .layer import SparseModule, check_input, geometry_repr, nd_variants, pool_forward
from .ops import global_avg_pool_features, global_max_pool_features
from .spconv_rules import MAX_NUM_VOXELS_DURING_TRAINING
from .tensor import SparseConvTensor, expand_nd

__all__ = [
    "SparseMaxPool", "SparseMaxPool1d", "SparseMaxPool2d", "SparseMaxPool3d", "SparseMaxPool4d",
    "SparseAvgPool", "SparseAvgPool1d", "SparseAvgPool2d", "SparseAvgPool3d", "SparseAvgPool4d",
    "SparseGlobalMaxPool", "SparseGlobalAvgPool",
]

class _SparsePool(SparseModule):
    _kind = "SparseMaxPool"

    def __init__(self, ndim: int, kernel_size: Any = 3, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
                 indice_key: Optional[str] = None, subm: bool = False, algo: Any = None,
                 record_voxel_count: bool = False, name: Optional[str] = None) -> None:
        super().__init__(name=name)
        self.ndim = ndim
        self.kernel_size = expand_nd(ndim, kernel_size, "kernel_size")
        self.stride = list(self.kernel_size) if stride is None else expand_nd(ndim, stride, "stride")
        self.padding = expand_nd(ndim, padding, "padding")
        self.dilation = expand_nd(ndim, dilation, "dilation")
        self.subm = subm
        self.indice_key = indice_key
        self.algo = algo
        self.record_voxel_count = record_voxel_count
        self._geometry = sc.ConvGeometry.create(ndim, self.kernel_size, self.stride, self.padding, self.dilation,
                                                kind="subm" if subm else "regular")
        if record_voxel_count and not subm:
            self.register_buffer(MAX_NUM_VOXELS_DURING_TRAINING, torch.zeros(1, dtype=torch.int32))

    def get_max_num_voxels(self) -> Optional[torch.Tensor]:
        """The ``max_num_voxels_during_training`` buffer, or None without ``record_voxel_count``."""
        return getattr(self, MAX_NUM_VOXELS_DURING_TRAINING, None)

    def extra_repr(self) -> str:
        text = geometry_repr(self.kernel_size, self.stride, self.padding, self.dilation)
        if self.subm:
            text += ", subm=True"
        return text

    def _benchmark_params(self) -> dict:
        return {"kernel_size": self.kernel_size, "stride": self.stride, "padding": self.padding,
                "dilation": self.dilation}

    #: The eager forward (`sparsecore.torch.layer.pool_forward`: input checks to output tensor, in one module).
    forward = pool_forward


class SparseMaxPool(_SparsePool):
    """Max over the active sites of each window (spconv ``SparseMaxPool``)."""


class SparseAvgPool(_SparsePool):
    """Mean over the active sites of each window (spconv ``SparseAvgPool``)."""

    _kind = "SparseAvgPool"


def _nd_init(self, kernel_size, stride=None, padding=0, dilation=1, indice_key=None, algo=None,
             record_voxel_count=False, name=None):
    """spconv's ``SparseMaxPool{n}d`` / ``SparseAvgPool{n}d`` constructor; ``n`` is the class's ``_ndim``."""
    _SparsePool.__init__(self, self._ndim, kernel_size, stride, padding, dilation, indice_key=indice_key,
                         algo=algo, record_voxel_count=record_voxel_count, name=name)


SparseMaxPool1d, SparseMaxPool2d, SparseMaxPool3d, SparseMaxPool4d = nd_variants(
    SparseMaxPool, "{ndim}-D sparse max pool (stride defaults to kernel_size).", __init__=_nd_init)
SparseAvgPool1d, SparseAvgPool2d, SparseAvgPool3d, SparseAvgPool4d = nd_variants(
    SparseAvgPool, "{ndim}-D sparse average pool (mean over active inputs; stride defaults to kernel_size).",
    __init__=_nd_init)


class _SparseGlobalPool(SparseModule):
    _pool_pass = staticmethod(global_max_pool_features)

    def __init__(self, name: Optional[str] = None) -> None:
        super().__init__(name=name)

    def forward(self, input: SparseConvTensor) -> torch.Tensor:
        layer = type(self).__name__
        check_input(layer, input)
        check_same_device(layer, features=input.features, indices=input.indices)
        if has_padding(input):  # capacity mode: over the true rows, no read back
            return padded_global_pool(input.features, input.indices, input.batch_size, self._kind)
        return type(self)._pool_pass(input.features, input.indices, input.batch_size)


class SparseGlobalMaxPool(_SparseGlobalPool):
    """Channel-wise max over each batch element's sites: dense ``[B, C]``."""

    _kind = "max"


class SparseGlobalAvgPool(_SparseGlobalPool):
    """Channel-wise mean over each batch element's sites: dense ``[B, C]``."""

    _pool_pass = staticmethod(global_avg_pool_features)
    _kind = "avg"
