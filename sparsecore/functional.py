"""Tensor-level operations: a layer's geometry (rulebook, with ``indice_key`` reuse) plus its feature pass.

These are the NumPy/CuPy user's API: find or build the rulebook through the
one geometry path (`sparsecore.layer_geometry.find_layer_rulebook`, which the
frontends call too), run the feature pass, wrap the result on the output
sites. The output holds the input's rulebook cache plus the layer's entry
(copy-on-write: the input and sibling branches do not see the layer's key),
spconv's ``indice_dict`` rule and the rule of both frontends.
"""

from __future__ import annotations

from typing import Any

from ._dispatch import array_module, from_core_array, to_core_array
from .conv import check_weight_layout, conv_forward
from .dense import union_sites
from .geometry import ConvGeometry, PerAxis
from .pool import avg_pool_forward, global_avg_pool_forward, global_max_pool_forward, max_pool_forward
from .capacity import true_rows
from .layer_geometry import FoundRulebook, find_layer_rulebook
from .rulebook import Rulebook
from .tensor import RulebookCache, SparseTensor

__all__ = [
    "layer_rulebook",
    "sparse_conv",
    "sparse_max_pool",
    "sparse_avg_pool",
    "global_max_pool",
    "global_avg_pool",
    "sparse_add",
]


def layer_rulebook(x: SparseTensor, geometry: ConvGeometry, indice_key: str | None = None) -> Rulebook:
    """The rulebook of a layer with ``geometry`` on ``x``, by `find_layer_rulebook` (the one geometry path).

    Found in ``x``'s cache (canonically, or under ``indice_key`` after checking it
    fits) or built; the cache `find_layer_rulebook` returns is stored in
    ``x.rulebooks`` (for callers that run the feature passes themselves on ``x``'s
    sites, e.g. `sparsecore.runtime`; the layers of this module hand it to their
    output instead, leaving ``x``'s cache as it is). For
    ``geometry.kind == "inverse"`` the rulebook under ``indice_key`` (a regular
    conv or pool's) is reversed; the key is required.

    Raises:
        ValueError: a cached rulebook that does not fit, a non-submanifold layer
            whose key holds another layer's rulebook, or an inverse conv without a
            matching ``indice_key``.
    """
    found = _layer(x, geometry, indice_key)
    x.rulebooks.value = found.cache
    return found.rulebook


def _layer(x: SparseTensor, geometry: ConvGeometry, indice_key: str | None) -> FoundRulebook:
    """The layer's rulebook and the cache its output holds (the input's cache is left as it is)."""
    return find_layer_rulebook(x.rulebooks.value, x.sites, geometry, indice_key, capacity=x.capacity)


def _output(x: SparseTensor, features: Any, found: FoundRulebook) -> SparseTensor:
    """The layer's output tensor, its arrays in the library of ``x``'s (torch in, torch out),
    holding a new handle on the cache `find_layer_rulebook` returned (copy-on-write)."""
    rulebook = found.rulebook
    cache = x.rulebooks if found.cache is x.rulebooks.value else RulebookCache(found.cache)
    features = from_core_array(features, like=x.features)
    if rulebook.output_indices is x.core_indices:
        return x.replace(features, rulebooks=cache)
    indices = from_core_array(rulebook.output_indices, like=x.indices)
    return x.with_sites(features, indices, rulebook.output_spatial_shape, core_indices=rulebook.output_indices,
                        rulebooks=cache)


def sparse_conv(x: SparseTensor, weight: Any, bias: Any | None = None, *, kind: str = "regular",
                stride: PerAxis = 1, padding: PerAxis = 0, dilation: PerAxis = 1,
                output_padding: PerAxis = 0, groups: int = 1,
                indice_key: str | None = None) -> SparseTensor:
    """A sparse convolution layer's forward on a `SparseTensor`.

    Args:
        x: the input.
        weight: ``[C_out, *kernel_size, C_in // groups]``; the kernel size is read from it.
        bias: optional ``[C_out]``.
        kind: ``"subm"``, ``"regular"``, ``"transposed"`` or ``"inverse"``.
        stride, padding, dilation, output_padding: per-axis ints (ignored for subm
            except dilation; inverse takes them from the paired layer).
        groups: channel groups.
        indice_key: cache key for rulebook reuse (required for ``kind="inverse"``).

    Returns:
        The output `SparseTensor`, sharing ``x``'s rulebook cache.
    """
    weight = to_core_array(weight, "weight")
    # the layout first: the kernel size is read from the weight, and a torch-layout
    # [out, in, *k] weight would otherwise be reported as an odd kernel size
    check_weight_layout(weight, x.num_channels, groups, x.ndim)
    kernel_size = tuple(int(size) for size in weight.shape[1:-1])
    if kind == "inverse":
        geometry = ConvGeometry.create(x.ndim, kernel_size, kind="regular")
        geometry = ConvGeometry("inverse", geometry.kernel_size, geometry.stride, geometry.padding,
                                geometry.dilation, geometry.output_padding)
    else:
        geometry = ConvGeometry.create(x.ndim, kernel_size, stride, padding, dilation,
                                       output_padding, kind=kind)
    found = _layer(x, geometry, indice_key)
    return _output(x, conv_forward(x.core_features, weight, found.rulebook, bias=bias, groups=groups), found)


