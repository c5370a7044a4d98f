"""QAT sparse convolutions: per-output-channel weight fake quantization, optional folded batch norm.

``prepare_qat_fx`` swaps a sparse conv (or a fused float module) for one of
these: the weight passes through ``qconfig.weight()`` (per-channel symmetric
qint8 fake quantization along the output axis) before the convolution, and the
activations get the qconfig's per-tensor fake quantizers around the module.
The ``...Bn...`` variants fold the batch norm into the weight before fake
quantizing it (the running-std fold of torch's ``ConvBn`` QAT modules): the
convolution runs with ``fq(w * gamma / std)``, the result is divided back by
``gamma / std`` and the batch norm applied, so training still updates the
statistics while the weight seen is the one int8 inference will use.
`to_float` returns the folded float module that conversion quantizes.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.ao.nn.intrinsic as nni
from torch import nn

from ....conv import SparseConvolution
from ....tensor import SparseConvTensor
from ..._functional import conv_with_weight
from ...utils import clone_sparse_conv, effective_weight, fuse_spconv_bn_weights
from .. import modules as fused

__all__ = ["SparseConv", "SparseConvReLU", "SparseConvAddReLU", "SparseConvBn", "SparseConvBnReLU",
           "SparseConvBnAddReLU"]


def _copy_config(target: SparseConvolution, conv: SparseConvolution) -> None:
    SparseConvolution.__init__(
        target, conv.ndim, conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
        conv.dilation, conv.groups, conv.bias is not None, subm=conv.subm, output_padding=conv.output_padding,
        transposed=conv.transposed, inverse=conv.inverse, indice_key=conv.indice_key, algo=conv.algo,
        fp32_accum=conv.fp32_accum, record_voxel_count=conv.record_voxel_count, act_type=conv.act_type,
        act_alpha=conv.act_alpha, act_beta=conv.act_beta, name=conv.name, device=conv.weight.device,
        dtype=conv.weight.dtype)
    target.weight = conv.weight
    target.bias = conv.bias
    for name, buffer in conv.named_buffers(recurse=False):
        setattr(target, name, buffer)


class _QatSparseConv(SparseConvolution):
    """Base: a sparse conv whose weight is fake-quantized by ``qconfig.weight()``."""

    _FLOAT_MODULE: Any = SparseConvolution
    _HAS_BN = False
    _HAS_RELU = False
    _HAS_ADD = False

    def __init__(self, conv: SparseConvolution, qconfig: Any, bn: Optional[nn.Module] = None) -> None:
        if qconfig is None:
            raise ValueError(f"{type(self).__name__} needs a qconfig (QAT modules are made by prepare_qat_fx)")
        _copy_config(self, conv)
        self.qconfig = qconfig
        self.weight_fake_quant = qconfig.weight(factory_kwargs={"device": conv.weight.device})
        if self._HAS_BN:
            if bn is None:
                raise ValueError(f"{type(self).__name__} needs the batch norm to fold")
            self.bn = bn
            self.freeze_bn = False

    @classmethod
    def from_float(cls, mod: nn.Module, use_precomputed_fake_quant: bool = False) -> "_QatSparseConv":
        """The QAT module of a float sparse conv or fused float module carrying a ``qconfig``."""
        if not isinstance(mod, cls._FLOAT_MODULE):
            raise TypeError(f"{cls.__name__}.from_float takes a {cls._FLOAT_MODULE.__name__}, got "
                            f"{type(mod).__name__}")
        qconfig = getattr(mod, "qconfig", None)
        if qconfig is None:
            raise ValueError(f"{cls.__name__}.from_float: the float module has no qconfig")
        conv = mod[0] if isinstance(mod, nni._FusedModule) else mod
        bn = mod[1] if cls._HAS_BN else None
        qat = cls(conv, qconfig, bn)
        qat.train(mod.training)
        return qat

    # -------------------------------------------------------------- batch norm handling

    def freeze_bn_stats(self) -> "_QatSparseConv":
        """Stops updating the batch norm's running statistics (it then normalizes with them)."""
        if self._HAS_BN:
            self.freeze_bn = True
            self.bn.training = False
        return self

    def update_bn_stats(self) -> "_QatSparseConv":
        """Resumes updating the batch norm's running statistics."""
        if self._HAS_BN:
            self.freeze_bn = False
            self.bn.training = self.training
        return self

    def train(self, mode: bool = True) -> "_QatSparseConv":
        super().train(mode)
        if self._HAS_BN and self.freeze_bn:
            self.bn.training = False
        return self

    def _bn_scale(self) -> torch.Tensor:
        bn = self.bn
        std = torch.sqrt(bn.running_var + bn.eps)
        gamma = bn.weight if bn.weight is not None else torch.ones_like(std)
        return gamma / std

    def folded_parameters(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The float weight and bias inference uses (batch norm folded with its running statistics)."""
        weight = effective_weight(self)
        if not self._HAS_BN:
            return weight, self.bias
        bn = self.bn
        return fuse_spconv_bn_weights(weight, self.bias, bn.running_mean, bn.running_var, bn.eps,
                                      bn.weight, bn.bias)

    # -------------------------------------------------------------- forward

    def _conv(self, input: SparseConvTensor) -> SparseConvTensor:
        weight = effective_weight(self)
        if not self._HAS_BN:
            return conv_with_weight(self, input, self.weight_fake_quant(weight), self.bias)
        scale = self._bn_scale()
        shape = [-1] + [1] * (weight.dim() - 1)
        weight = self.weight_fake_quant(weight * scale.reshape(shape))
        out = conv_with_weight(self, input, weight, None)
        if out.features.shape[0] == 0:
            return out
        features = out.features / scale
        if self.bias is not None:
            features = features + self.bias
        return out.replace_feature(self.bn(features))

    def forward(self, input: SparseConvTensor, add_input: Optional[SparseConvTensor] = None) -> SparseConvTensor:
        if self._HAS_ADD and add_input is None:
            raise TypeError(f"{type(self).__name__}.forward needs add_input (the residual)")
        out = self._conv(input)
        features = out.features
        if add_input is not None:
            features = features + add_input.features
        if self._HAS_RELU:
            features = torch.relu(features)
        elif self._activation is not None:
            features = self._apply_activation(features)
        return out.replace_feature(features) if features is not out.features else out

    def to_float(self) -> nn.Module:
        """The float module (batch norm folded) that conversion turns into an int8 module."""
        conv = clone_sparse_conv(self)
        weight, bias = self.folded_parameters()
        conv.weight = nn.Parameter(weight.detach().clone())
        conv.bias = None if bias is None else nn.Parameter(bias.detach().clone())
        if self._HAS_ADD:
            return fused.SpconvAddReLUNd(conv, nn.ReLU())
        if self._HAS_RELU:
            return fused.SpconvReLUNd(conv, nn.ReLU())
        return conv


def _variant(name: str, float_module: Any, doc: str, *, bn: bool = False, relu: bool = False,
             add: bool = False) -> type:
    """The QAT class of one float module: its name, the module it replaces and which parts it folds in."""
    attributes = {"__doc__": doc, "__module__": __name__, "__qualname__": name, "_FLOAT_MODULE": float_module,
                  "_HAS_BN": bn, "_HAS_RELU": relu, "_HAS_ADD": add}
    return type(name, (_QatSparseConv,), attributes)


SparseConv = _variant("SparseConv", SparseConvolution, "QAT sparse conv.")
SparseConvReLU = _variant("SparseConvReLU", fused.SpconvReLUNd, "QAT ``relu(conv(x))``.", relu=True)
SparseConvAddReLU = _variant("SparseConvAddReLU", fused.SpconvAddReLUNd, "QAT ``relu(conv(x) + add_input)``.",
                             relu=True, add=True)
SparseConvBn = _variant("SparseConvBn", fused.SpconvBnNd,
                        "QAT ``bn(conv(x))`` with the batch norm folded into the fake-quantized weight.", bn=True)
SparseConvBnReLU = _variant("SparseConvBnReLU", fused.SpconvBnReLUNd, "QAT ``relu(bn(conv(x)))``.", bn=True,
                            relu=True)
SparseConvBnAddReLU = _variant("SparseConvBnAddReLU", fused.SpconvBnAddReLUNd,
                               "QAT ``relu(bn(conv(x)) + add_input)``.", bn=True, relu=True, add=True)
