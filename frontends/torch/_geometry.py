"""A layer's rulebook, with spconv's ``indice_key`` rules, built by the core.

This is the geometry half of every conv / pool layer: it runs eagerly, outside
``torch.compile`` graphs (`layer_indice_data` is ``torch.compiler.disable``\\ d,
so a compiled model has a graph break before each layer that builds or looks
up a rulebook; the feature passes after it are captured). The rules, as in
spconv 2.x:

- a submanifold layer (conv or pool) whose ``indice_key`` is already in the
  input's ``indice_dict`` reuses that rulebook, after the core checks it fits
  (same geometry, spatial shape and sites);
- any other layer whose key already exists is an error (spconv asserts);
- an inverse conv reverses the rulebook of the regular conv / pool saved
  under its key, after checking its input is that layer's output;
- a new rulebook is built by `sparsecore.build_rulebook` and, with a key,
  saved in a *copy* of the input's dict handed to the output.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import sparsecore as sc

from ._convert import core_context, to_torch
from .tensor import IndiceData, SparseConvTensor

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


def _from_rulebook(x: SparseConvTensor, rulebook: sc.Rulebook, core_indices: Any, algo: Any) -> IndiceData:
    if rulebook.output_indices is core_indices:
        out_indices = x.indices
    else:
        out_indices = to_torch(rulebook.output_indices)
    return IndiceData(rulebook, x.indices, out_indices, to_torch(rulebook.pair_input),
                      to_torch(rulebook.pair_output), algo, rulebook.output_indices)


@torch.compiler.disable
def layer_indice_data(layer: str, x: SparseConvTensor, geometry: sc.ConvGeometry, indice_key: Optional[str],
                      algo: Any = None) -> tuple[IndiceData, dict]:
    """The rulebook of a layer with ``geometry`` on ``x`` and the output's ``indice_dict``.

    Args:
        layer: the layer's name, for messages.
        x: the input tensor.
        geometry: the layer's geometry (kind ``"inverse"`` for an inverse conv).
        indice_key: the layer's key, or None.
        algo: recorded on a new `IndiceData` (spconv compatibility; unused).

    Returns:
        ``(data, indice_dict)``.

    Raises:
        ValueError: an inverse conv without a matching key, a non-submanifold layer
            whose key exists, or a saved rulebook that does not fit.
    """
    saved = x.indice_dict.get(indice_key) if indice_key is not None else None
    core_indices = x.core_indices()
    spatial_shape = tuple(x.spatial_shape)
    with core_context(x.indices.device):
        if geometry.kind == "inverse":
            if saved is None:
                known = sorted(str(key) for key in x.indice_dict)
                raise ValueError(
                    f"{layer} needs the indice_key of the SparseConv / SparseMaxPool layer it inverts: "
                    f"got indice_key={indice_key!r}, and the input's indice_dict holds "
                    f"{known if known else 'no rulebooks'}. Give the paired layer the same indice_key and "
                    "feed this layer a tensor derived from that layer's output."
                )
            if not isinstance(saved, IndiceData):
                raise TypeError(f"indice_dict[{indice_key!r}] is a {type(saved).__name__}, not a sparsecore IndiceData")
            if saved.is_subm:
                raise ValueError(
                    f"{layer}: indice_key {indice_key!r} belongs to a submanifold layer; an inverse conv "
                    "can only invert a regular (strided) SparseConv or SparseMaxPool / SparseAvgPool"
                )
            sc.check_inverse_fits(saved.rulebook, geometry.kernel_size, core_indices, spatial_shape, indice_key)
            return saved.inverse(), dict(x.indice_dict)
        if saved is not None:
            if not isinstance(saved, IndiceData):
                raise TypeError(f"indice_dict[{indice_key!r}] is a {type(saved).__name__}, not a sparsecore IndiceData")
            if geometry.kind != "subm":
                raise ValueError(
                    f"{layer}: indice_key {indice_key!r} already exists in this sparse tensor; only "
                    "submanifold layers may share an indice_key (to reuse its rulebook). Give this "
                    "layer its own indice_key."
                )
            sc.check_rulebook_fits(saved.rulebook, geometry, core_indices, spatial_shape, indice_key)
            if saved.indices is not x.indices:
                saved = IndiceData(saved.rulebook, x.indices, x.indices, saved.pair_input,
                                   saved.pair_output, saved.algo, core_indices)
            return saved, dict(x.indice_dict)
        rulebook = sc.build_rulebook(core_indices, spatial_shape, x.batch_size, geometry,
                                     assume_unique=x._trusted)
        x._trusted = True  # the builder checked the sites (range and duplicates)
        data = _from_rulebook(x, rulebook, core_indices, algo)
        indice_dict = dict(x.indice_dict)
        if indice_key is not None:
            indice_dict[indice_key] = data
        return data, indice_dict
