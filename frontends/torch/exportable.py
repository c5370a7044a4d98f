"""``torch.export`` of sparsecore.torch models: geometry as an opaque op with data-dependent sizes.

A layer's eager geometry (`_geometry.layer_indice_data`) reads the sites on
the host, which ``torch.export`` cannot trace. Under export, sparse convs run
`export_forward` instead, built from two ``torch.library`` custom ops:

- ``sparsecore::export_rulebook(indices, ...) -> (out_indices, pair_input,
  pair_output, offset_counts)``: the core's `sparsecore.build_rulebook`; its
  fake kernel gives the output sites and the pairs unbacked sizes (at least
  one output site: a strided layer of a non-empty input has one);
- ``sparsecore::export_conv(features, weight, bias, pair_input, pair_output,
  offset_counts, out_indices, ...)``: the core's `sparsecore.conv_forward`;
  its fake output has one row per output site.

``indice_key`` sharing is kept: the output's ``indice_dict`` holds an
`ExportRulebook` (tensors only) for the key, reused by a SubM layer with the
same kernel on the same sites and reversed by an inverse conv. The exported
program is therefore a graph of these ops plus BatchNorm, ReLU, adds,
``.dense()`` and views, valid for any input sites (export with a dynamic
number of sites to run it on other scans). Sparse max / avg pools take the
same path (``sparsecore::export_pool``); global pools do not.

`SparseConvolution.forward` (and the pools' forward) takes this path when ``torch.compiler.is_exporting()``,
so ``torch.export.export(model, (x,), dynamic_shapes=(sites_dynamic_shapes(),))``
works for models of sparse convs, BatchNorm, ReLU, adds, ``.dense()`` and views.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

import sparsecore as sc

from ._convert import core_context, core_float_view, core_view, to_torch
from .conv import SparseConvolution, spconv_1x1_weight
from .tensor import SparseConvTensor

__all__ = ["ExportRulebook", "export_forward", "export_pool_forward", "effective_weight", "layer_rulebook_key", "sites_dynamic_shapes"]


@dataclass(frozen=True)
class ExportRulebook:
    """A layer's rulebook as tensors, saved under its ``indice_key`` during export."""

    kind: str
    kernel_size: tuple[int, ...]
    dilation: tuple[int, ...]
    indices: Tensor
    out_indices: Tensor
    pair_input: Tensor
    pair_output: Tensor
    offset_counts: Tensor
    input_spatial_shape: tuple[int, ...]
    output_spatial_shape: tuple[int, ...]


