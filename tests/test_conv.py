"""Oracle tests of the sparse convolutions against dense PyTorch ops in float64.

For every layer kind (regular, submanifold, transposed, inverse) and hundreds of
seeded configurations (1-3 spatial axes, kernels 1-5 including even and
anisotropic ones, strides 1-3, paddings 0-2, dilations 1-3, output padding,
grouped and depthwise channels, batches 1-3, random densities), the sparse
result must equal the dense torch convolution of the densified input read at
the output's active sites, in the forward pass and in both gradients. The
active sites themselves come from a dense op on the occupancy mask. 4D layers
are checked against the brute-force pair enumeration of ``dense_oracle``.
Nothing here compares sparsecore with itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sparsecore as sc

try:
    from . import conv_cases
    from . import dense_oracle as do
except ImportError:
    import conv_cases
    import dense_oracle as do

_geometry = conv_cases.case_geometry
_dense_fn = conv_cases.case_dense_fn

REGULAR = do.sample_cases("regular", 96, base_seed=1000)
SUBM = do.sample_cases("subm", 60, base_seed=2000)
TRANSPOSED = do.sample_cases("transposed", 72, base_seed=3000)
INVERSE = do.sample_cases("regular", 36, base_seed=4000)

# Hand-picked corners the sampler may miss.
_HAND = [
    # (kind, ndim, kernel, stride, padding, dilation, output_padding, groups, cin, cout, B, shape)
    ("regular", 3, (1, 3, 3), (1, 2, 2), (0, 1, 1), 1, 0, 1, 2, 3, 2, (3, 6, 5)),
    ("regular", 3, (2, 2, 2), (2, 2, 2), 0, 1, 0, 1, 3, 2, 2, (4, 5, 6)),
    ("regular", 2, 4, 3, 2, 1, 0, 4, 4, 4, 1, (9, 7)),
    ("regular", 1, 5, 1, 2, 3, 0, 2, 2, 4, 3, (15,)),
    ("regular", 3, 3, 3, 0, 1, 0, 1, 1, 1, 1, (3, 3, 3)),
    ("regular", 2, (5, 1), (1, 3), (2, 0), (1, 2), 0, 3, 3, 6, 2, (6, 8)),
    ("subm", 3, (1, 3, 3), 1, 0, 1, 0, 1, 2, 2, 2, (4, 5, 5)),
    ("subm", 3, 1, 1, 0, 1, 0, 1, 3, 2, 2, (3, 4, 5)),
    ("subm", 2, 5, 1, 0, 3, 0, 3, 3, 3, 1, (7, 9)),
    ("subm", 1, 3, 1, 0, 2, 0, 2, 4, 2, 3, (12,)),
    ("transposed", 3, 2, 2, 0, 1, 1, 1, 2, 3, 2, (3, 3, 4)),
    ("transposed", 2, 3, (2, 3), 1, 1, (1, 2), 2, 2, 4, 1, (4, 3)),
    ("transposed", 1, 4, 3, 2, 2, 2, 3, 3, 3, 2, (5,)),
    ("transposed", 3, (1, 3, 3), (1, 2, 2), (0, 1, 1), 1, (0, 1, 1), 1, 2, 2, 1, (3, 4, 4)),
    ("transposed", 2, 5, 1, 2, 3, 2, 1, 1, 2, 3, (3, 3)),
]


def _hand_case(i, spec):
    kind, ndim, k, s, p, d, op, g, cin, cout, b, shape = spec
    t = lambda v: do.as_tuple(v, ndim)  # noqa: E731
    return do.ConvCase(seed=90000 + i, kind=kind, ndim=ndim, kernel_size=t(k), stride=t(s), padding=t(p),
                       dilation=t(d), output_padding=t(op), groups=g, in_channels=cin, out_channels=cout,
                       batch_size=b, spatial_shape=tuple(shape), density=0.35)


HAND = [_hand_case(i, spec) for i, spec in enumerate(_HAND)]
REGULAR += [c for c in HAND if c.kind == "regular"]
SUBM += [c for c in HAND if c.kind == "subm"]
TRANSPOSED += [c for c in HAND if c.kind == "transposed"]


_expected_sites = conv_cases.expected_sites


def _check_forward(case: do.ConvCase):
    features, indices, weight = case.inputs()
    rb = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, _geometry(case))
    sites = _expected_sites(case, indices)
    do.assert_sites(rb.output_indices, sites)
    out = sc.conv_forward(features, weight, rb, groups=case.groups)
    oracle = do.evaluate(_dense_fn(case, indices, case.spatial_shape, case.kind == "transposed"),
                         features, sites, weight)
    do.assert_close(out, oracle.values, "conv_forward")
    return rb


def _check_backward(case: do.ConvCase):
    features, indices, weight = case.inputs()
    rb = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, _geometry(case))
    sites = _expected_sites(case, indices)
    do.assert_sites(rb.output_indices, sites)
    grad_out = do.random_features(case.rng(), sites.shape[0], case.out_channels)
    oracle = do.evaluate(_dense_fn(case, indices, case.spatial_shape, case.kind == "transposed"),
                         features, sites, weight, grad_output=grad_out)
    grad_features, grad_weight = sc.conv_backward(grad_out, features, weight, rb, groups=case.groups)
    do.assert_close(grad_features, oracle.grad_features, "grad_features")
    do.assert_close(grad_weight, oracle.grad_weight, "grad_weight")


@pytest.mark.parametrize("case", REGULAR + SUBM + TRANSPOSED, ids=str)
def test_backward(case):
    """Gradients of every regular, submanifold and transposed case against the dense oracle's."""
    _check_backward(case)


