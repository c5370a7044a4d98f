"""Tests of densification, `sparse_add`, global pools and `SparseTensor` validation.

Expected values come from the oracle's own densification (``torch.index_put``
into a float64 grid) and torch reductions; the library is never compared with
itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import sparsecore as sc

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

_SHAPES = [(9,), (4, 6), (3, 5, 4), (2, 3, 2, 3), (1, 1, 1)]


def _case(seed, shape, batch_size, channels, density=None, dtype=np.float64, empty_batches=()):
    rng = do.make_rng(seed)
    indices = do.random_indices(rng, shape, batch_size, density, empty_batches=empty_batches)
    return do.random_features(rng, indices.shape[0], channels, dtype), indices


def _sort_rows(features, indices):
    order = np.lexsort(np.asarray(indices).T[::-1])
    return np.asarray(features)[order], np.asarray(indices)[order]


@pytest.mark.parametrize("channels_first", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_to_dense(seed, channels_first):
    shape = _SHAPES[seed % len(_SHAPES)]
    batch_size = 1 + seed % 3
    features, indices = _case(seed, shape, batch_size, 3)
    dense = sc.to_dense(features, indices, shape, batch_size, channels_first=channels_first)
    expected = do.densify(features, indices, shape, batch_size).numpy()
    if not channels_first:
        expected = np.moveaxis(expected, 1, -1)
    assert dense.dtype == features.dtype
    np.testing.assert_array_equal(dense, expected)
    x = sc.SparseTensor(features, indices, shape, batch_size)
    np.testing.assert_array_equal(x.dense(channels_first=channels_first), expected)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_to_dense_keeps_dtype(dtype):
    features, indices = _case(3, (4, 5), 2, 2, dtype=dtype)
    dense = sc.to_dense(features, indices, (4, 5), 2)
    assert dense.dtype == dtype
    np.testing.assert_array_equal(dense, do.densify(features.astype(np.float64), indices, (4, 5), 2).numpy())


@pytest.mark.parametrize("channels_first", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_from_dense(seed, channels_first):
    shape = _SHAPES[seed % len(_SHAPES)]
    batch_size = 1 + seed % 3
    features, indices = _case(100 + seed, shape, batch_size, 2)
    features[0, 0] = 0.0  # a site with one zero channel is still a site
    dense = do.densify(features, indices, shape, batch_size).numpy()
    if not channels_first:
        dense = np.moveaxis(dense, 1, -1).copy()
    got_f, got_i = sc.from_dense(dense, channels_first=channels_first)
    assert got_i.dtype == np.int32 and got_i.shape == indices.shape
    exp_f, exp_i = _sort_rows(features, indices)
    got_f, got_i = _sort_rows(got_f, got_i)
    np.testing.assert_array_equal(got_i, exp_i)
    np.testing.assert_array_equal(got_f, exp_f)
    x = sc.SparseTensor.from_dense(dense, channels_first=channels_first)
    assert x.batch_size == batch_size and tuple(x.spatial_shape) == shape
    xf, xi = _sort_rows(x.features, x.indices)
    np.testing.assert_array_equal(xi, exp_i)
    np.testing.assert_array_equal(xf, exp_f)


def test_round_trip_and_empty():
    features, indices = _case(7, (3, 4, 5), 2, 3)
    f2, i2 = sc.from_dense(sc.to_dense(features, indices, (3, 4, 5), 2, channels_first=False))
    np.testing.assert_array_equal(sc.to_dense(f2, i2, (3, 4, 5), 2), sc.to_dense(features, indices, (3, 4, 5), 2))
    empty = sc.to_dense(np.zeros((0, 3)), np.zeros((0, 4), np.int32), (3, 4, 5), 2)
    assert empty.shape == (2, 3, 3, 4, 5) and not np.any(empty)
    fe, ie = sc.from_dense(np.zeros((2, 3, 4, 5, 3)))
    assert fe.shape == (0, 3) and ie.shape == (0, 4)


# --------------------------------------------------------------------- sparse_add


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_sparse_add(seed, count):
    shape = _SHAPES[seed % 4]
    batch_size = 1 + seed % 3
    tensors = []
    for j in range(count):
        f, i = _case(1000 * seed + j, shape, batch_size, 4, density=0.3)
        tensors.append(sc.SparseTensor(f, i, shape, batch_size))
    out = sc.sparse_add(*tensors)
    dense_sum = sum(do.densify(t.features, t.indices, shape, batch_size) for t in tensors)
    union = sum(do.occupancy(t.indices, shape, batch_size) for t in tensors)
    sites = do.sites_of(union)
    # docs/api.md: "output sites sorted" (even for a single input)
    do.assert_sites(out.indices, sites, "sparse_add sites (sorted union)")
    do.assert_close(out.features, do.read_sites(dense_sum, sites).numpy(), "sparse_add values")
    assert tuple(out.spatial_shape) == shape and out.batch_size == batch_size


def test_sparse_add_with_empty():
    f, i = _case(5, (4, 4), 2, 3)
    x = sc.SparseTensor(f, i, (4, 4), 2)
    e = sc.SparseTensor(np.zeros((0, 3)), np.zeros((0, 3), np.int32), (4, 4), 2)
    out = sc.sparse_add(x, e)
    exp_f, exp_i = _sort_rows(f, i)
    do.assert_sites(out.indices, exp_i)
    do.assert_close(out.features, exp_f, "x + empty")
    assert sc.sparse_add(e, e).num_active == 0


def test_sparse_add_identical_indices():
    """Inputs sharing one indices array (a residual connection).

    docs/api.md: the values are the per-site sums, and sites (and their order)
    are kept when every input shares the very same indices array.
    """
    f, i = _case(5, (4, 4), 2, 3)
    x = sc.SparseTensor(f, i, (4, 4), 2)
    exp_f, exp_i = _sort_rows(f, i)
    twice = sc.sparse_add(x, x.replace(features=3 * f))
    got_f, got_i = _sort_rows(twice.features, twice.indices)
    do.assert_sites(got_i, exp_i)
    do.assert_close(got_f, 4 * exp_f, "x + 3x")
    # docs/api.md: inputs sharing one indices array keep their sites and order
    do.assert_sites(twice.indices, i, "sparse_add of identical indices keeps the input order")
    # ...while equal but distinct arrays take the general path: union, sorted
    other = sc.SparseTensor(3 * f, i.copy(), (4, 4), 2)
    do.assert_sites(sc.sparse_add(x, other).indices, exp_i, "sparse_add of equal indices: sorted union")


def test_sparse_add_mismatch():
    f, i = _case(6, (4, 4), 1, 3)
    a = sc.SparseTensor(f, i, (4, 4), 1)
    with pytest.raises(ValueError, match="(?i)spatial_shape|shape"):
        sc.sparse_add(a, sc.SparseTensor(f, i, (4, 5), 1))
    with pytest.raises(ValueError, match="(?i)channel|features"):
        sc.sparse_add(a, sc.SparseTensor(f[:, :2], i, (4, 4), 1))
    with pytest.raises(ValueError, match="(?i)batch"):
        sc.sparse_add(a, sc.SparseTensor(f, i, (4, 4), 2))


# --------------------------------------------------------------------- global pools


def _global_oracle(features, indices, batch_size, reduce):
    feats = do.to_torch(features, True)
    batch = torch.as_tensor(indices[:, 0].astype(np.int64))
    rows = []
    for b in range(batch_size):
        sel = feats[batch == b]
        if sel.shape[0] == 0:
            rows.append(torch.zeros(features.shape[1], dtype=torch.float64))
        else:
            rows.append(sel.max(dim=0).values if reduce == "max" else sel.mean(dim=0))
    out = torch.stack(rows)
    grad_out = do.random_features(do.make_rng(indices.shape[0], 3), batch_size, features.shape[1])
    (out * do.to_torch(grad_out)).sum().backward()
    grad = feats.grad if feats.grad is not None else torch.zeros_like(feats)
    return out.detach().numpy(), grad.numpy(), grad_out


@pytest.mark.parametrize("seed", range(12))
def test_global_pools(seed):
    shape = _SHAPES[seed % 4]
    batch_size = 1 + seed % 3
    empty = (1,) if batch_size == 3 else ()
    features, indices = _case(200 + seed, shape, batch_size, 3, empty_batches=empty)
    exp, exp_grad, g = _global_oracle(features, indices, batch_size, "max")
    out, argmax = sc.global_max_pool_forward(features, indices, batch_size)
    do.assert_close(out, exp, "global max")
    assert argmax.shape == (batch_size, 3) and argmax.dtype == np.int32
    for b in range(batch_size):
        if b in empty:
            assert np.all(argmax[b] == -1)
        else:
            assert np.all(indices[argmax[b], 0] == b)
            np.testing.assert_array_equal(features[argmax[b], np.arange(3)], out[b])
    do.assert_close(sc.global_max_pool_backward(g, argmax, features.shape[0]), exp_grad, "global max grad")

    exp, exp_grad, g = _global_oracle(features, indices, batch_size, "mean")
    do.assert_close(sc.global_avg_pool_forward(features, indices, batch_size), exp, "global avg")
    do.assert_close(sc.global_avg_pool_backward(g, indices, batch_size), exp_grad, "global avg grad")

    x = sc.SparseTensor(features, indices, shape, batch_size)
    do.assert_close(sc.global_max_pool(x), _global_oracle(features, indices, batch_size, "max")[0], "tensor max")
    do.assert_close(sc.global_avg_pool(x), exp, "tensor avg")


def test_global_pools_empty_input():
    features = np.zeros((0, 4))
    indices = np.zeros((0, 3), np.int32)
    out, argmax = sc.global_max_pool_forward(features, indices, 2)
    assert out.shape == (2, 4) and not np.any(out) and np.all(argmax == -1)
    assert sc.global_max_pool_backward(np.ones((2, 4)), argmax, 0).shape == (0, 4)
    avg = sc.global_avg_pool_forward(features, indices, 2)
    assert avg.shape == (2, 4) and not np.any(avg)
    assert sc.global_avg_pool_backward(np.ones((2, 4)), indices, 2).shape == (0, 4)


def test_global_pools_negative_features():
    """All-negative features: the max is negative (no implicit zero from inactive sites)."""
    features, indices = _case(300, (4, 4), 2, 3)
    features = -np.abs(features)
    out, _ = sc.global_max_pool_forward(features, indices, 2)
    do.assert_close(out, _global_oracle(features, indices, 2, "max")[0], "negative max")
    assert np.all(out[np.unique(indices[:, 0])] < 0)


# --------------------------------------------------------------- SparseTensor


def test_sparse_tensor_attributes():
    features, indices = _case(400, (3, 4, 5), 2, 6)
    x = sc.SparseTensor(features, indices.astype(np.int64), [3, 4, 5], 2)
    assert x.indices.dtype == np.int32
    assert x.spatial_shape == (3, 4, 5) and isinstance(x.spatial_shape, tuple)
    assert x.ndim == 3 and x.num_active == indices.shape[0] and x.num_channels == 6 and x.batch_size == 2
    y = x.replace(features=features * 2)
    assert y.rulebooks is x.rulebooks
    np.testing.assert_array_equal(y.indices, x.indices)
    x.rulebooks.put("k", sc.build_rulebook(indices, (3, 4, 5), 2, sc.ConvGeometry.create(3, 3, kind="subm")))
    assert "k" in y.rulebooks and list(y.rulebooks.keys()) == ["k"]
    assert y.rulebooks.get("k") is x.rulebooks.get("k")
    with pytest.raises(Exception):
        x.batch_size = 3  # frozen
    empty = sc.SparseTensor(np.zeros((0, 2)), np.zeros((0, 4), np.int32), (3, 4, 5), 1)
    assert empty.num_active == 0 and empty.dense().shape == (1, 2, 3, 4, 5)


_F = np.ones((2, 3))
_I = np.array([[0, 1, 2], [1, 3, 0]], dtype=np.int32)


@pytest.mark.parametrize(
    "features,indices,shape,batch,match,exc",
    [
        (np.ones(2), _I, (4, 4), 2, "features", ValueError),
        (_F, _I[:, :2], (4, 4), 2, "indices", ValueError),
        (_F, _I[:1], (4, 4), 2, "indices|features|rows", ValueError),
        (_F, np.array([[0, -1, 2], [1, 3, 0]]), (4, 4), 2, "indices", ValueError),
        (_F, np.array([[0, 1, 4], [1, 3, 0]]), (4, 4), 2, "indices|spatial_shape", ValueError),
        (_F, np.array([[0, 1, 2], [1, 4, 0]]), (4, 4), 2, "indices|spatial_shape", ValueError),
        (_F, _I, (4, 4), 1, "(?i)batch", ValueError),
        (_F, _I.astype(np.float32), (4, 4), 2, "indices", (TypeError, ValueError)),
        (_F, _I, (4, 0), 2, "spatial_shape", ValueError),
        (_F, _I, (4, 4), 0, "batch_size", ValueError),
    ],
    ids=["features-1d", "columns", "rows", "negative", "x-range", "y-range", "batch", "float-indices",
         "zero-shape", "zero-batch"],
)
def test_sparse_tensor_validation(features, indices, shape, batch, match, exc):
    with pytest.raises(exc, match=match):
        sc.SparseTensor(features, indices, shape, batch)


def test_to_dense_rejects_duplicate_sites():
    """A dense grid holds one vector per cell: duplicates must raise, not keep one silently."""
    rng = do.make_rng(41)
    indices = np.array([[0, 1, 2], [0, 3, 0], [0, 1, 2]], np.int32)
    features = do.random_features(rng, 3, 2, np.float64)
    with pytest.raises(ValueError, match="rows 0 and 2 are both \\[0, 1, 2\\]"):
        sc.to_dense(features, indices, (4, 4), 1)


# --------------------------------------------------------------------------- refusals (issue 16)

_CHECK_SHAPE = (5, 6, 7)


def _check_sites(seed: int, batch: int = 2) -> np.ndarray:
    return do.random_indices(do.make_rng(16000, seed), _CHECK_SHAPE, batch)


def test_to_dense_refuses_duplicates():
    indices = _check_sites(4)
    indices[1] = indices[0]
    with pytest.raises(ValueError, match="duplicate sites: rows 0 and 1"):
        sc.to_dense(np.ones((indices.shape[0], 2)), indices, _CHECK_SHAPE, 2)


def test_union_sites_refuses_a_set_with_a_duplicate():
    first, second = _check_sites(5), _check_sites(6)
    second[2] = second[0]
    with pytest.raises(ValueError, match=r"indices_list\[1\] contains duplicate sites: rows 0 and 2"):
        sc.union_sites([first, second], _CHECK_SHAPE, 2)


def test_dense_size_is_computed_before_allocating():
    with pytest.raises(ValueError, match=r"dense grid of batch_size 1 x spatial_shape \(1048576, 1048576, 1048576\)"):
        sc.to_dense(np.ones((1, 2), np.float32), np.zeros((1, 4), np.int32), (2**20,) * 3, 1)
    from sparsecore.interop import check_dense_size

    assert check_dense_size(2, (3, 4), 5, 8) == 2 * 3 * 4 * 5 * 8