@torch.library.custom_op("sparsecore::export_rulebook", mutates_args=())
def _export_rulebook(indices: Tensor, spatial_shape: list[int], batch_size: int, kind: str, kernel_size: list[int],
                     stride: list[int], padding: list[int], dilation: list[int],
                     output_padding: list[int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    geometry = sc.ConvGeometry.create(len(spatial_shape), kernel_size, stride, padding, dilation, output_padding,
                                      kind=kind)
    with core_context(indices.device):
        rulebook = sc.build_rulebook(core_view(indices, "indices"), spatial_shape, batch_size, geometry)
        counts = torch.tensor(rulebook.offset_counts, dtype=torch.int64)
        return (to_torch(rulebook.output_indices).clone(), to_torch(rulebook.pair_input).clone(),
                to_torch(rulebook.pair_output).clone(), counts)


@_export_rulebook.register_fake
def _(indices, spatial_shape, batch_size, kind, kernel_size, stride, padding, dilation, output_padding):
    context = torch.library.get_ctx()
    sites = indices.shape[0] if kind == "subm" else context.new_dynamic_size(min=1)
    pairs = context.new_dynamic_size()
    return (indices.new_empty((sites, indices.shape[1])), indices.new_empty(pairs), indices.new_empty(pairs),
            indices.new_empty(math.prod(kernel_size), dtype=torch.int64))


def _pair_map(pair_input: Tensor, pair_output: Tensor, offset_counts: Tensor, num_input: int, num_output: int,
              kernel_size: list[int]) -> sc.PairMap:
    starts = tuple(int(s) for s in np.concatenate([[0], np.cumsum(offset_counts.cpu().numpy())]))
    return sc.PairMap(core_view(pair_input, "pair_input"), core_view(pair_output, "pair_output"), starts,
                      int(num_input), int(num_output), tuple(kernel_size))


@torch.library.custom_op("sparsecore::export_pool", mutates_args=())
def _export_pool(features: Tensor, pair_input: Tensor, pair_output: Tensor, offset_counts: Tensor,
                 out_indices: Tensor, kernel_size: list[int], mode: str) -> Tensor:
    with core_context(features.device):
        pairs = _pair_map(pair_input, pair_output, offset_counts, features.shape[0], out_indices.shape[0],
                          kernel_size)
        values = core_float_view(features, "features")
        out = sc.max_pool_forward(values, pairs)[0] if mode == "max" else sc.avg_pool_forward(values, pairs)
        return to_torch(out, features.dtype)


@_export_pool.register_fake
def _(features, pair_input, pair_output, offset_counts, out_indices, kernel_size, mode):
    return features.new_empty((out_indices.shape[0], features.shape[1]))


@torch.library.custom_op("sparsecore::export_conv", mutates_args=())
def _export_conv(features: Tensor, weight: Tensor, bias: Optional[Tensor], pair_input: Tensor, pair_output: Tensor,
                 offset_counts: Tensor, out_indices: Tensor, kernel_size: list[int], groups: int) -> Tensor:
    with core_context(features.device):
        pairs = _pair_map(pair_input, pair_output, offset_counts, features.shape[0], out_indices.shape[0],
                          kernel_size)
        out = sc.conv_forward(core_float_view(features, "features"), core_float_view(weight, "weight"), pairs,
                              bias=None if bias is None else core_float_view(bias, "bias"), groups=groups)
        return to_torch(out, features.dtype)


@_export_conv.register_fake
def _(features, weight, bias, pair_input, pair_output, offset_counts, out_indices, kernel_size, groups):
    return features.new_empty((out_indices.shape[0], weight.shape[0]))


def export_pool_forward(module: Any, input: SparseConvTensor) -> SparseConvTensor:
    """A sparse max / avg pool's forward through the export ops (same results as the eager forward)."""
    key = module.indice_key
    rulebook = _rulebook(module, input, key)
    mode = "max" if module._kind == "SparseMaxPool" else "avg"
    features = torch.ops.sparsecore.export_pool(input.features, rulebook.pair_input, rulebook.pair_output,
                                                rulebook.offset_counts, rulebook.out_indices,
                                                list(module.kernel_size), mode)
    indice_dict = dict(input.indice_dict)
    if key is not None:
        indice_dict[key] = rulebook
    return SparseConvTensor._derived(input, features, rulebook.out_indices, list(rulebook.output_spatial_shape),
                                     indice_dict)


def effective_weight(module: SparseConvolution) -> Tensor:
    """The ``[out, *kernel, in // groups]`` weight the layer computes with (spconv's 1x1 reading applied)."""
    if getattr(module, "reads_weight_as_spconv_1x1", False):
        return spconv_1x1_weight(module.weight, module.in_channels, module.out_channels)
    return module.weight


def layer_rulebook_key(module: SparseConvolution) -> Optional[str]:
    """The key the layer reads and saves: a SubM 1x1 layer ignores its ``indice_key`` (spconv's shortcut)."""
    if getattr(module, "conv1x1", False) and module.subm:
        return None
    return module.indice_key


def _rulebook(module: Any, x: SparseConvTensor, key: Optional[str]) -> ExportRulebook:
    layer = f"{type(module).__name__}(indice_key={module.indice_key!r})"
    saved = x.indice_dict.get(key) if key is not None else None
    if saved is not None and not isinstance(saved, ExportRulebook):
        raise TypeError(f"{layer}: indice_dict[{key!r}] holds a {type(saved).__name__}; run the exported model "
                        "on a fresh SparseConvTensor")
    if getattr(module, "inverse", False):
        if saved is None or saved.kind != "regular":
            raise ValueError(f"{layer} inverts indice_key {key!r}, but no regular conv saved it before")
        return ExportRulebook("inverse", saved.kernel_size, saved.dilation, saved.out_indices, saved.indices,
                              saved.pair_output, saved.pair_input, saved.offset_counts, saved.output_spatial_shape,
                              saved.input_spatial_shape)
    kind = "subm" if module.subm else "transposed" if getattr(module, "transposed", False) else "regular"
    if saved is not None:
        if kind != "subm" or saved.kind != "subm" or saved.kernel_size != tuple(module.kernel_size) or \
                saved.dilation != tuple(module.dilation) or saved.indices is not x.indices:
            raise ValueError(f"{layer}: indice_key {key!r} exists and only a SubM layer with the same kernel and "
                             "dilation, on the same sites, may share it")
        return saved
    outputs = torch.ops.sparsecore.export_rulebook(
        x.indices, list(x.spatial_shape), x.batch_size, kind, list(module.kernel_size), list(module.stride),
        list(module.padding), list(module.dilation), list(getattr(module, "output_padding", [0] * len(module.stride))))
    out_indices = x.indices if kind == "subm" else outputs[0]
    shape = tuple(x.spatial_shape) if kind == "subm" else tuple(module._geometry.output_spatial_shape(x.spatial_shape))
    return ExportRulebook(kind, tuple(module.kernel_size), tuple(module.dilation), x.indices, out_indices,
                          outputs[1], outputs[2], outputs[3], tuple(x.spatial_shape), shape)


def export_forward(module: SparseConvolution, input: SparseConvTensor,
                   add_input: Optional[SparseConvTensor] = None) -> SparseConvTensor:
    """A sparse conv's forward through the export ops (same results as the eager forward)."""
    key = layer_rulebook_key(module)
    rulebook = _rulebook(module, input, key)
    features = torch.ops.sparsecore.export_conv(
        input.features, effective_weight(module), module.bias, rulebook.pair_input, rulebook.pair_output,
        rulebook.offset_counts, rulebook.out_indices, list(module.kernel_size), module.groups)
    indice_dict = dict(input.indice_dict)
    if key is not None and not module.inverse:
        indice_dict[key] = rulebook
    out = SparseConvTensor._derived(input, features, rulebook.out_indices, list(rulebook.output_spatial_shape),
                                    indice_dict)
    if add_input is not None:
        out = out.replace_feature(out.features + add_input.features)
    if module._activation is not None:
        out = out.replace_feature(module._apply_activation(out.features))
    return out


def sites_dynamic_shapes(min_sites: int = 2) -> list:
    """``dynamic_shapes`` for one `SparseConvTensor` argument: a dynamic number of sites (features and indices)."""
    sites = torch.export.Dim("sites", min=min_sites)
    return [{0: sites}, {0: sites}]
