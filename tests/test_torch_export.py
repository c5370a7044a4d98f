"""sparsecore.torch.export_onnx: the exported file run by sparsecore.runtime equals the torch model.

Oracles: the torch model itself (eval mode, BatchNorm unfused) for the round
trips; the layers' own configuration and shapes recorded here by forward hooks
for the attributes; a BatchNorm folded by hand in float64 for the weights.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
torch = pytest.importorskip("torch")

from onnx import helper, numpy_helper  # noqa: E402
from torch import nn  # noqa: E402

import sparsecore.runtime as runtime  # noqa: E402
import sparsecore.torch as spconv  # noqa: E402
from tests.dense_oracle import make_rng, random_features, random_indices  # noqa: E402


def _randomize_batch_norms(model: nn.Module, seed: int) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm1d):
            channels = module.num_features
            module.running_mean.copy_(torch.rand(channels, generator=generator) - 0.5)
            module.running_var.copy_(torch.rand(channels, generator=generator) * 1.5 + 0.5)
            module.weight.data.copy_(torch.rand(channels, generator=generator) + 0.5)
            module.bias.data.copy_(torch.rand(channels, generator=generator) * 0.6 - 0.3)
    return model.eval()


def _bn(channels: int) -> nn.BatchNorm1d:
    return nn.BatchNorm1d(channels, eps=1e-3, momentum=0.01)


class SecondStyle(nn.Module):
    """SubM (shared keys) + strided convs + BN + ReLU, then .dense() and the BEV view."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.net = spconv.SparseSequential(
            spconv.SubMConv3d(channels, 16, 3, bias=False, indice_key="subm1"), _bn(16), nn.ReLU(),
            spconv.SubMConv3d(16, 16, 3, bias=False, indice_key="subm1"), _bn(16), nn.ReLU(),
            spconv.SparseConv3d(16, 24, 3, stride=2, padding=1, bias=False, indice_key="spconv2"), _bn(24), nn.ReLU(),
            spconv.SubMConv3d(24, 24, 3, bias=False, indice_key="subm2"), _bn(24), nn.ReLU(),
            spconv.SparseConv3d(24, 24, (3, 1, 1), stride=(2, 1, 1), bias=False, indice_key="spconv_down2"),
            _bn(24), nn.ReLU(),
        )

    def forward(self, x):
        dense = self.net(x).dense()
        batch, channels, depth, height, width = dense.shape
        return dense.view(batch, channels * depth, height, width)


class BasicBlock(spconv.SparseModule):
    """OpenPCDet's SparseBasicBlock: conv-BN-ReLU, conv-BN, + identity, ReLU."""

    def __init__(self, channels: int, indice_key: str) -> None:
        super().__init__()
        self.conv1 = spconv.SubMConv3d(channels, channels, 3, bias=False, indice_key=indice_key)
        self.bn1 = _bn(channels)
        self.conv2 = spconv.SubMConv3d(channels, channels, 3, bias=False, indice_key=indice_key)
        self.bn2 = _bn(channels)
        self.relu = nn.ReLU()

    def forward(self, x):
        out = self.conv1(x)
        out = out.replace_feature(self.relu(self.bn1(out.features)))
        out = self.conv2(out)
        out = out.replace_feature(self.bn2(out.features))
        out = out.replace_feature(out.features + x.features)
        return out.replace_feature(self.relu(out.features))


