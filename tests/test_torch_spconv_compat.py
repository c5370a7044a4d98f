"""sparsecore.torch against spconv 2.3.8 itself (CPU build), when it is importable.

The same module is built in both libraries, spconv's state_dict is loaded into
ours, both run on the same input, and the outputs (compared site by site, as
spconv does not sort its output sites), input gradients and parameter
gradients must agree. A SECOND / VoxelNet-style backbone and a small U-Net,
written exactly as spconv users write them, run under both imports
(``import spconv.pytorch as spconv`` vs ``import sparsecore.torch as spconv``).

spconv's CPU build races with more than one thread (wrong sums), so the
module runs single-threaded; its CPU backward calls
``torch.cuda.current_stream()``, patched to 0 here. spconv's 1x1 convs read
their weight as ``view(in, out)`` (issue #450); sparsecore.torch's do the same,
and the 1x1 tests below check that checkpoints move unchanged both ways.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ours = pytest.importorskip("sparsecore.torch")
theirs = pytest.importorskip("spconv.pytorch")
from torch import nn  # noqa: E402

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

# spconv 2.3.8's own deprecation warnings under torch 2.13 (its dense() and sparse_add)
pytestmark = [
    pytest.mark.filterwarnings("ignore:Using a non-tuple sequence for multidimensional indexing"),
    pytest.mark.filterwarnings("ignore::UserWarning:spconv"),
    pytest.mark.filterwarnings("ignore:.*is_fx_tracing.*"),
]


@pytest.fixture(autouse=True)
def _spconv_cpu_workarounds(monkeypatch):
    import spconv.pytorch.ops as spconv_ops

    monkeypatch.setattr(spconv_ops, "get_current_stream", lambda: 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _input(lib, seed, shape, batch=2, channels=3, density=0.25, positive=False):
    rng = do.make_rng(95000, seed)
    indices = do.random_indices(rng, shape, batch, density)
    features = do.random_features(rng, indices.shape[0], channels)
    features = torch.tensor(np.abs(features) if positive else features, requires_grad=True)
    return lib.SparseConvTensor(features, torch.from_numpy(indices), list(shape), batch), rng


def _sorted_rows(x):
    """Features and indices ordered by (batch, coordinates)."""
    idx = x.indices.long()
    key = idx[:, 0]
    for axis, size in enumerate(x.spatial_shape):
        key = key * size + idx[:, axis + 1]
    order = torch.argsort(key)
    return x.features[order], x.indices[order]


def _assert_same_output(mine, reference):
    assert list(mine.spatial_shape) == list(reference.spatial_shape)
    f_mine, i_mine = _sorted_rows(mine)
    f_ref, i_ref = _sorted_rows(reference)
    assert torch.equal(i_mine, i_ref), "same active sites"
    torch.testing.assert_close(f_mine, f_ref, rtol=1e-10, atol=1e-10)


LAYERS = [
    ("SubMConv3d", (3, 4, 3), {"indice_key": "subm1"}),
    ("SubMConv3d", (3, 4, (3, 1, 5)), {"dilation": (1, 1, 2)}),
    ("SparseConv3d", (3, 4, 3, 2, 1), {}),
    ("SparseConv3d", (3, 4, 2, 2), {"bias": False}),
    ("SparseConv3d", (3, 4, (3, 1, 3), (2, 1, 1), (1, 0, 0)), {"dilation": (1, 1, 2)}),
    ("SparseConvTranspose3d", (3, 4, 3, 2), {}),
    ("SparseConvTranspose3d", (3, 2, (2, 3, 2), (2, 1, 2), (0, 1, 0)), {}),
    ("SubMConv2d", (3, 4, 3), {}),
    ("SparseConv2d", (3, 4, 3, 2, 1), {}),
    ("SparseConv1d", (3, 4, 3, 2, 1), {}),
    ("SubMConv4d", (3, 2, 3), {}),
    ("SparseConv4d", (3, 2, 3, 2, 1), {}),
    ("SparseMaxPool3d", (2,), {}),
    ("SparseMaxPool3d", (3, 2, 1), {}),
    ("SparseMaxPool2d", (2,), {}),
]
_SHAPES = {1: (17,), 2: (9, 8), 3: (7, 6, 8), 4: (4, 5, 4, 3)}


@pytest.mark.parametrize("name, args, kwargs", LAYERS, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(LAYERS)])
def test_layer_matches_spconv(name, args, kwargs):
    ndim = int(name[-2])
    reference = getattr(theirs, name)(*args, **kwargs).double()
    mine = getattr(ours, name)(*args, **kwargs).double()
    mine.load_state_dict(reference.state_dict())
    # spconv's CPU max pool starts from 0 (see test_max_pool_of_negative_features): compare on
    # positive features, as after a ReLU
    positive = "Pool" in name
    x_ref, rng = _input(theirs, len(name), _SHAPES[ndim], positive=positive)
    x_mine, _ = _input(ours, len(name), _SHAPES[ndim], positive=positive)
    out_ref, out_mine = reference(x_ref), mine(x_mine)
    _assert_same_output(out_mine, out_ref)
    weights = torch.tensor(rng.standard_normal(tuple(out_ref.dense().shape)))
    (out_ref.dense() * weights).sum().backward()
    (out_mine.dense() * weights).sum().backward()
    torch.testing.assert_close(x_mine.features.grad, x_ref.features.grad, rtol=1e-10, atol=1e-10)
    ref_params = dict(reference.named_parameters())
    for key, parameter in mine.named_parameters():
        torch.testing.assert_close(parameter.grad, ref_params[key].grad, rtol=1e-10, atol=1e-10)


def test_inverse_conv_matches_spconv_row_for_row():
    modules = []
    for lib in (theirs, ours):
        torch.manual_seed(0)
        modules.append(lib.SparseSequential(lib.SparseConv3d(3, 4, 3, 2, 1, indice_key="down"),
                                            lib.SparseInverseConv3d(4, 2, 3, indice_key="down")).double())
    modules[1].load_state_dict(modules[0].state_dict())
    x_ref, _ = _input(theirs, 11, (7, 6, 8))
    x_mine, _ = _input(ours, 11, (7, 6, 8))
    out_ref, out_mine = modules[0](x_ref), modules[1](x_mine)
    assert torch.equal(out_mine.indices, out_ref.indices), "both restore the input rows in order"
    torch.testing.assert_close(out_mine.features, out_ref.features, rtol=1e-10, atol=1e-10)


def test_same_seed_gives_spconv_init():
    for name, args in (("SubMConv3d", (16, 32, 3)), ("SparseConv3d", (8, 16, (3, 1, 1), (2, 1, 1))),
                       ("SparseConvTranspose2d", (4, 4, 2, 2)), ("SparseInverseConv3d", (8, 4, 3, "k"))):
        torch.manual_seed(7)
        reference = getattr(theirs, name)(*args)
        torch.manual_seed(7)
        mine = getattr(ours, name)(*args)
        assert list(mine.state_dict()) == list(reference.state_dict())
        for key, value in reference.state_dict().items():
            assert torch.equal(mine.state_dict()[key], value), (name, key)


def test_constructor_signatures_match_spconv():
    names = [n for n in dir(theirs) if n[0].isupper() and inspect.isclass(getattr(theirs, n))]
    checked = 0
    for name in names:
        if not hasattr(ours, name) or name in ("SparseConvTensor",):
            continue
        mine, reference = inspect.signature(getattr(ours, name).__init__), inspect.signature(
            getattr(theirs, name).__init__)
        ref_params = [(p.name, p.default) for p in reference.parameters.values()
                      if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        my_params = [(p.name, p.default) for p in mine.parameters.values()
                     if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if name in ("SparseConvolution",):  # spconv's act_type default is a cumm enum; ours None
            ref_params = [(n, None if n == "act_type" else d) for n, d in ref_params]
        assert my_params == ref_params, name
        checked += 1
    ref_tensor = [p.name for p in inspect.signature(theirs.SparseConvTensor.__init__).parameters.values()]
    assert [p.name for p in inspect.signature(ours.SparseConvTensor.__init__).parameters.values()] == ref_tensor
    assert checked >= 35
    public = {n for n in dir(theirs) if not n.startswith("_") and (
        inspect.isclass(getattr(theirs, n)) or inspect.isfunction(getattr(theirs, n)))}
    public |= {"functional", "ops", "utils", "hash", "conv", "pool", "modules", "tables", "core"}
    public -= {"Path", "Union"}  # typing / pathlib names spconv's __init__ happens to import
    missing = sorted(public - set(dir(ours)))
    assert missing == [], f"spconv.pytorch names missing from sparsecore.torch: {missing}"


# --------------------------------------------------------------------------- real models


def post_act_block(spconv, in_channels, out_channels, kernel_size, indice_key=None, stride=1, padding=0,
                   conv_type="subm"):
    if conv_type == "subm":
        conv = spconv.SubMConv3d(in_channels, out_channels, kernel_size, bias=False, indice_key=indice_key)
    elif conv_type == "spconv":
        conv = spconv.SparseConv3d(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                                   bias=False, indice_key=indice_key)
    elif conv_type == "inverseconv":
        conv = spconv.SparseInverseConv3d(in_channels, out_channels, kernel_size, indice_key=indice_key, bias=False)
    else:
        raise NotImplementedError
    return spconv.SparseSequential(conv, nn.BatchNorm1d(out_channels, eps=1e-3, momentum=0.01), nn.ReLU())


class VoxelBackBone8x(nn.Module):
    """SECOND's sparse middle extractor (as in OpenPCDet), parameterised by the spconv module."""

    def __init__(self, spconv, input_channels, grid_size):
        super().__init__()
        self.spconv = spconv
        self.sparse_shape = grid_size[::-1] + np.array([1, 0, 0])
        self.conv_input = spconv.SparseSequential(
            spconv.SubMConv3d(input_channels, 16, 3, padding=1, bias=False, indice_key="subm1"),
            nn.BatchNorm1d(16, eps=1e-3, momentum=0.01),
            nn.ReLU(),
        )
        block = lambda *a, **k: post_act_block(spconv, *a, **k)  # noqa: E731
        self.conv1 = spconv.SparseSequential(block(16, 16, 3, padding=1, indice_key="subm1"))
        self.conv2 = spconv.SparseSequential(
            block(16, 32, 3, stride=2, padding=1, indice_key="spconv2", conv_type="spconv"),
            block(32, 32, 3, padding=1, indice_key="subm2"),
            block(32, 32, 3, padding=1, indice_key="subm2"),
        )
        self.conv3 = spconv.SparseSequential(
            block(32, 64, 3, stride=2, padding=1, indice_key="spconv3", conv_type="spconv"),
            block(64, 64, 3, padding=1, indice_key="subm3"),
        )
        self.conv4 = spconv.SparseSequential(
            block(64, 64, 3, stride=2, padding=(0, 1, 1), indice_key="spconv4", conv_type="spconv"),
            block(64, 64, 3, padding=1, indice_key="subm4"),
        )
        self.conv_out = spconv.SparseSequential(
            spconv.SparseConv3d(64, 128, (3, 1, 1), stride=(2, 1, 1), padding=0, bias=False,
                                indice_key="spconv_down2"),
            nn.BatchNorm1d(128, eps=1e-3, momentum=0.01),
            nn.ReLU(),
        )

    def forward(self, voxel_features, voxel_coords, batch_size):
        input_sp_tensor = self.spconv.SparseConvTensor(
            features=voxel_features, indices=voxel_coords.int(), spatial_shape=self.sparse_shape,
            batch_size=batch_size)
        x = self.conv_input(input_sp_tensor)
        x_conv1 = self.conv1(x)
        x_conv2 = self.conv2(x_conv1)
        x_conv3 = self.conv3(x_conv2)
        x_conv4 = self.conv4(x_conv3)
        out = self.conv_out(x_conv4)
        spatial_features = out.dense()
        n, c, d, h, w = spatial_features.shape
        return spatial_features.view(n, c * d, h, w)


