"""Containers and small modules of spconv 2.x: `SparseModule`, `SparseSequential`, `ToDense`, ...

`SparseSequential` passes the `SparseConvTensor` itself to sparse modules
(subclasses of `SparseModule`, `SparseBatchNorm`, `SparseReLU`) and applies
any other module (``nn.BatchNorm1d``, ``nn.ReLU``, ...) to its features,
skipping it when the tensor has no active site, exactly as spconv does.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Optional

import torch
from torch import nn

from .fx import FxLeafModule, traces_into_containers
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


class SparseModule(FxLeafModule, nn.Module):
    """Marker base class: `SparseSequential` hands these modules the whole `SparseConvTensor`.

    Under ``torch.fx`` tracing a sparse module is a leaf (one ``call_module`` node).
    """

    def __init__(self, name: Optional[str] = None) -> None:
        super().__init__()
        self.name = name
        self._sparse_unique_name = ""


class SparseBatchNorm(FxLeafModule, nn.BatchNorm1d):
    """``BatchNorm1d`` on the features of a `SparseConvTensor` (or on a plain tensor)."""

    def forward(self, input):
        if isinstance(input, SparseConvTensor):
            return input.replace_feature(super().forward(input.features))
        return super().forward(input)


class SparseSyncBatchNorm(FxLeafModule, nn.SyncBatchNorm):
    """``SyncBatchNorm`` on the features of a `SparseConvTensor`."""

    def forward(self, input):
        if isinstance(input, SparseConvTensor):
            return input.replace_feature(super().forward(input.features))
        return super().forward(input)


class SparseReLU(FxLeafModule, nn.ReLU):
    """``ReLU`` on the features of a `SparseConvTensor`."""

    def forward(self, input):
        if isinstance(input, SparseConvTensor):
            return input.replace_feature(super().forward(input.features))
        return super().forward(input)


class SparseIdentity(FxLeafModule, nn.Identity):
    """``Identity`` on the features of a `SparseConvTensor`."""

    def forward(self, input):
        if isinstance(input, SparseConvTensor):
            return input.replace_feature(super().forward(input.features))
        return super().forward(input)


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
    from .conv import SparseConvolution

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


# --------------------------------------------------------------------------- benchmark records


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _BenchmarkRecord:
    """Fills ``input.benchmark_record[name]`` like spconv's benchmark mode."""

    def __init__(self, entry: dict, device: torch.device) -> None:
        self.entry = entry
        self.device = device
        _synchronize(device)
        self.start = time.perf_counter()

    def indices_done(self) -> None:
        _synchronize(self.device)
        now = time.perf_counter()
        self.entry["indice_gen_time"].append(now - self.start)
        self.start = now

    def done(self, num_points: int, num_out_points: int) -> None:
        _synchronize(self.device)
        self.entry["time"].append(time.perf_counter() - self.start)
        self.entry["num_points"].append(int(num_points))
        self.entry["num_out_points"].append(int(num_out_points))


@torch.compiler.disable
def start_benchmark(module: SparseModule, input: SparseConvTensor, kind: str,
                    params: Callable[[], dict]) -> _BenchmarkRecord:
    """Starts timing one layer call in benchmark mode (``SparseConvTensor(..., benchmark=True)``)."""
    name = module.name
    if name is None:
        raise ValueError(
            "benchmark mode needs named sparse modules: pass name=... to the layers (or give them "
            "names with assign_name_for_sparse_modules and set .name)"
        )
    if name not in input.benchmark_record:
        input.benchmark_record[name] = {"type": kind, "indice_gen_time": [], "time": [], "num_points": [],
                                        "num_out_points": [], "params": params()}
    return _BenchmarkRecord(input.benchmark_record[name], input.features.device)

