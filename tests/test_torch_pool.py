"""sparsecore.torch pooling layers against dense torch pooling in float64.

Max pooling is over the *active* inputs of each window: the oracle is torch
``max_pool`` of the densified input with ``-inf`` at inactive sites (features
have both signs). Average pooling divides by the number of active inputs: the
oracle is the dense windowed sum over the windowed occupancy count. Forward
values and feature gradients (torch autograd through the dense ops) are
compared at the output sites, which must be the dense positions with an
active input in their window. Global pools go against per-batch torch
reductions, 4D pools against the brute-force pairs of ``dense_oracle``.
"""

from __future__ import annotations


import numpy as np
import pytest

torch = pytest.importorskip("torch")
spconv = pytest.importorskip("sparsecore.torch")

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

REGULAR = do.sample_cases("regular", 16, base_seed=71000, grouped=False)
SUBM = do.sample_cases("subm", 6, base_seed=72000, grouped=False)
CASES_4D = (do.sample_cases("regular", 3, ndims=(4,), base_seed=73000, grouped=False, max_kernel=3, max_dilation=2)
            + do.sample_cases("subm", 1, ndims=(4,), base_seed=73100, grouped=False, max_kernel=3, max_dilation=2))


def _pool(cls, case):
    return cls(case.ndim, case.kernel_size, case.stride, case.padding, case.dilation, subm=case.kind == "subm")


def _tensor(features, indices, case):
    f = torch.tensor(features, dtype=torch.float64, requires_grad=True)
    return spconv.SparseConvTensor(f, torch.from_numpy(indices), list(case.spatial_shape), case.batch_size)


def _check(cls, fn_factory, case):
    features, indices, _ = case.inputs()
    sites = do.pool_sites(case, indices)
    grad_out = do.random_features(do.make_rng(case.seed, 17), sites.shape[0], case.in_channels)
    oracle = do.evaluate(fn_factory(case, indices), features, sites, grad_output=grad_out)
    x = _tensor(features, indices, case)
    out = _pool(cls, case)(x)
    do.assert_sites(out.indices.numpy(), sites)
    assert tuple(out.spatial_shape) == do.output_shape(case.kind, case.spatial_shape, case.kernel_size,
                                                       case.stride, case.padding, case.dilation)
    do.assert_close(out.features.detach().numpy(), oracle.values, "pooled features")
    (out.features * torch.from_numpy(grad_out)).sum().backward()
    do.assert_close(x.features.grad.numpy(), oracle.grad_features, "grad features")


@pytest.mark.parametrize("case", REGULAR + SUBM, ids=str)
def test_max_pool_layer(case):
    _check(spconv.SparseMaxPool, do.max_pool_oracle, case)


@pytest.mark.parametrize("case", REGULAR + SUBM, ids=str)
def test_avg_pool_layer(case):
    _check(spconv.SparseAvgPool, do.avg_pool_oracle, case)


@pytest.mark.parametrize("case", CASES_4D, ids=str)
@pytest.mark.parametrize("pool", ["max", "avg"])
def test_4d_pool_against_naive_loops(case, pool):
    features, indices, _ = case.inputs()
    naive = do.naive_rulebook(indices, case.spatial_shape, case.batch_size, case.kind, case.kernel_size,
                              case.stride, case.padding, case.dilation)
    reference = do.naive_max_pool if pool == "max" else do.naive_avg_pool
    grad_out = do.random_features(do.make_rng(case.seed, 3), naive.output_indices.shape[0], case.in_channels)
    oracle = do.evaluate_sparse(lambda f: reference(f, naive), features, grad_output=grad_out)
    x = _tensor(features, indices, case)
    out = _pool(spconv.SparseMaxPool if pool == "max" else spconv.SparseAvgPool, case)(x)
    do.assert_sites(out.indices.numpy(), naive.output_indices)
    do.assert_close(out.features.detach().numpy(), oracle.values, "4D pool")
    (out.features * torch.from_numpy(grad_out)).sum().backward()
    do.assert_close(x.features.grad.numpy(), oracle.grad_features, "4D pool grad")


