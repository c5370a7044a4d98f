"""Module mappings (spconv's names): float / fused -> QAT, and QAT / fused -> int8."""

from __future__ import annotations

from typing import Any, Callable

from . import intrinsic as fused
from .backend_cfg import SPARSE_CONV_TYPES
from .intrinsic import qat
from .quantized import conv as quantized

__all__ = ["get_spconv_fmod_to_qat_mapping", "get_spconv_qat_to_static_mapping"]


def get_spconv_qat_to_static_mapping() -> dict[Callable, Any]:
    """Float, fused and QAT sparse module classes -> their int8 module class (a new dict per call)."""
    mapping: dict[Callable, Any] = {conv_type: quantized.SparseConv for conv_type in SPARSE_CONV_TYPES}
    mapping.update({
        fused.SpconvReLUNd: quantized.SparseConvReLU,
        fused.SpconvAddReLUNd: quantized.SparseConvAddReLU,
        qat.SparseConv: quantized.SparseConv,
        qat.SparseConvBn: quantized.SparseConv,
        qat.SparseConvReLU: quantized.SparseConvReLU,
        qat.SparseConvBnReLU: quantized.SparseConvReLU,
        qat.SparseConvAddReLU: quantized.SparseConvAddReLU,
        qat.SparseConvBnAddReLU: quantized.SparseConvAddReLU,
    })
    return mapping


def get_spconv_fmod_to_qat_mapping() -> dict[Callable, Any]:
    """Fused float module classes -> their QAT module class (a new dict per call)."""
    return {
        fused.SpconvReLUNd: qat.SparseConvReLU,
        fused.SpconvBnNd: qat.SparseConvBn,
        fused.SpconvBnReLUNd: qat.SparseConvBnReLU,
        fused.SpconvAddReLUNd: qat.SparseConvAddReLU,
        fused.SpconvBnAddReLUNd: qat.SparseConvBnAddReLU,
    }