@pytest.mark.parametrize("case", REGULAR, ids=str)
def test_regular_forward(case):
    rb = _check_forward(case)
    expected_shape = do.output_shape("regular", case.spatial_shape, case.kernel_size, case.stride,
                                     case.padding, case.dilation)
    assert tuple(rb.output_spatial_shape) == expected_shape


@pytest.mark.parametrize("case", SUBM, ids=str)
def test_subm_forward(case):
    rb = _check_forward(case)
    assert tuple(rb.output_spatial_shape) == case.spatial_shape


@pytest.mark.parametrize("case", TRANSPOSED, ids=str)
def test_transposed_forward(case):
    rb = _check_forward(case)
    x = torch.zeros((1, 1, *case.spatial_shape), dtype=torch.float64)
    w = torch.zeros((1, *case.kernel_size, 1), dtype=torch.float64)
    torch_shape = tuple(do.dense_conv_transpose(x, w, case.stride, case.padding, case.dilation,
                                                case.output_padding).shape[2:])
    assert tuple(rb.output_spatial_shape) == torch_shape
    assert tuple(_geometry(case).output_spatial_shape(case.spatial_shape)) == torch_shape


# ----------------------------------------------------------------- inverse conv


def _inverse_setup(case: do.ConvCase):
    features, indices, _ = case.inputs()
    rb = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, _geometry(case, "regular"))
    down_sites = do.regular_sites(indices, case.spatial_shape, case.batch_size, case.kernel_size, case.stride,
                                  case.padding, case.dilation)
    do.assert_sites(rb.output_indices, down_sites, "regular conv output indices")
    irb = sc.inverse_rulebook(rb)
    rng = do.make_rng(case.seed, 31)
    # the inverse conv maps out_channels (coarse) back to in_channels (fine)
    coarse_features = do.random_features(rng, down_sites.shape[0], case.out_channels)
    groups = case.groups
    weight = do.random_weight(rng, case.in_channels, case.kernel_size, case.out_channels // groups)
    coarse_shape = do.output_shape("regular", case.spatial_shape, case.kernel_size, case.stride, case.padding,
                                   case.dilation)
    default = do.output_shape("transposed", coarse_shape, case.kernel_size, case.stride, case.padding,
                              case.dilation)
    output_padding = tuple(n - m for n, m in zip(case.spatial_shape, default))

    def fn(feats, w):
        x = do.densify(feats, down_sites, coarse_shape, case.batch_size)
        return do.dense_conv_transpose(x, w, case.stride, case.padding, case.dilation, output_padding, groups)

    return indices, irb, coarse_features, weight, fn, rng


@pytest.mark.parametrize("case", INVERSE, ids=str)
def test_inverse_forward(case):
    indices, irb, feats, weight, fn, _ = _inverse_setup(case)
    do.assert_sites(irb.output_indices, indices, "inverse conv output indices (original rows, same order)")
    assert tuple(irb.output_spatial_shape) == case.spatial_shape
    assert irb.geometry.kind == "inverse"
    out = sc.conv_forward(feats, weight, irb, groups=case.groups)
    oracle = do.evaluate(fn, feats, indices, weight)
    do.assert_close(out, oracle.values, "inverse conv_forward")


@pytest.mark.parametrize("case", INVERSE, ids=str)
def test_inverse_backward(case):
    indices, irb, feats, weight, fn, rng = _inverse_setup(case)
    grad_out = do.random_features(rng, indices.shape[0], case.in_channels)
    oracle = do.evaluate(fn, feats, indices, weight, grad_output=grad_out)
    grad_features, grad_weight = sc.conv_backward(grad_out, feats, weight, irb, groups=case.groups)
    do.assert_close(grad_features, oracle.grad_features, "inverse grad_features")
    do.assert_close(grad_weight, oracle.grad_weight, "inverse grad_weight")


# ------------------------------------------------------------------------- 4D

CASES_4D = (do.sample_cases("regular", 8, ndims=(4,), base_seed=5000, max_kernel=3, max_dilation=2)
            + do.sample_cases("subm", 6, ndims=(4,), base_seed=5100, max_kernel=3, max_dilation=2)
            + do.sample_cases("transposed", 6, ndims=(4,), base_seed=5200, max_kernel=3, max_dilation=2))


@pytest.mark.parametrize("case", CASES_4D, ids=str)
def test_4d_against_naive_reference(case):
    features, indices, weight = case.inputs()
    rb = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, _geometry(case))
    naive = do.naive_rulebook(indices, case.spatial_shape, case.batch_size, case.kind, case.kernel_size,
                              case.stride, case.padding, case.dilation, case.output_padding)
    do.assert_sites(rb.output_indices, naive.output_indices)
    assert tuple(rb.output_spatial_shape) == naive.output_spatial_shape
    grad_out = do.random_features(case.rng(), naive.output_indices.shape[0], case.out_channels)
    oracle = do.evaluate_sparse(lambda f, w: do.naive_conv(f, w, naive, case.groups), features, weight, grad_out)
    out = sc.conv_forward(features, weight, rb, groups=case.groups)
    do.assert_close(out, oracle.values, "4D conv_forward")
    grad_features, grad_weight = sc.conv_backward(grad_out, features, weight, rb, groups=case.groups)
    do.assert_close(grad_features, oracle.grad_features, "4D grad_features")
    do.assert_close(grad_weight, oracle.grad_weight, "4D grad_weight")


