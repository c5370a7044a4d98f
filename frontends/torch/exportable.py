"""``torch.export`` of sparsecore.torch models: geometry as an opaque op with data-dependent sizes.

A layer's eager geometry (`layer.layer_indice_data`) reads the sites on
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
same path (``sparsecore::export_pool``); global pools do not. The three ops
are declared from one table, `EXPORT_OPS`, as the feature-pass ops are
(`sparsecore.torch._op_table`).

`SparseConvolution.forward` (and the pools' forward) takes this path when ``torch.compiler.is_exporting()``,
so ``torch.export.export(model, (x,), dynamic_shapes=(sites_dynamic_shapes(),))``
works for models of sparse convs, BatchNorm, ReLU, adds, ``.dense()`` and views.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor

import sparsecore as sc
from sparsecore.interop import is_cupy_array

from ._op_table import OpSpec, Output, declare_ops
from .spconv_rules import effective_weight, layer_rulebook_key
from .tensor import SparseConvTensor

__all__ = ["ExportRulebook", "export_forward", "export_pool_forward", "effective_weight", "layer_rulebook_key",
           "sites_dynamic_shapes", "EXPORT_OPS"]


@dataclass(frozen=True)
class ExportRulebook:
    """A layer's rulebook as tensors, saved under its ``indice_key`` during export.

    Attributes:
        geometry: the layer geometry it was built for.
        indices: int32 ``[N_in, 1 + D]`` input sites.
        out_indices: int32 ``[N_out, 1 + D]`` output sites.
        pairs: ``(pair_input [P] int32, pair_output [P] int32, offset_counts [K] int64)``,
            the pairs grouped by kernel offset and each offset's pair count.
        spatial_shapes: ``(input grid shape, output grid shape)``.
    """

    geometry: sc.ConvGeometry
    indices: Tensor
    out_indices: Tensor
    pairs: tuple[Tensor, Tensor, Tensor]
    spatial_shapes: tuple[tuple[int, ...], tuple[int, ...]]

    kind = property(lambda self: self.geometry.kind, doc="The geometry's kind ('subm', 'regular', ...).")
    kernel_size = property(lambda self: self.geometry.kernel_size, doc="The kernel size per axis.")
    dilation = property(lambda self: self.geometry.dilation, doc="The dilation per axis.")
    pair_input = property(lambda self: self.pairs[0], doc="int32 ``[P]`` input rows.")
    pair_output = property(lambda self: self.pairs[1], doc="int32 ``[P]`` output rows.")
    offset_counts = property(lambda self: self.pairs[2], doc="int64 ``[K]`` pairs per kernel offset.")
    input_spatial_shape = property(lambda self: self.spatial_shapes[0], doc="The input grid shape.")
    output_spatial_shape = property(lambda self: self.spatial_shapes[1], doc="The output grid shape.")

    def inverted(self, geometry: sc.ConvGeometry) -> "ExportRulebook":
        """The same pairs read backwards: output sites to input sites (an inverse conv's rulebook)."""
        return ExportRulebook(geometry, self.out_indices, self.indices, (self.pair_output, self.pair_input,
                              self.offset_counts), (self.output_spatial_shape, self.input_spatial_shape))


def _geometry(a: SimpleNamespace) -> sc.ConvGeometry:
    return sc.ConvGeometry.create(len(a.spatial_shape), a.kernel_size, a.stride, a.padding, a.dilation,
                                  a.output_padding, kind=a.kind)


def _build_rulebook(a: SimpleNamespace) -> tuple:
    rulebook = sc.build_rulebook(a.indices, a.spatial_shape, a.batch_size, _geometry(a))
    # copies: the outputs of a custom op may not alias its inputs (a subm layer's output sites are its input's)
    return (rulebook.output_indices.copy(), rulebook.pair_input.copy(), rulebook.pair_output.copy(),
            np.asarray(rulebook.offset_counts, dtype=np.int64))


def _rulebook_shapes(a: SimpleNamespace) -> list:
    context = torch.library.get_ctx()
    sites = a.indices.shape[0] if a.kind == "subm" else context.new_dynamic_size(min=1)
    pairs = context.new_dynamic_size()
    return [(sites, a.indices.shape[1]), (pairs,), (pairs,), (math.prod(a.kernel_size),)]


def _pairs(a: SimpleNamespace) -> sc.PairMap:
    """The core `sparsecore.PairMap` of an export op's arguments (offset starts from the per-offset counts)."""
    counts = a.offset_counts.get() if is_cupy_array(a.offset_counts) else a.offset_counts  # to the host
    starts = tuple(int(s) for s in np.concatenate([[0], np.cumsum(counts)]))
    return sc.PairMap(a.pair_input, a.pair_output, starts, int(a.features.shape[0]), int(a.out_indices.shape[0]),
                      tuple(int(k) for k in a.kernel_size))


def _pool(a: SimpleNamespace) -> Any:
    pairs = _pairs(a)
    return sc.max_pool_forward(a.features, pairs)[0] if a.mode == "max" else sc.avg_pool_forward(a.features, pairs)


_EXPORT_PAIRS = "Tensor pair_input, Tensor pair_output, Tensor offset_counts, Tensor out_indices"

#: The export ops, one entry an op (see `_op_table.OpSpec`); forward only (export traces inference).
EXPORT_OPS = (
    OpSpec("export_rulebook",
           "(Tensor indices, SymInt[] spatial_shape, SymInt batch_size, str kind, SymInt[] kernel_size, "
           "SymInt[] stride, SymInt[] padding, SymInt[] dilation, SymInt[] output_padding) "
           "-> (Tensor, Tensor, Tensor, Tensor)",
           (Output("out_indices", "indices"), Output("pair_input", "indices"), Output("pair_output", "indices"),
            Output("offset_counts", torch.int64)),
           _build_rulebook, _rulebook_shapes),
    OpSpec("export_pool",
           f"(Tensor features, {_EXPORT_PAIRS}, SymInt[] kernel_size, str mode) -> Tensor",
           (Output("out", "features"),), _pool,
           lambda a: [(a.out_indices.shape[0], a.features.shape[1])]),
    OpSpec("export_conv",
           f"(Tensor features, Tensor weight, Tensor? bias, {_EXPORT_PAIRS}, SymInt[] kernel_size, SymInt groups) "
           "-> Tensor",
           (Output("out", "features"),),
           lambda a: sc.conv_forward(a.features, a.weight, _pairs(a), bias=a.bias, groups=a.groups),
           lambda a: [(a.out_indices.shape[0], a.weight.shape[0])]),
)

declare_ops(EXPORT_OPS)


def export_pool_forward(module: Any, input: SparseConvTensor) -> SparseConvTensor:
    """A sparse max / avg pool's forward through the export ops (same results as the eager forward)."""
    key = module.indice_key
    rulebook = _rulebook(module, input, key)
    mode = "max" if module._kind == "SparseMaxPool" else "avg"
    features = torch.ops.sparsecore.export_pool(input.features, *rulebook.pairs, rulebook.out_indices,
                                                list(module.kernel_size), mode)
    return _output(input, features, rulebook, key)


def _output(input: SparseConvTensor, features: Tensor, rulebook: ExportRulebook,
            key: Optional[str]) -> SparseConvTensor:
    indice_dict = dict(input.indice_dict)
    if key is not None:
        indice_dict[key] = rulebook
    return SparseConvTensor._derived(input, features, rulebook.out_indices, list(rulebook.output_spatial_shape),
                                     indice_dict)


def _rulebook(module: Any, x: SparseConvTensor, key: Optional[str]) -> ExportRulebook:
    layer = f"{type(module).__name__}(indice_key={module.indice_key!r})"
    saved = x.indice_dict.get(key) if key is not None else None
    if saved is not None and not isinstance(saved, ExportRulebook):
        raise TypeError(f"{layer}: indice_dict[{key!r}] holds a {type(saved).__name__}; run the exported model "
                        "on a fresh SparseConvTensor")
    geometry = module._geometry
    if geometry.kind == "inverse":
        if saved is None or saved.kind != "regular":
            raise ValueError(f"{layer} inverts indice_key {key!r}, but no regular conv saved it before")
        return saved.inverted(geometry)
    if saved is not None:
        if geometry.kind != "subm" or saved.kind != "subm" or saved.kernel_size != geometry.kernel_size or \
                saved.dilation != geometry.dilation or saved.indices is not x.indices:
            raise ValueError(f"{layer}: indice_key {key!r} exists and only a SubM layer with the same kernel and "
                             "dilation, on the same sites, may share it")
        return saved
    outputs = torch.ops.sparsecore.export_rulebook(
        x.indices, list(x.spatial_shape), x.batch_size, geometry.kind, list(geometry.kernel_size),
        list(geometry.stride), list(geometry.padding), list(geometry.dilation), list(geometry.output_padding))
    subm = geometry.kind == "subm"
    out_indices = x.indices if subm else outputs[0]
    shape = tuple(x.spatial_shape) if subm else tuple(geometry.output_spatial_shape(x.spatial_shape))
    return ExportRulebook(geometry, x.indices, out_indices, tuple(outputs[1:]), (tuple(x.spatial_shape), shape))


def export_forward(module: Any, input: SparseConvTensor,
                   add_input: Optional[SparseConvTensor] = None) -> SparseConvTensor:
    """A sparse conv's forward through the export ops (same results as the eager forward)."""
    key = layer_rulebook_key(module)
    rulebook = _rulebook(module, input, key)
    features = torch.ops.sparsecore.export_conv(
        input.features, effective_weight(module), module.bias, *rulebook.pairs, rulebook.out_indices,
        list(module.kernel_size), module.groups)
    return module._epilogue(_output(input, features, rulebook, None if module.inverse else key), add_input)


def sites_dynamic_shapes(min_sites: int = 2) -> list:
    """``dynamic_shapes`` for one `SparseConvTensor` argument: a dynamic number of sites (features and indices)."""
    sites = torch.export.Dim("sites", min=min_sites)
    return [{0: sites}, {0: sites}]
