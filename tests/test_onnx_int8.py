"""int8 ONNX export (``export_onnx(..., precision="int8")``) and sparsecore.runtime's int8 mode.

Oracles: the converted torch int8 model (the INT8 workflow's own int8 layers)
for the runtime's outputs; the converted modules' own scales, weights and
biases, read here and turned into libspconv's quantities independently
(``range = 127 * scale``, FP16 initializers) for the attributes.

Why bit-exact in one case and one step in the others: the file stores biases
as FP16 (libspconv's only initializer type), while the torch model adds its
float32 bias, so an output whose float value falls near a rounding boundary
can round to the neighbouring int8 value. With biases made FP16-representable
and an input already on the first layer's quantization grid (so that torch's
``quantize_per_tensor``, which multiplies by the reciprocal of the scale, and
the core's division agree), the runtime equals the torch int8 model bit for
bit. The residual network also drops the requantization of the identity (a
dequantize -> SparseIdentity -> quantize to another scale has no node in the
format), so there the promise is one quantization step per element.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import sparsecore.int8 as core_int8
import sparsecore.runtime as runtime
import sparsecore.torch as spconv
from tests.test_torch_quantization import SmallNet, ThreeLayers, _convert, _prepare, _randomize_bn, _tensor
from tests.torch_networks import FusableResidualBlock

onnx = pytest.importorskip("onnx")  # the 'onnx' extra


class ResidualNet(SmallNet):
    """The quantization tests' network without its max pool (the format has no pooling node), ending on ``.dense()``:
    stem (subm-bn-relu), spconv's fusable residual block, strided conv-bn-relu, 1x1 head."""

    def __init__(self) -> None:
        super().__init__()
        del self.pool

    def forward(self, x):
        return self.head(self.down(self.block(self.stem(x)))).dense()


class BlockFirst(nn.Module):
    """A residual block straight on the input: its identity quantizes the float input with its own scale."""

    def __init__(self) -> None:
        super().__init__()
        self.block = FusableResidualBlock(4, spconv.SubMConv3d)
        self.head = spconv.SubMConv3d(4, 3, 3)

    def forward(self, x):
        return self.head(self.block(x)).features