_GROUPED_T = [c for c in do.sample_cases("transposed", 30, base_seed=5600) if c.groups > 1][:4]


@pytest.mark.parametrize("case", do.sample_cases("regular", 4, base_seed=5300)
                         + do.sample_cases("subm", 3, base_seed=5400)
                         + do.sample_cases("transposed", 3, base_seed=5500) + _GROUPED_T, ids=str)
def test_naive_reference_matches_dense_torch(case):
    """The 4D reference itself is validated against torch where torch has the op."""
    features, indices, weight = case.inputs()
    naive = do.naive_rulebook(indices, case.spatial_shape, case.batch_size, case.kind, case.kernel_size,
                              case.stride, case.padding, case.dilation, case.output_padding)
    do.assert_sites(naive.output_indices, _expected_sites(case, indices), "naive sites")
    got = do.naive_conv(do.to_torch(features), do.to_torch(weight), naive, case.groups).numpy()
    oracle = do.evaluate(_dense_fn(case, indices, case.spatial_shape, case.kind == "transposed"),
                         features, naive.output_indices, weight)
    do.assert_close(got, oracle.values, "naive vs dense torch")


# ------------------------------------------------------------ bias and dtypes


@pytest.mark.parametrize("case", REGULAR[:6] + SUBM[:6] + TRANSPOSED[:6], ids=str)
def test_bias(case):
    features, indices, weight = case.inputs()
    bias = do.random_features(do.make_rng(case.seed, 5), 1, case.out_channels)[0]
    rb = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, _geometry(case))
    sites = _expected_sites(case, indices)
    out = sc.conv_forward(features, weight, rb, bias=bias, groups=case.groups)
    oracle = do.evaluate(_dense_fn(case, indices, case.spatial_shape, case.kind == "transposed"),
                         features, sites, weight, bias)
    do.assert_close(out, oracle.values, "conv_forward with bias")


_DTYPE_CASES = REGULAR[10:16] + SUBM[10:14] + TRANSPOSED[10:14]


@pytest.mark.parametrize("dtype,rel", [(np.float16, 1.5e-3), (np.float32, 5e-6)], ids=["float16", "float32"])
@pytest.mark.parametrize("case", _DTYPE_CASES, ids=str)
def test_low_precision(case, dtype, rel):
    """float16/float32 against float64 on the same (rounded) inputs.

    The tolerance is relative to the sum of absolute contributions at each site
    (the dense op on |x|, |w|, |G|), which bounds rounding in the output and in a
    float32 accumulation.
    """
    f64, indices, w64 = case.inputs()
    features, weight = f64.astype(dtype), w64.astype(dtype)
    rb = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, _geometry(case))
    sites = _expected_sites(case, indices)
    grad_out = do.random_features(case.rng(), sites.shape[0], case.out_channels).astype(dtype)
    fn = _dense_fn(case, indices, case.spatial_shape, case.kind == "transposed")
    exact = do.evaluate(fn, features.astype(np.float64), sites, weight.astype(np.float64),
                        grad_output=grad_out.astype(np.float64))
    scale = do.evaluate(fn, np.abs(features).astype(np.float64), sites, np.abs(weight).astype(np.float64),
                        grad_output=np.abs(grad_out).astype(np.float64))
    tiny = 1e-4 if dtype == np.float16 else 1e-9

    out = sc.conv_forward(features, weight, rb, groups=case.groups)
    assert out.dtype == dtype
    err = np.abs(out.astype(np.float64) - exact.values)
    assert np.all(err <= rel * scale.values + tiny), f"forward error {err.max()}"

    grad_features, grad_weight = sc.conv_backward(grad_out, features, weight, rb, groups=case.groups)
    assert grad_features.dtype == dtype and grad_weight.dtype == dtype
    # d/dx of sum(|G| * conv(x, |w|)) bounds |dx| termwise; likewise for dw
    bound_f = do.evaluate(fn, features.astype(np.float64), sites, np.abs(weight).astype(np.float64),
                          grad_output=np.abs(grad_out).astype(np.float64)).grad_features
    bound_w = do.evaluate(fn, np.abs(features).astype(np.float64), sites, weight.astype(np.float64),
                          grad_output=np.abs(grad_out).astype(np.float64)).grad_weight
    err_f = np.abs(grad_features.astype(np.float64) - exact.grad_features)
    err_w = np.abs(grad_weight.astype(np.float64) - exact.grad_weight)
    assert np.all(err_f <= rel * bound_f + tiny), f"grad_features error {err_f.max()}"
    assert np.all(err_w <= rel * bound_w + tiny), f"grad_weight error {err_w.max()}"


