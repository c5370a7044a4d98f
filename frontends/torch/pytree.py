"""`SparseConvTensor` as a torch pytree node (registered when ``sparsecore.torch`` is imported).

Leaves: ``features`` and ``indices``; context: ``(spatial_shape, batch_size)``.
So ``torch.utils._pytree.tree_map``, ``torch.export``'s input and output
specs and anything else that walks pytrees see the two tensors of a sparse
tensor. Unflattening builds a new, validated `SparseConvTensor` with an empty
``indice_dict``: rulebooks are derived data, rebuilt by the next layer (a
tree-mapped tensor, e.g. moved to another device, must not reuse rulebooks of
the old one).

What ``torch.export`` can and cannot do with sparsecore models is in
docs/deployment.md: the feature passes are custom ops with fake kernels, but a
layer's geometry (hashing the input sites into a rulebook) reads the indices
on the host and has data-dependent sizes, so tracing stops at the first layer
that builds a rulebook.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree

from .tensor import SparseConvTensor

__all__ = ["SERIALIZED_TYPE_NAME", "flatten", "unflatten", "register"]

SERIALIZED_TYPE_NAME = "sparsecore.torch.SparseConvTensor"


def flatten(tensor: SparseConvTensor) -> tuple[list[Any], tuple[tuple[int, ...], int]]:
    """``[features, indices]`` and the context ``(spatial_shape, batch_size)``."""
    return [tensor.features, tensor.indices], (tuple(int(s) for s in tensor.spatial_shape), int(tensor.batch_size))


def _flatten_with_keys(tensor: SparseConvTensor) -> tuple[list[tuple[Any, Any]], tuple[tuple[int, ...], int]]:
    leaves, context = flatten(tensor)
    keys = (pytree.GetAttrKey("features"), pytree.GetAttrKey("indices"))
    return list(zip(keys, leaves)), context


def _symbolic(tensor: Any) -> bool:
    """True for the fake tensors ``torch.export`` traces with (no data to check)."""
    from torch._subclasses.fake_tensor import is_fake

    return isinstance(tensor, torch.Tensor) and is_fake(tensor)


def unflatten(leaves: Any, context: tuple[tuple[int, ...], int]) -> SparseConvTensor:
    """A new `SparseConvTensor` from ``[features, indices]``, checked as the constructor checks them.

    Under ``torch.export`` (fake leaves, no data) only the traced program's own checks apply.
    """
    features, indices = leaves
    spatial_shape, batch_size = context
    if _symbolic(features) or _symbolic(indices) or torch.compiler.is_exporting():
        tensor = SparseConvTensor.__new__(SparseConvTensor)
        tensor._init(features, indices, list(spatial_shape), int(batch_size), None, None, None, False, True)
        return tensor
    return SparseConvTensor(features, indices, list(spatial_shape), batch_size)


def _to_dumpable(context: tuple[tuple[int, ...], int]) -> str:
    spatial_shape, batch_size = context
    return ",".join(str(size) for size in (batch_size, *spatial_shape))


def _from_dumpable(dumped: str) -> tuple[tuple[int, ...], int]:
    batch_size, *spatial_shape = (int(value) for value in dumped.split(","))
    return tuple(spatial_shape), batch_size


def register() -> None:
    """Registers `SparseConvTensor` with torch's pytree (idempotent)."""
    if SparseConvTensor in pytree.SUPPORTED_NODES:
        return
    pytree.register_pytree_node(
        SparseConvTensor, flatten, unflatten, serialized_type_name=SERIALIZED_TYPE_NAME,
        to_dumpable_context=_to_dumpable, from_dumpable_context=_from_dumpable,
        flatten_with_keys_fn=_flatten_with_keys,
    )
    # torch.export.save keeps the example inputs; let torch.load(weights_only=True) rebuild them
    torch.serialization.add_safe_globals([SparseConvTensor])


register()
