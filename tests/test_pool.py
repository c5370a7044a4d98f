"""Oracle tests of sparse max and average pooling against dense PyTorch pooling.

Max pooling is the max over the ACTIVE inputs of each window: the oracle is
torch ``max_pool`` of a dense input whose inactive sites hold ``-inf`` (the
features have both signs, so a zero fill would be wrong). Average pooling is
the mean over the active inputs: the windowed sum of the dense input divided
by the windowed count of the occupancy mask. Both forward values and input
gradients (torch autograd through the dense ops) are compared at the output
sites, which are the dense positions with an active input in their window
(or the input sites for ``subm=True``). 4D goes against the naive pairs.
"""

from __future__ import annotations


import numpy as np
import pytest

import sparsecore as sc

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

REGULAR = do.sample_cases("regular", 54, base_seed=6000, grouped=False)
SUBM = do.sample_cases("subm", 30, base_seed=6500, grouped=False)


def _geometry(case):
    if case.kind == "subm":
        return sc.ConvGeometry.create(case.ndim, case.kernel_size, dilation=case.dilation, kind="subm")
    return sc.ConvGeometry.create(case.ndim, case.kernel_size, stride=case.stride, padding=case.padding,
                                  dilation=case.dilation)


def _setup(case):
    features, indices, _ = case.inputs()
    rb = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, _geometry(case))
    sites = do.pool_sites(case, indices)
    do.assert_sites(rb.output_indices, sites)
    grad_out = do.random_features(do.make_rng(case.seed, 17), sites.shape[0], case.in_channels)
    return features, indices, rb, sites, grad_out


@pytest.mark.parametrize("case", REGULAR + SUBM, ids=str)
def test_max_pool(case):
    features, indices, rb, sites, grad_out = _setup(case)
    oracle = do.evaluate(do.max_pool_oracle(case, indices), features, sites, grad_output=grad_out)
    out, argmax = sc.max_pool_forward(features, rb)
    do.assert_close(out, oracle.values, "max_pool_forward")
    assert argmax.shape == out.shape
    assert argmax.dtype == np.int32
    np.testing.assert_array_equal(np.take_along_axis(features, argmax.astype(np.int64), 0), out,
                                  err_msg="argmax names the input row of each max")
    grad = sc.max_pool_backward(grad_out, argmax, rb.num_input)
    do.assert_close(grad, oracle.grad_features, "max_pool_backward")


@pytest.mark.parametrize("case", REGULAR + SUBM, ids=str)
def test_avg_pool(case):
    features, indices, rb, sites, grad_out = _setup(case)
    oracle = do.evaluate(do.avg_pool_oracle(case, indices), features, sites, grad_output=grad_out)
    out = sc.avg_pool_forward(features, rb)
    do.assert_close(out, oracle.values, "avg_pool_forward")
    grad = sc.avg_pool_backward(grad_out, rb)
    do.assert_close(grad, oracle.grad_features, "avg_pool_backward")


@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["float16", "float32"])
@pytest.mark.parametrize("case", REGULAR[:4] + SUBM[:2], ids=str)
def test_pool_low_precision(case, dtype):
    f64, indices, _ = case.inputs()
    features = f64.astype(dtype)
    rb = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, _geometry(case))
    sites = do.pool_sites(case, indices)
    out, _ = sc.max_pool_forward(features, rb)
    assert out.dtype == dtype
    expected = do.evaluate(do.max_pool_oracle(case, indices), features.astype(np.float64), sites).values
    np.testing.assert_array_equal(out.astype(np.float64), expected)  # a max is exact
    avg = sc.avg_pool_forward(features, rb)
    assert avg.dtype == dtype
    expected = do.evaluate(do.avg_pool_oracle(case, indices), features.astype(np.float64), sites).values
    scale = do.evaluate(do.avg_pool_oracle(case, indices), np.abs(features).astype(np.float64), sites).values
    rel = 1.5e-3 if dtype == np.float16 else 5e-6
    assert np.all(np.abs(avg.astype(np.float64) - expected) <= rel * scale + 1e-6)


CASES_4D = (do.sample_cases("regular", 6, ndims=(4,), base_seed=6800, grouped=False, max_kernel=3,
                            max_dilation=2)
            + do.sample_cases("subm", 4, ndims=(4,), base_seed=6900, grouped=False, max_kernel=3,
                              max_dilation=2))