def test_torch_and_noncontiguous_inputs():
    """torch tensors (torch in, torch out) and non-contiguous NumPy views are accepted (DLPack views)."""
    case = REGULAR[3]
    features, indices, weight = case.inputs()
    rb = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, _geometry(case))
    sites = _expected_sites(case, indices)
    expected = do.evaluate(_dense_fn(case, indices, case.spatial_shape), features, sites, weight).values
    out_t = sc.conv_forward(torch.from_numpy(features), torch.from_numpy(weight), rb, groups=case.groups)
    assert isinstance(out_t, torch.Tensor)
    do.assert_close(out_t.numpy(), expected, "torch inputs")
    f_nc = np.asfortranarray(features)
    padded = np.zeros((features.shape[0], features.shape[1] * 2))
    padded[:, ::2] = features
    for view in (f_nc, padded[:, ::2]):
        do.assert_close(sc.conv_forward(view, weight, rb, groups=case.groups), expected, "strided features")


# --------------------------------------------------------------------- empty


@pytest.mark.parametrize("kind", ["regular", "subm", "transposed"])
@pytest.mark.parametrize("ndim", [1, 2, 3, 4])
def test_empty_input(kind, ndim):
    k = do.as_tuple(3, ndim)
    geom = sc.ConvGeometry.create(ndim, k, stride=1 if kind == "subm" else 2, padding=0 if kind == "subm" else 1,
                                  kind=kind)
    shape = (5,) * ndim
    indices = np.zeros((0, 1 + ndim), dtype=np.int32)
    features = np.zeros((0, 4))
    weight = do.random_weight(do.make_rng(ndim), 6, k, 2)
    rb = sc.build_rulebook(indices, shape, 2, geom)
    assert rb.num_output == 0 and rb.num_pairs == 0
    assert rb.output_indices.shape == (0, 1 + ndim)
    out = sc.conv_forward(features, weight, rb, groups=2)
    assert out.shape == (0, 6)
    out_b = sc.conv_forward(features, weight, rb, bias=np.ones(6), groups=2)
    assert out_b.shape == (0, 6)
    gf, gw = sc.conv_backward(np.zeros((0, 6)), features, weight, rb, groups=2)
    assert gf.shape == (0, 4)
    assert gw.shape == weight.shape and not np.any(gw)
    if kind == "regular":
        irb = sc.inverse_rulebook(rb)
        assert irb.num_output == 0 and irb.output_indices.shape == (0, 1 + ndim)
        assert sc.conv_forward(np.zeros((0, 1)), weight[..., :1], irb).shape == (0, 6)


def test_regular_conv_with_no_reachable_output():
    """Inputs whose receptive fields hit no output position give an empty output (stride > extent)."""
    indices = np.array([[0, 1], [0, 4]], dtype=np.int32)  # 1D, shape 6, k=1 s=3 -> reads 0, 3
    geom = sc.ConvGeometry.create(1, 1, stride=3)
    rb = sc.build_rulebook(indices, (6,), 1, geom)
    expected = do.regular_sites(indices, (6,), 1, (1,), (3,), (0,), (1,))
    assert expected.shape == (0, 2)
    do.assert_sites(rb.output_indices, expected)
    out = sc.conv_forward(np.ones((2, 2)), np.ones((3, 1, 2)), rb)
    assert out.shape == (0, 3)


# ---------------------------------------------------------------- tensor level


def _tensor(case, features=None):
    f, indices, _ = case.inputs()
    return sc.SparseTensor(f if features is None else features, indices, case.spatial_shape, case.batch_size)


@pytest.mark.parametrize("case", REGULAR[20:26] + SUBM[20:26] + TRANSPOSED[20:26], ids=str)
def test_sparse_conv_tensor_level(case):
    features, indices, weight = case.inputs()
    x = sc.SparseTensor(features, indices, case.spatial_shape, case.batch_size)
    bias = do.random_features(do.make_rng(case.seed, 9), 1, case.out_channels)[0]
    kwargs = dict(kind=case.kind, groups=case.groups)
    if case.kind != "subm":
        kwargs.update(stride=case.stride, padding=case.padding)
    if case.kind == "transposed":
        kwargs.update(output_padding=case.output_padding)
    y = sc.sparse_conv(x, weight, bias, dilation=case.dilation, **kwargs)
    sites = _expected_sites(case, indices)
    do.assert_sites(y.indices, sites)
    assert y.batch_size == case.batch_size
    assert tuple(y.spatial_shape) == tuple(_geometry(case).output_spatial_shape(case.spatial_shape))
    oracle = do.evaluate(_dense_fn(case, indices, case.spatial_shape, case.kind == "transposed"),
                         features, sites, weight, bias)
    do.assert_close(y.features, oracle.values, "sparse_conv")