class Residual(nn.Module):
    """Residual blocks, a strided conv, a conv with bias and fused act_type, an inverse conv, a transposed
    conv, SparseConvTensor '+', then .dense() and a permute (every layer kind the format has)."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.stem = spconv.SparseSequential(spconv.SubMConv3d(channels, 8, 3, indice_key="stem"), _bn(8), nn.ReLU())
        self.block1 = BasicBlock(8, "res1")
        self.down = spconv.SparseSequential(
            spconv.SparseConv3d(8, 12, 3, stride=2, padding=1, bias=False, indice_key="down"), _bn(12), nn.ReLU())
        self.block2 = BasicBlock(12, "res2")
        self.head = spconv.SubMConv3d(12, 12, 1, indice_key="head")
        self.fused = spconv.SparseConvolution(3, 12, 12, 3, subm=True, indice_key="res2", act_type="relu")
        self.up = spconv.SparseInverseConv3d(12, 8, 3, indice_key="down")
        self.upsample = spconv.SparseConvTranspose3d(8, 6, 2, stride=2, indice_key="transposed")

    def forward(self, x):
        x = self.block1(self.stem(x))
        y = self.block2(self.down(x))
        y = self.fused(self.head(y)) + y
        up = self.up(y)
        up = up.replace_feature(up.features + x.features)
        dense = self.upsample(up).dense()
        return dense.permute(0, 2, 3, 4, 1)


def _input(seed: int, shape=(9, 12, 10), batch: int = 2, channels: int = 4, num: int = 260):
    rng = make_rng(seed)
    indices = random_indices(rng, shape, batch, num=num)
    features = random_features(rng, len(indices), channels, np.float32)
    tensor = spconv.SparseConvTensor(torch.from_numpy(features), torch.from_numpy(indices), list(shape), batch)
    return tensor, features, indices


def _model(kind: type, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return _randomize_batch_norms(kind(), seed)


def _model_input_and_output(kind: type, seed: int):
    """A seeded model of ``kind``, an input (seed + 1) and the eval model's output on it (the oracle)."""
    model = _model(kind, seed)
    x, features, indices = _input(seed + 1)
    with torch.no_grad():
        expected = model(x)
    return model, x, features, indices, expected


def _exported_program(kind: type, seed: int):
    """``torch.export`` of a seeded model with dynamic sites, checked on its example input against the eager
    model; returns the model, the program and the names of the ops the program calls."""
    from sparsecore.torch.exportable import sites_dynamic_shapes

    model, x, _, _, expected = _model_input_and_output(kind, seed)
    program = torch.export.export(model, (x,), dynamic_shapes=(sites_dynamic_shapes(),))
    torch.testing.assert_close(program.module()(x), expected, rtol=1e-5, atol=1e-5)
    targets = [str(node.target) for node in program.graph.nodes if node.op == "call_function"]
    return model, program, targets


def _check_saved_program_on_other_sites(model: nn.Module, program, path: Path, seed: int, num: int) -> None:
    """Saves and reloads the program (through `load_program`: no unrestricted unpickling) and checks it on
    other sites, another count (not tied to the example)."""
    torch.export.save(program, path)
    other, _, _ = _input(seed, num=num)
    with torch.no_grad():
        expected = model(other)
    torch.testing.assert_close(spconv.load_program(path).module()(other), expected, rtol=1e-5, atol=1e-5)


def _node_ops(model) -> list[str]:
    return [node.op_type for node in model.graph.node]


@pytest.mark.parametrize("kind", [SecondStyle, Residual])
def test_float32_round_trip_equals_the_torch_model(kind: type, tmp_path: Path) -> None:
    model, x, features, indices, expected = _model_input_and_output(kind, 1)
    expected = expected.numpy()
    exported = spconv.export_onnx(model, x, tmp_path / "model.onnx", precision="fp32", strict=False)
    onnx.checker.check_model(onnx.load(tmp_path / "model.onnx"))
    assert "BatchNormalization" not in _node_ops(exported)
    got = runtime.load(tmp_path / "model.onnx").run(features, indices, 2, (9, 12, 10)).dense
    assert got.shape == expected.shape and np.abs(expected).max() > 0.1
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", [SecondStyle, Residual])
def test_fp16_round_trip_is_within_fp16_tolerance(kind: type, tmp_path: Path) -> None:
    model, x, features, indices, expected = _model_input_and_output(kind, 3)
    expected = expected.numpy()
    spconv.export_onnx(model, x, tmp_path / "model.onnx", strict=kind is SecondStyle)
    scale = np.abs(expected).max()
    for dtype in ("float32", "float16"):
        got = runtime.load(tmp_path / "model.onnx", dtype=dtype).run(features, indices, 2, (9, 12, 10)).dense
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_allclose(got.astype(np.float32), expected, rtol=2e-2, atol=2e-2 * scale)