class Branches(nn.Module):
    """A stem read by two heads whose features are added; excluding one head leaves the stem's output with an int8
    and a float reader."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = spconv.SparseSequential(spconv.SubMConv3d(4, 8, 3, indice_key="s"), nn.ReLU())
        self.a = spconv.SubMConv3d(8, 3, 3, indice_key="s")
        self.b = spconv.SubMConv3d(8, 3, 3, indice_key="s")

    def forward(self, x):
        stem = self.stem(x)
        return self.a(stem).features + self.b(stem).features


def _converted(model: nn.Module, seed: int, exclude: tuple[str, ...] = ()) -> torch.fx.GraphModule:
    """``model`` (batch norms randomized) through the PTQ workflow, calibrated on 4 inputs; ``exclude``: layers
    the qconfig mapping leaves float."""
    _randomize_bn(model, seed)
    prepared, mapping, backend = _prepare(model.eval(), False) if not exclude else _prepare_excluding(model, exclude)
    for offset in range(4):
        prepared(_tensor(seed * 10 + offset))
    return _convert(prepared, mapping, backend)


def _prepare_excluding(model: nn.Module, exclude: tuple[str, ...]):
    import torch.ao.quantization.quantize_fx as qfx

    import sparsecore.torch.quantization as spconvq

    mapping = spconvq.get_default_spconv_qconfig_mapping(False)
    for name in exclude:
        mapping.set_module_name(name, None)
    backend = spconvq.get_spconv_backend_config()
    prepared = qfx.prepare_fx(model.eval(), mapping, (), backend_config=backend,
                              prepare_custom_config=spconvq.get_spconv_prepare_custom_config())
    return prepared, mapping, backend


@pytest.fixture(scope="module")
def three_layers() -> torch.fx.GraphModule:
    torch.manual_seed(30)
    return _converted(ThreeLayers(), 30)


@pytest.fixture(scope="module")
def residual_net() -> torch.fx.GraphModule:
    torch.manual_seed(31)
    return _converted(ResidualNet(), 31)


def _attributes(node) -> dict:
    return {attribute.name: onnx.helper.get_attribute_value(attribute) for attribute in node.attribute}


def _initializers(model) -> dict[str, np.ndarray]:
    return {tensor.name: onnx.numpy_helper.to_array(tensor) for tensor in model.graph.initializer}


def _run(path: Path, x: spconv.SparseConvTensor):
    return runtime.load(path).run(x.features.numpy(), x.indices.numpy(), x.batch_size, x.spatial_shape)


# ----------------------------------------------------------------------------- attributes


def test_three_layer_int8_attributes_are_the_converted_modules_scales(three_layers, tmp_path: Path) -> None:
    x = _tensor(32)
    exported = spconv.export_onnx(three_layers, x, tmp_path / "three.onnx", precision="int8")
    onnx.checker.check_model(onnx.load(tmp_path / "three.onnx"))
    layers = [three_layers.get_submodule(name) for name in ("layers.0", "layers.3", "layers.5")]
    input_scales = [float(three_layers.layers_0_input_scale_0)] + [float(layer.scale) for layer in layers[:2]]
    nodes = [node for node in exported.graph.node if node.op_type == "SparseConvolution"]
    assert [node.op_type for node in exported.graph.node] == ["SparseConvolution"] * 3
    initializers = _initializers(exported)
    expected_precisions = [(b"fp16", b"int8"), (b"int8", b"int8"), (b"int8", b"fp16")]
    for node, layer, input_scale, precisions in zip(nodes, layers, input_scales, expected_precisions):
        attributes = _attributes(node)
        assert (attributes["precision"], attributes["output_precision"]) == precisions
        np.testing.assert_allclose(attributes["input_dynamic_range"], 127 * input_scale, rtol=1e-6)
        weight_scales = layer.weight_scales.numpy().astype(np.float64)
        np.testing.assert_allclose(attributes["weight_dynamic_ranges"], 127 * weight_scales, rtol=1e-6)
        # libspconv's scale = range / 127 in float32 gives back the model's scale, or the float32 next to it
        # where no float32 range does
        np.testing.assert_array_max_ulp(np.float32(attributes["input_dynamic_range"]) / np.float32(127),
                                        np.float32(input_scale), maxulp=1)
        np.testing.assert_array_max_ulp(np.float32(attributes["weight_dynamic_ranges"]) / np.float32(127),
                                        layer.weight_scales.numpy(), maxulp=1)
        assert attributes["activation"] == (b"ReLU" if type(layer).__name__ == "SparseConvReLU" else b"None")
        weight, bias = initializers[node.input[1]], initializers[node.input[2]]
        assert weight.dtype == bias.dtype == np.float16
        dequantized = layer.weight_int8.numpy().astype(np.float64) * weight_scales.reshape(-1, 1, 1, 1, 1)
        np.testing.assert_array_equal(weight, dequantized.astype(np.float16))
        want_bias = np.zeros(layer.out_channels) if layer.bias_float is None else layer.bias_float.numpy()
        np.testing.assert_array_equal(bias, want_bias.astype(np.float16))
        # libspconv quantizes the FP16 weight per channel with range / 127: the model's int8 weight again
        back = core_int8.quantize(weight.astype(np.float32), np.float32(attributes["weight_dynamic_ranges"])
                                  / np.float32(127), axis=0)
        np.testing.assert_array_equal(back, layer.weight_int8.numpy())
    # the same ranges as the TensorRT parameters of the quantization package
    import sparsecore.torch.quantization as spconvq

    for node, parameters in zip(nodes, spconvq.tensorrt_parameters(three_layers)):
        np.testing.assert_allclose(_attributes(node)["input_dynamic_range"], parameters.input_dynamic_range,
                                   rtol=1e-6)
        np.testing.assert_allclose(_attributes(node)["weight_dynamic_ranges"], 127 * parameters.weight_scales,
                                   rtol=1e-6)


def test_residual_network_writes_conv_add_relu_with_int8_ranges(residual_net, tmp_path: Path) -> None:
    x = _tensor(33)
    exported = spconv.export_onnx(residual_net, x, tmp_path / "res.onnx", precision="int8")
    ops = [node.op_type for node in exported.graph.node]
    assert ops == ["SparseConvolution"] * 3 + ["Add", "Relu"] + ["SparseConvolution"] * 2 + ["ScatterDense"]
    stem, conv1, conv2, add, relu, down, head, scatter = exported.graph.node
    stem_scale = float(residual_net.get_submodule("stem.0").scale)
    conv2_module = residual_net.get_submodule("block.conv2_bn.conv")
    assert _attributes(conv2)["output_precision"] == b"fp16" and _attributes(conv2)["activation"] == b"None"
    assert list(add.input) == [conv2.output[0], stem.output[0]] and list(relu.input) == list(add.output)
    add_attributes = _attributes(add)
    assert add.domain == "spconv" and add_attributes["precision"] == add_attributes["output_precision"] == b"int8"
    assert add_attributes["input0_dynamic_range"] == 0.0  # the conv's float result
    np.testing.assert_allclose(add_attributes["input1_dynamic_range"], 127 * stem_scale, rtol=1e-6)
    np.testing.assert_allclose(_attributes(down)["input_dynamic_range"], 127 * float(conv2_module.scale), rtol=1e-6)
    np.testing.assert_allclose(_attributes(scatter)["input_dynamic_range"], 127 * float(residual_net.head.scale),
                               rtol=1e-6)
    assert _attributes(head)["output_precision"] == b"int8"  # ScatterDense reads it as int8


# ----------------------------------------------------------------------------- runtime vs the torch int8 model


def _expressible(converted: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy with FP16-representable biases and the identity requantized at its producer's scale: what the
    file holds exactly."""
    model = copy.deepcopy(converted)
    for module in model.modules():
        if getattr(module, "bias_float", None) is not None:
            module.bias_float = module.bias_float.half().float()
    if hasattr(model, "block_iden_for_fx_match_scale_0"):
        model.block_iden_for_fx_match_scale_0.copy_(model.get_submodule("stem.0").scale)
    return model