def test_indice_key_subm_reuse_and_mismatch():
    case = do.sample_case(77, "subm", 3, grouped=False)
    case = do.ConvCase(**{**case.__dict__, "kernel_size": (3, 3, 3), "dilation": (1, 1, 1)})
    features, indices, _ = case.inputs()
    rng = do.make_rng(77, 1)
    w1 = do.random_weight(rng, 4, (3, 3, 3), case.in_channels)
    w2 = do.random_weight(rng, 2, (3, 3, 3), 4)
    x = sc.SparseTensor(features, indices, case.spatial_shape, case.batch_size)
    y = sc.sparse_conv(x, w1, kind="subm", indice_key="subm1")
    # spconv's indice_dict rule: the output holds the input's entries plus the layer's; the input is unchanged
    assert "subm1" in y.rulebooks and "subm1" not in x.rulebooks
    cached = y.rulebooks.get("subm1")
    z = sc.sparse_conv(y, w2, kind="subm", indice_key="subm1")
    assert z.rulebooks.get("subm1") is cached, "a fitting rulebook is reused, not rebuilt"
    sibling = sc.sparse_conv(x, w1, kind="subm")
    assert "subm1" not in sibling.rulebooks, "a sibling branch does not see the other branch's key"
    do.assert_sites(z.indices, indices)
    pad = do.subm_padding((3, 3, 3), 1, 3)

    def fn(f, a, b):
        h = do.dense_conv(do.densify(f, indices, case.spatial_shape, case.batch_size), a, 1, pad, 1)
        h = do.densify(do.read_sites(h, indices), indices, case.spatial_shape, case.batch_size)
        return do.dense_conv(h, b, 1, pad, 1)

    expected = do.read_sites(fn(do.to_torch(features), do.to_torch(w1), do.to_torch(w2)), indices).numpy()
    do.assert_close(z.features, expected, "two subm layers sharing a rulebook")
    w5 = do.random_weight(rng, 2, (5, 5, 5), 4)
    with pytest.raises(ValueError, match="subm1"):
        sc.sparse_conv(y, w5, kind="subm", indice_key="subm1")


def test_indice_key_inverse_conv_restores_input():
    case = do.ConvCase(seed=78, kind="regular", ndim=3, kernel_size=(3, 3, 3), stride=(2, 2, 2),
                       padding=(1, 1, 1), dilation=(1, 1, 1), output_padding=(0, 0, 0), groups=1,
                       in_channels=3, out_channels=4, batch_size=2, spatial_shape=(7, 6, 5), density=0.3)
    features, indices, weight = case.inputs()
    x = sc.SparseTensor(features, indices, case.spatial_shape, case.batch_size)
    y = sc.sparse_conv(x, weight, kind="regular", stride=2, padding=1, indice_key="down1")
    down_sites = _expected_sites(case, indices)
    do.assert_sites(y.indices, down_sites)
    w_inv = do.random_weight(do.make_rng(78, 2), 5, (3, 3, 3), 4)
    z = sc.sparse_conv(y, w_inv, kind="inverse", indice_key="down1")
    do.assert_sites(z.indices, indices, "inverse conv restores the input rows in order")
    assert tuple(z.spatial_shape) == case.spatial_shape
    coarse = tuple(y.spatial_shape)
    default = do.output_shape("transposed", coarse, 3, 2, 1, 1)
    op = tuple(n - m for n, m in zip(case.spatial_shape, default))
    dense = do.dense_conv_transpose(do.densify(y.features, y.indices, coarse, case.batch_size),
                                    do.to_torch(w_inv), 2, 1, 1, op)
    do.assert_close(z.features, do.read_sites(dense, indices).numpy(), "inverse conv values")


def test_inverse_conv_needs_known_key():
    case = REGULAR[0]
    x = _tensor(case)
    w = do.random_weight(do.make_rng(1), 2, case.kernel_size, case.in_channels)
    with pytest.raises(ValueError, match="nokey"):
        sc.sparse_conv(x, w, kind="inverse", indice_key="nokey")
    with pytest.raises(ValueError, match="indice_key"):
        sc.sparse_conv(x, w, kind="inverse")