class TinyUNet(nn.Module):
    """A segmentation head with an inverse conv and a skip concatenation (SparseUNet style)."""

    def __init__(self, spconv, channels):
        super().__init__()
        self.stem = post_act_block(spconv, channels, 8, 3, indice_key="subm1")
        self.down = post_act_block(spconv, 8, 16, 3, stride=2, padding=1, indice_key="spconv2", conv_type="spconv")
        self.mid = post_act_block(spconv, 16, 16, 3, indice_key="subm2")
        self.up = post_act_block(spconv, 16, 8, 3, indice_key="spconv2", conv_type="inverseconv")
        self.fuse = post_act_block(spconv, 16, 8, 3, indice_key="subm1")

    def forward(self, x):
        skip = self.stem(x)
        up = self.up(self.mid(self.down(skip)))
        return self.fuse(up.replace_feature(torch.cat([up.features, skip.features], 1)))


def _clouds(seed, count=2, points=1500):
    rng = np.random.default_rng(seed)
    clouds = []
    for _ in range(count):
        xyz = rng.random((points, 3)) * np.array([6.4, 6.4, 4.0]) + np.array([0.0, -3.2, -3.0])
        xyz = xyz[rng.random(points) < 0.5 + 0.5 * np.cos(xyz[:, 0])]  # uneven density
        intensity = rng.random((xyz.shape[0], 1))
        clouds.append(torch.tensor(np.hstack([xyz, intensity]), dtype=torch.float32))
    return clouds


