"""int8 sparse modules: convolutions (plain, fused ReLU, fused residual add + ReLU), max pooling, Linear.

Inputs are `SparseConvTensor`\\ s whose features are ``torch.qint8`` (zero point
0); outputs are qint8 with the module's ``scale``. The arithmetic is the core's
(`sparsecore.int8`): int8 x int8 products summed exactly in int32 over the
rulebook, then ``acc * input_scale * weight_scale[c] + bias`` (+ the residual),
ReLU, and requantization (round half to even, saturate) in float32, on the CPU
(NumPy) or the GPU (the ``kernels_cu/int8.cu`` kernel), any channel count.
The rulebook is found or built as the float layer does (``indice_key``).
Modules are made by ``from_reference`` (what ``transform_qdq`` calls).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..._convert import core_context, core_view, to_torch
from ...layer import layer_indice_data
from ...modules import SparseModule
from ...pool import SparseMaxPool
from ...tensor import SparseConvTensor
from .._functional import check_int8_input, int8_conv, int8_features, quantized_features
from ..utils import layer_indice_key
from .reference import SpConv, quantize_weight_per_channel
from .._torch_notices import torch_notices_silenced

__all__ = ["SparseConv", "SparseConvReLU", "SparseConvAddReLU", "QuantizedSparseMaxPool",
           "LinearPerChannelWeight", "LinearPerChannelWeightReLU"]

_CONFIG = ("conv1x1", "ndim", "in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation",
           "output_padding", "groups", "subm", "transposed", "inverse", "indice_key", "algo", "_geometry", "name")


class SparseConv(SparseModule):
    """int8 sparse convolution (spconv ``quantized.SparseConv``).

    Attributes:
        scale, zero_point: the output's quantization (buffers; zero point 0).
        weight_scales: float32 ``[out]`` buffer.
    Methods ``weight()`` (per-channel qint8) and ``bias()`` (float32) as spconv's.
    """

    _RELU = False
    _ADD = False

    def __init__(self, reference: SpConv, output_scale: float, output_zero_point: int = 0) -> None:
        super().__init__(name=reference.name)
        if not isinstance(reference, SpConv):
            raise TypeError(f"{type(self).__name__} is made from a reference SpConv, got "
                            f"{type(reference).__name__}")
        if int(output_zero_point) != 0:
            raise ValueError(f"{type(self).__name__}: sparse int8 outputs are symmetric (zero point 0), got "
                             f"zero point {int(output_zero_point)}")
        for name in _CONFIG:
            setattr(self, name, getattr(reference, name))
        self.register_buffer("weight_int8", quantize_weight_per_channel(reference.weight, reference.weight_scale))
        self.register_buffer("weight_scales", reference.weight_scale.detach().float().clone())
        bias = None if reference.bias is None else reference.bias.detach().float().clone()
        self.register_buffer("bias_float", bias)
        device = reference.weight.device
        self.register_buffer("scale", torch.tensor(float(output_scale), dtype=torch.float64, device=device))
        self.register_buffer("zero_point", torch.tensor(0, dtype=torch.int64, device=device))

    @classmethod
    def from_reference(cls, reference: nn.Module, output_scale: Any, output_zero_point: Any = 0) -> "SparseConv":
        """The int8 module of a reference `SpConv` (or a fused module whose first child is one)."""
        if isinstance(reference, nn.Sequential):
            reference = reference[0]
        return cls(reference, float(output_scale), int(output_zero_point))

    def weight(self) -> torch.Tensor:
        """The weight as a per-channel ``torch.qint8`` tensor ``[out, *kernel, in // groups]``."""
        zero_points = torch.zeros(self.out_channels, dtype=torch.int64, device=self.weight_int8.device)
        with torch_notices_silenced():
            return torch._make_per_channel_quantized_tensor(self.weight_int8, self.weight_scales.double(),
                                                            zero_points, 0)

    def bias(self) -> Optional[torch.Tensor]:
        """The float32 bias ``[out]`` (None without one)."""
        return self.bias_float

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"subm={self.subm}, scale={float(self.scale):.6g}")

    def forward(self, input: SparseConvTensor, add_input: Optional[SparseConvTensor] = None) -> SparseConvTensor:
        if self._ADD and add_input is None:
            raise TypeError(f"{type(self).__name__}.forward needs add_input (the residual)")
        if not self._ADD and add_input is not None:
            raise TypeError(f"{type(self).__name__} takes no add_input; a residual add is SparseConvAddReLU")
        return int8_conv(self, input, self.weight_int8, self.weight_scales, self.bias_float, float(self.scale),
                         relu=self._RELU, residual=add_input)


class SparseConvReLU(SparseConv):
    """int8 ``relu(conv(x))`` (spconv ``intrinsic.quantized.SparseConvReLU``)."""

    _RELU = True