def test_inverse_of_a_pool():
    case = do.ConvCase(seed=79, kind="regular", ndim=2, kernel_size=(2, 2), stride=(2, 2), padding=(0, 0),
                       dilation=(1, 1), output_padding=(0, 0), groups=1, in_channels=3, out_channels=3,
                       batch_size=2, spatial_shape=(7, 8), density=0.4)
    features, indices, _ = case.inputs()
    x = sc.SparseTensor(features, indices, case.spatial_shape, case.batch_size)
    y = sc.sparse_max_pool(x, 2, indice_key="pool1")
    w = do.random_weight(do.make_rng(79, 3), 2, (2, 2), 3)
    z = sc.sparse_conv(y, w, kind="inverse", indice_key="pool1")
    do.assert_sites(z.indices, indices)
    coarse = tuple(y.spatial_shape)
    op = tuple(n - m for n, m in zip(case.spatial_shape, do.output_shape("transposed", coarse, 2, 2, 0, 1)))
    dense = do.dense_conv_transpose(do.densify(y.features, y.indices, coarse, 2), do.to_torch(w), 2, 0, 1, op)
    do.assert_close(z.features, do.read_sites(dense, indices).numpy(), "inverse of a pool")


# ------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def rb3d():
    indices = do.random_indices(do.make_rng(3), (4, 4, 4), 2, 0.3)
    return sc.build_rulebook(indices, (4, 4, 4), 2, sc.ConvGeometry.create(3, 3, kind="subm"))


def test_bad_features(rb3d):
    n = rb3d.num_input
    w = np.ones((2, 3, 3, 3, 4))
    with pytest.raises(ValueError, match="features"):
        sc.conv_forward(np.ones((n + 1, 4)), w, rb3d)
    with pytest.raises(ValueError, match="features"):
        sc.conv_forward(np.ones(n), w, rb3d)
    with pytest.raises((TypeError, ValueError), match="features"):
        sc.conv_forward(np.ones((n, 4), dtype=np.int32), w, rb3d)


def test_bad_weight(rb3d):
    n = rb3d.num_input
    f = np.ones((n, 4))
    with pytest.raises(ValueError, match="weight"):
        sc.conv_forward(f, np.ones((2, 3, 3, 4)), rb3d)  # 2 kernel axes for a 3D rulebook
    with pytest.raises(ValueError, match="weight"):
        sc.conv_forward(f, np.ones((2, 3, 3, 5, 4)), rb3d)  # kernel (3, 3, 5) vs (3, 3, 3)
    with pytest.raises(ValueError, match="(?i)channel|weight"):
        sc.conv_forward(f, np.ones((2, 3, 3, 3, 3)), rb3d)  # 3 input channels, features have 4
    with pytest.raises(ValueError, match="bias"):
        sc.conv_forward(f, np.ones((2, 3, 3, 3, 4)), rb3d, bias=np.ones(3))


def test_bad_groups(rb3d):
    n = rb3d.num_input
    with pytest.raises(ValueError, match="groups"):
        sc.conv_forward(np.ones((n, 4)), np.ones((3, 3, 3, 3, 2)), rb3d, groups=2)  # 3 out % 2
    with pytest.raises(ValueError, match="groups"):
        sc.conv_forward(np.ones((n, 3)), np.ones((4, 3, 3, 3, 1)), rb3d, groups=2)  # 3 in % 2
    with pytest.raises(ValueError, match="groups"):
        sc.conv_forward(np.ones((n, 4)), np.ones((4, 3, 3, 3, 4)), rb3d, groups=0)


def test_bad_grad_output(rb3d):
    n = rb3d.num_input
    f, w = np.ones((n, 4)), np.ones((2, 3, 3, 3, 4))
    with pytest.raises(ValueError, match="grad_output"):
        sc.conv_backward(np.ones((n, 3)), f, w, rb3d)
    with pytest.raises(ValueError, match="grad_output"):
        sc.conv_backward(np.ones((n + 2, 2)), f, w, rb3d)


@pytest.mark.parametrize("ndim", [2, 3])
def test_torch_layout_weight_is_a_layout_error_not_a_kernel_size_error(ndim):
    """A torch Conv weight [out, in, *k] in a submanifold conv: the layout is named, with the fix."""
    shape = (5, 6, 4)[:ndim]
    rng = do.make_rng(97000, ndim)
    indices = do.random_indices(rng, shape, 2, 0.3)
    x = sc.SparseTensor(do.random_features(rng, indices.shape[0], 4), indices, shape, 2)
    torch_weight = torch.tensor(rng.standard_normal((6, 4) + (3,) * ndim))  # torch.nn.Conv{ndim}d(4, 6, 3)
    with pytest.raises(ValueError) as caught:
        sc.sparse_conv(x, torch_weight, kind="subm")
    message = str(caught.value)
    assert "odd" not in message
    assert message.startswith("weight must be laid out [out_channels, *kernel_size, in_channels // groups]")
    assert f"got shape {(6, 4) + (3,) * ndim}" in message and f"torch's Conv{ndim}d layout" in message
    permutation = "weight.permute(0, 2, 3, 4, 1)" if ndim == 3 else "weight.permute(0, 2, 3, 1)"
    assert permutation in message
    moved = torch_weight.permute(0, *range(2, ndim + 2), 1)
    padding = do.subm_padding((3,) * ndim, 1, ndim)
    out = sc.sparse_conv(x, moved, kind="subm")
    dense = torch.nn.functional.conv2d if ndim == 2 else torch.nn.functional.conv3d
    expected = do.read_sites(dense(do.densify(x.features, indices, shape, 2), torch_weight, padding=padding), indices)
    do.assert_close(np.asarray(out.features), expected.numpy(), "after the permutation")
    rulebook = sc.build_rulebook(indices, shape, 2, sc.ConvGeometry.create(ndim, 3, kind="subm"))
    with pytest.raises(ValueError, match=r"torch's Conv.d layout.*permute"):
        sc.conv_forward(x.features, torch_weight, rulebook)
    with pytest.raises(ValueError, match=r"looks like \[in_channels, \*kernel_size, out_channels\]"):
        sc.conv_forward(x.features, np.ascontiguousarray(np.moveaxis(moved.numpy(), [0, -1], [-1, 0])), rulebook)