def _voxelize(spconv, clouds):
    """What a data pipeline does: PointToVoxel per cloud, mean VFE, batch column."""
    from importlib import import_module

    utils = import_module(spconv.__name__ + ".utils")
    generator = utils.PointToVoxel(vsize_xyz=[0.1, 0.1, 0.1], coors_range_xyz=[0, -3.2, -3, 6.4, 3.2, 1],
                                   num_point_features=4, max_num_voxels=20000, max_num_points_per_voxel=5)
    features, coords = [], []
    for b, cloud in enumerate(clouds):
        voxels, coordinates, counts = generator(cloud)
        features.append(voxels.sum(1) / counts.clamp(min=1)[:, None].to(voxels.dtype))
        coords.append(torch.cat([torch.full((coordinates.shape[0], 1), b, dtype=torch.int32), coordinates], 1))
    grid_size = np.array(generator.grid_size[::-1])  # xyz, like a dataset's grid_size
    return torch.cat(features).double(), torch.cat(coords), grid_size


def test_second_backbone_runs_unchanged_under_both_imports():
    clouds = _clouds(1)
    results = {}
    for lib in (theirs, ours):
        voxel_features, voxel_coords, grid_size = _voxelize(lib, clouds)
        model = VoxelBackBone8x(lib, 4, grid_size).double()
        if lib is theirs:
            initial = {k: v.clone() for k, v in model.state_dict().items()}
        else:
            model.load_state_dict(initial)
        voxel_features.requires_grad_()
        out = model(voxel_features, voxel_coords, len(clouds))
        results[lib] = (model, voxel_features, voxel_coords, out)
    (_, f_ref, c_ref, out_ref), (model, f_mine, c_mine, out_mine) = results[theirs], results[ours]
    assert torch.equal(c_mine, c_ref), "PointToVoxel gives spconv's voxels, in spconv's order"
    torch.testing.assert_close(f_mine, f_ref)
    assert out_mine.shape == out_ref.shape == (2, 128 * 2, 8, 8)
    assert out_ref.abs().sum() > 0
    torch.testing.assert_close(out_mine, out_ref, rtol=1e-9, atol=1e-9)
    weights = torch.tensor(np.random.default_rng(2).standard_normal(tuple(out_ref.shape)))
    (out_ref * weights).sum().backward()
    (out_mine * weights).sum().backward()
    torch.testing.assert_close(f_mine.grad, f_ref.grad, rtol=1e-8, atol=1e-9)
    ref_params = dict(results[theirs][0].named_parameters())
    for key, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, ref_params[key].grad, rtol=1e-8, atol=1e-8, msg=key)
    ref_state = results[theirs][0].state_dict()
    for key, value in model.state_dict().items():  # BatchNorm running stats moved the same way
        torch.testing.assert_close(value, ref_state[key], rtol=1e-9, atol=1e-9, msg=key)