def test_residual_graph_keeps_add_and_relu_explicit(tmp_path: Path) -> None:
    model = _model(Residual, 5)
    x, _, _ = _input(6)
    exported = spconv.export_onnx(model, x, tmp_path / "model.onnx", strict=False)
    ops = _node_ops(exported)
    # stem, block1 (2), down, block2 (2), head, fused, inverse, transposed: 10 convs; BN folded, ReLU fused
    assert ops.count("SparseConvolution") == 10
    assert ops.count("Add") == 4 and ops.count("Relu") == 2
    assert ops[-2:] == ["ScatterDense", "Transpose"]
    nodes = {node.name: node for node in exported.graph.node}
    add0 = nodes["add0"]
    producers = {node.output[0]: node for node in exported.graph.node}
    assert producers[add0.input[0]].name == "conv2" and producers[add0.input[1]].name == "conv0"
    relu0 = nodes["relu0"]
    assert relu0.input[0] == add0.output[0]
    assert [n.name for n in exported.graph.node if n.op_type == "SparseConvolution"] == [f"conv{i}" for i in range(10)]
    assert exported.graph.input[0].name == "0"
    assert [node.output[0] for node in exported.graph.node] == [str(i) for i in range(1, len(ops) + 1)]


def test_batch_norm_folding_alone_matches_the_unfused_eval_model(tmp_path: Path) -> None:
    torch.manual_seed(7)
    model = _randomize_batch_norms(spconv.SparseSequential(
        spconv.SparseConv3d(4, 8, 3, stride=2, padding=1, bias=True, indice_key="d"), _bn(8)), 7)
    x, features, indices = _input(8)
    with torch.no_grad():
        expected = model(x)
    exported = spconv.export_onnx(model, x, tmp_path / "bn.onnx", precision="fp32", strict=False)
    assert _node_ops(exported) == ["SparseConvolution"]
    conv, norm = model[0], model[1]
    with torch.no_grad():
        scale = norm.weight.double() / torch.sqrt(norm.running_var.double() + norm.eps)
        weight = conv.weight.double() * scale.view(-1, 1, 1, 1, 1)
        bias = (conv.bias.double() - norm.running_mean.double()) * scale + norm.bias.double()
    arrays = {tensor.name: numpy_helper.to_array(tensor) for tensor in exported.graph.initializer}
    np.testing.assert_allclose(arrays["spconv0.weight"], weight.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(arrays["spconv0.bias"], bias.numpy(), rtol=1e-6, atol=1e-7)
    out = runtime.load(tmp_path / "bn.onnx").run(features, indices, 2, (9, 12, 10)).sparse
    np.testing.assert_array_equal(out.indices, expected.indices.numpy())
    np.testing.assert_allclose(out.features, expected.features.detach().numpy(), rtol=1e-4, atol=1e-5)


def _record_calls(model: nn.Module, x) -> list[tuple]:
    calls = []
    hooks = [module.register_forward_hook(
        lambda module, args, output: calls.append((module, tuple(args[0].features.shape),
                                                   tuple(output.features.shape), list(args[0].spatial_shape),
                                                   list(output.spatial_shape))))
        for module in model.modules() if isinstance(module, spconv.SparseConvolution)]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return calls


def _expected_spatial(module, shape: list[int], calls: list[tuple]) -> list[int]:
    if module.subm:
        return shape
    if module.inverse:  # back onto the input grid of the layer with the same key
        return next(c[3] for c in calls if c[0].indice_key == module.indice_key and not c[0].inverse)
    if module.transposed:
        return [(s - 1) * st - 2 * p + d * (k - 1) + op + 1 for s, st, p, d, k, op in
                zip(shape, module.stride, module.padding, module.dilation, module.kernel_size, module.output_padding)]
    return [(s + 2 * p - d * (k - 1) - 1) // st + 1 for s, st, p, d, k in
            zip(shape, module.stride, module.padding, module.dilation, module.kernel_size)]


@pytest.mark.parametrize("kind", [SecondStyle, Residual])
def test_conv_attributes_follow_the_layer_configuration(kind: type, tmp_path: Path) -> None:
    model = _model(kind, 9)
    x, _, _ = _input(10)
    calls = _record_calls(model, x)
    exported = spconv.export_onnx(model, x, tmp_path / "model.onnx", strict=False)
    convs = [node for node in exported.graph.node if node.op_type == "SparseConvolution"]
    assert len(convs) == len(calls)
    initializers = {tensor.name: tensor for tensor in exported.graph.initializer}
    relu_follows = {id(module) for module in model.modules() if isinstance(module, spconv.SparseConvolution)}
    for node, (module, in_shape, out_shape, in_spatial, out_spatial) in zip(convs, calls):
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attributes["ndim"] == 3 and attributes["groups"] == 1
        assert attributes["in_channels"] == module.in_channels and attributes["out_channels"] == module.out_channels
        for key in ("kernel_size", "stride", "padding", "dilation", "output_padding"):
            assert attributes[key] == list(getattr(module, key)), (node.name, key)
        assert (attributes["subm"], attributes["transposed"], attributes["inverse"]) == (
            int(module.subm), int(module.transposed), int(module.inverse))
        # a layer's own key; a layer without one, or a SubM 1x1 (which ignores its key), a name of its own
        uses_key = module.indice_key is not None and not (module.subm and np.prod(module.kernel_size) == 1)
        expected_key = module.indice_key.encode() if uses_key else b"auto." + node.name.encode()
        assert attributes["rulebook"] == expected_key, node.name
        assert attributes["input_shape"] == list(in_shape) and attributes["output_shape"] == list(out_shape)
        assert attributes["input_spatial_shape"] == in_spatial
        assert attributes["output_spatial_shape"] == out_spatial == _expected_spatial(module, in_spatial, calls)
        assert attributes["precision"] == attributes["output_precision"] == b"fp16"
        assert attributes["output_bound"] == 200000
        assert attributes["activation"] in (b"ReLU", b"None") and id(module) in relu_follows
        weight, bias = initializers[node.input[1]], initializers[node.input[2]]
        assert weight.data_type == helper.TensorProto.FLOAT16 and len(weight.raw_data) > 0
        assert list(weight.dims) == [module.out_channels, *module.kernel_size, module.in_channels]
        assert list(bias.dims) == [module.out_channels]
    if kind is SecondStyle:  # every conv is followed by BN + ReLU: all fused
        assert all(helper.get_attribute_value(next(a for a in n.attribute if a.name == "activation")) == b"ReLU"
                   for n in convs)
        scatter = next(node for node in exported.graph.node if node.op_type == "ScatterDense")
        scatter_attributes = {a.name: helper.get_attribute_value(a) for a in scatter.attribute}
        final_spatial = calls[-1][4]
        assert scatter_attributes["output_shape"] == [2, 24, *final_spatial]
        assert scatter_attributes["format"] == b"zyx" and scatter_attributes["output_layout"] == b"NCHW"
        reshape = exported.graph.node[-1]
        assert helper.get_attribute_value(reshape.attribute[0]) == [2, 24 * final_spatial[0], *final_spatial[1:]]


def test_channels_last_dense_is_scatter_dense_then_transpose(tmp_path: Path) -> None:
    torch.manual_seed(22)
    body = spconv.SparseSequential(spconv.SubMConv3d(4, 6, 3, indice_key="a"), nn.ReLU()).eval()

    class ChannelsLast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = body

        def forward(self, x):
            return self.body(x).dense(channels_first=False)

    model = ChannelsLast().eval()
    x, features, indices = _input(23)
    with torch.no_grad():
        expected = model(x).numpy()
    exported = spconv.export_onnx(model, x, tmp_path / "model.onnx")
    assert _node_ops(exported) == ["SparseConvolution", "ScatterDense", "Transpose"]
    assert helper.get_attribute_value(exported.graph.node[2].attribute[0]) == [0, 2, 3, 4, 1]
    got = runtime.load(tmp_path / "model.onnx").run(features, indices, 2, (9, 12, 10)).dense
    assert got.shape == expected.shape == (2, 9, 12, 10, 6)
    np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())


