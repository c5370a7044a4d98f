"""Containers and small modules of spconv 2.x: `SparseModule`, `SparseSequential`, `ToDense`, ...

`SparseSequential` passes the `SparseConvTensor` itself to sparse modules
(subclasses of `SparseModule`, `SparseBatchNorm`, `SparseReLU`) and applies
any other module (``nn.BatchNorm1d``, ``nn.ReLU``, ...) to its features,
skipping it when the tensor has no active site, exactly as spconv does.
`SparseModule` lives in `sparsecore.torch.layer` (the layers' shared base) and
`start_benchmark` in `sparsecore.torch.benchmark_mode`; both are re-exported
here under spconv's module path.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch
from torch import nn

from .capacity import has_padding, masked_batch_norm
from .conv import SparseConvolution
from .fx import FxLeafModule, traces_into_containers
from .layer import SparseModule, start_benchmark
from .tensor import SparseConvTensor

__all__ = [
    "SparseModule",
    "SparseSequential",
    "ToDense",
    "RemoveGrid",
    "SparseBatchNorm",
    "SparseSyncBatchNorm",
    "SparseReLU",
    "SparseIdentity",
    "Identity",
    "assign_name_for_sparse_modules",
    "is_spconv_module",
    "is_sparse_conv",
    "start_benchmark",
]


class _OnFeatures:
    """Applies the torch module it is mixed into to a `SparseConvTensor`'s features (or to a plain tensor)."""

    def forward(self, input):
        if isinstance(input, SparseConvTensor):
            if isinstance(self, nn.BatchNorm1d) and has_padding(input):  # statistics of the true rows only
                return input.replace_feature(masked_batch_norm(self, input.features, input.valid_rows()))
            return input.replace_feature(super().forward(input.features))
        return super().forward(input)


class SparseBatchNorm(_OnFeatures, FxLeafModule, nn.BatchNorm1d):
    """``BatchNorm1d`` on the features of a `SparseConvTensor` (or on a plain tensor)."""


class SparseSyncBatchNorm(_OnFeatures, FxLeafModule, nn.SyncBatchNorm):
    """``SyncBatchNorm`` on the features of a `SparseConvTensor`."""


class SparseReLU(_OnFeatures, FxLeafModule, nn.ReLU):
    """``ReLU`` on the features of a `SparseConvTensor`."""


class SparseIdentity(_OnFeatures, FxLeafModule, nn.Identity):
    """``Identity`` on the features of a `SparseConvTensor`."""


class Identity(nn.Module):
    """Returns its input (spconv ``Identity``)."""

    def forward(self, input):
        return input

    def input_spatial_size(self, out_size):
        return out_size


def is_spconv_module(module: nn.Module) -> bool:
    """True for modules that take a `SparseConvTensor` in `SparseSequential`."""
    return isinstance(module, (SparseModule, SparseBatchNorm, SparseReLU))


def is_sparse_conv(module: nn.Module) -> bool:
    """True for sparse convolution layers."""
    return isinstance(module, SparseConvolution)


class SparseSequential(SparseModule):
    """A sequential container of sparse and plain modules (spconv ``SparseSequential``).

    Accepts ``*modules``, one ``OrderedDict`` of named modules, or keyword modules.
    """

    def __init__(self, *args: nn.Module, **kwargs: nn.Module) -> None:
        super().__init__()
        if len(args) == 1 and isinstance(args[0], OrderedDict):
            for key, module in args[0].items():
                self.add_module(key, module)
        else:
            for index, module in enumerate(args):
                self.add_module(str(index), module)
        for name, module in kwargs.items():
            if name in self._modules:
                raise ValueError(f"SparseSequential: module name {name!r} exists")
            self.add_module(name, module)

    def fx_is_leaf(self, tracer) -> bool:
        """A leaf for plain fx tracers; traced into by the quantization tracer (see `sparsecore.torch.fx`)."""
        return not traces_into_containers(tracer) and super().fx_is_leaf(tracer)

    def __getitem__(self, idx: int) -> nn.Module:
        if not -len(self) <= idx < len(self):
            raise IndexError(f"index {idx} is out of range")
        if idx < 0:
            idx += len(self)
        return list(self._modules.values())[idx]

    def __len__(self) -> int:
        return len(self._modules)

    def add(self, module: nn.Module, name: Optional[str] = None) -> None:
        """Appends ``module`` (named ``str(len(self))`` by default)."""
        if name is None:
            name = str(len(self._modules))
        if name in self._modules:
            raise KeyError(f"SparseSequential: module name {name!r} exists")
        self.add_module(name, module)

    def forward(self, input):
        for module in self._modules.values():
            if is_spconv_module(module):
                input = module(input)
            elif isinstance(input, SparseConvTensor):
                input._ensure_valid()  # before a feature module (BatchNorm statistics) sees the rows
                if input.indices.shape[0] != 0:
                    if isinstance(module, nn.BatchNorm1d) and has_padding(input):  # capacity mode: true rows
                        input = input.replace_feature(masked_batch_norm(module, input.features, input.valid_rows()))
                    else:
                        input = input.replace_feature(module(input.features))
            else:
                input = module(input)
        return input


class ToDense(SparseModule):
    """`SparseConvTensor` to a dense ``[B, C, *spatial]`` tensor."""

    def forward(self, x: SparseConvTensor) -> torch.Tensor:
        return x.dense()


class RemoveGrid(SparseModule):
    """Drops the tensor's pre-allocated ``grid`` (kept for spconv compatibility)."""

    def forward(self, x: SparseConvTensor) -> SparseConvTensor:
        x.grid = None
        return x


def assign_name_for_sparse_modules(module: nn.Module) -> None:
    """Sets ``_sparse_unique_name`` of every `SparseModule` to its qualified name."""
    for name, child in module.named_modules():
        if isinstance(child, SparseModule):
            child._sparse_unique_name = name