class SparseConvAddReLU(SparseConv):
    """int8 ``relu(conv(x) + add_input)``; ``add_input`` qint8 (fused) or float (after its dequantize)."""

    _RELU = True
    _ADD = True


class QuantizedSparseMaxPool(SparseModule):
    """int8 max pooling (spconv has none): the maximum of the int8 values, scale unchanged."""

    def __init__(self, pool: SparseMaxPool) -> None:
        super().__init__(name=pool.name)
        if not isinstance(pool, SparseMaxPool):
            raise TypeError(f"QuantizedSparseMaxPool is made from a SparseMaxPool, got {type(pool).__name__}")
        for name in ("ndim", "kernel_size", "stride", "padding", "dilation", "subm", "indice_key", "algo",
                     "_geometry"):
            setattr(self, name, getattr(pool, name))

    @classmethod
    def from_float(cls, pool: SparseMaxPool) -> "QuantizedSparseMaxPool":
        """The int8 pool with ``pool``'s geometry."""
        return cls(pool)

    def forward(self, input: SparseConvTensor) -> SparseConvTensor:
        import sparsecore.int8 as core_int8

        layer = type(self).__name__
        values, scale = int8_features(layer, input)
        check_int8_input(layer, input, values, None, self.ndim)
        data, indice_dict = layer_indice_data(layer, input, self._geometry, self.indice_key, self.algo,
                                              neighbour_tensors=False)
        with core_context(values.device):
            out = to_torch(core_int8.int8_max_pool_forward(core_view(values, "features"), data.rulebook))
        return SparseConvTensor._derived(input, quantized_features(out, scale), data.out_indices,
                                         data.out_spatial_shape, indice_dict, core_indices=data.out_core_indices)


class LinearPerChannelWeight(nn.Module):
    """int8 ``Linear`` with per-output-channel weight scales (spconv's ``quantized.LinearPerChannelWeight``).

    Takes a qint8 tensor ``[..., in]`` or a SparseConvTensor with qint8 features; the
    products are summed exactly (float64 holds every int8 dot product of < 2^37 terms)
    and the epilogue is the core's, in float32.
    """

    _RELU = False

    def __init__(self, reference: nn.Module, output_scale: float, output_zero_point: int = 0) -> None:
        super().__init__()
        quantized = reference.get_quantized_weight()
        if quantized.qscheme() not in (torch.per_channel_symmetric, torch.per_channel_affine,
                                       torch.per_tensor_symmetric, torch.per_tensor_affine):
            raise ValueError(f"unsupported weight qscheme {quantized.qscheme()}")
        if quantized.qscheme() in (torch.per_tensor_symmetric, torch.per_tensor_affine):
            scales = torch.full((quantized.shape[0],), quantized.q_scale(), dtype=torch.float32)
        else:
            scales = quantized.q_per_channel_scales().float()
        self.register_buffer("weight_int8", quantized.int_repr())
        self.register_buffer("weight_scales", scales)
        self.register_buffer("bias_float", None if reference.bias is None else reference.bias.detach().float())
        self.register_buffer("scale", torch.tensor(float(output_scale), dtype=torch.float64))
        self.register_buffer("zero_point", torch.tensor(int(output_zero_point), dtype=torch.int64))

    @classmethod
    def from_reference(cls, reference: nn.Module, output_scale: Any, output_zero_point: Any = 0):
        """The int8 module of torch's reference ``Linear`` (or a fused ``LinearReLU`` holding one)."""
        if isinstance(reference, nn.Sequential):
            reference = reference[0]
        return cls(reference, float(output_scale), int(output_zero_point))

    def forward(self, input: Any) -> Any:
        if isinstance(input, SparseConvTensor):
            return input.replace_feature(self.forward(input.features))
        if not isinstance(input, torch.Tensor) or input.dtype != torch.qint8:
            raise TypeError(f"{type(self).__name__} expects qint8 input, got "
                            f"{getattr(input, 'dtype', type(input).__name__)}")
        values = input.int_repr().double()
        acc = (values @ self.weight_int8.double().t()).float()
        multiplier = self.weight_scales * torch.tensor(input.q_scale(), dtype=torch.float32)
        y = acc * multiplier
        if self.bias_float is not None:
            y = y + self.bias_float
        if self._RELU:
            y = torch.relu(y)
        out = torch.clamp(torch.round(y / torch.tensor(float(self.scale), dtype=torch.float32)), -128, 127)
        return quantized_features(out.to(torch.int8), float(self.scale))


class LinearPerChannelWeightReLU(LinearPerChannelWeight):
    """int8 ``relu(Linear(x))`` with per-channel weight scales."""

    _RELU = True