def test_a_layer_without_bias_gets_a_zero_bias(tmp_path: Path) -> None:
    torch.manual_seed(11)
    model = spconv.SparseSequential(spconv.SubMConv3d(4, 5, 3, bias=False, indice_key="a")).eval()
    x, _, _ = _input(12)
    exported = spconv.export_onnx(model, x, tmp_path / "model.onnx")
    bias = numpy_helper.to_array(exported.graph.initializer[1])
    assert bias.shape == (5,) and bias.dtype == np.float16 and not bias.any()


class _Scale(spconv.SparseModule):
    def forward(self, x):
        return x.replace_feature(x.features * 2)


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = spconv.SubMConv3d(4, 4, 3, indice_key="a")

    def forward(self, x):
        out = self.conv(x)
        if out.features.sum() > 0:
            return out
        return x


@pytest.mark.parametrize("model, message", [
    (lambda: spconv.SparseSequential(spconv.SubMConv3d(4, 4, 3), spconv.SparseMaxPool3d(2)),
     r"module '1' \(sparsecore.torch.pool.SparseMaxPool3d\).*no pooling node"),
    (lambda: spconv.SparseSequential(spconv.SubMConv3d(4, 4, 3), _Scale()),
     r"module '1' \(.*_Scale\) calls mul.*no node"),
    (lambda: _Branchy(), r"module '<root>' \(.*_Branchy\) turns recorded features into a Python value"),
    (lambda: spconv.SparseSequential(spconv.SubMConv3d(4, 4, 3), nn.ReLU(), _bn(4)),
     r"BatchNorm1d\).*cannot be folded"),
    (lambda: spconv.SparseSequential(spconv.SparseConvTranspose3d(4, 4, 2, stride=2)),
     r"module '0' \(SparseConvTranspose3d\) is a transposed conv"),
])
def test_unsupported_models_fail_before_writing(model, message: str, tmp_path: Path) -> None:
    torch.manual_seed(13)
    built = model().eval()
    x, _, _ = _input(14)
    path = tmp_path / "model.onnx"
    with pytest.raises(spconv.ExportError, match=message):
        spconv.export_onnx(built, x, path)
    assert not path.exists()