def test_unet_with_inverse_conv_under_both_imports():
    outputs = []
    for lib in (theirs, ours):
        torch.manual_seed(4)
        model = TinyUNet(lib, 3).double()
        x, _ = _input(lib, 12, (12, 14, 10), channels=3, density=0.15)
        out = model(x)
        out.features.square().sum().backward()
        outputs.append((model, x, out))
    (m_ref, x_ref, o_ref), (m_mine, x_mine, o_mine) = outputs
    assert torch.equal(o_mine.indices, o_ref.indices)
    torch.testing.assert_close(o_mine.features, o_ref.features, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(x_mine.features.grad, x_ref.features.grad, rtol=1e-8, atol=1e-9)
    ref_params = dict(m_ref.named_parameters())
    for key, parameter in m_mine.named_parameters():
        torch.testing.assert_close(parameter.grad, ref_params[key].grad, rtol=1e-8, atol=1e-8, msg=key)


# --------------------------------------------------------------------------- 1x1 layers (spconv issue #450)

ONE_BY_ONE = [
    ("SubMConv3d", (5, 7, 1), {}),
    ("SubMConv3d", (5, 7, 1), {"bias": False, "indice_key": "p"}),
    ("SubMConv3d", (7, 5, (1, 1, 1)), {"stride": 2}),  # subm ignores the stride: still the shortcut
    ("SparseConv3d", (5, 7, 1), {}),
    ("SparseConv3d", (5, 7, 1, 1, 0), {"bias": False}),
    ("SparseConv3d", (5, 7, 1, 2), {}),  # stride 2: spconv's regular path, the documented layout
    ("SparseConv3d", (5, 7, 1, (2, 1, 1)), {"bias": False}),
    ("SparseConvTranspose3d", (5, 7, 1), {}),
    ("SubMConv1d", (5, 7, 1), {}),
    ("SparseConv1d", (6, 3, 1), {"bias": False}),
    ("SubMConv2d", (5, 7, 1), {"bias": False}),
    ("SparseConv2d", (5, 7, 1), {}),
    ("SubMConv4d", (5, 7, 1), {}),
    ("SparseConv4d", (4, 6, 1), {"bias": False}),
    ("SubMConv3d", (4, 4, 1), {}),
]


@pytest.mark.parametrize("name, args, kwargs", ONE_BY_ONE, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(ONE_BY_ONE)])
def test_one_by_one_layer_matches_spconv(name, args, kwargs):
    """The same stored tensor gives spconv's outputs and gradients (features, weight, bias)."""
    ndim = int(name[-2])
    torch.manual_seed(len(ONE_BY_ONE) + ONE_BY_ONE.index((name, args, kwargs)))
    reference = getattr(theirs, name)(*args, **kwargs).double()
    mine = getattr(ours, name)(*args, **kwargs).double()
    mine.load_state_dict(reference.state_dict(), strict=True)
    x_ref, rng = _input(theirs, 40 + ndim, _SHAPES[ndim], channels=args[0])
    x_mine, _ = _input(ours, 40 + ndim, _SHAPES[ndim], channels=args[0])
    out_ref, out_mine = reference(x_ref), mine(x_mine)
    _assert_same_output(out_mine, out_ref)
    weights = torch.tensor(rng.standard_normal(tuple(out_ref.features.shape)))
    f_ref, _ = _sorted_rows(out_ref)
    f_mine, _ = _sorted_rows(out_mine)
    (f_ref * weights).sum().backward()
    (f_mine * weights).sum().backward()
    torch.testing.assert_close(x_mine.features.grad, x_ref.features.grad, rtol=1e-10, atol=1e-10)
    ref_params = dict(reference.named_parameters())
    assert set(ref_params) == {key for key, _ in mine.named_parameters()}
    for key, parameter in mine.named_parameters():
        torch.testing.assert_close(parameter.grad, ref_params[key].grad, rtol=1e-10, atol=1e-10, msg=key)


