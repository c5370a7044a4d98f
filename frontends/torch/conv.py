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
import os
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import init

import sparsecore as sc

from ._convert import check_same_device
from ._geometry import check_input, layer_indice_data
from .modules import SparseModule, start_benchmark
from .ops import sparse_conv_features
from .tensor import SparseConvTensor, expand_nd

__all__ = [
    "SparseConvolution",
    "SparseConv1d", "SparseConv2d", "SparseConv3d", "SparseConv4d",
    "SubMConv1d", "SubMConv2d", "SubMConv3d", "SubMConv4d",
    "SparseConvTranspose1d", "SparseConvTranspose2d", "SparseConvTranspose3d", "SparseConvTranspose4d",
    "SparseInverseConv1d", "SparseInverseConv2d", "SparseInverseConv3d", "SparseInverseConv4d",
]

MAX_NUM_VOXELS_DURING_TRAINING = "max_num_voxels_during_training"

_ACTIVATIONS = {"none": None, "none_": None, "relu": "relu", "sigmoid": "sigmoid", "leakyrelu": "leaky_relu",
                "leaky_relu": "leaky_relu"}


def _activation_name(act_type: Any) -> Optional[str]:
    """``None`` / "relu" / "sigmoid" / "leaky_relu" from a string or an enum like spconv's ``tv.gemm.Activation``."""
    if act_type is None:
        return None
    name = getattr(act_type, "name", act_type)
    key = str(name).lower()
    if key not in _ACTIVATIONS:
        raise ValueError(f"act_type must be None, 'relu', 'sigmoid' or 'leaky_relu', got {act_type!r}")
    return _ACTIVATIONS[key]


def spconv_1x1_weight(weight: torch.Tensor, in_channels: int, out_channels: int) -> torch.Tensor:
    """The core-layout weight that computes spconv's 1x1 product with the stored tensor.

    spconv 2.x computes a 1x1 layer as ``features @ weight.view(in, out)``; the
    core computes ``features @ weight[:, 0, ..., 0, :].T``. This returns
    ``weight.reshape(in, out).T`` laid out as ``[out, 1, ..., 1, in]``, a
    differentiable function of ``weight``, so gradients reach the stored
    parameter in spconv's reading too.

    Args:
        weight: ``[out, 1, ..., 1, in]``, as stored in the module and its state_dict.
        in_channels, out_channels: the layer's channels.

    Returns:
        A tensor of ``weight``'s shape, dtype and device.
    """
    return weight.reshape(in_channels, out_channels).t().reshape(weight.shape)


def autocast_inputs(*tensors: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
    """Casts float32 tensors to the autocast dtype when autocast is on for their device.

    The core then multiplies in that dtype's storage with float32 accumulation.
    """
    first = next(t for t in tensors if t is not None)
    device_type = first.device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None and t.dtype == torch.float32 else t for t in tensors)


def _weight_layout_hook(module: "SparseConvolution", state_dict: dict, prefix: str, *args: Any) -> None:
    """Fills a missing voxel-count buffer and applies ``SPCONV_SAVED_WEIGHT_LAYOUT`` (as spconv)."""
    name = prefix + MAX_NUM_VOXELS_DURING_TRAINING
    if hasattr(module, MAX_NUM_VOXELS_DURING_TRAINING) and name not in state_dict:
        state_dict[name] = torch.zeros(1, dtype=torch.int32)
    layout = os.environ.get("SPCONV_SAVED_WEIGHT_LAYOUT", "")
    key = prefix + "weight"
    if not layout or layout == "KRSC" or key not in state_dict:
        return
    ndim = module.ndim
    weight = state_dict[key]
    if layout == "RSKC":  # [*k, out, in] -> [out, *k, in]
        state_dict[key] = weight.permute(ndim, *range(ndim), ndim + 1).contiguous()
    elif layout == "RSCK":  # [*k, in, out] -> [out, *k, in]
        state_dict[key] = weight.permute(ndim + 1, *range(ndim), ndim).contiguous()
    else:
        raise ValueError(f"SPCONV_SAVED_WEIGHT_LAYOUT must be KRSC, RSKC or RSCK, got {layout!r}")


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
        self.subm = subm
        self.transposed = transposed
        self.inverse = inverse
        self.indice_key = indice_key
        self.record_voxel_count = record_voxel_count
        self.algo = algo
        self.fp32_accum = fp32_accum
        self.large_kernel_fast_algo = large_kernel_fast_algo
        self.act_type = act_type
        self.act_alpha = act_alpha
        self.act_beta = act_beta
        self._activation = _activation_name(act_type)
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
        self.register_load_state_dict_pre_hook(_weight_layout_hook)

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
        text = f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"
        if any(self.padding):
            text += f", padding={self.padding}"
        if any(d != 1 for d in self.dilation):
            text += f", dilation={self.dilation}"
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
        if self._activation == "relu":
            return F.relu(features)
        if self._activation == "sigmoid":
            return torch.sigmoid(features)
        if self._activation == "leaky_relu":
            return F.leaky_relu(features, self.act_alpha)
        return features

    def forward(self, input: SparseConvTensor, add_input: Optional[SparseConvTensor] = None) -> SparseConvTensor:
        """Convolves ``input``; ``add_input`` (same sites as the output) is added before the activation."""
        if torch.compiler.is_exporting():  # geometry as an opaque op: frontends/torch/exportable.py
            from .exportable import export_forward
            return export_forward(self, input, add_input)
        layer = type(self).__name__
        check_input(layer, input, self.in_channels, self.ndim)
        check_same_device(layer, features=input.features, indices=input.indices, weight=self.weight)
        record = start_benchmark(self, input, "SparseConvolution", self._benchmark_params) if input.benchmark else None
        # spconv's 1x1 shortcut neither reads nor saves its indice_key, so spconv models give a
        # SubM 1x1 projection the key of a 3x3 layer; a regular 1x1 layer keeps its key (an
        # inverse conv may need it)
        indice_key = None if self.conv1x1 and self.subm else self.indice_key
        data, indice_dict = layer_indice_data(layer, input, self._geometry, indice_key, self.algo)
        if record is not None:
            record.indices_done()
        weight = self.weight
        if self.reads_weight_as_spconv_1x1:
            weight = spconv_1x1_weight(weight, self.in_channels, self.out_channels)
        features, weight, bias = autocast_inputs(input.features, weight, self.bias)
        out_features = sparse_conv_features(features, weight, bias, data, self.groups)
        if record is not None:
            record.done(input.features.shape[0], out_features.shape[0])
        if hasattr(self, MAX_NUM_VOXELS_DURING_TRAINING):
            buffer = getattr(self, MAX_NUM_VOXELS_DURING_TRAINING)
            with torch.no_grad():
                buffer.clamp_(min=data.num_output)
        out = SparseConvTensor._derived(input, out_features, data.out_indices, data.out_spatial_shape, indice_dict,
                                        core_indices=data.out_core_indices)
        if add_input is not None:
            out = out.replace_feature(out.features + add_input.features)
        if self._activation is not None:
            out = out.replace_feature(self._apply_activation(out.features))
        return out

    def _benchmark_params(self) -> dict:
        return {"kernel_size": self.kernel_size, "stride": self.stride, "padding": self.padding,
                "dilation": self.dilation, "output_padding": self.output_padding, "subm": self.subm,
                "transposed": self.transposed, "input_channels": self.in_channels,
                "out_channels": self.out_channels}