def _grid_input(converted: torch.fx.GraphModule, scale_name: str, seed: int) -> spconv.SparseConvTensor:
    """A random input whose features lie on the first layer's int8 grid (``q * scale``, q int8): torch's
    ``quantize_per_tensor`` (times the reciprocal) and the core's (a division) agree on it."""
    x = _tensor(seed)
    scale = np.float32(float(getattr(converted, scale_name)))
    levels = np.random.default_rng(seed).integers(-127, 128, size=tuple(x.features.shape))
    return x.replace_feature(torch.from_numpy((levels * scale).astype(np.float32)))


def test_runtime_equals_the_int8_model_bit_for_bit_where_the_file_holds_it_exactly(
        three_layers, residual_net, tmp_path: Path) -> None:
    model = _expressible(three_layers)
    x = _grid_input(model, "layers_0_input_scale_0", 34)
    spconv.export_onnx(model, x, tmp_path / "three.onnx", precision="int8")
    last_scale = float(model.get_submodule("layers.5").scale)
    want = np.rint(model(x).numpy() / last_scale)  # the torch model's int8 output values
    got = _run(tmp_path / "three.onnx", x).sparse.features  # the last layer's float result (output fp16)
    assert got.dtype == np.float32 and got.shape == want.shape and want.any()
    np.testing.assert_array_equal(core_int8.quantize(got, last_scale), want)
    model = _expressible(residual_net)
    x = _grid_input(model, "stem_0_input_scale_0", 35)
    spconv.export_onnx(model, x, tmp_path / "res.onnx", precision="int8")
    want, got = model(x).numpy(), _run(tmp_path / "res.onnx", x).dense  # both dequantized int8 (ScatterDense)
    assert got.shape == want.shape and np.abs(want).max() > 0
    np.testing.assert_array_equal(got, want)