def test_int64_indices_are_converted_once_when_they_fit_int32():
    """The rule sparsecore.torch shares: any integer dtype whose values fit int32, converted once."""
    case = SUBM[4]
    features, indices, weight = case.inputs()
    expected = do.evaluate(_dense_fn(case, indices, case.spatial_shape), features, indices, weight).values
    for wide in (indices.astype(np.int64), torch.from_numpy(indices.astype(np.int64))):
        x = sc.SparseTensor(features, wide, case.spatial_shape, case.batch_size)
        assert type(x.indices) is type(wide) and str(x.indices.dtype).endswith("int32")
        assert x.core_indices.dtype == np.int32
        np.testing.assert_array_equal(np.asarray(x.indices), indices)
        y = sc.sparse_conv(x, weight, kind="subm", dilation=case.dilation, groups=case.groups)
        do.assert_close(np.asarray(y.features), expected, "int64 indices")
    too_wide = indices.astype(np.int64)
    too_wide[0, 1] = 2**40
    with pytest.raises(ValueError, match=r"indices has values outside the int32 range .*seen 0 to 1099511627776"):
        sc.SparseTensor(features, too_wide, case.spatial_shape, case.batch_size)


def test_row_count_message_reads_one_per_active_site(rb3d):
    n = rb3d.num_input
    with pytest.raises(ValueError) as caught:
        sc.conv_forward(np.ones((n + 1, 4)), np.ones((2, 3, 3, 3, 4)), rb3d)
    message = str(caught.value)
    assert f"features has {n + 1} rows but {n} are expected: one per active site (" in message
    assert "active sites;" not in message
    with pytest.raises(ValueError, match="one per active site \\(features and indices must have one row per site\\)"):
        two_sites = np.zeros((2, 4), dtype=np.int32) + np.arange(2, dtype=np.int32)[:, None]
        sc.SparseTensor(np.ones((3, 2)), two_sites, (4, 4, 4), 2)


def test_sparse_conv_channel_mismatch():
    x = _tensor(REGULAR[1])
    c = x.num_channels
    with pytest.raises(ValueError, match="(?i)channel|weight"):
        sc.sparse_conv(x, np.ones((2,) + REGULAR[1].kernel_size + (c + 1,)), kind="regular")


def test_inverse_conv_kernel_mismatch_raises():
    case = REGULAR[5]
    x = _tensor(case)
    w = do.random_weight(do.make_rng(2), 2, case.kernel_size, case.in_channels)
    y = sc.sparse_conv(x, w, kind="regular", stride=case.stride, padding=case.padding, dilation=case.dilation,
                       indice_key="down2")
    bigger = tuple(k + 1 for k in case.kernel_size)
    with pytest.raises(ValueError, match="down2"):
        sc.sparse_conv(y, do.random_weight(do.make_rng(3), 2, bigger, 2), kind="inverse", indice_key="down2")


def test_subm_key_holding_a_strided_rulebook_raises():
    case = do.ConvCase(seed=80, kind="regular", ndim=2, kernel_size=(3, 3), stride=(1, 1), padding=(1, 1),
                       dilation=(1, 1), output_padding=(0, 0), groups=1, in_channels=2, out_channels=2,
                       batch_size=1, spatial_shape=(6, 6), density=0.3)
    x = _tensor(case)
    w = do.random_weight(do.make_rng(4), 2, (3, 3), 2)
    y = sc.sparse_conv(x, w, kind="regular", stride=1, padding=1, indice_key="shared")
    with pytest.raises(ValueError, match="shared"):  # the key travels with the output (spconv's rule)
        sc.sparse_conv(y, w, kind="subm", indice_key="shared")


