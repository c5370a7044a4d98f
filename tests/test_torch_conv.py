"""sparsecore.torch conv layers against dense torch.nn.functional convolutions in float64.

Each sampled configuration (1-3 spatial axes, kernel sizes incl. even and
anisotropic ones, strides, paddings, dilations, groups and depthwise, batches
with empty elements) runs through the *layer* (``SparseConvolution`` with the
case's arguments, or the public ``SparseConv3d``-style classes): the output
sites must be the dense op's active sites, the values the dense op on the
densified input read there, and the gradients of features, weight and bias
those of torch autograd through the dense op. 4D layers are checked against
the brute-force pair loops of ``dense_oracle``. Nothing here compares
sparsecore with itself.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
spconv = pytest.importorskip("sparsecore.torch")

try:
    from . import conv_cases
    from . import dense_oracle as do
except ImportError:
    import conv_cases
    import dense_oracle as do

CASES = conv_cases.sample_case_sets(regular=24, subm=15, transposed=15, inverse=12, base_seed=61000)
CASES_4D = (do.sample_cases("regular", 3, ndims=(4,), base_seed=65000, max_kernel=3, max_dilation=2)
            + do.sample_cases("subm", 2, ndims=(4,), base_seed=65100, max_kernel=3, max_dilation=2)
            + do.sample_cases("transposed", 2, ndims=(4,), base_seed=65200, max_kernel=3, max_dilation=2))


def _tensor(features, indices, spatial_shape, batch_size, requires_grad=True):
    f = torch.tensor(features, dtype=torch.float64, requires_grad=requires_grad)
    return spconv.SparseConvTensor(f, torch.from_numpy(np.asarray(indices, dtype=np.int32)), list(spatial_shape),
                                   batch_size)


def _stored_weight(weight, kind, stride, groups):
    """The tensor a layer stores to compute with the core-layout ``weight`` (the oracle's).

    A layer spconv sends down its 1x1 shortcut (kernel volume 1, and subm or stride 1;
    spconv has no groups) reads its ``[out, 1, ..., 1, in]`` weight as ``view(in, out)``:
    the core's ``W[:, 0, ..., 0, :].T`` is then stored as ``W.reshape(out, in).T``. The map
    permutes entries, so it carries weight gradients the same way.
    """
    volume = math.prod(weight.shape[1:-1])
    if volume != 1 or groups != 1 or not (kind == "subm" or math.prod(stride) == 1):
        return weight
    return np.ascontiguousarray(weight.reshape(weight.shape[0], weight.shape[-1]).T).reshape(weight.shape)


def _layer(case: do.ConvCase, weight, bias, kind=None, indice_key=None):
    kind = kind or case.kind
    layer = spconv.SparseConvolution(
        case.ndim, case.in_channels, case.out_channels, case.kernel_size, case.stride, case.padding,
        case.dilation, case.groups, bias=True, subm=kind == "subm", transposed=kind == "transposed",
        output_padding=case.output_padding if kind == "transposed" else 0, indice_key=indice_key).double()
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(_stored_weight(weight, kind, case.stride, case.groups)))
        layer.bias.copy_(torch.from_numpy(bias))
    return layer


def _dense_fn(case, indices, transposed):
    padding = do.subm_padding(case.kernel_size, case.dilation, case.ndim) if case.kind == "subm" else case.padding

    def fn(feats, weight, bias):
        x = do.densify(feats, indices, case.spatial_shape, case.batch_size)
        if transposed:
            return do.dense_conv_transpose(x, weight, case.stride, padding, case.dilation, case.output_padding,
                                           case.groups, bias)
        return do.dense_conv(x, weight, case.stride, padding, case.dilation, case.groups, bias)

    return fn


def _run(layer, x, grad_out):
    out = layer(x)
    (out.features * torch.from_numpy(grad_out)).sum().backward()
    return out


def _check_against_dense(case: do.ConvCase):
    features, indices, weight = case.inputs()
    rng = do.make_rng(case.seed, 17)
    bias = rng.standard_normal(case.out_channels)
    sites = conv_cases.expected_sites(case, indices)
    grad_out = do.random_features(rng, sites.shape[0], case.out_channels)
    oracle = do.evaluate(_dense_fn(case, indices, case.kind == "transposed"), features, sites, weight, bias,
                         grad_output=grad_out)
    layer = _layer(case, weight, bias)
    x = _tensor(features, indices, case.spatial_shape, case.batch_size)
    out = _run(layer, x, grad_out)
    do.assert_sites(out.indices.numpy(), sites)
    expected_shape = do.output_shape(case.kind, case.spatial_shape, case.kernel_size, case.stride, case.padding,
                                     case.dilation, case.output_padding)
    assert tuple(out.spatial_shape) == expected_shape
    assert out.batch_size == case.batch_size
    do.assert_close(out.features.detach().numpy(), oracle.values, "features")
    do.assert_close(x.features.grad.numpy(), oracle.grad_features, "grad features")
    do.assert_close(layer.weight.grad.numpy(), _stored_weight(oracle.grad_weight, case.kind, case.stride, case.groups),
                    "grad weight")
    do.assert_close(layer.bias.grad.numpy(), oracle.grad_bias, "grad bias")


@pytest.mark.parametrize("case", CASES.regular, ids=str)
def test_regular_conv_layer(case):
    _check_against_dense(case)


@pytest.mark.parametrize("case", CASES.subm, ids=str)
def test_subm_conv_layer(case):
    _check_against_dense(case)


@pytest.mark.parametrize("case", CASES.transposed, ids=str)
def test_transposed_conv_layer(case):
    _check_against_dense(case)


@pytest.mark.parametrize("case", CASES.inverse, ids=str)
def test_inverse_conv_layer(case):
    """SparseConv (indice_key) then SparseInverseConv: back on the input sites, in their order."""
    features, indices, weight = case.inputs()
    rng = do.make_rng(case.seed, 31)
    down = _layer(case, weight, rng.standard_normal(case.out_channels), kind="regular", indice_key="down")
    x = _tensor(features, indices, case.spatial_shape, case.batch_size, requires_grad=False)
    y = down(x)
    coarse_sites = y.indices.numpy()
    coarse_shape = tuple(y.spatial_shape)
    coarse = do.random_features(rng, coarse_sites.shape[0], case.out_channels)
    y = y.replace_feature(torch.tensor(coarse, requires_grad=True))
    inverse = spconv.SparseConvolution(case.ndim, case.out_channels, case.in_channels, case.kernel_size,
                                       groups=case.groups, inverse=True, indice_key="down").double()
    inv_weight = do.random_weight(rng, case.in_channels, case.kernel_size, case.out_channels // case.groups)
    inv_bias = rng.standard_normal(case.in_channels)
    with torch.no_grad():
        inverse.weight.copy_(torch.from_numpy(_stored_weight(inv_weight, "inverse", (1,) * case.ndim, case.groups)))
        inverse.bias.copy_(torch.from_numpy(inv_bias))
    default = do.output_shape("transposed", coarse_shape, case.kernel_size, case.stride, case.padding,
                              case.dilation)
    output_padding = tuple(n - m for n, m in zip(case.spatial_shape, default))

    def fn(feats, w, b):
        dense = do.densify(feats, coarse_sites, coarse_shape, case.batch_size)
        return do.dense_conv_transpose(dense, w, case.stride, case.padding, case.dilation, output_padding,
                                       case.groups, b)

    grad_out = do.random_features(rng, indices.shape[0], case.in_channels)
    oracle = do.evaluate(fn, coarse, indices, inv_weight, inv_bias, grad_output=grad_out)
    out = _run(inverse, y, grad_out)
    assert out.indices is x.indices, "the inverse conv restores the paired layer's input indices object"
    assert list(out.spatial_shape) == list(case.spatial_shape)
    do.assert_close(out.features.detach().numpy(), oracle.values, "inverse features")
    do.assert_close(y.features.grad.numpy(), oracle.grad_features, "inverse grad features")
    do.assert_close(inverse.weight.grad.numpy(),
                    _stored_weight(oracle.grad_weight, "inverse", (1,) * case.ndim, case.groups), "inverse grad weight")
    do.assert_close(inverse.bias.grad.numpy(), oracle.grad_bias, "inverse grad bias")


@pytest.mark.parametrize("case", CASES_4D, ids=str)
def test_4d_conv_layer_against_naive_loops(case):
    features, indices, weight = case.inputs()
    naive = do.naive_rulebook(indices, case.spatial_shape, case.batch_size, case.kind, case.kernel_size,
                              case.stride, case.padding, case.dilation, case.output_padding)
    rng = do.make_rng(case.seed, 5)
    bias = rng.standard_normal(case.out_channels)
    grad_out = do.random_features(rng, naive.output_indices.shape[0], case.out_channels)
    oracle = do.evaluate_sparse(lambda f, w: do.naive_conv(f, w, naive, case.groups, torch.from_numpy(bias)),
                                features, weight, grad_out)
    layer = _layer(case, weight, bias)
    x = _tensor(features, indices, case.spatial_shape, case.batch_size)
    out = _run(layer, x, grad_out)
    do.assert_sites(out.indices.numpy(), naive.output_indices)
    assert tuple(out.spatial_shape) == naive.output_spatial_shape
    do.assert_close(out.features.detach().numpy(), oracle.values, "4D features")
    do.assert_close(x.features.grad.numpy(), oracle.grad_features, "4D grad features")
    do.assert_close(layer.weight.grad.numpy(), _stored_weight(oracle.grad_weight, case.kind, case.stride, case.groups),
                    "4D grad weight")


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_public_classes_match_dense(ndim):
    """SubMConv{n}d, SparseConv{n}d and SparseConvTranspose{n}d as users write them."""
    rng = do.make_rng(66000, ndim)
    shape = {1: (13,), 2: (7, 6), 3: (5, 4, 6)}[ndim]
    indices = do.random_indices(rng, shape, 2, 0.3)
    features = do.random_features(rng, indices.shape[0], 3)
    subm = getattr(spconv, f"SubMConv{ndim}d")(3, 4, 3, indice_key="subm0").double()
    down = getattr(spconv, f"SparseConv{ndim}d")(4, 5, 3, 2, 1, bias=False).double()
    up = getattr(spconv, f"SparseConvTranspose{ndim}d")(5, 2, 2, 2).double()
    x = _tensor(features, indices, shape, 2)
    out = up(down(subm(x)))

    def dense(f, w1, b1, w2, w3, b3):
        d = do.densify(f, indices, shape, 2)
        d = do.dense_conv(d, w1, 1, 1, 1, 1, b1)
        d = d * do.occupancy(indices, shape, 2)  # a subm conv only writes the input sites
        d = do.dense_conv(d, w2, 2, 1, 1)
        return do.dense_conv_transpose(d, w3, 2, 0, 1, 0, 1, b3)

    leaves = [x.features, subm.weight, subm.bias, down.weight, up.weight, up.bias]
    ref_leaves = [p.detach().clone().requires_grad_() for p in leaves]
    mid = do.regular_sites(indices, shape, 2, 3, 2, 1, 1)
    mid_shape = do.output_shape("regular", shape, 3, 2, 1, 1)
    sites = do.transposed_sites(mid, mid_shape, 2, 2, 2, 0, 1, 0)
    do.assert_sites(out.indices.numpy(), sites)
    assert tuple(out.spatial_shape) == do.output_shape("transposed", mid_shape, 2, 2, 0, 1)
    ref = do.read_sites(dense(*ref_leaves), sites)
    do.assert_close(out.features.detach().numpy(), ref.detach().numpy(), "chain")
    grad_out = torch.from_numpy(do.random_features(rng, sites.shape[0], 2))
    (out.features * grad_out).sum().backward()
    (ref * grad_out).sum().backward()
    for mine, theirs in zip(leaves, ref_leaves):
        do.assert_close(mine.grad.numpy(), theirs.grad.numpy(), "chain grad")


@pytest.mark.parametrize("kind", ["subm", "regular", "transposed"])
@pytest.mark.parametrize("ndim", [1, 3, 4])
def test_empty_input(kind, ndim):
    shape = (5,) * ndim
    layer = spconv.SparseConvolution(ndim, 3, 2, 3, stride=2 if kind != "subm" else 1, padding=1,
                                     subm=kind == "subm", transposed=kind == "transposed", indice_key="k").double()
    features = torch.zeros((0, 3), dtype=torch.float64, requires_grad=True)
    x = spconv.SparseConvTensor(features, torch.zeros((0, ndim + 1), dtype=torch.int32), list(shape), 2)
    out = layer(x)
    assert out.features.shape == (0, 2) and out.indices.shape == (0, ndim + 1)
    assert out.indices.dtype == torch.int32
    expected_shape = do.output_shape(kind, shape, 3, 2 if kind != "subm" else 1, 1)
    assert tuple(out.spatial_shape) == expected_shape
    out.features.sum().backward()
    assert features.grad.shape == (0, 3)
    assert torch.equal(layer.weight.grad, torch.zeros_like(layer.weight))
    assert torch.equal(layer.bias.grad, torch.zeros_like(layer.bias))
    assert out.dense().shape == (2, 2, *expected_shape)
    if kind == "regular":
        inverse = spconv.SparseConvolution(ndim, 2, 3, 3, inverse=True, indice_key="k").double()
        back = inverse(out)
        assert back.features.shape == (0, 3) and list(back.spatial_shape) == list(shape)


# --------------------------------------------------------------------------- indice_key rules


def _input(seed=0, shape=(6, 7, 5), batch=2, channels=3, dtype=torch.float64):
    rng = do.make_rng(67000, seed)
    indices = do.random_indices(rng, shape, batch, 0.3)
    features = torch.tensor(do.random_features(rng, indices.shape[0], channels), dtype=dtype)
    return spconv.SparseConvTensor(features, torch.from_numpy(indices), list(shape), batch)


def test_subm_layers_share_rulebook_by_key():
    x = _input()
    a = spconv.SubMConv3d(3, 4, 3, indice_key="s1").double()
    b = spconv.SubMConv3d(4, 4, 3, indice_key="s1").double()
    y = a(x)
    assert "s1" in y.indice_dict and "s1" not in x.indice_dict, "a layer hands its output a copy of the dict"
    saved = y.find_indice_pair("s1")
    z = b(y)
    assert z.find_indice_pair("s1") is saved, "the second layer reuses the saved rulebook"
    assert z.indices is x.indices
    # a shared key with another kernel size is an error naming the key
    c = spconv.SubMConv3d(4, 4, 5, indice_key="s1").double()
    with pytest.raises(ValueError, match="indice_key 's1'.*does not fit"):
        c(y)


def test_regular_conv_key_cannot_be_reused():
    x = _input()
    down = spconv.SparseConv3d(3, 4, 3, 2, 1, indice_key="d1").double()
    y = down(x)
    again = spconv.SubMConv3d(4, 4, 3, indice_key="d1").double()
    with pytest.raises(ValueError, match="indice_key 'd1'"):
        again(y)
    other = spconv.SparseConv3d(4, 4, 3, 2, 1, indice_key="d1").double()
    with pytest.raises(ValueError, match="already exists in this sparse tensor"):
        other(y)


def test_running_a_model_twice_on_one_input():
    x = _input()
    model = spconv.SparseSequential(spconv.SubMConv3d(3, 4, 3, indice_key="s1"),
                                    spconv.SparseConv3d(4, 4, 3, 2, 1, indice_key="d1"),
                                    spconv.SparseInverseConv3d(4, 2, 3, indice_key="d1")).double()
    first = model(x)
    second = model(x)
    assert torch.equal(first.features, second.features) and first.indices is x.indices


def test_inverse_conv_errors():
    x = _input()
    inverse = spconv.SparseInverseConv3d(3, 3, 3, indice_key="missing").double()
    with pytest.raises(ValueError, match="indice_key='missing'.*no rulebooks"):
        inverse(x)
    y = spconv.SparseConv3d(3, 4, 3, 2, 1, indice_key="d1").double()(x)
    wrong_kernel = spconv.SparseInverseConv3d(4, 3, 2, indice_key="d1").double()
    with pytest.raises(ValueError, match="kernel_size"):
        wrong_kernel(y)
    fewer = spconv.SparseConvTensor(y.features[:-1], y.indices[:-1], y.spatial_shape, y.batch_size,
                                    indice_dict=y.indice_dict)
    with pytest.raises(ValueError, match="not the paired layer's"):
        spconv.SparseInverseConv3d(4, 3, 3, indice_key="d1").double()(fewer)
    s = spconv.SubMConv3d(3, 3, 3, indice_key="s").double()(x)
    with pytest.raises(ValueError, match="submanifold"):
        spconv.SparseInverseConv3d(3, 3, 3, indice_key="s").double()(s)
    with pytest.raises(ValueError, match="needs the indice_key"):
        spconv.SparseConvolution(3, 3, 3, 3, inverse=True)


def test_inverse_of_max_pool():
    x = _input(1, channels=2)
    pool = spconv.SparseMaxPool3d(2, indice_key="p1")
    y = pool(x)
    up = spconv.SparseInverseConv3d(2, 2, 2, indice_key="p1").double()
    z = up(y)
    assert z.indices is x.indices and list(z.spatial_shape) == list(x.spatial_shape)


# --------------------------------------------------------------------------- bad input


def test_channel_mismatch():
    x = _input(channels=3)
    with pytest.raises(ValueError, match="in_channels=4 but the input features have 3 channels"):
        spconv.SubMConv3d(4, 4, 3).double()(x)


def test_wrong_dimension_and_type():
    x = _input()
    with pytest.raises(ValueError, match="2-D layer but the input has 3 spatial axes"):
        spconv.SubMConv2d(3, 3, 3).double()(x)
    with pytest.raises(TypeError, match="expects a sparsecore.torch.SparseConvTensor"):
        spconv.SubMConv3d(3, 3, 3)(x.features)


def test_weight_on_another_device():
    x = _input()
    layer = spconv.SubMConv3d(3, 3, 3).to(device="meta", dtype=torch.float64)
    with pytest.raises(ValueError, match="different devices.*weight on meta"):
        layer(x)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="odd kernel size"):
        spconv.SubMConv3d(2, 2, 4)
    with pytest.raises(ValueError, match="groups=3 must divide"):
        spconv.SparseConv3d(4, 6, 3, groups=3)
    with pytest.raises(ValueError, match="kernel_size must have 3 entries"):
        spconv.SparseConv3d(4, 6, (3, 3))


# --------------------------------------------------------------------------- parameters


def test_weight_layout_init_and_state_dict_keys():
    layer = spconv.SparseConv3d(4, 8, (3, 1, 2), groups=2, record_voxel_count=True)
    assert layer.weight.shape == (8, 3, 1, 2, 2)
    assert list(layer.state_dict()) == ["weight", "bias", "max_num_voxels_during_training"]
    assert spconv.SubMConv3d(4, 8, 3, bias=False).bias is None
    assert list(spconv.SubMConv3d(4, 8, 3, bias=False).state_dict()) == ["weight"]
    big = spconv.SubMConv3d(16, 64, 3)
    fan_in = 16 * 27
    bound = 1 / math.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)) bound = gain * sqrt(3 / fan_in)
    assert big.weight.abs().max() <= bound and big.weight.abs().max() > 0.9 * bound
    assert big.bias.abs().max() <= bound
    # the same seed draws the same numbers as spconv's init (uniform weight, then uniform bias)
    torch.manual_seed(3)
    a = spconv.SubMConv3d(16, 64, 3)
    torch.manual_seed(3)
    w = torch.zeros(64, 3, 3, 3, 16).uniform_(-bound, bound)
    b = torch.zeros(64).uniform_(-bound, bound)
    assert torch.equal(a.weight.detach(), w) and torch.equal(a.bias.detach(), b)


def test_state_dict_without_voxel_count_buffer_loads():
    src = spconv.SparseConv3d(2, 3, 3)
    dst = spconv.SparseConv3d(2, 3, 3, record_voxel_count=True)
    dst.load_state_dict(src.state_dict())
    assert torch.equal(dst.weight, src.weight)


def test_record_voxel_count():
    x = _input()
    layer = spconv.SparseConv3d(3, 2, 3, 2, 1, record_voxel_count=True).double()
    y = layer(x)
    assert int(layer.get_max_num_voxels()) == y.indices.shape[0]
    assert spconv.SubMConv3d(3, 2, 3).get_max_num_voxels() is None


def test_one_by_one_conv_reads_weight_as_spconv():
    """spconv's 1x1 shortcut: features @ weight.view(in, out) (its issue #450); gradients reach the parameter."""
    x = _input()
    layer = spconv.SubMConv3d(3, 5, 1).double()
    out = layer(x)
    expected = x.features @ layer.weight.detach().reshape(3, 5) + layer.bias.detach()
    assert torch.allclose(out.features, expected)
    assert not torch.allclose(out.features, x.features @ layer.weight.detach().reshape(5, 3).T + layer.bias)
    out.features.square().sum().backward()
    grad = x.features.detach().T @ (2 * out.features.detach())  # d/dM of |f @ M + b|^2, M = view(in, out)
    torch.testing.assert_close(layer.weight.grad, grad.reshape(layer.weight.shape))
    grouped = spconv.SubMConv3d(4, 6, 1, groups=2).double()  # spconv has no groups: the documented reading
    assert not grouped.reads_weight_as_spconv_1x1


def test_fused_activation_and_add_input():
    x = _input()
    layer = spconv.SparseConvolution(3, 3, 4, 3, subm=True, act_type="relu").double()
    base = spconv.SubMConv3d(3, 4, 3).double()
    base.load_state_dict(layer.state_dict())
    generator = torch.Generator().manual_seed(0)
    residual = x.replace_feature(torch.randn(x.features.shape[0], 4, dtype=torch.float64, generator=generator))
    out = layer(x, residual)
    assert torch.allclose(out.features, torch.relu(base(x).features + residual.features))


def test_float16_input_on_cpu():
    x64 = _input(2)
    layer = spconv.SubMConv3d(3, 4, 3).double()
    ref = layer(x64).features
    layer16 = spconv.SubMConv3d(3, 4, 3).half()
    layer16.load_state_dict({k: v.half() for k, v in layer.state_dict().items()})
    out = layer16(x64.replace_feature(x64.features.half()))
    assert out.features.dtype == torch.float16
    assert torch.allclose(out.features.double(), ref, atol=2e-2, rtol=2e-2)
    out.features.float().sum().backward()
    assert layer16.weight.grad.dtype == torch.float16


def test_autocast_bfloat16_on_cpu():
    x = _input(3, dtype=torch.float32)
    layer = spconv.SubMConv3d(3, 4, 3)
    ref = layer(x).features
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.features.dtype == torch.bfloat16
    assert torch.allclose(out.features.float(), ref, atol=5e-2, rtol=5e-2)
    out.features.float().sum().backward()
    assert layer.weight.grad.dtype == torch.float32 and torch.isfinite(layer.weight.grad).all()


def test_mixed_dtypes_raise_naming_both_as_torch_layers_do():
    x64 = _input(4, dtype=torch.float64)
    layer = spconv.SubMConv3d(3, 4, 3, indice_key="s")  # float32 parameters
    with pytest.raises(RuntimeError):  # the oracle: torch's own layer refuses the same mix
        torch.nn.Linear(3, 4)(x64.features)
    with pytest.raises(TypeError, match=r"SubMConv3d: the input features are torch.float64 but its weight is "
                                        r"torch.float32, its bias is torch.float32.*layer.to\(torch.float64\)"):
        layer(x64)
    x32 = x64.replace_feature(x64.features.float())
    with pytest.raises(TypeError, match=r"SparseConv3d: the input features are torch.float32 but its weight is "
                                        r"torch.float64; .*x.features.to\(torch.float64\)"):
        spconv.SparseConv3d(3, 2, 3, stride=2, bias=False).double()(x32)
    # converted, they agree with each other (and autocast still runs float32 layers: the test above)
    expected = layer.double()(x64).features
    torch.testing.assert_close(layer.float()(x32).features.double(), expected, rtol=1e-5, atol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # float64 is not an autocast dtype: still refused
        with pytest.raises(TypeError, match="torch.float64 but its weight is torch.bfloat16"):
            layer(x64)


def _bfloat16_route_layers(monkeypatch):
    """A bfloat16 run of a subm and a strided layer on the core's bfloat16 route, with its float64 twin."""
    from sparsecore.backends import _cpu_kernels

    monkeypatch.setattr(_cpu_kernels, "NUMPY_MAX_WORK", -1)  # small clouds on the compiled bfloat16 kernels
    torch.manual_seed(67100)
    return spconv.SparseSequential(spconv.SubMConv3d(16, 40, 3, indice_key="b"),
                                   spconv.SparseConv3d(40, 24, 3, stride=2, padding=1, bias=False))


def sc_x86_features():
    from sparsecore.backends import x86_features

    return x86_features


def _bfloat16_bound(reference: torch.Tensor, magnitude: torch.Tensor, terms: int) -> None:
    """tests/test_bf16_cpu_dataflow.py's bound per stage (two stages here: the second sees the first's rounding)."""
    return (2 * 2.0 ** -8 + 3 * terms * 2.0 ** -24) * magnitude + 1e-12


def test_bfloat16_layers_and_autocast_run_the_core_bfloat16_passes_with_autograd(monkeypatch):
    pytest.importorskip("ml_dtypes")
    net = _bfloat16_route_layers(monkeypatch)
    x = _input(5, shape=(8, 9, 7), channels=16, dtype=torch.float32)
    x16 = x.replace_feature(x.features.bfloat16().requires_grad_(True))
    exact = x16.features.detach().double().requires_grad_(True)
    twin = _bfloat16_route_layers(monkeypatch).double()
    twin.load_state_dict({name: value.bfloat16().double() for name, value in net.state_dict().items()})
    reference = twin(x.replace_feature(exact))
    reference.features.sum().backward()
    net16 = _bfloat16_route_layers(monkeypatch).bfloat16()
    net16.load_state_dict(net.state_dict())
    import sparsecore.conv as core_conv

    routes = []
    forward = core_conv.dot_forward
    monkeypatch.setattr(core_conv, "dot_forward", lambda *a: routes.append(a[-1]) or forward(*a))
    out = net16(x16)
    assert out.features.dtype == torch.bfloat16
    has_bf16 = sc_x86_features().available_features().avx512_bf16
    assert len(routes) == (2 if has_bf16 else 0)  # the core's bfloat16 kernels, not a float32 upcast
    out.features.float().sum().backward()
    assert x16.features.grad.dtype == net16[0].weight.grad.dtype == torch.bfloat16
    absolute = _bfloat16_route_layers(monkeypatch).double()
    absolute.load_state_dict({name: value.abs() for name, value in twin.state_dict().items()})
    magnitude = absolute(x.replace_feature(exact.detach().abs())).features
    bound = _bfloat16_bound(reference.features, magnitude, 27 * 40)
    assert torch.all((out.features.double() - reference.features.detach()).abs() <= bound)
    assert torch.allclose(x16.features.grad.double(), exact.grad, rtol=2 ** -6, atol=2 ** -6 * exact.grad.abs().max())
    # autocast casts the float32 input and parameters to bfloat16 and runs the same passes: the same bits
    net32 = _bfloat16_route_layers(monkeypatch)
    net32.load_state_dict(net.state_dict())
    for layer in (net32, net16):
        for parameter in layer.parameters():
            parameter.data = parameter.data.bfloat16().to(parameter.dtype)  # the same bfloat16 values
    x32 = x.replace_feature(x16.features.detach().float().requires_grad_(True))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = net32(x32)
    torch.testing.assert_close(cast.features, net16(x16).features, rtol=0, atol=0)
    cast.features.float().sum().backward()
    assert net32[0].weight.grad.dtype == torch.float32 and x32.features.grad.dtype == torch.float32
