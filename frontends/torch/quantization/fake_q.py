"""Observers, fake quantizers, qconfigs and the qconfig mapping of sparse int8 quantization.

The scheme (spconv's, TensorRT's): symmetric ``qint8`` in [-128, 127], zero
point 0; activations per tensor (eps 2^-12), weights per output channel (axis 0
of the ``[out, *kernel, in]`` weight). The observers and fake quantizers accept
a `SparseConvTensor` as well as a tensor and look only at real rows: a tensor
without active sites is passed through unobserved (an empty batch must not
turn the range into +-inf or reset it), and when ``voxel_num`` is set (inputs
padded to a static row count, as for TensorRT) only the first ``voxel_num``
rows are observed and fake-quantized.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import torch
from torch.ao.quantization.fake_quantize import (
    FakeQuantize,
    FixedQParamsFakeQuantize,
    FusedMovingAvgObsFakeQuantize,
    default_per_channel_weight_fake_quant,
    default_weight_fake_quant,
)
from torch.ao.quantization.observer import (
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    default_per_channel_weight_observer,
    default_placeholder_observer,
    default_weight_observer,
)
from torch.ao.quantization.qconfig import QConfig, default_reuse_input_qconfig
from torch.ao.quantization.qconfig_mapping import _FIXED_QPARAMS_OP_TO_OBSERVER, QConfigMapping

from ..tensor import SparseConvTensor
from .graph import modules_in_graph

__all__ = [
    "SparseHistogramObserver", "SparseMinMaxObserver", "SparseMovingAvgObsFakeQuantize",
    "SparseFusedMovingAvgObsFakeQuantize", "ACTIVATION_EPS", "is_calibrated", "check_calibration",
    "get_default_spconv_trt_ptq_qconfig", "get_default_spconv_trt_qat_qconfig",
    "get_default_spconv_qconfig_mapping",
]

ACTIVATION_EPS = 2.0 ** -12
"""The smallest activation scale (spconv's choice): a layer whose outputs are all ~0 still gets a usable scale."""


def _observe_rows(parent_forward: Callable[[torch.Tensor], torch.Tensor],
                  value: Union[SparseConvTensor, torch.Tensor]) -> Union[SparseConvTensor, torch.Tensor]:
    """Runs an observer / fake quantizer on the real rows of ``value``; empty inputs pass unobserved."""
    if isinstance(value, SparseConvTensor):
        features = value.features
        if features.shape[0] == 0:
            return value
        rows = value.voxel_num
        if rows is not None:
            rows = int(rows.reshape(-1)[0]) if isinstance(rows, torch.Tensor) else int(rows)
            if rows < features.shape[0]:
                head = parent_forward(features[:rows])
                return value.replace_feature(torch.cat([head, features[rows:]], dim=0))
        return value.replace_feature(parent_forward(features))
    if isinstance(value, torch.Tensor) and value.numel() == 0:
        return value
    return parent_forward(value)


UNCALIBRATED_MESSAGE = (
    "{observer} has observed no data, so it has no scale: calibrate before convert_fx (PTQ: run the prepared "
    "model on representative inputs; QAT: train or run it in train mode). "
    "sparsecore.torch.quantization.check_calibration(prepared_model) names every layer still uncalibrated."
)


def is_calibrated(observer: torch.nn.Module) -> bool:
    """True once an activation observer / fake quantizer has seen at least one non-empty input."""
    inner = getattr(observer, "activation_post_process", observer)
    min_val = getattr(inner, "min_val", None)
    if isinstance(inner, HistogramObserver):
        return bool(inner.histogram.sum() > 0) or bool(torch.isfinite(min_val).all() and min_val.numel() > 0)
    if min_val is None:
        return True  # not a range observer (fixed qparams, placeholders)
    return min_val.numel() > 0 and bool(torch.isfinite(min_val).all())


class _SparseRows:
    """Mixin for an observer or fake quantizer: it observes only the real rows of a `SparseConvTensor` (or a
    tensor), passes empty inputs unobserved, and refuses to give qparams before it has seen data."""

    def forward(self, value: Union[SparseConvTensor, torch.Tensor]) -> Union[SparseConvTensor, torch.Tensor]:
        return _observe_rows(super().forward, value)  # type: ignore[misc]

    def calculate_qparams(self) -> Any:
        if not is_calibrated(self):  # type: ignore[arg-type]
            raise RuntimeError(UNCALIBRATED_MESSAGE.format(observer=type(self).__name__))
        return super().calculate_qparams()  # type: ignore[misc]


class SparseHistogramObserver(_SparseRows, HistogramObserver):
    """``HistogramObserver`` for a `SparseConvTensor`'s features (or a tensor); ignores empty and padded rows."""


class SparseMinMaxObserver(_SparseRows, MinMaxObserver):
    """``MinMaxObserver`` for a `SparseConvTensor`'s features (or a tensor); ignores empty and padded rows."""


class SparseMovingAvgObsFakeQuantize(_SparseRows, FakeQuantize):
    """``FakeQuantize`` for a `SparseConvTensor`'s features (or a tensor); ignores empty and padded rows."""


class SparseFusedMovingAvgObsFakeQuantize(_SparseRows, FusedMovingAvgObsFakeQuantize):
    """``FusedMovingAvgObsFakeQuantize`` for a `SparseConvTensor`'s features; ignores empty and padded rows."""


_ACTIVATION_ARGS: dict[str, Any] = {
    "quant_min": -128, "quant_max": 127, "dtype": torch.qint8, "reduce_range": False,
    "qscheme": torch.per_tensor_symmetric, "eps": ACTIVATION_EPS,
}

default_symmetric_spconv_ptq_qconfig = QConfig(
    activation=SparseHistogramObserver.with_args(**_ACTIVATION_ARGS),
    weight=default_per_channel_weight_observer,
)
"""PTQ: histogram-calibrated per-tensor activations, min-max per-channel weights (symmetric qint8)."""

default_symmetric_spconv_qat_qconfig = QConfig(
    activation=SparseMovingAvgObsFakeQuantize.with_args(observer=MovingAverageMinMaxObserver, **_ACTIVATION_ARGS),
    weight=default_per_channel_weight_fake_quant,
)
"""QAT: moving-average per-tensor activation fake-quant, per-channel weight fake-quant (symmetric qint8).

Not torch's fused fake quantizers (``FusedMovingAvgObsFakeQuantize``, spconv's
choice): on an all-positive input (a ReLU output) their kernel trains with zero
point -128 and half the scale, while ``convert_fx`` takes the symmetric scale
from ``calculate_qparams``, so the converted model would not compute what was
trained. ``FakeQuantize`` trains with exactly the qparams conversion uses.
"""


def get_default_spconv_trt_ptq_qconfig(backend: str = "fbgemm", version: int = 0) -> QConfig:
    """The PTQ qconfig (spconv's name; ``backend`` and ``version`` are accepted and unused)."""
    return default_symmetric_spconv_ptq_qconfig


def get_default_spconv_trt_qat_qconfig(backend: str = "fbgemm", version: int = 0) -> QConfig:
    """The QAT qconfig (spconv's name; ``backend`` and ``version`` are accepted and unused)."""
    return default_symmetric_spconv_qat_qconfig


def get_default_spconv_qconfig_mapping(is_qat: bool, backend: str = "fbgemm", version: int = 0) -> QConfigMapping:
    """The ``QConfigMapping`` for ``prepare_fx`` (PTQ) or ``prepare_qat_fx`` (QAT) of a sparse model.

    Args:
        is_qat: QAT (fake quantization) instead of PTQ (observers).
        backend: ``"fbgemm"`` / ``"x86"`` / ``"qnnpack"`` / ``"onednn"`` (as torch's mapping:
            dense transposed convs get per-tensor weights on fbgemm / x86).
        version: accepted for spconv compatibility.

    Returns:
        A mapping with the symmetric qint8 qconfig globally, layer norms with float
        weights, and torch's fixed-qparams ops (sigmoid, tanh, ...) on their fixed ranges.
    """
    if not isinstance(is_qat, bool):
        raise TypeError(f"is_qat must be a bool (True for QAT, False for PTQ), got {is_qat!r}")
    qconfig = get_default_spconv_trt_qat_qconfig(backend, version) if is_qat else \
        get_default_spconv_trt_ptq_qconfig(backend, version)
    default_weight = default_weight_fake_quant if is_qat else default_weight_observer
    transpose_qconfig = QConfig(activation=qconfig.activation, weight=default_weight) \
        if backend in ("fbgemm", "x86") else qconfig
    layernorm_qconfig = QConfig(activation=qconfig.activation, weight=default_placeholder_observer)
    functional = torch.nn.functional
    mapping = QConfigMapping().set_global(qconfig).set_object_type("reshape", default_reuse_input_qconfig)
    for transposed in (torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d,
                       functional.conv_transpose1d, functional.conv_transpose2d, functional.conv_transpose3d):
        mapping.set_object_type(transposed, transpose_qconfig)
    mapping.set_object_type(functional.layer_norm, layernorm_qconfig)
    mapping.set_object_type(torch.nn.LayerNorm, layernorm_qconfig)
    fixed: dict[Any, QConfig] = {}
    for op, observer in _FIXED_QPARAMS_OP_TO_OBSERVER.items():
        if observer not in fixed:
            activation = FixedQParamsFakeQuantize.with_args(observer=observer) if is_qat else observer
            fixed[observer] = QConfig(activation=activation, weight=default_weight)
        mapping.set_object_type(op, fixed[observer])
    if backend == "onednn":
        for op in (torch.nn.Linear, torch.nn.LeakyReLU, functional.leaky_relu, torch.nn.Tanh, functional.tanh):
            mapping.set_object_type(op, qconfig)
    return mapping


def check_calibration(prepared: torch.nn.Module) -> None:
    """Raises a RuntimeError naming every layer whose input or output observer has seen no data.

    Args:
        prepared: the GraphModule returned by ``prepare_fx`` / ``prepare_qat_fx``.
    """
    observers = modules_in_graph(prepared, (HistogramObserver, MinMaxObserver, FakeQuantize,
                                            FusedMovingAvgObsFakeQuantize),
                                 "check_calibration takes the GraphModule prepare_fx returns")
    missing = []
    for node, observer in observers:
        if is_calibrated(observer):
            continue
        source = node.args[0] if node.args else None
        what = getattr(source, "target", source)
        layers = sorted(str(user.target) for user in node.users if user.op == "call_module")
        missing.append(f"the output of {what!s} (input of {', '.join(layers) or 'the graph output'})")
    if missing:
        raise RuntimeError("not calibrated: " + "; ".join(missing) + ". Run the prepared model on data "
                           "before convert_fx.")
