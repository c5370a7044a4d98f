"""sparsecore.torch.quantization: spconv's int8 PTQ / QAT workflow, running real int8 on CPU and GPU.

``import sparsecore.torch.quantization as spconvq`` answers to the names of
``spconv.pytorch.quantization``: qconfig mappings for PTQ and QAT, the
prepare-custom-config and backend config for ``torch.ao``'s fx quantization,
`prepare_spconv_torch_inference`, `transform_qdq`, `remove_conv_add_dq`, and
the module families ``intrinsic`` (fused float), ``intrinsic.qat``,
``intrinsic.quantized``, ``quantized`` (and ``quantized.reference``),
``fake_q`` (observers) and ``utils``. After `transform_qdq` the sparse convs
and max pools run int8 x int8 products with exact int32 sums over the
rulebook (`sparsecore.int8`), any channel count, on the CPU (NumPy) or the
GPU. `tensorrt_parameters` lists each int8 layer's scales and biases for a
deployment engine. See docs/quantization.md.
"""

from __future__ import annotations

from . import backend_cfg, fake_q, graph, intrinsic, qmapping, quantized, tensorrt, utils
from .backend_cfg import (get_spconv_backend_config, get_spconv_convert_custom_config,
                          get_spconv_prepare_custom_config, prepare_spconv_torch_inference)
from .fake_q import (check_calibration, get_default_spconv_qconfig_mapping, get_default_spconv_trt_ptq_qconfig,
                     get_default_spconv_trt_qat_qconfig)
from .graph import quantize_per_tensor, quantized_add, remove_conv_add_dq, transform_qdq
from .qmapping import get_spconv_fmod_to_qat_mapping, get_spconv_qat_to_static_mapping
from .tensorrt import Int8LayerParameters, tensorrt_parameters
from .utils import fuse_spconv_bn_eval

__all__ = [
    "get_default_spconv_qconfig_mapping", "get_spconv_prepare_custom_config", "get_spconv_backend_config",
    "get_spconv_convert_custom_config", "prepare_spconv_torch_inference", "get_default_spconv_trt_ptq_qconfig",
    "get_default_spconv_trt_qat_qconfig", "get_spconv_fmod_to_qat_mapping", "get_spconv_qat_to_static_mapping",
    "quantize_per_tensor", "quantized_add", "transform_qdq", "remove_conv_add_dq", "check_calibration",
    "tensorrt_parameters", "Int8LayerParameters", "fuse_spconv_bn_eval",
    "backend_cfg", "fake_q", "graph", "intrinsic", "qmapping", "quantized", "tensorrt", "utils",
]