def test_one_by_one_reading_is_spconv_view_not_the_documented_layout():
    """An independent check of what spconv computes: features @ weight.view(in, out), unlike the
    documented ``W[:, 0, 0, 0, :].T`` a strided 1x1 layer (spconv's regular path) uses."""
    reference = theirs.SubMConv3d(5, 7, 1).double()
    mine = ours.SubMConv3d(5, 7, 1).double()
    mine.load_state_dict(reference.state_dict())
    x_ref, _ = _input(theirs, 50, (6, 6, 6), channels=5)
    x_mine, _ = _input(ours, 50, (6, 6, 6), channels=5)
    weight, bias = reference.weight.detach(), reference.bias.detach()
    spconv_math = x_ref.features.detach() @ weight.reshape(5, 7) + bias
    documented = x_ref.features.detach() @ weight.reshape(7, 5).T + bias
    assert not torch.allclose(spconv_math, documented)
    torch.testing.assert_close(reference(x_ref).features, spconv_math, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mine(x_mine).features, spconv_math, rtol=1e-12, atol=1e-12)


class OneByOneNet(nn.Module):
    """1x1 layers as networks use them: a SubM 1x1 projection, a regular 1x1 conv, a 1x1 head."""

    def __init__(self, spconv, in_channels=5, classes=7):
        super().__init__()
        self.stem = spconv.SparseSequential(
            spconv.SubMConv3d(in_channels, 8, 3, bias=False, indice_key="subm1"),
            nn.BatchNorm1d(8, eps=1e-3, momentum=0.01), nn.ReLU())
        self.project = spconv.SparseSequential(
            spconv.SubMConv3d(8, 12, 1, bias=False, indice_key="subm1"),
            nn.BatchNorm1d(12, eps=1e-3, momentum=0.01), nn.ReLU())
        self.down = spconv.SparseSequential(spconv.SparseConv3d(12, 6, 2, 2, bias=False, indice_key="down"),
                                            nn.ReLU())
        self.mix = spconv.SparseConv3d(6, 9, 1, bias=True)
        self.head = spconv.SubMConv3d(9, classes, 1, bias=True)

    def forward(self, x):
        return self.head(self.mix(self.down(self.project(self.stem(x)))))