def test_training_mode_empty_input_and_int8_are_refused(tmp_path: Path) -> None:
    model = spconv.SparseSequential(spconv.SubMConv3d(4, 4, 3), _bn(4))
    x, _, _ = _input(15)
    path = tmp_path / "model.onnx"
    with pytest.raises(spconv.ExportError, match=r"module '<root>' \(.*SparseSequential\) is in training mode"):
        spconv.export_onnx(model, x, path)
    model.eval()
    empty = spconv.SparseConvTensor(torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.int32), [9, 12, 10], 1)
    with pytest.raises(spconv.ExportError, match="no active sites"):
        spconv.export_onnx(model, empty, path)
    with pytest.raises(spconv.ExportError, match="precision='int8' exports a model converted by the INT8"):
        spconv.export_onnx(model, x, path, precision="int8")  # a float model (tests/test_onnx_int8.py: converted)
    with pytest.raises(spconv.ExportError, match="fp32.*strict=False"):
        spconv.export_onnx(model, x, path, precision="fp32")
    with pytest.raises(ValueError, match="precision must be one of"):
        spconv.export_onnx(model, x, path, precision="bf16")
    assert not path.exists()


def test_exported_file_runs_on_an_empty_input(tmp_path: Path) -> None:
    model = _model(SecondStyle, 16)
    x, _, _ = _input(17)
    spconv.export_onnx(model, x, tmp_path / "model.onnx")
    out = runtime.load(tmp_path / "model.onnx").run(np.zeros((0, 4), np.float32), np.zeros((0, 4), np.int32), 2,
                                                   (9, 12, 10)).dense
    with torch.no_grad():
        expected_shape = model(x).shape
    assert out.shape == tuple(expected_shape) and not out.any()


# ----------------------------------------------------------------------------- torch.export / pytree


