"""sparsecore.torch.quantization: spconv's fx PTQ / QAT workflow with real int8 layers.

Oracles: the unfused float model (fusion and folding), the fake-quantized QAT
model (the int8 model must agree within one output quantization step), the
float model (PTQ quality, reported), an integer NumPy reference of a 1x1
layer built from the TensorRT parameters, and the float reference module
(``convert_fx``'s own simulation) for the int8 modules.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
import torch.ao.quantization as tq
import torch.ao.quantization.quantize_fx as qfx
import torch.fx
from torch import nn

import sparsecore.torch as spconv
import sparsecore.torch.quantization as spconvq
from sparsecore.torch.quantization.fake_q import SparseMinMaxObserver, is_calibrated
from tests.torch_networks import FusableResidualBlock, randomize_batch_norms, sparse_input

# the tests call torch.ao's fx workflow as a user does (prepare_fx, convert_fx): torch's deprecation of it is
# the user's to see, not sparsecore's (sparsecore's own calls are checked to warn nothing, below)
pytestmark = [pytest.mark.filterwarnings(r"ignore:torch\.ao\.quantization is deprecated:DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:is_fx_tracing will return true")]

SHAPE = [10, 9, 8]
BATCH = 2


def _tensor(seed: int, channels: int = 4, num: int = 180) -> spconv.SparseConvTensor:
    return spconv.SparseConvTensor(*sparse_input(seed, SHAPE, BATCH, channels, num, np.float32), SHAPE, BATCH)


def _randomize_bn(model: nn.Module, seed: int) -> None:
    randomize_batch_norms(model, seed, mean_std=0.2, variance_low=0.1, variance_width=0.5)


class SmallNet(nn.Module):
    """stem (subm-bn-relu), residual block, strided conv-bn-relu, max pool, 1x1 head; returns dense features."""

    def __init__(self, channels: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.stem = spconv.SparseSequential(spconv.SubMConv3d(4, channels, 3, bias=False, indice_key="stem"),
                                            nn.BatchNorm1d(channels), nn.ReLU())
        self.block = FusableResidualBlock(channels, spconv.SubMConv3d, indice_key="res")
        self.down = spconv.SparseSequential(spconv.SparseConv3d(channels, 12, 3, 2, 1, bias=False),
                                            spconv.SparseBatchNorm(12), spconv.SparseReLU())
        self.pool = spconv.SparseMaxPool3d(2, 2)
        self.head = spconv.SubMConv3d(12, classes, 1)

    def forward(self, x):
        x = self.block(self.stem(x))
        return self.head(self.pool(self.down(x))).features


def _model(seed: int, training: bool = False) -> SmallNet:
    torch.manual_seed(seed)
    model = SmallNet()
    _randomize_bn(model, seed)
    return model.train(training)


def _prepare(model: nn.Module, is_qat: bool):
    mapping = spconvq.get_default_spconv_qconfig_mapping(is_qat)
    backend = spconvq.get_spconv_backend_config()
    prepare = qfx.prepare_qat_fx if is_qat else qfx.prepare_fx
    prepared = prepare(model, mapping, (), backend_config=backend,
                       prepare_custom_config=spconvq.get_spconv_prepare_custom_config())
    return prepared, mapping, backend


def _convert(prepared, mapping, backend, with_linear: bool = True):
    spconvq.prepare_spconv_torch_inference(with_linear)
    converted = qfx.convert_fx(prepared, qconfig_mapping=mapping, backend_config=backend)
    converted = spconvq.transform_qdq(converted)
    return spconvq.remove_conv_add_dq(converted)


def _module_kinds(model: nn.Module) -> list[str]:
    return [type(m).__name__ for m in model.modules()]


# ----------------------------------------------------------------------------- fusion


def test_fuse_spconv_bn_eval_equals_conv_then_bn():
    torch.manual_seed(1)
    conv = spconv.SparseConv3d(4, 6, 3, 2, 1).double().eval()
    bn = nn.BatchNorm1d(6).double().eval()
    _randomize_bn(bn, 1)
    x = _tensor(1)
    x = x.replace_feature(x.features.double())
    folded = spconvq.fuse_spconv_bn_eval(conv, bn)
    want = bn(conv(x).features)
    torch.testing.assert_close(folded(x).features, want, rtol=1e-12, atol=1e-12)
    assert type(folded) is spconv.SparseConv3d
    with pytest.raises(ValueError, match="eval"):
        spconvq.fuse_spconv_bn_eval(conv.train(), bn)


def test_fuse_spconv_bn_eval_of_a_1x1_layer_keeps_spconvs_weight_reading():
    torch.manual_seed(24)
    conv = spconv.SubMConv3d(4, 6, 1).double().eval()
    bn = nn.BatchNorm1d(6).double().eval()
    _randomize_bn(bn, 24)
    x = _tensor(24)
    x = x.replace_feature(x.features.double())
    folded = spconvq.fuse_spconv_bn_eval(conv, bn)
    assert type(folded) is spconv.SubMConv3d and folded.reads_weight_as_spconv_1x1
    torch.testing.assert_close(folded(x).features, bn(conv(x).features), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("is_qat", [False, True])
def test_prepared_model_fuses_every_pattern_and_matches_float(is_qat):
    model = _model(2, training=is_qat)
    prepared, _, _ = _prepare(model, is_qat)
    kinds = _module_kinds(prepared)
    if is_qat:
        assert kinds.count("SparseConvBnReLU") == 3 and kinds.count("SparseConvBnAddReLU") == 1
        assert kinds.count("SparseConv") == 1  # the head
    else:
        assert kinds.count("SpconvReLUNd") == 3 and kinds.count("SpconvAddReLUNd") == 1
        assert "BatchNorm1d" not in kinds and "SparseBatchNorm" not in kinds
    # with the observers and fake quantizers switched off, the prepared model is the float model
    prepared.apply(tq.disable_observer)
    prepared.apply(tq.disable_fake_quant)
    prepared.eval()
    model.eval()
    x = _tensor(2)
    torch.testing.assert_close(prepared(x), model(x), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- PTQ


def test_guide_ptq_sequence_runs_and_int8_model_is_close_to_float():
    model = _model(3)
    prepared, mapping, backend = _prepare(model, False)
    for seed in range(8):
        prepared(_tensor(100 + seed))
    converted = _convert(prepared, mapping, backend)
    kinds = _module_kinds(converted)
    assert kinds.count("SparseConvReLU") == 3 and kinds.count("SparseConvAddReLU") == 1
    assert kinds.count("SparseConv") == 1 and kinds.count("QuantizedSparseMaxPool") == 1
    x = _tensor(4)
    want, got = model(x), converted(x)
    assert got.dtype == torch.float32 and got.shape == want.shape
    relative = float((got - want).detach().norm() / want.detach().norm())
    print(f"PTQ relative error of the small network's output: {relative:.4f}")
    assert relative < 0.1


def test_sparsecore_own_quantized_tensor_calls_warn_nothing():
    """torch's notice about quantized-tensor constructors is silenced around sparsecore's calls only."""
    from sparsecore.torch.quantization._torch_notices import QUANTIZED_TENSOR_NOTICE

    model = _model(5)
    prepared, mapping, backend = _prepare(model, False)
    for seed in range(3):
        prepared(_tensor(110 + seed))
    converted = _convert(prepared, mapping, backend)
    previous = torch.is_warn_always_enabled()
    torch.set_warn_always(True)  # torch warns once per process otherwise: every call warns now
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            converted(_tensor(6))  # quantize nodes, int8 convs, pool, adds
            [layer.weight() for layer in converted.modules() if hasattr(layer, "weight_int8")]
            ours = [str(w.message) for w in caught]
            torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)  # the user's own call still warns
            theirs = [str(w.message) for w in caught[len(ours):]]
    finally:
        torch.set_warn_always(previous)
    import re

    assert not [message for message in ours if re.search(QUANTIZED_TENSOR_NOTICE, message)], ours
    assert any(re.search(QUANTIZED_TENSOR_NOTICE, message) for message in theirs), theirs
    assert not [f for f in warnings.filters if f[1] is not None and "quantized tensor" in f[1].pattern]


def test_int8_modules_equal_the_reference_simulation():
    """transform_qdq's int8 modules against convert_fx's float reference modules (same scales)."""
    model = _model(5)
    prepared, mapping, backend = _prepare(model, False)
    for seed in range(4):
        prepared(_tensor(200 + seed))
    reference = qfx.convert_fx(copy.deepcopy(prepared), qconfig_mapping=mapping, backend_config=backend)
    for node in reference.graph.nodes:  # only make quantize accept SparseConvTensors, keep float modules
        if node.op == "call_function" and node.target is torch.quantize_per_tensor:
            node.target = spconvq.quantize_per_tensor
    reference.recompile()
    converted = _convert(prepared, mapping, backend)
    x = _tensor(6)
    step = float(converted.head.scale)
    difference = (converted(x) - reference(x)).abs().max().item()
    assert difference <= step * 1.001


def test_converting_without_calibration_names_the_problem():
    model = _model(7)
    prepared, mapping, backend = _prepare(model, False)
    with pytest.raises(RuntimeError, match="not calibrated: .*stem"):
        spconvq.check_calibration(prepared)
    with pytest.raises(RuntimeError, match="observed no data"):
        qfx.convert_fx(prepared, qconfig_mapping=mapping, backend_config=backend)


# ----------------------------------------------------------------------------- QAT


class ThreeLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = spconv.SparseSequential(
            spconv.SubMConv3d(4, 8, 3, bias=False, indice_key="a"), nn.BatchNorm1d(8), nn.ReLU(),
            spconv.SparseConv3d(8, 16, 3, 2, 1), nn.ReLU(),
            spconv.SubMConv3d(16, 3, 3, indice_key="b"))

    def forward(self, x):
        return self.layers(x).features


def test_qat_fake_quantized_model_and_int8_model_agree_within_one_step():
    torch.manual_seed(8)
    model = ThreeLayers().train()
    _randomize_bn(model, 8)
    prepared, mapping, backend = _prepare(model, True)
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.01)
    for seed in range(4):  # a few QAT steps
        out = prepared(_tensor(300 + seed))
        loss = out.square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    prepared.apply(tq.disable_observer)
    prepared.eval()
    x = _tensor(9)
    with torch.no_grad():
        fake = prepared(x)
    converted = _convert(copy.deepcopy(prepared), mapping, backend)
    assert _module_kinds(converted).count("SparseConvReLU") == 2
    int8 = converted(x)
    step = float(converted.get_submodule("layers.5").scale)  # the last conv's output scale
    difference = (int8 - fake).abs()
    assert float(difference.max()) <= step * 1.001, (float(difference.max()), step)
    assert float((difference > step * 0.5).float().mean()) < 0.02  # nearly all elements bit-identical


def test_guide_qat_sequence_with_residual_block_runs():
    model = _model(10, training=True)
    prepared, mapping, backend = _prepare(model, True)
    optimizer = torch.optim.Adam(prepared.parameters(), lr=1e-3)
    for seed in range(3):
        loss = prepared(_tensor(400 + seed)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    prepared.eval()
    converted = _convert(prepared, mapping, backend)
    assert _module_kinds(converted).count("SparseConvAddReLU") == 1
    out = converted(_tensor(11))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


# ----------------------------------------------------------------------------- observers


def test_observers_ignore_empty_inputs_and_padding_rows():
    observer = SparseMinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)
    empty = spconv.SparseConvTensor(torch.zeros(0, 3), torch.zeros(0, 4, dtype=torch.int32), SHAPE, 1)
    assert observer(empty) is empty
    assert not is_calibrated(observer)
    x = _tensor(12, channels=3)
    padded = x.replace_feature(torch.cat([x.features, torch.full((5, 3), 1000.0)])[: x.features.shape[0]])
    padded.voxel_num = torch.tensor([x.features.shape[0] - 5])
    observer(padded)
    real = padded.features[:-5]
    assert float(observer.max_val) == pytest.approx(float(real.max()))
    assert float(observer.min_val) == pytest.approx(float(real.min()))


# ----------------------------------------------------------------------------- TensorRT parameters


class OneByOne(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = spconv.SparseSequential(spconv.SubMConv3d(4, 7, 1), nn.ReLU())

    def forward(self, x):
        return self.conv(x)


def test_tensorrt_parameters_reproduce_the_int8_layer():
    torch.manual_seed(13)
    model = OneByOne().eval()
    prepared, mapping, backend = _prepare(model, False)
    for seed in range(3):
        prepared(_tensor(500 + seed))
    converted = _convert(prepared, mapping, backend)
    [layer] = spconvq.tensorrt_parameters(converted)
    assert layer.kind == "SparseConvReLU" and layer.relu and layer.residual_scale is None
    np.testing.assert_allclose(layer.gemm_scale, layer.input_scale * layer.weight_scales / layer.output_scale,
                               rtol=1e-6)
    assert layer.input_dynamic_range == pytest.approx(127 * layer.input_scale)
    x = _tensor(14)
    # integer reference: acc = x_int8 @ w_int8^T (exact), then the documented epilogue
    x_int = np.clip(np.rint(x.features.numpy() / np.float32(layer.input_scale)), -128, 127).astype(np.int64)
    acc = x_int @ layer.weight_int8.reshape(7, 4).astype(np.int64).T
    multiplier = np.float32(layer.input_scale) * layer.weight_scales
    y = np.maximum(acc.astype(np.float32) * multiplier + layer.bias, 0)
    want = np.clip(np.rint(y / np.float32(layer.output_scale)), -128, 127)
    quantize = next(n for n in converted.graph.nodes if n.op == "call_function")
    assert quantize.target is spconvq.quantize_per_tensor
    got = converted(x)
    assert got.features.dtype == torch.float32  # dequantized at the graph's end
    np.testing.assert_array_equal(np.rint(got.features.numpy() / layer.output_scale), want)


# ----------------------------------------------------------------------------- bad input


def test_int8_features_into_a_float_layer_name_the_layer():
    x = _tensor(15)
    quantized = spconvq.quantize_per_tensor(x, 0.05, 0, torch.qint8)
    with pytest.raises(TypeError, match="SubMConv3d is a float layer.*qint8"):
        spconv.SubMConv3d(4, 4, 3)(quantized)
    with pytest.raises(TypeError, match="SparseMaxPool3d is a float layer"):
        spconv.SparseMaxPool3d(2)(quantized)


def test_float_features_into_an_int8_layer_name_the_layer():
    torch.manual_seed(16)
    model = OneByOne().eval()
    prepared, mapping, backend = _prepare(model, False)
    prepared(_tensor(16))
    converted = _convert(prepared, mapping, backend)
    with pytest.raises(TypeError, match="SparseConvReLU is a quantized .*float32"):
        converted.get_submodule("conv.0")(_tensor(17))


def test_untraceable_block_is_named_and_can_be_kept_as_a_leaf():
    class Untraceable(spconv.SparseModule):
        def __init__(self):
            super().__init__()
            self.conv = spconv.SubMConv3d(4, 4, 3)

        def forward(self, x):
            if x.features.sum() > 0:  # data-dependent control flow
                return self.conv(x)
            return x

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.odd = Untraceable()
            self.head = spconv.SubMConv3d(4, 2, 1)

        def forward(self, x):
            return self.head(self.odd(x)).features

    model = Model().eval()
    with pytest.raises(torch.fx.proxy.TraceError, match="'odd' \\(Untraceable\\).*non_traceable_module_classes"):
        _prepare(model, False)
    config = spconvq.get_spconv_prepare_custom_config()
    config.non_traceable_module_classes.append(Untraceable)
    prepared = qfx.prepare_fx(model, spconvq.get_default_spconv_qconfig_mapping(False), (),
                              backend_config=spconvq.get_spconv_backend_config(), prepare_custom_config=config)
    x = _tensor(18)
    torch.testing.assert_close(prepared(x), model(x))


def test_public_names_match_spconv():
    import sparsecore.torch.quantization.intrinsic as snni
    import sparsecore.torch.quantization.intrinsic.qat as snniqat
    import sparsecore.torch.quantization.intrinsic.quantized as snniq
    import sparsecore.torch.quantization.quantized as snnq
    import sparsecore.torch.quantization.quantized.reference as snnqr

    for name in ("get_default_spconv_qconfig_mapping", "get_spconv_prepare_custom_config",
                 "get_spconv_backend_config", "get_spconv_convert_custom_config", "prepare_spconv_torch_inference",
                 "get_default_spconv_trt_ptq_qconfig", "get_default_spconv_trt_qat_qconfig",
                 "get_spconv_fmod_to_qat_mapping", "get_spconv_qat_to_static_mapping", "quantize_per_tensor",
                 "transform_qdq", "remove_conv_add_dq"):
        assert callable(getattr(spconvq, name))
    for module, names in ((snni, ["SpconvReLUNd", "SpconvBnNd", "SpconvBnReLUNd", "SpconvBnAddReLUNd",
                                  "SpconvAddReLUNd"]),
                          (snniqat, ["SparseConv", "SparseConvReLU", "SparseConvAddReLU", "SparseConvBn",
                                     "SparseConvBnReLU", "SparseConvBnAddReLU"]),
                          (snniq, ["SparseConvReLU", "SparseConvAddReLU", "LinearPerChannelWeightReLU"]),
                          (snnq, ["SparseConv", "LinearPerChannelWeight"]), (snnqr, ["SpConv"]),
                          (spconvq.fake_q, ["SparseHistogramObserver", "SparseMinMaxObserver",
                                            "SparseMovingAvgObsFakeQuantize"]),
                          (spconvq.utils, ["fuse_spconv_bn_eval"])):
        for name in names:
            assert isinstance(getattr(module, name), type) or callable(getattr(module, name))


def test_converted_model_runs_on_an_empty_input():
    model = _model(19)
    prepared, mapping, backend = _prepare(model, False)
    empty = spconv.SparseConvTensor(torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.int32), SHAPE, BATCH)
    prepared(empty)  # observers skip it
    for seed in range(3):
        prepared(_tensor(600 + seed))
    converted = _convert(prepared, mapping, backend)
    out = converted(empty)
    assert out.shape == model(empty).shape == (0, 5)


class LinearHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = spconv.SparseSequential(spconv.SubMConv3d(4, 8, 3), nn.ReLU())
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.conv(x).features)


def test_prepare_spconv_torch_inference_with_and_without_linear():
    torch.manual_seed(20)
    model = LinearHead().eval()
    outputs = {}
    for with_linear in (True, False):
        prepared, mapping, backend = _prepare(model, False)
        for seed in range(3):
            prepared(_tensor(700 + seed))
        converted = _convert(prepared, mapping, backend, with_linear=with_linear)
        kinds = _module_kinds(converted)
        assert ("LinearPerChannelWeight" in kinds) == with_linear
        outputs[with_linear] = converted(_tensor(21))
    step = float(converted.head_scale_1) if hasattr(converted, "head_scale_1") else 0.05
    # the int8 Linear (exact integer sums) and torch's reference Linear (float on int8-rounded values)
    assert float((outputs[True] - outputs[False]).abs().max()) <= step * 1.001
    want = model(_tensor(21))
    assert float((outputs[True] - want).norm() / want.norm()) < 0.05


def test_layers_excluded_by_the_qconfig_mapping_stay_float():
    """The guide's ``set_module_name_regex(..., None)`` and ``set_object_type(ModuleClass, None)``.

    A conv fused with its batch norm / ReLU is reached by its name, not its class:
    torch maps object-type qconfigs onto its own fused types only.
    """
    model = _model(22)
    mapping = spconvq.get_default_spconv_qconfig_mapping(False)
    mapping.set_module_name_regex("down.*", None)
    mapping.set_object_type(spconv.SparseMaxPool3d, None)
    mapping.set_module_name("head", None)
    backend = spconvq.get_spconv_backend_config()
    prepared = qfx.prepare_fx(model, mapping, (), backend_config=backend,
                              prepare_custom_config=spconvq.get_spconv_prepare_custom_config())
    for seed in range(4):
        prepared(_tensor(800 + seed))
    converted = _convert(prepared, mapping, backend)
    kinds = _module_kinds(converted)
    assert kinds.count("SparseConvReLU") == 2 and kinds.count("SparseConvAddReLU") == 1  # stem, block
    assert "SparseConv3d" in kinds  # the strided conv (its batch norm folded) stays float
    assert "SubMConv3d" in kinds  # the head stays float
    x = _tensor(23)
    want = model(x)
    assert float((converted(x) - want).norm() / want.norm()) < 0.1


@pytest.mark.parametrize("name, what", [
    ("check_calibration", "the GraphModule prepare_fx returns"),
    ("tensorrt_parameters", "the converted GraphModule"),
    ("transform_qdq", "the GraphModule that convert_fx returns"),
    ("remove_conv_add_dq", "a GraphModule"),
])
def test_graph_passes_refuse_a_plain_module_by_name(name, what):
    with pytest.raises(TypeError, match=f"{name} takes {what}, got SmallNet"):
        getattr(spconvq, name)(_model(31))
