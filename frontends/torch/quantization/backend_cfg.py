"""The ``BackendConfig`` and custom configs that teach ``torch.ao``'s fx quantization about sparse layers.

Fusion patterns (every sparse conv class): conv -> relu; conv -> bn (-> relu)
for ``nn.BatchNorm1d``, `SparseBatchNorm`, `SparseSyncBatchNorm` and the ReLUs
``nn.ReLU``, ``F.relu``, `SparseReLU`; and the residual patterns
``SparseReLU(conv(x) + y)`` and ``SparseReLU(bn(conv(x)) + y)`` (``+`` as
``operator.add`` or ``torch.add``). PTQ folds the batch norm at fusion time;
QAT keeps it (the QAT modules fold it into the fake-quantized weight).
`ToDense`, `SparseIdentity` and the pools share their input's observer.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.quantization.backend_config import (BackendConfig, BackendPatternConfig, DTypeConfig,
                                                  ObservationType, get_tensorrt_backend_config)
from torch.ao.quantization.fx.custom_config import ConvertCustomConfig, PrepareCustomConfig
from torch.ao.quantization.fx.match_utils import MatchAllNode

from .. import conv as sparse_conv
from .. import pool as sparse_pool
from ..modules import SparseBatchNorm, SparseIdentity, SparseReLU, SparseSyncBatchNorm, ToDense
from . import intrinsic as fused
from .intrinsic import qat
from .quantized.reference import SpConv
from .utils import DocumentedLayoutConv, fuse_spconv_bn_eval

__all__ = ["SPARSE_CONV_TYPES", "SPARSE_POOL_TYPES", "BATCH_NORM_TYPES", "RELU_TYPES",
           "get_spconv_backend_config", "get_spconv_prepare_custom_config", "get_spconv_convert_custom_config",
           "prepare_spconv_torch_inference", "weighted_op_qint8_dtype_config",
           "non_weighted_op_qint8_dtype_config"]

SPARSE_CONV_TYPES: tuple[type, ...] = (sparse_conv.SparseConvolution, DocumentedLayoutConv) + tuple(
    getattr(sparse_conv, name) for name in sparse_conv.__all__ if name != "SparseConvolution")
SPARSE_POOL_TYPES: tuple[type, ...] = tuple(getattr(sparse_pool, name) for name in sparse_pool.__all__)
BATCH_NORM_TYPES: tuple[type, ...] = (nn.BatchNorm1d, SparseBatchNorm, SparseSyncBatchNorm)
RELU_TYPES: tuple[Any, ...] = (nn.ReLU, F.relu, SparseReLU)
_ADD_OPS = (operator.add, torch.add)

weighted_op_qint8_dtype_config = DTypeConfig(input_dtype=torch.qint8, output_dtype=torch.qint8,
                                             weight_dtype=torch.qint8, bias_dtype=torch.float)
non_weighted_op_qint8_dtype_config = DTypeConfig(input_dtype=torch.qint8, output_dtype=torch.qint8)


# ------------------------------------------------------------------------- fusers


def _check_same_mode(*modules: nn.Module) -> None:
    modes = {m.training for m in modules if isinstance(m, nn.Module)}
    if len(modes) > 1:
        raise ValueError("cannot fuse a sparse conv with a batch norm / ReLU in a different train / eval mode; "
                         "call model.train() (QAT) or model.eval() (PTQ) before prepare")


def _check_bn(conv: nn.Module, bn: nn.Module) -> None:
    if bn.num_features != conv.out_channels:
        raise ValueError(f"batch norm has {bn.num_features} features but {type(conv).__name__} has "
                         f"{conv.out_channels} output channels")
    if not bn.affine or not bn.track_running_stats:
        raise ValueError("only a batch norm with affine=True and track_running_stats=True can be fused")


def fuse_conv_relu(is_qat: bool, conv: nn.Module, relu: nn.Module) -> nn.Module:
    """conv -> relu: `SpconvReLUNd`."""
    _check_same_mode(conv, relu)
    return fused.SpconvReLUNd(conv, relu)


def _fuse_folding_bn(is_qat: bool, qat_module: type, ptq_module: Any, conv: nn.Module, bn: nn.Module,
                     *after: nn.Module) -> nn.Module:
    """conv -> bn (-> ``after``): ``qat_module(conv, bn, *after)`` for QAT; for PTQ the batch norm folded
    into a copy of the conv, wrapped as ``ptq_module(folded, *after)`` (the folded conv alone when None)."""
    _check_same_mode(conv, bn, *after)
    _check_bn(conv, bn)
    if is_qat:
        return qat_module(conv, bn, *after)
    folded = fuse_spconv_bn_eval(conv, bn)
    return folded if ptq_module is None else ptq_module(folded, *after)


def fuse_conv_bn(is_qat: bool, conv: nn.Module, bn: nn.Module) -> nn.Module:
    """conv -> bn: `SpconvBnNd` for QAT, the folded conv for PTQ."""
    return _fuse_folding_bn(is_qat, fused.SpconvBnNd, None, conv, bn)


def fuse_conv_bn_relu(is_qat: bool, conv: nn.Module, bn: nn.Module, relu: nn.Module) -> nn.Module:
    """conv -> bn -> relu: `SpconvBnReLUNd` for QAT, folded conv + ReLU (`SpconvReLUNd`) for PTQ."""
    return _fuse_folding_bn(is_qat, fused.SpconvBnReLUNd, fused.SpconvReLUNd, conv, bn, relu)


def fuse_conv_bn_add_relu(is_qat: bool, relu: nn.Module, add_pattern: tuple) -> nn.Module:
    """relu(bn(conv(x)) + y): `SpconvBnAddReLUNd` for QAT, folded `SpconvAddReLUNd` for PTQ."""
    _, (bn, conv), _ = add_pattern
    return _fuse_folding_bn(is_qat, fused.SpconvBnAddReLUNd, fused.SpconvAddReLUNd, conv, bn, relu)


def fuse_conv_add_relu(is_qat: bool, relu: nn.Module, add_pattern: tuple) -> nn.Module:
    """relu(conv(x) + y): `SpconvAddReLUNd`."""
    _, conv, _ = add_pattern
    _check_same_mode(conv, relu)
    return fused.SpconvAddReLUNd(conv, relu)


def _bn_add_root(pattern: tuple) -> Any:
    _, (_, (_, conv), _) = pattern
    return conv


def _bn_add_extra_inputs(pattern: tuple) -> list:
    _, (_, _, extra) = pattern
    return [extra]


def _add_root(pattern: tuple) -> Any:
    _, (_, conv, _) = pattern
    return conv


# --------------------------------------------------------------------- pattern configs


def _weighted(pattern: Any, dtype_configs: list[DTypeConfig]) -> BackendPatternConfig:
    return (BackendPatternConfig(pattern)
            .set_observation_type(ObservationType.OUTPUT_USE_DIFFERENT_OBSERVER_AS_INPUT)
            .set_dtype_configs(dtype_configs))


def _bn_configs(conv_type: type, bn_type: type, dtype_configs: list[DTypeConfig]) -> list[BackendPatternConfig]:
    configs = [BackendPatternConfig((conv_type, bn_type)).set_dtype_configs(dtype_configs)
               .set_fuser_method(fuse_conv_bn).set_fused_module(fused.SpconvBnNd)]
    for relu in RELU_TYPES:
        configs.append(BackendPatternConfig((conv_type, bn_type, relu)).set_dtype_configs(dtype_configs)
                       .set_fuser_method(fuse_conv_bn_relu).set_fused_module(fused.SpconvBnReLUNd))
    for add in _ADD_OPS:
        configs.append(BackendPatternConfig()._set_pattern_complex_format(
            (SparseReLU, (add, (bn_type, conv_type), MatchAllNode)))
            .set_dtype_configs(dtype_configs).set_fuser_method(fuse_conv_bn_add_relu)
            ._set_root_node_getter(_bn_add_root)._set_extra_inputs_getter(_bn_add_extra_inputs)
            .set_fused_module(fused.SpconvBnAddReLUNd))
    return configs


def _conv_configs(conv_type: type, dtype_configs: list[DTypeConfig]) -> list[BackendPatternConfig]:
    configs = [
        _weighted(conv_type, dtype_configs).set_root_module(conv_type)
        .set_reference_quantized_module(SpConv).set_qat_module(qat.SparseConv),
    ]
    for relu in RELU_TYPES:
        configs.append(BackendPatternConfig((conv_type, relu)).set_dtype_configs(dtype_configs)
                       .set_fuser_method(fuse_conv_relu).set_fused_module(fused.SpconvReLUNd))
    for add in _ADD_OPS:
        configs.append(BackendPatternConfig()._set_pattern_complex_format(
            (SparseReLU, (add, conv_type, MatchAllNode)))
            .set_dtype_configs(dtype_configs).set_fuser_method(fuse_conv_add_relu)
            ._set_root_node_getter(_add_root)._set_extra_inputs_getter(_bn_add_extra_inputs)
            .set_fused_module(fused.SpconvAddReLUNd))
    return configs


def _fused_configs(dtype_configs: list[DTypeConfig]) -> list[BackendPatternConfig]:
    root = DocumentedLayoutConv  # what QAT modules' to_float returns
    pairs = ((fused.SpconvReLUNd, qat.SparseConvReLU), (fused.SpconvBnNd, qat.SparseConvBn),
             (fused.SpconvBnReLUNd, qat.SparseConvBnReLU), (fused.SpconvAddReLUNd, qat.SparseConvAddReLU),
             (fused.SpconvBnAddReLUNd, qat.SparseConvBnAddReLU))
    configs = []
    for fused_type, qat_type in pairs:
        configs.append(_weighted(fused_type, dtype_configs).set_root_module(root)
                       .set_reference_quantized_module(SpConv).set_qat_module(qat_type))
        configs.append(_weighted(qat_type, dtype_configs).set_root_module(root)
                       .set_reference_quantized_module(SpConv))
    configs.append(_weighted(qat.SparseConv, dtype_configs).set_root_module(root)
                   .set_reference_quantized_module(SpConv))
    return configs


def _share_observer_configs(dtype_configs: list[DTypeConfig]) -> list[BackendPatternConfig]:
    return [BackendPatternConfig(module_type)
            .set_observation_type(ObservationType.OUTPUT_SHARE_OBSERVER_WITH_INPUT)
            .set_dtype_configs(dtype_configs)
            for module_type in (ToDense, SparseIdentity) + SPARSE_POOL_TYPES]


def get_spconv_backend_config(additional_bns: Optional[Sequence[type]] = None) -> BackendConfig:
    """torch's TensorRT backend config plus every sparse pattern (see the module docstring).

    Args:
        additional_bns: further batch-norm classes to fuse after sparse convs.
    """
    weighted = [weighted_op_qint8_dtype_config]
    configs: list[BackendPatternConfig] = []
    for conv_type in SPARSE_CONV_TYPES:
        configs.extend(_conv_configs(conv_type, weighted))
        for bn_type in BATCH_NORM_TYPES + tuple(additional_bns or ()):
            configs.extend(_bn_configs(conv_type, bn_type, weighted))
    configs.extend(_fused_configs(weighted))
    configs.extend(_share_observer_configs([non_weighted_op_qint8_dtype_config]))
    return get_tensorrt_backend_config().set_backend_pattern_configs(configs)


def get_spconv_prepare_custom_config(additional_bns: Optional[Sequence[type]] = None) -> PrepareCustomConfig:
    """A ``PrepareCustomConfig`` for sparse models; users extend ``non_traceable_module_classes`` as in spconv.

    The sparse layers need no entry: they are leaves under any fx tracer
    (`sparsecore.torch.fx`). Listing them as non-traceable, as spconv does, would
    also keep ``prepare_qat_fx`` from giving a lone sparse conv its qconfig, so it
    would never be swapped for its QAT module.

    Args:
        additional_bns: batch-norm classes of your own to keep whole (leaves).
    """
    config = PrepareCustomConfig()
    config.non_traceable_module_classes = list(additional_bns or ())
    return config


def get_spconv_convert_custom_config() -> ConvertCustomConfig:
    """An empty ``ConvertCustomConfig`` (the sparse lowering is done by `transform_qdq`)."""
    return ConvertCustomConfig()


def prepare_spconv_torch_inference(with_linear: bool) -> None:
    """Chooses how ``convert_fx`` lowers ``nn.Linear``; call before ``convert_fx`` (spconv's API).

    Sparse layers need nothing registered: `transform_qdq` lowers them to int8
    modules after ``convert_fx``. ``with_linear=True`` lowers ``Linear`` (and
    ``LinearReLU``) to `LinearPerChannelWeight` (per-channel int8 weights, exact
    integer sums); ``with_linear=False`` keeps their quantize / dequantize pairs
    (TensorRT's explicit quantization). This edits torch's lowering tables
    (``torch.ao.quantization.fx._lower_to_native_backend``) for the process, as
    spconv does.
    """
    if not isinstance(with_linear, bool):
        raise TypeError(f"with_linear must be a bool, got {with_linear!r}")
    import torch.ao.nn.intrinsic as nni
    import torch.ao.nn.quantized.reference as nnqr
    from torch.ao.quantization.fx import _lower_to_native_backend as lowering

    from .quantized.conv import LinearPerChannelWeight, LinearPerChannelWeightReLU

    if with_linear:
        lowering.STATIC_LOWER_MODULE_MAP[nnqr.Linear] = LinearPerChannelWeight
        lowering.STATIC_LOWER_FUSED_MODULE_MAP[nni.LinearReLU] = (nnqr.Linear, LinearPerChannelWeightReLU)
    else:
        lowering.STATIC_LOWER_MODULE_MAP.pop(nnqr.Linear, None)
        lowering.STATIC_LOWER_FUSED_MODULE_MAP.pop(nni.LinearReLU, None)