def test_runtime_is_close_to_the_int8_model_as_converted(three_layers, residual_net, tmp_path: Path) -> None:
    """FP16 biases (and the residual's dropped requantization) move a few values by one step in a layer; the
    steps then propagate through the layers after it, so the last layer sees at most a couple of steps."""
    x = _tensor(36)
    spconv.export_onnx(three_layers, x, tmp_path / "three.onnx", precision="int8")
    step = float(three_layers.get_submodule("layers.5").scale)
    want = np.rint(three_layers(x).numpy() / step)
    got = core_int8.quantize(_run(tmp_path / "three.onnx", x).sparse.features, step)
    assert np.abs(got - want).max() <= 2 and (got == want).mean() > 0.9
    spconv.export_onnx(residual_net, x, tmp_path / "res.onnx", precision="int8")
    step = float(residual_net.head.scale)
    want, got = residual_net(x).numpy(), _run(tmp_path / "res.onnx", x).dense
    assert got.shape == want.shape and np.abs(got).max() > 0
    steps = np.rint(np.abs(got - want) / step)
    assert steps.max() <= 2 and (steps == 0).mean() > 0.95 and steps.mean() < 0.05


def test_empty_input_runs_through_the_int8_runtime(three_layers, residual_net, tmp_path: Path) -> None:
    x = _tensor(36)
    spconv.export_onnx(three_layers, x, tmp_path / "three.onnx", precision="int8")
    spconv.export_onnx(residual_net, x, tmp_path / "res.onnx", precision="int8")
    features, indices = np.zeros((0, 4), np.float32), np.zeros((0, 4), np.int32)
    sparse = runtime.load(tmp_path / "three.onnx").run(features, indices, 2, x.spatial_shape).sparse
    assert sparse.features.shape == (0, 3) and sparse.features.dtype == np.float32
    dense = runtime.load(tmp_path / "res.onnx").run(features, indices, 2, x.spatial_shape).dense
    assert dense.shape == residual_net(x).shape and not dense.any()


def test_a_model_with_float_layers_writes_them_as_fp16_nodes(tmp_path: Path) -> None:
    torch.manual_seed(37)
    converted = _converted(ThreeLayers(), 37, exclude=("layers.5",))
    x = _tensor(38)
    exported = spconv.export_onnx(converted, x, tmp_path / "mixed.onnx", precision="int8")
    precisions = [(_attributes(node)["precision"], _attributes(node)["output_precision"])
                  for node in exported.graph.node]
    assert precisions == [(b"fp16", b"int8"), (b"int8", b"fp16"), (b"fp16", b"fp16")]
    want, got = converted(x).detach().numpy(), _run(tmp_path / "mixed.onnx", x).sparse.features
    # the file's layers.3 returns its float result, which torch rounds to its output scale first (at most half
    # a step per input value), and the float layer's weights and bias are FP16 (relative error 2^-11)
    step = float(converted.get_submodule("layers.3").scale)
    float_layer = converted.get_submodule("layers.5")
    weight_sums = np.abs(float_layer.weight.detach().numpy()).reshape(3, -1).sum(axis=1)
    largest_input = 127 * step
    bound = (0.5 * step + 2.0**-11 * largest_input) * weight_sums + 2.0**-11 * np.abs(
        float_layer.bias.detach().numpy()) + 1e-6
    assert got.shape == want.shape and np.all(np.abs(got - want) <= bound)


# ----------------------------------------------------------------------------- errors


def test_float_model_and_inexpressible_models_are_refused_before_writing(three_layers, tmp_path: Path) -> None:
    path = tmp_path / "model.onnx"
    torch.manual_seed(39)
    with pytest.raises(spconv.ExportError, match="ThreeLayers has no int8 sparse conv. Convert it first"):
        spconv.export_onnx(ThreeLayers().eval(), _tensor(39), path, precision="int8")
    torch.manual_seed(40)
    with pytest.raises(spconv.ExportError, match="rounds a float tensor to int8 and back.*put a conv"):
        spconv.export_onnx(_converted(BlockFirst(), 40), _tensor(40), path, precision="int8")
    torch.manual_seed(41)
    with pytest.raises(spconv.ExportError, match="'stem.0' is read by int8 layers .*'a'.* and float layers .*'b'"):
        spconv.export_onnx(_converted(Branches(), 41, exclude=("b",)), _tensor(41), path, precision="int8")
    tiny = copy.deepcopy(three_layers)
    layer = tiny.get_submodule("layers.3")
    layer.weight_scales = torch.full_like(layer.weight_scales, 1e-9)
    with pytest.raises(spconv.ExportError, match="'layers.3'.*FP16 weights .* cannot hold output channel 0"):
        spconv.export_onnx(tiny, _tensor(41), path, precision="int8")
    assert not path.exists()