@pytest.mark.parametrize("ndim", [1, 2, 3, 4])
def test_public_pool_classes_default_stride_is_kernel_size(ndim):
    shape = (6,) * ndim if ndim < 4 else (4, 4, 4, 4)
    rng = do.make_rng(74000, ndim)
    indices = do.random_indices(rng, shape, 2, 0.4)
    features = do.random_features(rng, indices.shape[0], 2)
    for name in ("SparseMaxPool", "SparseAvgPool"):
        layer = getattr(spconv, f"{name}{ndim}d")(2)
        assert layer.stride == [2] * ndim
        out = layer(spconv.SparseConvTensor(torch.tensor(features), torch.from_numpy(indices), list(shape), 2))
        expected = do.regular_sites(indices, shape, 2, 2, 2, 0, 1) if ndim < 4 else do.naive_rulebook(
            indices, shape, 2, "regular", 2, 2).output_indices
        do.assert_sites(out.indices.numpy(), expected)
        assert list(out.spatial_shape) == [s // 2 for s in shape]


def _global_input(seed, empty=()):
    rng = do.make_rng(75000, seed)
    indices = do.random_indices(rng, (5, 6, 4), 3, 0.3, empty_batches=empty)
    features = do.random_features(rng, indices.shape[0], 4)
    return rng, indices, features


@pytest.mark.parametrize("empty", [(), (1,)])
def test_global_pools(empty):
    rng, indices, features = _global_input(len(empty), empty)
    f = torch.tensor(features, requires_grad=True)
    x = spconv.SparseConvTensor(f, torch.from_numpy(indices), [5, 6, 4], 3)
    grad_out = torch.from_numpy(do.random_features(rng, 3, 4))
    for layer, reduce in ((spconv.SparseGlobalMaxPool(), "max"), (spconv.SparseGlobalAvgPool(), "mean")):
        ref_f = torch.tensor(features, requires_grad=True)
        rows = []
        for b in range(3):
            mine = ref_f[torch.from_numpy(indices[:, 0] == b)]
            if mine.shape[0] == 0:
                rows.append(torch.zeros(4, dtype=torch.float64))
            else:
                rows.append(mine.amax(0) if reduce == "max" else mine.mean(0))
        ref = torch.stack(rows)
        out = layer(x)
        assert out.shape == (3, 4), "a dense [B, C] tensor, every channel"
        do.assert_close(out.detach().numpy(), ref.detach().numpy(), f"global {reduce}")
        f.grad = None
        (out * grad_out).sum().backward()
        (ref * grad_out).sum().backward()
        do.assert_close(f.grad.numpy(), ref_f.grad.numpy(), f"global {reduce} grad")


@pytest.mark.parametrize("ndim", [1, 3, 4])
def test_pool_empty_input(ndim):
    shape = [4] * ndim
    features = torch.zeros((0, 3), dtype=torch.float64, requires_grad=True)
    x = spconv.SparseConvTensor(features, torch.zeros((0, ndim + 1), dtype=torch.int32), shape, 2)
    for cls in (spconv.SparseMaxPool, spconv.SparseAvgPool):
        out = cls(ndim, 2, 2, indice_key="p")(x)
        assert out.features.shape == (0, 3) and list(out.spatial_shape) == [2] * ndim
        out.features.sum().backward()
    for layer in (spconv.SparseGlobalMaxPool(), spconv.SparseGlobalAvgPool()):
        out = layer(x)
        assert torch.equal(out, torch.zeros((2, 3), dtype=torch.float64))


def test_pool_indice_key_rules():
    rng, indices, features = _global_input(5)
    x = spconv.SparseConvTensor(torch.tensor(features), torch.from_numpy(indices), [5, 6, 4], 3)
    y = spconv.SparseMaxPool3d(2, indice_key="p")(x)
    assert "p" in y.indice_dict and not y.find_indice_pair("p").is_subm
    with pytest.raises(ValueError, match="indice_key 'p' already exists"):
        spconv.SparseAvgPool3d(2, indice_key="p")(y)


def test_record_voxel_count_on_pool():
    rng, indices, features = _global_input(6)
    x = spconv.SparseConvTensor(torch.tensor(features), torch.from_numpy(indices), [5, 6, 4], 3)
    pool = spconv.SparseMaxPool3d(2, record_voxel_count=True)
    assert list(pool.state_dict()) == ["max_num_voxels_during_training"]
    y = pool(x)
    assert int(pool.get_max_num_voxels()) == y.indices.shape[0]
    assert np.isfinite(y.features.numpy()).all()
