"""Table modules of spconv 2.x: `JoinTable` (concatenate channels), `AddTable` (sum), `ConcatTable` (branches).

`JoinTable` and `AddTable` need inputs on the very same sites (same indices,
in the same order: e.g. branches of one tensor through submanifold layers);
`AddTableMisaligned` adds tensors on different sites with `sparse_add`.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .functional import sparse_add
from .modules import SparseModule
from .tensor import SparseConvTensor

__all__ = ["JoinTable", "AddTable", "AddTableMisaligned", "ConcatTable"]


def _check_aligned(table: str, inputs: Sequence[SparseConvTensor], same_channels: bool) -> None:
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise ValueError(f"{table} expects a non-empty list of SparseConvTensors, got {type(inputs).__name__}")
    first = inputs[0]
    for position, tensor in enumerate(inputs):
        if not isinstance(tensor, SparseConvTensor):
            raise TypeError(f"{table} input {position} is a {type(tensor).__name__}, not a SparseConvTensor")
        tensor._ensure_valid()
        problems = []
        if tensor.spatial_shape != first.spatial_shape:
            problems.append(f"spatial_shape {tensor.spatial_shape} vs {first.spatial_shape}")
        if tensor.batch_size != first.batch_size:
            problems.append(f"batch_size {tensor.batch_size} vs {first.batch_size}")
        if same_channels and tensor.features.shape[1] != first.features.shape[1]:
            problems.append(f"{tensor.features.shape[1]} channels vs {first.features.shape[1]}")
        if tensor.indices is not first.indices and (
                tensor.indices.shape != first.indices.shape or not torch.equal(tensor.indices, first.indices)):
            problems.append("different indices")
        if problems:
            raise ValueError(
                f"you can't use {table} on sparse tensors with different sites: input {position} vs input 0: "
                + "; ".join(problems) + ". Use AddTableMisaligned / sparse_add for tensors on different sites."
            )


class JoinTable(SparseModule):
    """Concatenates the channels of tensors on the same sites."""

    def forward(self, input: Sequence[SparseConvTensor]) -> SparseConvTensor:
        _check_aligned("JoinTable", input, same_channels=False)
        return input[0].replace_feature(torch.cat([t.features for t in input], 1))

    def input_spatial_size(self, out_size):
        return out_size


class AddTable(SparseModule):
    """Sums the features of tensors on the same sites."""

    def forward(self, input: Sequence[SparseConvTensor]) -> SparseConvTensor:
        _check_aligned("AddTable", input, same_channels=True)
        total = input[0].features
        for tensor in input[1:]:
            total = total + tensor.features
        return input[0].replace_feature(total)

    def input_spatial_size(self, out_size):
        return out_size


class AddTableMisaligned(SparseModule):
    """Sums tensors on different sites (over the union of their sites)."""

    def forward(self, input: Sequence[SparseConvTensor]) -> SparseConvTensor:
        return sparse_add(*input)

    def input_spatial_size(self, out_size):
        return out_size


class ConcatTable(SparseModule):
    """Applies each child module to the input and returns the list of results."""

    def forward(self, input):
        return [module(input) for module in self._modules.values()]

    def add(self, module):
        self._modules[str(len(self._modules))] = module
        return self

    def input_spatial_size(self, out_size):
        return self._modules["0"].input_spatial_size(out_size)