def test_sparse_conv_tensor_is_a_pytree_node() -> None:
    import torch.utils._pytree as pytree

    x, features, indices = _input(18, num=40)
    leaves, spec = pytree.tree_flatten({"voxels": x, "scale": torch.ones(1)})
    assert len(leaves) == 3 and leaves[0] is x.features and leaves[1] is x.indices
    assert pytree.treespec_loads(pytree.treespec_dumps(spec)) == spec
    doubled = pytree.tree_map(lambda t: t.double() if t.is_floating_point() else t, {"voxels": x})["voxels"]
    assert isinstance(doubled, spconv.SparseConvTensor) and doubled.features.dtype == torch.float64
    assert doubled.spatial_shape == [9, 12, 10] and doubled.batch_size == 2 and doubled.indice_dict == {}
    np.testing.assert_array_equal(doubled.features.numpy(), features.astype(np.float64))
    np.testing.assert_array_equal(doubled.indices.numpy(), indices)
    with pytest.raises(ValueError, match="features has 39 rows"):
        pytree.tree_unflatten([x.features[:39], x.indices], pytree.tree_flatten(x)[1])


# builds: SecondStyle subm1 (shared), spconv2, subm2, spconv_down2; Residual stem, res1 (shared), down,
# res2 (shared with `fused`), head (a SubM 1x1 ignores its key), transposed; the inverse conv reuses `down`'s
@pytest.mark.parametrize("kind, builds, convs", [(SecondStyle, 4, 5), (Residual, 6, 10)])
def test_torch_export_round_trip(kind: type, builds: int, convs: int, tmp_path: Path) -> None:
    model, program, targets = _exported_program(kind, 19)
    # geometry and feature passes are the two sparsecore ops; shared indice_keys build once
    assert targets.count("sparsecore.export_rulebook.default") == builds
    assert targets.count("sparsecore.export_conv.default") == convs
    _check_saved_program_on_other_sites(model, program, tmp_path / "model.pt2", 21, num=180)


class Pooled(nn.Module):
    """SubM convs, a max pool with a key, the inverse conv of that pool, an avg pool."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = spconv.SparseSequential(spconv.SubMConv3d(4, 8, 3, indice_key="s1"), _bn(8), nn.ReLU())
        self.pool = spconv.SparseMaxPool3d(2, indice_key="pool1")
        self.mid = spconv.SubMConv3d(8, 8, 3, indice_key="s2")
        self.avg = spconv.SparseAvgPool3d(3, stride=1, padding=1)  # a regular window: sites grow
        self.up = spconv.SparseInverseConv3d(8, 5, 2, indice_key="pool1")  # back onto the stem's sites

    def forward(self, x):
        y = self.up(self.mid(self.pool(self.stem(x))))
        return self.avg(y).features


def test_torch_export_round_trip_with_pooling(tmp_path: Path) -> None:
    model, program, targets = _exported_program(Pooled, 24)
    assert targets.count("sparsecore.export_pool.default") == 2
    assert targets.count("sparsecore.export_rulebook.default") == 4  # s1, pool1, s2, avg (the inverse reuses)
    _check_saved_program_on_other_sites(model, program, tmp_path / "pooled.pt2", 26, num=150)


# A fresh process: torch.load refuses anything but weights_only=True (so torch.export.load's fallback to an
# unrestricted pickle would fail the run), then the program runs on other sites.
_LOAD_IN_A_FRESH_PROCESS = """
import sys
import numpy as np
import torch

unrestricted = torch.load

def weights_only_load(*args, weights_only=None, **kwargs):
    if weights_only is not True:
        raise AssertionError(f"torch.load(weights_only={weights_only!r}) called while loading the program")
    return unrestricted(*args, weights_only=True, **kwargs)

torch.load = weights_only_load
import sparsecore.torch as spconv

program = torch.export.load(sys.argv[1])
data = np.load(sys.argv[2])
x = spconv.SparseConvTensor(torch.from_numpy(data["features"]), torch.from_numpy(data["indices"]), [9, 12, 10], 2)
with torch.no_grad():
    np.save(sys.argv[3], program.module()(x).numpy())