@pytest.mark.parametrize("kind", ["regular", "subm", "transposed"])
def test_large_grid_values_against_naive(kind):
    """A LiDAR-sized grid (41 x 1600 x 1408) with sites at the borders, against the naive pairs."""
    shape, batch_size = (41, 1600, 1408), 2
    rng = do.make_rng(81, len(kind))
    rows = {(int(rng.integers(batch_size)), *[int(rng.choice([0, 1, n - 2, n - 1, int(rng.integers(n))]))
                                              for n in shape]) for _ in range(120)}
    indices = np.array(sorted(rows), dtype=np.int32)[rng.permutation(len(rows))]
    k, s, p, op = (3, 1, 0, 0) if kind == "subm" else (3, 2, 1, 1 if kind == "transposed" else 0)
    geom = (sc.ConvGeometry.create(3, k, kind="subm") if kind == "subm"
            else sc.ConvGeometry.create(3, k, s, p, 1, op, kind=kind))
    features = do.random_features(rng, indices.shape[0], 3)
    weight = do.random_weight(rng, 4, (k,) * 3, 3)
    rb = sc.build_rulebook(indices, shape, batch_size, geom)
    naive = do.naive_rulebook(indices, shape, batch_size, kind, k, s, p, 1, op)
    do.assert_sites(rb.output_indices, naive.output_indices)
    grad_out = do.random_features(rng, naive.output_indices.shape[0], 4)
    oracle = do.evaluate_sparse(lambda f, w: do.naive_conv(f, w, naive), features, weight, grad_out)
    do.assert_close(sc.conv_forward(features, weight, rb), oracle.values, "large-grid forward")
    gf, gw = sc.conv_backward(grad_out, features, weight, rb)
    do.assert_close(gf, oracle.grad_features, "large-grid grad_features")
    do.assert_close(gw, oracle.grad_weight, "large-grid grad_weight")


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_empty_tensor_level(ndim):
    x = sc.SparseTensor(np.zeros((0, 2)), np.zeros((0, 1 + ndim), np.int32), (6,) * ndim, 2)
    k = (3,) * ndim
    w = np.ones((4, *k, 2))
    y = sc.sparse_conv(x, w, kind="regular", stride=2, padding=1, indice_key="e")
    assert y.num_active == 0 and y.features.shape == (0, 4) and tuple(y.spatial_shape) == (3,) * ndim
    s = sc.sparse_conv(x, w, np.ones(4), kind="subm")
    assert s.features.shape == (0, 4) and s.indices.shape == (0, 1 + ndim)
    t = sc.sparse_conv(x, w, kind="transposed", stride=2)
    assert t.features.shape == (0, 4) and tuple(t.spatial_shape) == (13,) * ndim
    z = sc.sparse_conv(y, np.ones((2, *k, 4)), kind="inverse", indice_key="e")
    assert z.features.shape == (0, 2) and tuple(z.spatial_shape) == (6,) * ndim
    for pool in (sc.sparse_max_pool, sc.sparse_avg_pool):
        p = pool(x, 2)
        assert p.features.shape == (0, 2) and tuple(p.spatial_shape) == (3,) * ndim
    assert sc.global_max_pool(x).shape == (2, 2) and not np.any(sc.global_max_pool(x))
    assert sc.global_avg_pool(x).shape == (2, 2) and not np.any(sc.global_avg_pool(x))
    assert sc.sparse_add(x, x).num_active == 0


def test_torch_backed_sparse_tensor_and_inputs_untouched():
    """A SparseTensor made from torch tensors computes the same values; one requiring grad is refused."""
    case = SUBM[2]
    features, indices, weight = case.inputs()
    f_copy, w_copy, i_copy = features.copy(), weight.copy(), indices.copy()
    with pytest.raises(TypeError, match="features is a torch tensor that requires grad.*sparsecore.torch"):
        sc.SparseTensor(torch.tensor(features, requires_grad=True), torch.from_numpy(indices),
                        case.spatial_shape, case.batch_size)
    x = sc.SparseTensor(torch.tensor(features), torch.from_numpy(indices), case.spatial_shape, case.batch_size)
    y = sc.sparse_conv(x, torch.from_numpy(weight), kind="subm", dilation=case.dilation, groups=case.groups)
    expected = do.evaluate(_dense_fn(case, indices, case.spatial_shape), features, indices, weight).values
    do.assert_close(np.asarray(y.features), expected, "torch-backed SparseTensor")
    np.testing.assert_array_equal(features, f_copy)
    np.testing.assert_array_equal(weight, w_copy)
    np.testing.assert_array_equal(indices, i_copy)


def test_bad_weight_dtype(rb3d):
    n = rb3d.num_input
    with pytest.raises((TypeError, ValueError), match="weight"):
        sc.conv_forward(np.ones((n, 4)), np.ones((2, 3, 3, 3, 4), dtype=np.int64), rb3d)


def test_rulebook_key_overflow_raises():
    geom = sc.ConvGeometry.create(3, 3, stride=2, padding=1)
    with pytest.raises(ValueError, match="(?i)int64|overflow|pack"):
        sc.build_rulebook(np.zeros((1, 4), np.int32), (2 ** 22, 2 ** 22, 2 ** 22), 2, geom)