def _pool_rulebook(x: SparseTensor, kernel_size: PerAxis, stride: PerAxis | None, padding: PerAxis,
                   dilation: PerAxis, subm: bool, indice_key: str | None) -> FoundRulebook:
    geometry = ConvGeometry.create(x.ndim, kernel_size, kernel_size if stride is None else stride,
                                   padding, dilation, kind="subm" if subm else "regular")
    return _layer(x, geometry, indice_key)


def sparse_max_pool(x: SparseTensor, kernel_size: PerAxis, stride: PerAxis | None = None,
                    padding: PerAxis = 0, dilation: PerAxis = 1, *, subm: bool = False,
                    indice_key: str | None = None) -> SparseTensor:
    """Max over the active sites of each window (stride defaults to the kernel size)."""
    found = _pool_rulebook(x, kernel_size, stride, padding, dilation, subm, indice_key)
    out, _ = max_pool_forward(x.core_features, found.rulebook)
    return _output(x, out, found)


def sparse_avg_pool(x: SparseTensor, kernel_size: PerAxis, stride: PerAxis | None = None,
                    padding: PerAxis = 0, dilation: PerAxis = 1, *, subm: bool = False,
                    indice_key: str | None = None) -> SparseTensor:
    """Mean over the active sites of each window (stride defaults to the kernel size)."""
    found = _pool_rulebook(x, kernel_size, stride, padding, dilation, subm, indice_key)
    return _output(x, avg_pool_forward(x.core_features, found.rulebook), found)


def _true_sites(x: SparseTensor) -> tuple[Any, Any]:
    """``x``'s features and sites without capacity mode's padding (the global pools group rows on the host)."""
    if x.capacity is None:
        return x.core_features, x.core_indices
    rows = true_rows(x.core_indices)
    return x.core_features[:rows], x.core_indices[:rows]


def global_max_pool(x: SparseTensor) -> Any:
    """``[B, C]`` channel-wise maximum per batch element (0 for an empty element), in ``x``'s library."""
    return from_core_array(global_max_pool_forward(*_true_sites(x), x.batch_size)[0], like=x.features)


def global_avg_pool(x: SparseTensor) -> Any:
    """``[B, C]`` channel-wise mean per batch element (0 for an empty element), in ``x``'s library."""
    return from_core_array(global_avg_pool_forward(*_true_sites(x), x.batch_size), like=x.features)


def sparse_add(*tensors: SparseTensor) -> SparseTensor:
    """Sum of sparse tensors over the union of their sites.

    Sites present in several inputs add their features; the output sites are
    sorted by (batch, coordinates) unless every input has the very same indices,
    in which case they are kept as they are. The output shares the first
    input's rulebook cache.

    Raises:
        ValueError: on no inputs, or inputs with different grids, batch sizes or channels.
    """
    if not tensors:
        raise ValueError("sparse_add needs at least one SparseTensor")
    first = tensors[0]
    for position, other in enumerate(tensors[1:], start=1):
        if (other.spatial_shape, other.batch_size, other.num_channels) != (
                first.spatial_shape, first.batch_size, first.num_channels):
            raise ValueError(
                f"sparse_add inputs must share spatial_shape, batch_size and channels: input 0 "
                f"has {first.spatial_shape}, {first.batch_size}, {first.num_channels}; input "
                f"{position} has {other.spatial_shape}, {other.batch_size}, {other.num_channels}"
            )
    if all(other.indices is first.indices for other in tensors):
        total = first.core_features
        for other in tensors[1:]:
            total = total + other.core_features
        return first.replace(from_core_array(total, like=first.features))
    if any(t.capacity is not None for t in tensors):
        raise ValueError(
            "sparse_add of tensors on different sites is not available in capacity mode (its union's size "
            "depends on the data, a read back); add tensors on the very same sites, or run this step in exact "
            "mode (capacity=None)"
        )
    # every SparseTensor's sites were checked unique where it was made
    union, rows = union_sites([t.core_indices for t in tensors], first.spatial_shape, first.batch_size,
                              assume_unique=all(t._checked for t in tensors))
    xp = array_module(first.core_features)
    dtype = xp.result_type(*[t.core_features.dtype for t in tensors])
    total = xp.zeros((union.shape[0], first.num_channels), dtype=dtype)
    for tensor, tensor_rows in zip(tensors, rows):
        total[tensor_rows] += tensor.core_features.astype(dtype, copy=False)
    return first.with_sites(from_core_array(total, like=first.features), from_core_array(union, like=first.indices),
                            first.spatial_shape)