def _train_steps(model, lib, steps=3):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x, _ = _input(lib, 60 + step, (8, 7, 9), channels=5, density=0.3)
        optimizer.zero_grad()
        model(x).features.square().mean().backward()
        optimizer.step()


def _compare_models(mine, reference, seed):
    x_ref, rng = _input(theirs, seed, (8, 7, 9), channels=5, density=0.3)
    x_mine, _ = _input(ours, seed, (8, 7, 9), channels=5, density=0.3)
    out_ref, out_mine = reference(x_ref), mine(x_mine)
    _assert_same_output(out_mine, out_ref)
    weights = torch.tensor(rng.standard_normal(tuple(out_ref.features.shape)))
    (_sorted_rows(out_ref)[0] * weights).sum().backward()
    (_sorted_rows(out_mine)[0] * weights).sum().backward()
    torch.testing.assert_close(x_mine.features.grad, x_ref.features.grad, rtol=1e-9, atol=1e-10)
    ref_params = dict(reference.named_parameters())
    for key, parameter in mine.named_parameters():
        torch.testing.assert_close(parameter.grad, ref_params[key].grad, rtol=1e-9, atol=1e-10, msg=key)


def test_spconv_checkpoint_with_1x1_layers_loads_unchanged():
    """A model trained in spconv, its state_dict loaded strictly: same outputs and gradients."""
    torch.manual_seed(21)
    reference = OneByOneNet(theirs).double()
    _train_steps(reference, theirs)
    mine = OneByOneNet(ours).double()
    mine.load_state_dict(reference.state_dict(), strict=True)
    for module in (mine, reference):
        module.zero_grad()
    _compare_models(mine, reference, 70)
    mine.eval(), reference.eval()
    with torch.no_grad():
        x_ref, _ = _input(theirs, 71, (8, 7, 9), channels=5, density=0.3)
        x_mine, _ = _input(ours, 71, (8, 7, 9), channels=5, density=0.3)
        # spconv's CPU build refuses a biased conv in eval mode; compare the bias-free trunk
        trunk_ref = reference.down(reference.project(reference.stem(x_ref)))
        trunk_mine = mine.down(mine.project(mine.stem(x_mine)))
        _assert_same_output(trunk_mine, trunk_ref)


def test_round_trip_sparsecore_spconv_sparsecore():
    """Trained in sparsecore.torch, run in spconv, back into sparsecore.torch: one function throughout."""
    torch.manual_seed(22)
    trained = OneByOneNet(ours).double()
    _train_steps(trained, ours)
    saved = {key: value.clone() for key, value in trained.state_dict().items()}
    reference = OneByOneNet(theirs).double()
    reference.load_state_dict(saved, strict=True)
    from_spconv = {key: value.clone() for key, value in reference.state_dict().items()}
    trained.zero_grad()
    _compare_models(trained, reference, 72)
    back = OneByOneNet(ours).double()
    back.load_state_dict(from_spconv, strict=True)
    for key, value in back.state_dict().items():
        assert torch.equal(value, saved[key]), key
    reference.zero_grad()
    _compare_models(back, reference, 73)


