"""Sparse convolution layers with spconv 2.x's names, arguments, defaults and state_dict keys.

`SparseConvolution` is the base (spconv's full argument list); the public
classes ``SparseConv{1,2,3,4}d``, ``SubMConv{1,2,3,4}d``,
``SparseConvTranspose{1,2,3,4}d`` and ``SparseInverseConv{1,2,3,4}d`` have
spconv's exact constructor signatures. Weights are ``[out, *kernel, in //
groups]``, initialised as spconv does (kaiming-uniform, ``a = sqrt(5)``).

1x1 layers compute what spconv's compute with the same stored tensor: where
spconv takes its matrix-product shortcut (kernel volume 1, and submanifold or
stride 1) it reads the ``[out, 1, ..., 1, in]`` weight as ``weight.view(in,
out)`` (spconv issue #450), and so does this layer (`spconv_1x1_weight`), so
checkpoints move unchanged in both directions.

Differences from spconv (see docs/migrating_from_spconv.md): ``groups`` works
(a grouped 1x1 layer, which spconv cannot build, reads its weight as
documented); a 1x1 layer adds ``add_input`` as every other layer does (spconv's
shortcut drops it); a transposed conv's output shape follows
``torch.nn.ConvTranspose`` including dilation; ``algo`` / ``fp32_accum`` / ``large_kernel_fast_algo`` are recorded
and ignored; a fused ``act_type`` also works in training.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn
from torch.nn import init

import sparsecore as sc

from .exportable import export_forward
from .layer import SparseModule, check_same_dtype, geometry_repr, layer_forward, nd_variants
from .ops import autocast_inputs, sparse_conv_features
from .spconv_rules import (
    MAX_NUM_VOXELS_DURING_TRAINING,
    activation_name,
    apply_activation,
    effective_weight,
    layer_rulebook_key,
    spconv_1x1_weight,  # noqa: F401  (its old home: sparsecore.torch.quantization imports it from here)
    weight_layout_hook,
)
from .tensor import SparseConvTensor, expand_nd

__all__ = [
    "SparseConvolution",
    "SparseConv1d", "SparseConv2d", "SparseConv3d", "SparseConv4d",
    "SubMConv1d", "SubMConv2d", "SubMConv3d", "SubMConv4d",
    "SparseConvTranspose1d", "SparseConvTranspose2d", "SparseConvTranspose3d", "SparseConvTranspose4d",
    "SparseInverseConv1d", "SparseInverseConv2d", "SparseInverseConv3d", "SparseInverseConv4d",
]

class SparseConvolution(SparseModule):
    """A sparse convolution layer (spconv ``SparseConvolution``).

    Args:
        ndim: spatial axes (1 to 4).
        in_channels, out_channels: channels.
        kernel_size, stride, padding, dilation: an int or ``ndim`` ints.
        groups: channel groups (``in`` and ``out`` divisible by it; spconv supports only 1).
        bias: add a learnable bias.
        subm: submanifold conv (output sites = input sites; stride and padding ignored, odd kernel).
        output_padding: extra output size of a transposed conv.
        transposed: transposed conv (``torch.nn.ConvTranspose`` semantics).
        inverse: inverse conv of the layer saved under ``indice_key``.
        indice_key: key of the rulebook to save / reuse / invert.
        algo, fp32_accum, large_kernel_fast_algo: accepted and recorded; sparsecore
            chooses its own dataflow and always accumulates float16 in float32.
        record_voxel_count: keep the largest output site count seen in buffer
            ``max_num_voxels_during_training``.
        act_type, act_alpha, act_beta: fused activation after the conv (and ``add_input``).
        name: layer name (benchmark records).
        device, dtype: of the parameters.
    """

    def __init__(self, ndim: int, in_channels: int, out_channels: int, kernel_size: Any = 3, stride: Any = 1,
                 padding: Any = 0, dilation: Any = 1, groups: int = 1, bias: bool = True, subm: bool = False,
                 output_padding: Any = 0, transposed: bool = False, inverse: bool = False,
                 indice_key: Optional[str] = None, algo: Any = None, fp32_accum: Optional[bool] = None,
                 record_voxel_count: bool = False, act_type: Any = None, act_alpha: float = 0,
                 act_beta: float = 0, large_kernel_fast_algo: bool = False, name: Optional[str] = None,
                 device: Any = None, dtype: Any = None) -> None:
        super().__init__(name=name)
        for arg, value in (("in_channels", in_channels), ("out_channels", out_channels), ("groups", groups)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"groups={groups} must divide in_channels ({in_channels}) and out_channels ({out_channels})")
        self.ndim = ndim
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = expand_nd(ndim, kernel_size, "kernel_size")
        self.stride = expand_nd(ndim, stride, "stride")
        self.padding = expand_nd(ndim, padding, "padding")
        self.dilation = expand_nd(ndim, dilation, "dilation")
        self.output_padding = expand_nd(ndim, output_padding, "output_padding")
        kernel_volume = math.prod(self.kernel_size)
        # spconv's 1x1 shortcut condition (spconv/pytorch/conv.py): kernel volume 1, and
        # submanifold or stride 1; such a layer reads its weight as view(in, out)
        self.conv1x1 = kernel_volume == 1 and (subm or math.prod(self.stride) == 1)
        self.groups = groups
        self.subm, self.transposed, self.inverse = subm, transposed, inverse
        self.indice_key = indice_key
        self.record_voxel_count = record_voxel_count
        # recorded as spconv records them; sparsecore chooses its own dataflow
        self.algo, self.fp32_accum, self.large_kernel_fast_algo = algo, fp32_accum, large_kernel_fast_algo
        self.act_type, self.act_alpha, self.act_beta = act_type, act_alpha, act_beta
        self._activation = activation_name(act_type)
        if inverse and indice_key is None:
            raise ValueError("an inverse conv needs the indice_key of the SparseConv / SparseMaxPool it inverts")
        if inverse:
            base = sc.ConvGeometry.create(ndim, self.kernel_size, kind="regular")
            self._geometry = sc.ConvGeometry("inverse", base.kernel_size, base.stride, base.padding,
                                             base.dilation, base.output_padding)
        else:
            kind = "subm" if subm else "transposed" if transposed else "regular"
            self._geometry = sc.ConvGeometry.create(ndim, self.kernel_size, self.stride, self.padding,
                                                    self.dilation, self.output_padding, kind=kind)
        self.weight_shape = [out_channels, *self.kernel_size, in_channels // groups]
        factory = {"device": device, "dtype": dtype}
        if record_voxel_count and not subm and not inverse:
            self.register_buffer(MAX_NUM_VOXELS_DURING_TRAINING, torch.zeros(1, dtype=torch.int32, device=device))
        self.weight = nn.Parameter(torch.zeros(*self.weight_shape, **factory))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_channels, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()
        self.register_load_state_dict_pre_hook(weight_layout_hook)

    @property
    def reads_weight_as_spconv_1x1(self) -> bool:
        """True when the layer computes ``features @ weight.view(in, out)``, as spconv's 1x1 shortcut.

        That is every layer spconv sends down its 1x1 path (`conv1x1`), ungrouped
        (spconv has no groups; a grouped 1x1 layer reads its weight as documented).
        """
        return self.conv1x1 and self.groups == 1

    def _fan_in(self) -> int:
        return (self.in_channels // self.groups) * math.prod(self.kernel_size)

    def reset_parameters(self) -> None:
        """Kaiming-uniform weight (``a = sqrt(5)``, fan_in = in/groups * kernel volume), uniform bias."""
        gain = init.calculate_gain("leaky_relu", math.sqrt(5))
        bound = math.sqrt(3.0) * gain / math.sqrt(self._fan_in())
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
        if self.bias is not None:
            bound = 1 / math.sqrt(self._fan_in())
            init.uniform_(self.bias, -bound, bound)

    def get_max_num_voxels(self) -> Optional[torch.Tensor]:
        """The ``max_num_voxels_during_training`` buffer, or None without ``record_voxel_count``."""
        return getattr(self, MAX_NUM_VOXELS_DURING_TRAINING, None)

    def is_inverseable(self) -> bool:
        """True when an inverse conv can invert this layer (a non-subm layer with an indice_key)."""
        return self.indice_key is not None and not self.subm

    def extra_repr(self) -> str:
        text = f"{self.in_channels}, {self.out_channels}, " + geometry_repr(self.kernel_size, self.stride,
                                                                             self.padding, self.dilation)
        if any(self.output_padding):
            text += f", output_padding={self.output_padding}"
        if self.groups != 1:
            text += f", groups={self.groups}"
        if self.bias is None:
            text += ", bias=False"
        if self.indice_key is not None:
            text += f", indice_key={self.indice_key!r}"
        return text

    def _apply_activation(self, features: torch.Tensor) -> torch.Tensor:
        return apply_activation(features, self._activation, self.act_alpha)

    def _epilogue(self, out: SparseConvTensor, add_input: Optional[SparseConvTensor]) -> SparseConvTensor:
        """The fused tail of a conv (eager or exported): ``add_input``, then the activation."""
        if add_input is not None:
            out = out.replace_feature(out.features + add_input.features)
        if self._activation is not None:
            out = out.replace_feature(self._apply_activation(out.features))
        return out

    def forward(self, input: SparseConvTensor, add_input: Optional[SparseConvTensor] = None) -> SparseConvTensor:
        """Convolves ``input``; ``add_input`` (same sites as the output) is added before the activation."""
        if torch.compiler.is_exporting():  # geometry as an opaque op: frontends/torch/exportable.py
            return export_forward(self, input, add_input)

        def feature_pass(data):
            features, weight, bias = autocast_inputs(input.features, effective_weight(self), self.bias)
            check_same_dtype(type(self).__name__, features, weight, bias)
            return sparse_conv_features(features, weight, bias, data, self.groups)

        out = layer_forward(self, input, "SparseConvolution", layer_rulebook_key(self), feature_pass,
                            in_channels=self.in_channels, weight=self.weight)
        return self._epilogue(out, add_input)

    def _benchmark_params(self) -> dict:
        return {"kernel_size": self.kernel_size, "stride": self.stride, "padding": self.padding,
                "dilation": self.dilation, "output_padding": self.output_padding, "subm": self.subm,
                "transposed": self.transposed, "input_channels": self.in_channels,
                "out_channels": self.out_channels}


class _SparseConvNd(SparseConvolution):
    _transposed = False

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, indice_key=None, algo=None, fp32_accum=None, record_voxel_count=False,
                 large_kernel_fast_algo=False, name=None):
        super().__init__(self._ndim, in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
                         bias, transposed=self._transposed, indice_key=indice_key, algo=algo,
                         fp32_accum=fp32_accum, record_voxel_count=record_voxel_count,
                         large_kernel_fast_algo=large_kernel_fast_algo, name=name)


class _SubMConvNd(SparseConvolution):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, indice_key=None, algo=None, fp32_accum=None, large_kernel_fast_algo=False,
                 name=None):
        super().__init__(self._ndim, in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
                         bias, True, indice_key=indice_key, algo=algo, fp32_accum=fp32_accum,
                         large_kernel_fast_algo=large_kernel_fast_algo, name=name)


class _SparseInverseConvNd(SparseConvolution):
    def __init__(self, in_channels, out_channels, kernel_size, indice_key, bias=True, algo=None,
                 fp32_accum=None, large_kernel_fast_algo=False, name=None):
        super().__init__(self._ndim, in_channels, out_channels, kernel_size, bias=bias, inverse=True,
                         indice_key=indice_key, algo=algo, fp32_accum=fp32_accum,
                         large_kernel_fast_algo=large_kernel_fast_algo, name=name)


class _SparseConvTransposeNd(_SparseConvNd):
    _transposed = True


SparseConv1d, SparseConv2d, SparseConv3d, SparseConv4d = nd_variants(
    _SparseConvNd, "{ndim}-D regular sparse conv: the dense conv evaluated at the sites any input reaches.")
SubMConv1d, SubMConv2d, SubMConv3d, SubMConv4d = nd_variants(
    _SubMConvNd, "{ndim}-D submanifold sparse conv: output sites = input sites.")
SparseConvTranspose1d, SparseConvTranspose2d, SparseConvTranspose3d, SparseConvTranspose4d = nd_variants(
    _SparseConvTransposeNd, "{ndim}-D transposed sparse conv (``torch.nn.ConvTranspose`` at the reached sites).")
SparseInverseConv1d, SparseInverseConv2d, SparseInverseConv3d, SparseInverseConv4d = nd_variants(
    _SparseInverseConvNd, "{ndim}-D inverse conv: back onto the input sites of the layer saved under ``indice_key``.")