@pytest.mark.parametrize("case", CASES_4D, ids=str)
def test_pool_4d_against_naive_reference(case):
    features, indices, _ = case.inputs()
    rb = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, _geometry(case))
    naive = do.naive_rulebook(indices, case.spatial_shape, case.batch_size, case.kind, case.kernel_size,
                              case.stride, case.padding, case.dilation)
    do.assert_sites(rb.output_indices, naive.output_indices)
    grad_out = do.random_features(case.rng(), naive.output_indices.shape[0], case.in_channels)
    mx = do.evaluate_sparse(lambda f: do.naive_max_pool(f, naive), features, grad_output=grad_out)
    out, argmax = sc.max_pool_forward(features, rb)
    do.assert_close(out, mx.values, "4D max pool")
    do.assert_close(sc.max_pool_backward(grad_out, argmax, rb.num_input), mx.grad_features, "4D max grad")
    av = do.evaluate_sparse(lambda f: do.naive_avg_pool(f, naive), features, grad_output=grad_out)
    do.assert_close(sc.avg_pool_forward(features, rb), av.values, "4D avg pool")
    do.assert_close(sc.avg_pool_backward(grad_out, rb), av.grad_features, "4D avg grad")


@pytest.mark.parametrize("case", REGULAR[:3], ids=str)
def test_naive_pool_reference_matches_dense_torch(case):
    features, indices, _ = case.inputs()
    naive = do.naive_rulebook(indices, case.spatial_shape, case.batch_size, case.kind, case.kernel_size,
                              case.stride, case.padding, case.dilation)
    sites = naive.output_indices
    f = do.to_torch(features)
    do.assert_close(do.naive_max_pool(f, naive).numpy(),
                    do.evaluate(do.max_pool_oracle(case, indices), features, sites).values, "naive max")
    do.assert_close(do.naive_avg_pool(f, naive).numpy(),
                    do.evaluate(do.avg_pool_oracle(case, indices), features, sites).values, "naive avg")


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_pool_empty(ndim):
    geom = sc.ConvGeometry.create(ndim, 2, stride=2)
    rb = sc.build_rulebook(np.zeros((0, 1 + ndim), np.int32), (4,) * ndim, 3, geom)
    features = np.zeros((0, 5))
    out, argmax = sc.max_pool_forward(features, rb)
    assert out.shape == (0, 5) and argmax.shape == (0, 5)
    assert sc.max_pool_backward(np.zeros((0, 5)), argmax, 0).shape == (0, 5)
    assert sc.avg_pool_forward(features, rb).shape == (0, 5)
    assert sc.avg_pool_backward(np.zeros((0, 5)), rb).shape == (0, 5)


# ----------------------------------------------------------------- tensor level


@pytest.mark.parametrize("subm", [False, True])
@pytest.mark.parametrize("case", REGULAR[30:36], ids=str)
def test_tensor_level_pools(case, subm):
    features, indices, _ = case.inputs()
    x = sc.SparseTensor(features, indices, case.spatial_shape, case.batch_size)
    if subm:
        kernel = tuple(k | 1 for k in case.kernel_size)  # odd
        pc = do.ConvCase(**{**case.__dict__, "kind": "subm", "kernel_size": kernel,
                            "stride": (1,) * case.ndim, "padding": (0,) * case.ndim})
        y_max = sc.sparse_max_pool(x, kernel, dilation=case.dilation, subm=True)
        y_avg = sc.sparse_avg_pool(x, kernel, dilation=case.dilation, subm=True)
    else:
        pc = case
        y_max = sc.sparse_max_pool(x, case.kernel_size, case.stride, case.padding, case.dilation)
        y_avg = sc.sparse_avg_pool(x, case.kernel_size, case.stride, case.padding, case.dilation)
    sites = do.pool_sites(pc, indices)
    for y in (y_max, y_avg):
        do.assert_sites(y.indices, sites)
        assert y.batch_size == case.batch_size
    do.assert_close(y_max.features, do.evaluate(do.max_pool_oracle(pc, indices), features, sites).values, "sparse_max_pool")
    do.assert_close(y_avg.features, do.evaluate(do.avg_pool_oracle(pc, indices), features, sites).values, "sparse_avg_pool")


def test_pool_stride_defaults_to_kernel_size():
    case = do.ConvCase(seed=61, kind="regular", ndim=2, kernel_size=(3, 2), stride=(3, 2), padding=(0, 0),
                       dilation=(1, 1), output_padding=(0, 0), groups=1, in_channels=2, out_channels=2,
                       batch_size=2, spatial_shape=(10, 7), density=0.3)
    features, indices, _ = case.inputs()
    x = sc.SparseTensor(features, indices, case.spatial_shape, case.batch_size)
    y = sc.sparse_max_pool(x, (3, 2))
    assert tuple(y.spatial_shape) == (3, 3)
    sites = do.pool_sites(case, indices)
    do.assert_sites(y.indices, sites)
    do.assert_close(y.features, do.evaluate(do.max_pool_oracle(case, indices), features, sites).values, "default stride")


def test_max_pool_backward_bad_argmax():
    with pytest.raises(ValueError, match="argmax"):
        sc.max_pool_backward(np.ones((2, 3)), np.zeros((2, 4), np.int32), 5)
    with pytest.raises(ValueError, match="argmax"):
        sc.max_pool_backward(np.ones((2, 3)), np.full((2, 3), 7, np.int32), 5)  # row 7 of 5