def test_runtime_names_the_node_of_a_bad_int8_graph(three_layers, residual_net, tmp_path: Path) -> None:
    exported = spconv.export_onnx(three_layers, _tensor(42), tmp_path / "three.onnx", precision="int8")
    residual = spconv.export_onnx(residual_net, _tensor(42), tmp_path / "res.onnx", precision="int8")

    def edited(node_index: int, name: str, value, source=exported) -> runtime.Session:
        model = onnx.ModelProto()
        model.CopyFrom(source)
        node = model.graph.node[node_index]
        kept = [attribute for attribute in node.attribute if attribute.name != name]
        del node.attribute[:]
        node.attribute.extend(kept + [onnx.helper.make_attribute(name, value)])
        return runtime.load_model(model)

    with pytest.raises(runtime.GraphError, match="'conv1'.*weight_dynamic_ranges with one positive range per output"):
        edited(1, "weight_dynamic_ranges", [1.0, 2.0])
    with pytest.raises(runtime.GraphError, match="'conv1'.*no positive input_dynamic_range"):
        edited(1, "input_dynamic_range", 0.0)
    with pytest.raises(runtime.GraphError, match="'conv2' writes its output '3' as int8.*no node reads"):
        edited(2, "output_precision", "int8")
    with pytest.raises(runtime.GraphError, match="'conv1'.*input_dynamic_range.*finite and >= 0"):
        edited(1, "input_dynamic_range", -1.0)
    # the add reads the stem's output '1' with another range than conv1 does: two scales for one int8 tensor
    with pytest.raises(runtime.GraphError, match="'add0' reads tensor '1' as int8 with input1_dynamic_range=1.5.*"
                                                 "node 'conv1' \\(input_dynamic_range\\)"):
        edited(3, "input1_dynamic_range", 1.5, residual)


def test_int8_runtime_imports_neither_torch_nor_jax(three_layers, tmp_path: Path) -> None:
    x = _tensor(43)
    spconv.export_onnx(three_layers, x, tmp_path / "three.onnx", precision="int8")
    np.savez(tmp_path / "input.npz", features=x.features.numpy(), indices=x.indices.numpy())
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        import sparsecore.runtime as runtime
        data = np.load({str(tmp_path / 'input.npz')!r})
        out = runtime.load({str(tmp_path / 'three.onnx')!r}).run(data["features"], data["indices"], 2, (10, 9, 8))
        assert out.sparse.features.shape[1] == 3 and out.sparse.features.any()
        print("LOADED:" + ",".join(sorted(m for m in ("torch", "jax", "jaxlib") if m in sys.modules)))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "LOADED:\n" in done.stdout, done.stdout


def test_runtime_fuses_conv_add_relu_with_the_values_of_the_three_nodes(residual_net, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import sparsecore.runtime.session as session_module

    x = _tensor(44)
    spconv.export_onnx(residual_net, x, tmp_path / "res.onnx", precision="int8")
    adds = []
    original_add = session_module.int8_add
    monkeypatch.setattr(session_module, "int8_add", lambda *args: adds.append(1) or original_add(*args))
    fused = _run(tmp_path / "res.onnx", x).dense
    assert adds == []  # the Add and the Relu ran inside the conv's int8 pass
    monkeypatch.setattr(session_module, "residual_fusions", lambda graph: {})
    unfused = _run(tmp_path / "res.onnx", x).dense
    assert adds == [1] and np.abs(fused).max() > 0
    np.testing.assert_array_equal(fused, unfused)