"""


@pytest.mark.parametrize("forward_first", [False, True], ids=["exported-fresh", "forward-before-export"])
def test_a_saved_program_loads_under_weights_only_in_a_fresh_process(forward_first: bool, tmp_path: Path) -> None:
    import subprocess
    import sys

    from sparsecore.torch.exportable import sites_dynamic_shapes

    model = _model(SecondStyle, 27)
    x, _, _ = _input(28)
    if forward_first:  # a forward leaves a core (NumPy) view of the indices cached on x
        with torch.no_grad():
            model(x)
    torch.export.save(torch.export.export(model, (x,), dynamic_shapes=(sites_dynamic_shapes(),)),
                      tmp_path / "model.pt2")
    other, features, indices = _input(29, num=170)
    with torch.no_grad():
        expected = model(other).numpy()
    np.savez(tmp_path / "other.npz", features=features, indices=indices)
    run = subprocess.run([sys.executable, "-c", _LOAD_IN_A_FRESH_PROCESS, str(tmp_path / "model.pt2"),
                          str(tmp_path / "other.npz"), str(tmp_path / "out.npy")],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    # nothing printed: no fallback warning, no logging error (sparsecore's one-line compile notice aside)
    printed = [line for line in (run.stdout + run.stderr).splitlines() if not line.startswith("sparsecore: ")]
    assert printed == []
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, rtol=1e-5, atol=1e-5)
    assert np.abs(expected).max() > 0.1


def test_load_program_refuses_what_would_be_unpickled_without_restriction(tmp_path: Path) -> None:
    import io
    import zipfile

    from sparsecore.torch.exportable import sites_dynamic_shapes

    model = _model(SecondStyle, 30)
    x, _, _ = _input(31)
    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(model, (x,), dynamic_shapes=(sites_dynamic_shapes(),)), path)
    marker = tmp_path / "ran"

    def rewritten(name: str, replace) -> Path:
        """A copy of the archive with the members whose name ends with ``name`` replaced (or one added)."""
        target = tmp_path / f"edited{len(list(tmp_path.iterdir()))}.pt2"
        with zipfile.ZipFile(path) as source, zipfile.ZipFile(target, "w") as out:
            root = source.namelist()[0].split("/")[0]
            for member in source.namelist():
                out.writestr(member, replace(source.read(member)) if member.endswith(name) else source.read(member))
            if not any(member.endswith(name) for member in source.namelist()):
                out.writestr(f"{root}/{name}", replace(b""))
        return target

    class RunsCode:  # what a crafted file could hold: unpickling it calls a function of the file's choosing
        def __reduce__(self):
            return (Path.touch, (marker,))

    def crafted_inputs(_: bytes) -> bytes:
        buffer = io.BytesIO()
        torch.save((RunsCode(),), buffer)
        return buffer.getvalue()

    def pickled_weight(data: bytes) -> bytes:
        return data.replace(b'"use_pickle": false', b'"use_pickle": true', 1)

    cases = [
        (rewritten("data/sample_inputs/model.pt", crafted_inputs), r"example inputs .*weights_only=True\) refuses"),
        (rewritten("data/weights/model_weights_config.json", pickled_weight), r"holds pickled tensors \['net"),
        (rewritten("data/constants/opaque_obj_0", lambda _: b"\x80\x04N."), r"'data/constants/opaque_obj_0', a member"),
        (rewritten("data/aotinductor/model/model.so", lambda _: b"\x7fELF"), r"'data/aotinductor/model/model.so'"),
    ]
    for crafted, message in cases:
        with pytest.raises(ValueError, match=message):
            spconv.load_program(crafted)
    assert not marker.exists()
    with pytest.raises(ValueError, match="more than max_bytes=1000"):
        spconv.load_program(path, max_bytes=1000)
    (tmp_path / "not.pt2").write_bytes(b"plain bytes")
    with pytest.raises(ValueError, match="not a .pt2 archive"):
        spconv.load_program(tmp_path / "not.pt2")
    assert not marker.exists()
    # the untouched file loads and computes what the model does
    with torch.no_grad():
        torch.testing.assert_close(spconv.load_program(path).module()(x), model(x), rtol=1e-5, atol=1e-5)