class _SparseConvNd(SparseConvolution):
    _ndim = 3
    _transposed = False

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, indice_key=None, algo=None, fp32_accum=None, record_voxel_count=False,
                 large_kernel_fast_algo=False, name=None):
        super().__init__(self._ndim, in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
                         bias, transposed=self._transposed, indice_key=indice_key, algo=algo,
                         fp32_accum=fp32_accum, record_voxel_count=record_voxel_count,
                         large_kernel_fast_algo=large_kernel_fast_algo, name=name)


class _SubMConvNd(SparseConvolution):
    _ndim = 3

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, indice_key=None, algo=None, fp32_accum=None, large_kernel_fast_algo=False,
                 name=None):
        super().__init__(self._ndim, in_channels, out_channels, kernel_size, stride, padding, dilation, groups,
                         bias, True, indice_key=indice_key, algo=algo, fp32_accum=fp32_accum,
                         large_kernel_fast_algo=large_kernel_fast_algo, name=name)


class _SparseInverseConvNd(SparseConvolution):
    _ndim = 3

    def __init__(self, in_channels, out_channels, kernel_size, indice_key, bias=True, algo=None,
                 fp32_accum=None, large_kernel_fast_algo=False, name=None):
        super().__init__(self._ndim, in_channels, out_channels, kernel_size, bias=bias, inverse=True,
                         indice_key=indice_key, algo=algo, fp32_accum=fp32_accum,
                         large_kernel_fast_algo=large_kernel_fast_algo, name=name)


class _SparseConvTransposeNd(_SparseConvNd):
    _transposed = True


class SparseConv1d(_SparseConvNd):
    """1-D regular sparse conv: the dense conv evaluated at the sites any input reaches."""
    _ndim = 1


class SparseConv2d(_SparseConvNd):
    """2-D regular sparse conv."""
    _ndim = 2


class SparseConv3d(_SparseConvNd):
    """3-D regular sparse conv."""
    _ndim = 3


class SparseConv4d(_SparseConvNd):
    """4-D regular sparse conv."""
    _ndim = 4


class SubMConv1d(_SubMConvNd):
    """1-D submanifold sparse conv: output sites = input sites."""
    _ndim = 1


class SubMConv2d(_SubMConvNd):
    """2-D submanifold sparse conv."""
    _ndim = 2


class SubMConv3d(_SubMConvNd):
    """3-D submanifold sparse conv."""
    _ndim = 3


class SubMConv4d(_SubMConvNd):
    """4-D submanifold sparse conv."""
    _ndim = 4


class SparseConvTranspose1d(_SparseConvTransposeNd):
    """1-D transposed sparse conv (``torch.nn.ConvTranspose1d`` at the reached sites)."""
    _ndim = 1


class SparseConvTranspose2d(_SparseConvTransposeNd):
    """2-D transposed sparse conv."""
    _ndim = 2


class SparseConvTranspose3d(_SparseConvTransposeNd):
    """3-D transposed sparse conv."""
    _ndim = 3


class SparseConvTranspose4d(_SparseConvTransposeNd):
    """4-D transposed sparse conv."""
    _ndim = 4


class SparseInverseConv1d(_SparseInverseConvNd):
    """1-D inverse conv: back onto the input sites of the layer saved under ``indice_key``."""
    _ndim = 1


class SparseInverseConv2d(_SparseInverseConvNd):
    """2-D inverse conv."""
    _ndim = 2


class SparseInverseConv3d(_SparseInverseConvNd):
    """3-D inverse conv."""
    _ndim = 3


class SparseInverseConv4d(_SparseInverseConvNd):
    """4-D inverse conv."""
    _ndim = 4
