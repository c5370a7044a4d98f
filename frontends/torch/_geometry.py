"""A layer's rulebook for sparsecore.torch: a thin adapter over the core's one geometry path.

`layer_indice_data` hands the input's sites and caches to
`sparsecore.layer_geometry.find_layer_rulebook`, which holds every rule (reuse
by sites and geometry, spconv's ``indice_key`` rules, inverse convs, misfit
errors naming both geometries), and wraps what it returns: an `IndiceData`
view of the rulebook, and the output's ``indice_dict``, a copy of the input's
with this layer's key added (spconv's copy-on-write: ``replace_feature`` and
``shadow_copy`` share the dict, each layer hands its output a new one, so a
model run twice on one input starts afresh and branches do not see each
other's keys). It runs eagerly, outside ``torch.compile`` graphs
(``torch.compiler.disable``: a compiled model has a graph break before each
layer that looks up a rulebook; the feature passes after it are captured).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import sparsecore as sc
from sparsecore.layer_geometry import GeometryCache, InputSites, find_layer_rulebook, sites_identity

from ._convert import core_context
from .indice_data import IndiceData, IndiceDict, canonical_cache
from .tensor import SparseConvTensor

__all__ = ["layer_indice_data", "check_input"]


def check_input(layer: str, x: Any, in_channels: Optional[int] = None, ndim: Optional[int] = None) -> None:
    """Raises a clear error for a non-SparseConvTensor input, a tensor that fails its checks
    (shapes, rows, range, duplicate sites), or a channel / dimension mismatch."""
    if not isinstance(x, SparseConvTensor):
        raise TypeError(f"{layer} expects a sparsecore.torch.SparseConvTensor, got {type(x).__name__}")
    x._ensure_valid()  # free for a tensor known valid; a full check after reassigned indices / unpickling
    if ndim is not None and len(x.spatial_shape) != ndim:
        raise ValueError(
            f"{layer} is a {ndim}-D layer but the input has {len(x.spatial_shape)} spatial axes "
            f"(spatial_shape {x.spatial_shape})"
        )
    if x.features.ndim != 2:
        raise ValueError(f"{layer}: features must be 2-D [N, C], got shape {tuple(x.features.shape)}")
    if x.features.dtype in (torch.qint8, torch.quint8, torch.int8):
        raise TypeError(
            f"{layer} is a float layer but its input features are {x.features.dtype} (int8): dequantize them "
            "first (x.dequantize()), or convert this layer too (sparsecore.torch.quantization)")
    if in_channels is not None and x.features.shape[1] != in_channels:
        raise ValueError(
            f"{layer} has in_channels={in_channels} but the input features have "
            f"{x.features.shape[1]} channels (features shape {tuple(x.features.shape)}); check the "
            "previous layer's out_channels or this layer's in_channels"
        )


def _input_cache(x: SparseConvTensor, indice_key: Optional[str]) -> GeometryCache:
    """The core cache of ``x``: its ``indice_dict``'s keys and canonical entries."""
    saved = x.indice_dict.get(indice_key) if indice_key is not None else None
    if saved is not None and not isinstance(saved, IndiceData):
        raise TypeError(f"indice_dict[{indice_key!r}] is a {type(saved).__name__}, not a sparsecore IndiceData")
    aliases = {key: data.rulebook for key, data in x.indice_dict.items() if isinstance(data, IndiceData)}
    return GeometryCache.from_aliases(aliases, canonical_cache(x.indice_dict))


@torch.compiler.disable
def layer_indice_data(layer: str, x: SparseConvTensor, geometry: sc.ConvGeometry, indice_key: Optional[str],
                      algo: Any = None) -> tuple[IndiceData, dict]:
    """The rulebook of a layer with ``geometry`` on ``x`` and the output's ``indice_dict``.

    Args:
        layer: the layer's name, for messages.
        x: the input tensor (checked by `check_input`).
        geometry: the layer's geometry (kind ``"inverse"`` for an inverse conv).
        indice_key: the layer's key, or None.
        algo: recorded on a new `IndiceData` (spconv compatibility; unused).

    Returns:
        ``(data, indice_dict)``: the rulebook's view (its pair tensors made) and
        the dict to hand to the output.

    Raises:
        ValueError: an inverse conv without a matching key, a non-submanifold layer
            whose key exists, or a saved rulebook that does not fit.
        TypeError: an ``indice_dict`` entry under the key that is not an `IndiceData`.
    """
    core_indices = x.core_indices()
    sites = InputSites(sites_identity(core_indices), core_indices, tuple(x.spatial_shape), x.batch_size,
                       checked=x._trusted)
    with core_context(x.indices.device):
        found = find_layer_rulebook(_input_cache(x, indice_key), sites, geometry, indice_key, layer=layer)
        saved = x.indice_dict.get(indice_key) if indice_key is not None else None
        if isinstance(saved, IndiceData) and saved.rulebook is found.rulebook and saved.indices is x.indices:
            data = saved
        elif geometry.kind == "inverse":  # back onto the paired layer's input sites
            data = IndiceData(found.rulebook, x.indices, saved.indices, algo)
        else:
            data = IndiceData(found.rulebook, x.indices, x.indices if geometry.kind == "subm" else None, algo)
        # the torch views, made here, eagerly, outside compiled graphs
        _ = (data.pair_input, data.pair_output, data.out_indices)
    indice_dict = IndiceDict(x.indice_dict, found.cache)
    if indice_key is not None and geometry.kind != "inverse" and indice_key not in indice_dict:
        indice_dict[indice_key] = data
    return data, indice_dict
