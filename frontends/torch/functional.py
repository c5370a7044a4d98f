"""Functional operations on `SparseConvTensor`\\ s: `sparse_add` (spconv ``functional.sparse_add``)."""

from __future__ import annotations

from typing import Any

import torch

import sparsecore as sc

from ._convert import check_same_device, core_context, to_torch
from .tensor import SparseConvTensor

__all__ = ["sparse_add", "sparse_add_hash_based"]


@torch.compiler.disable
def _union_rows(tensors: tuple[SparseConvTensor, ...]) -> tuple[Any, list[torch.Tensor]]:
    first = tensors[0]
    with core_context(first.indices.device):
        union, rows = sc.union_sites([t.core_indices() for t in tensors], first.spatial_shape, first.batch_size,
                                     assume_unique=True)
        return union, [to_torch(r) for r in rows]


def sparse_add(*tens: SparseConvTensor) -> SparseConvTensor:
    """Sum of sparse tensors over the union of their sites (differentiable in every input).

    When the union is the site set of the largest input, the output keeps that
    input's indices (same rows, same order) and its ``indice_dict``, so later
    layers can still reuse or invert its rulebooks; otherwise the sites come
    sorted by (batch, coordinates) with an empty ``indice_dict`` (spconv keeps
    the dict in the same case).

    Raises:
        ValueError: no input, or inputs with different spatial shapes, batch sizes,
            channel counts or devices.
    """
    if not tens:
        raise ValueError("sparse_add needs at least one SparseConvTensor")
    first = tens[0]
    for position, other in enumerate(tens):
        if not isinstance(other, SparseConvTensor):
            raise TypeError(f"sparse_add input {position} is a {type(other).__name__}, not a SparseConvTensor")
        if (other.spatial_shape, other.batch_size, other.features.shape[1]) != (
                first.spatial_shape, first.batch_size, first.features.shape[1]):
            raise ValueError(
                f"sparse_add inputs must share spatial_shape, batch_size and channels: input 0 has "
                f"{first.spatial_shape}, {first.batch_size}, {first.features.shape[1]}; input {position} has "
                f"{other.spatial_shape}, {other.batch_size}, {other.features.shape[1]}"
            )
    for other in tens:
        other._ensure_valid()  # unique, in-range sites: each input's union rows are distinct
    check_same_device("sparse_add", **{f"input {i}": t.features for i, t in enumerate(tens)})
    if all(t.indices is first.indices for t in tens):
        total = first.features
        for other in tens[1:]:
            total = total + other.features
        return first.replace_feature(total)
    if any(t.capacity is not None for t in tens):
        raise ValueError("sparse_add of tensors on different sites is not available in capacity mode (the union's "
                         "size depends on the data: a read back); add tensors on the very same sites, or run this "
                         "step in exact mode")
    union, rows = _union_rows(tens)
    dtype = first.features.dtype
    for other in tens[1:]:
        dtype = torch.promote_types(dtype, other.features.dtype)
    largest = max(range(len(tens)), key=lambda i: tens[i].indices.shape[0])
    count = int(union.shape[0])
    if count == tens[largest].indices.shape[0]:
        # the union is the largest input's site set: keep its rows, order and rulebooks
        # (its sites are unique, so its union rows are a permutation and fill every entry)
        order = torch.empty_like(rows[largest])
        order[rows[largest]] = torch.arange(count, device=order.device)
        rows = [order[r] for r in rows]
        base, indices, indice_dict = tens[largest], tens[largest].indices, tens[largest].indice_dict
    else:
        base, indices, indice_dict = first, to_torch(union), {}
    total = first.features.new_zeros((count, first.features.shape[1]), dtype=dtype)
    for tensor, tensor_rows in zip(tens, rows):
        total = total.index_add(0, tensor_rows, tensor.features.to(dtype))
    return SparseConvTensor._derived(base, total, indices, first.spatial_shape, indice_dict,
                                     trusted=base._trusted if indices is base.indices else True)


#: spconv's hash-based variant computes the same sum; one implementation serves both names.
sparse_add_hash_based = sparse_add