def test_convert_spconv_1x1_weights_is_deprecated_identity():
    reference = OneByOneNet(theirs).double()
    mine = OneByOneNet(ours).double()
    state = reference.state_dict()
    with pytest.warns(DeprecationWarning, match="no longer needed.*load_state_dict"):
        converted = ours.utils.convert_spconv_1x1_weights(mine, state)
    assert converted is not state and list(converted) == list(state)
    assert all(converted[key] is value for key, value in state.items())
    mine.load_state_dict(converted)
    _compare_models(mine, reference, 74)


def test_sparse_add_and_dense_match_spconv():
    a_ref, _ = _input(theirs, 14, (5, 6, 7))
    b_ref, _ = _input(theirs, 15, (5, 6, 7))
    a_mine, _ = _input(ours, 14, (5, 6, 7))
    b_mine, _ = _input(ours, 15, (5, 6, 7))
    total_ref = theirs.functional.sparse_add(a_ref, b_ref)
    total_mine = ours.functional.sparse_add(a_mine, b_mine)
    _assert_same_output(total_mine, total_ref)
    assert torch.equal(a_mine.dense(), a_ref.dense())
    assert torch.equal(a_mine.dense(channels_first=False), a_ref.dense(channels_first=False))
    dense = a_ref.dense(channels_first=False).detach()
    _assert_same_output(ours.SparseConvTensor.from_dense(dense), theirs.SparseConvTensor.from_dense(dense))


def test_max_pool_of_negative_features():
    """spconv's Native max pool starts from 0, so an all-negative window gives 0; ours gives its max."""
    x_ref, _ = _input(theirs, 16, (6, 6, 6), channels=2)
    x_mine, _ = _input(ours, 16, (6, 6, 6), channels=2)
    out_ref = theirs.SparseMaxPool3d(2)(x_ref)
    out_mine = ours.SparseMaxPool3d(2)(x_mine)
    dense = torch.full((2, 2, 6, 6, 6), -float("inf"), dtype=torch.float64)
    index = x_mine.indices.long()
    dense[index[:, 0], :, index[:, 1], index[:, 2], index[:, 3]] = x_mine.features.detach()
    expected = nn.functional.max_pool3d(dense, 2)
    sites = out_mine.indices.long()
    at_sites = expected[sites[:, 0], :, sites[:, 1], sites[:, 2], sites[:, 3]]
    torch.testing.assert_close(out_mine.features, at_sites)
    assert (at_sites < 0).any(), "the input has all-negative windows"
    f_ref, _ = _sorted_rows(out_ref)
    torch.testing.assert_close(f_ref, at_sites.clamp(min=0)), "spconv: max(0, window max)"


def test_point_to_voxel_matches_spconv():
    from spconv.pytorch.utils import PointToVoxel as TheirPointToVoxel

    rng = np.random.default_rng(17)
    points = torch.tensor(rng.random((4000, 5)) * np.array([4.0, 5.0, 3.0, 1.0, 1.0]) - np.array(
        [0.5, 0.5, 0.5, 0.0, 0.0]), dtype=torch.float32)
    args = ([0.2, 0.25, 0.3], [0, 0, 0, 3.2, 4.0, 2.4], 5, 150, 4)
    reference, mine = TheirPointToVoxel(*args), ours.utils.PointToVoxel(*args)
    for name in ("ndim", "vsize", "grid_size", "grid_stride", "coors_range"):
        assert list(np.atleast_1d(getattr(mine, name))) == list(np.atleast_1d(getattr(reference, name))), name
    for got, expected in zip(mine.generate_voxel_with_id(points), reference.generate_voxel_with_id(points)):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert (reference.generate_voxel_with_id(points)[3] == -1).any(), "max_num_voxels dropped some points"


def test_eval_mode_with_bias():
    """spconv's CPU build asserts 'cpu don't support act and bias' in eval mode; ours runs."""
    layer = ours.SubMConv3d(3, 4, 3).double().eval()
    x, _ = _input(ours, 18, (5, 5, 5))
    with pytest.raises(AssertionError):
        theirs.SubMConv3d(3, 4, 3).double().eval()(_input(theirs, 18, (5, 5, 5))[0])
    assert layer(x).features.shape == (x.features.shape[0], 4)
