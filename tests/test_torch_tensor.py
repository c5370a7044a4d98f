"""SparseConvTensor: spconv's validation (plus a coordinate range check), read-only features,
derived tensors and their shared indice_dict, dense / from_dense, select_by_index, +, +=, sparse_add.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")
spconv = pytest.importorskip("sparsecore.torch")

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

SHAPE = [4, 5, 6]


def _data(seed=0, batch=2, channels=3, shape=SHAPE, density=0.3):
    rng = do.make_rng(91000, seed)
    indices = do.random_indices(rng, shape, batch, density)
    features = torch.tensor(do.random_features(rng, indices.shape[0], channels))
    return features, torch.from_numpy(indices)


def _tensor(seed=0, **kwargs):
    features, indices = _data(seed, **kwargs)
    return spconv.SparseConvTensor(features, indices, kwargs.get("shape", SHAPE), kwargs.get("batch", 2))


# --------------------------------------------------------------------------- validation


def test_features_must_be_2d():
    features, indices = _data()
    with pytest.raises(ValueError, match=r"features must be 2-D \[N, C\], got shape \(\d+, 3, 1\)"):
        spconv.SparseConvTensor(features[:, :, None], indices, SHAPE, 2)


def test_int64_indices_are_converted_once_when_they_fit_int32():
    """One rule with the core: any integer dtype whose values fit int32 is converted once."""
    features, indices = _data()
    for dtype in (torch.int64, torch.int16):
        x = spconv.SparseConvTensor(features, indices.to(dtype), SHAPE, 2)
        assert x.indices.dtype == torch.int32 and torch.equal(x.indices, indices)
    same = spconv.SparseConvTensor(features, indices, SHAPE, 2)
    assert same.indices is indices, "int32 indices are kept as they are"
    x.indices = indices.long()  # spconv code assigns indices; the setter applies the same rule
    assert x.indices.dtype == torch.int32 and torch.equal(x.indices, indices)
    wide = indices.long()
    wide[0, 1] = 2**40
    with pytest.raises(ValueError) as caught:
        spconv.SparseConvTensor(features, wide, SHAPE, 2)
    message = str(caught.value)
    assert message.startswith("indices (torch.int64) has values in [0, 1099511627776], outside the int32 range")


def test_non_integer_indices_are_refused_with_the_fix():
    features, indices = _data()
    for bad in (indices.float(), indices.bool()):
        with pytest.raises(TypeError) as caught:
            spconv.SparseConvTensor(features, bad, SHAPE, 2)
        message = str(caught.value)
        assert message.startswith("indices must be an integer tensor (int32 as spconv stores them; int64")
        assert f"got {bad.dtype}" in message and "indices.int()" in message


def test_indices_must_have_ndim_plus_one_columns():
    features, indices = _data()
    with pytest.raises(ValueError, match=r"indices must be \[N, ndim \+ 1\].*3 axes.*got shape \(\d+, 3\)"):
        spconv.SparseConvTensor(features, indices[:, :3].contiguous(), SHAPE, 2)
    with pytest.raises(ValueError, match="indices must be 2-D"):
        spconv.SparseConvTensor(features, indices[:, 0].contiguous(), SHAPE, 2)


def test_batch_size_and_rows():
    features, indices = _data()
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        spconv.SparseConvTensor(features, indices, SHAPE, 0)
    with pytest.raises(ValueError, match="rows but indices has"):
        spconv.SparseConvTensor(features[1:], indices, SHAPE, 2)


def test_coordinates_are_range_checked():
    features, indices = _data()
    bad = indices.clone()
    bad[3, 2] = SHAPE[1]
    with pytest.raises(ValueError, match=r"indices\[3\].*coordinate on spatial axis 1 5, outside \[0, 5\)"):
        spconv.SparseConvTensor(features, bad, SHAPE, 2)
    bad = indices.clone()
    bad[0, 0] = 2
    with pytest.raises(ValueError, match="batch index 2"):
        spconv.SparseConvTensor(features, bad, SHAPE, 2)
    bad = indices.clone()
    bad[1, 3] = -1
    with pytest.raises(ValueError, match="outside"):
        spconv.SparseConvTensor(features, bad, SHAPE, 2)


def test_duplicate_sites_are_rejected_where_the_tensor_is_made():
    features, indices = _data()
    indices[1] = indices[0]
    with pytest.raises(ValueError, match="duplicate sites: rows 0 and 1"):
        spconv.SparseConvTensor(features, indices, SHAPE, 2)


@pytest.mark.parametrize("shape, seen", [([1.9, 2, 2], "1.9"), ([float("nan"), 2, 2], "nan"),
                                         (["4", 5, 6], "'4'"), ("456", "'456'"), ([4, 0, 6], "0"),
                                         ([True, 5, 6], "True")])
def test_spatial_shape_must_be_positive_ints(shape, seen):
    features, indices = _data()
    with pytest.raises(ValueError, match=rf"spatial_shape must be .*positive ints.*{seen}"):
        spconv.SparseConvTensor(features, indices, shape, 2)
    x = _tensor()
    with pytest.raises(ValueError, match=r"spatial_shape must be"):
        x.spatial_shape = shape


def test_spatial_shape_accepts_integer_arrays_and_tensors():
    features, indices = _data()
    for shape in (np.array(SHAPE), torch.tensor(SHAPE), tuple(SHAPE)):
        assert spconv.SparseConvTensor(features, indices, shape, 2).spatial_shape == SHAPE


def test_tensors_on_different_devices():
    features, indices = _data()
    with pytest.raises(ValueError, match="features is on meta but indices is on cpu"):
        spconv.SparseConvTensor(features.to("meta"), indices, SHAPE, 2)


def test_features_are_read_only():
    x = _tensor()
    with pytest.raises(ValueError, match=r"use 'x = x.replace_feature\(your_new_feature\)'"):
        x.features = x.features * 2


# --------------------------------------------------------------------------- derived tensors


def test_replace_feature_and_shadow_copy_share_the_dict():
    x = _tensor()
    y = spconv.SubMConv3d(3, 4, 3, indice_key="s").double()(x)
    z = y.replace_feature(torch.relu(y.features))
    assert z.indice_dict is y.indice_dict and z.indices is y.indices
    assert z.spatial_shape == y.spatial_shape and z.batch_size == y.batch_size
    copy = y.shadow_copy()
    assert copy.indice_dict is y.indice_dict and copy.features is y.features
    assert z.find_indice_pair("s") is y.indice_dict["s"] and z.find_indice_pair(None) is None
    assert z.find_indice_pair("nope") is None
    with pytest.raises(ValueError, match="one row per site"):
        y.replace_feature(y.features[1:])


def test_indice_data_describes_the_layer():
    x = _tensor()
    y = spconv.SparseConv3d(3, 4, (3, 1, 3), (2, 1, 2), (1, 0, 1), indice_key="d").double()(x)
    data = y.find_indice_pair("d")
    assert data.indices is x.indices and data.out_indices is y.indices
    assert data.spatial_shape == SHAPE and data.out_spatial_shape == y.spatial_shape
    assert data.ksize == [3, 1, 3] and data.stride == [2, 1, 2] and data.padding == [1, 0, 1]
    assert data.dilation == [1, 1, 1] and not data.is_subm
    assert int(data.indice_pair_num.sum()) == data.pair_input.shape[0]


def test_spatial_size_ndim_repr():
    x = _tensor()
    assert x.spatial_size == 4 * 5 * 6 and x.ndim == 3
    assert "spatial_shape=[4, 5, 6]" in repr(x)


def test_select_by_index_works():
    x = _tensor()
    y = spconv.SubMConv3d(3, 3, 3, indice_key="s").double()(x)
    mask = y.indices[:, 0] == 1
    picked = y.select_by_index(mask)
    assert torch.equal(picked.indices, y.indices[mask]) and torch.equal(picked.features, y.features[mask])
    assert picked.indice_dict == {} and "s" in y.indice_dict, "the source keeps its rulebooks"
    rows = torch.tensor([2, 0])
    picked = y.select_by_index(rows)
    assert torch.equal(picked.indices, y.indices[rows])
    # a fresh rulebook is built on the selected sites and matches dense
    out = spconv.SubMConv3d(3, 2, 3, indice_key="s").double()(picked)
    assert out.indices.shape == (2, 4)


def test_add_radd_iadd():
    x = _tensor()
    y = x.replace_feature(x.features * 3)
    total = x + y
    assert torch.allclose(total.features, x.features * 4) and total.indices is x.indices
    plus_tensor = x + torch.ones_like(x.features)
    assert torch.allclose(plus_tensor.features, x.features + 1)
    right = torch.ones_like(x.features) + x
    assert isinstance(right, spconv.SparseConvTensor) and torch.allclose(right.features, x.features + 1)
    assert torch.allclose(x.__radd__(y).features, x.features * 4)
    z = x.shadow_copy()
    original = z
    z += y
    assert z is original and torch.allclose(z.features, x.features * 4)
    other = _tensor(seed=1)
    with pytest.raises(ValueError, match="different indices"):
        x + other


def test_add_keeps_autograd():
    x = _tensor()
    features = x.features.clone().requires_grad_()
    x = x.replace_feature(features)
    y = x.shadow_copy()
    y += x
    y.features.sum().backward()
    assert torch.equal(features.grad, torch.full_like(features, 2.0))


# --------------------------------------------------------------------------- dense


def test_dense_layouts_match_scatter():
    features, indices = _data(3)
    x = spconv.SparseConvTensor(features, indices, SHAPE, 2)
    expected = do.densify(features, indices.numpy(), SHAPE, 2)
    assert torch.equal(x.dense(), expected)
    assert torch.equal(x.dense(channels_first=False), expected.movedim(1, -1))
    assert x.dense().is_contiguous()


def test_dense_is_differentiable():
    features, indices = _data(4)
    features.requires_grad_()
    x = spconv.SparseConvTensor(features, indices, SHAPE, 2)
    weights = torch.randn(2, 3, *SHAPE, dtype=torch.float64)
    (x.dense() * weights).sum().backward()
    expected = do.read_sites(weights, indices.numpy())
    assert torch.equal(features.grad, expected)


def test_from_dense_drops_zero_vectors():
    rng = do.make_rng(92000)
    dense = torch.tensor(rng.standard_normal((2, 3, 4, 5, 3)))
    dense[torch.from_numpy(rng.random((2, 3, 4, 5)) < 0.6)] = 0
    dense[0, 1, 1, 1, 0] = 0.0  # one zero channel keeps the site
    x = spconv.SparseConvTensor.from_dense(dense)
    assert x.spatial_shape == [3, 4, 5] and x.batch_size == 2 and x.indices.dtype == torch.int32
    active = (dense != 0).any(-1)
    assert x.indices.shape[0] == int(active.sum())
    assert torch.equal(x.dense(channels_first=False), dense)
    order = x.indices.long()
    keys = ((order[:, 0] * 3 + order[:, 1]) * 4 + order[:, 2]) * 5 + order[:, 3]
    assert torch.all(keys[1:] > keys[:-1]), "sites come sorted"


def test_from_dense_round_trip_through_a_layer():
    x = _tensor(5)
    back = spconv.SparseConvTensor.from_dense(x.dense(channels_first=False))
    layer = spconv.SubMConv3d(3, 2, 3).double()
    assert torch.allclose(layer(back).dense(), layer(x).dense())


# --------------------------------------------------------------------------- sparse_add


def test_sparse_add_union():
    a = _tensor(6)
    b = _tensor(7)
    fa = a.features.clone().requires_grad_()
    fb = b.features.clone().requires_grad_()
    total = spconv.functional.sparse_add(a.replace_feature(fa), b.replace_feature(fb))
    expected = do.densify(a.features, a.indices.numpy(), SHAPE, 2) + do.densify(b.features, b.indices.numpy(),
                                                                                SHAPE, 2)
    assert torch.allclose(total.dense(), expected)
    union = {tuple(r) for r in a.indices.tolist()} | {tuple(r) for r in b.indices.tolist()}
    assert total.indices.shape[0] == len(union)
    total.features.sum().backward()
    assert torch.equal(fa.grad, torch.ones_like(fa)) and torch.equal(fb.grad, torch.ones_like(fb))


def test_sparse_add_subset_keeps_largest_inputs_rows_and_rulebooks():
    a = spconv.SubMConv3d(3, 3, 3, indice_key="s").double()(_tensor(8))
    b = a.select_by_index(torch.arange(0, a.indices.shape[0], 2))
    total = spconv.functional.sparse_add(b, a)
    assert total.indices is a.indices and total.indice_dict is a.indice_dict
    expected = a.features.clone()
    expected[0::2] += b.features
    assert torch.allclose(total.features, expected)
    # the saved rulebook still serves the next subm layer
    spconv.SubMConv3d(3, 3, 3, indice_key="s").double()(total)


def test_sparse_add_validation():
    a = _tensor(9)
    with pytest.raises(ValueError, match="spatial_shape, batch_size and channels"):
        spconv.functional.sparse_add(a, _tensor(9, channels=2))
    with pytest.raises(ValueError, match="at least one"):
        spconv.functional.sparse_add()


def test_assigned_indices_are_checked_again():
    x = _tensor(10)
    y = spconv.SubMConv3d(3, 3, 3).double()(x)
    y.indices = torch.cat([y.indices[:1], y.indices[:-1]])  # a duplicate site, assigned directly
    with pytest.raises(ValueError, match="duplicate sites"):
        spconv.SubMConv3d(3, 3, 3).double()(y)
    z = spconv.SubMConv3d(3, 3, 3).double()(x)
    z.spatial_shape = [4, 5, 3]  # smaller than the sites
    with pytest.raises(ValueError, match="outside"):
        spconv.SparseConv3d(3, 3, 3).double()(z)


# --------------------------------------------------------------------------- the sites rule after assignment


def _with_duplicate(x):
    """``x`` with its last row's site replaced by its first (rows unchanged in count)."""
    x.indices = torch.cat([x.indices[:-1], x.indices[:1]])
    return x


_PATHS = {
    "dense": lambda x: x.dense(),
    "ToDense": lambda x: spconv.ToDense()(x),
    "global max pool": lambda x: spconv.SparseGlobalMaxPool()(x),
    "global avg pool": lambda x: spconv.SparseGlobalAvgPool()(x),
    "JoinTable": lambda x: spconv.JoinTable()([x, x]),
    "AddTable": lambda x: spconv.AddTable()([x, x]),
    "x + x": lambda x: x + x,
    "x + tensor": lambda x: x + x.features,
    "replace_feature": lambda x: x.replace_feature(x.features * 2),
    "BatchNorm in SparseSequential": lambda x: spconv.SparseSequential(torch.nn.BatchNorm1d(3).double())(x),
    "sparse_add": lambda x: spconv.functional.sparse_add(x, x.select_by_index(torch.arange(3))),
    "SubMConv3d": lambda x: spconv.SubMConv3d(3, 3, 3).double()(x),
    "SparseMaxPool3d": lambda x: spconv.SparseMaxPool3d(2)(x),
}


@pytest.mark.parametrize("path", sorted(_PATHS))
def test_duplicate_sites_are_refused_on_every_path(path):
    x = _with_duplicate(_tensor(10))
    with pytest.raises(ValueError, match=r"indices contains duplicate sites: rows 0 and \d+"):
        _PATHS[path](x)


@pytest.mark.parametrize("path", sorted(_PATHS))
def test_reassigned_indices_with_another_row_count_are_refused(path):
    x = _tensor(10)
    x.indices = x.indices[:-2]
    with pytest.raises(ValueError, match=r"rows"):
        _PATHS[path](x)


@pytest.mark.parametrize("path", sorted(_PATHS))
def test_a_smaller_spatial_shape_is_refused_on_every_path(path):
    x = _tensor(10)
    x.spatial_shape = [2, 2, 2]
    with pytest.raises(ValueError, match=r"outside \[0, 2\) \(spatial_shape\[\d\] = 2\)"):
        _PATHS[path](x)


def test_a_valid_reassignment_is_checked_once_and_then_works():
    x = _tensor(12)
    x.indices = torch.flip(x.indices, [0])  # the same sites in another order: valid
    x.batch_size = 3
    assert not x._trusted
    expected = do.densify(x.features, x.indices.numpy(), SHAPE, 3)
    assert torch.equal(x.dense(), expected.to(x.features.dtype)) and x._trusted


def test_unpickled_tensors_are_checked_again():
    x = _tensor(14)
    state = pickle.loads(pickle.dumps(x))
    assert not state._trusted
    assert torch.equal(state.dense(), x.dense()) and state._trusted
    tampered = pickle.loads(pickle.dumps(x))
    tampered._indices = torch.cat([x.indices[:-1], x.indices[:1]])  # as a crafted pickle could hold
    with pytest.raises(ValueError, match="duplicate sites"):
        tampered.dense()


def test_a_tensor_that_ran_through_a_layer_saves_and_loads_under_weights_only():
    import io

    x = _tensor(15)
    layer = spconv.SubMConv3d(x.features.shape[1], 3, 3, indice_key="s").double()
    with torch.no_grad():
        expected = layer(x).features  # caches the core (NumPy) view of x's indices on x
    assert x.core_indices() is not None
    buffer = io.BytesIO()
    torch.save((x,), buffer)
    buffer.seek(0)
    (loaded,) = torch.load(buffer, weights_only=True)  # the view is a cache: not saved
    assert not loaded._trusted and loaded._core_indices is None
    assert torch.equal(loaded.indices, x.indices) and torch.equal(loaded.features, x.features)
    with torch.no_grad():
        assert torch.equal(layer(loaded).features, expected)


def test_batch_size_assignment_is_checked():
    x = _tensor()
    for bad in (0, 1.5, "2", True):
        with pytest.raises(ValueError, match="batch_size must be a positive int"):
            x.batch_size = bad


def test_dense_of_a_huge_grid_names_its_size():
    features = torch.ones(1, 2)
    indices = torch.zeros(1, 4, dtype=torch.int32)
    x = spconv.SparseConvTensor(features, indices, [2**20] * 3, 1)
    with pytest.raises(ValueError, match=r"dense grid of batch_size 1 x spatial_shape \(1048576, 1048576, 1048576\)"):
        x.dense()


def test_sparse_add_of_overlapping_inputs_matches_the_dense_sum_over_many_trials():
    # the former holes of torch.empty_like: inputs whose union is the largest one's sites
    for seed in range(20):
        a = _tensor(100 + seed)
        keep = torch.from_numpy(do.make_rng(92000, seed).random(a.indices.shape[0]) < 0.5)
        b = a.select_by_index(keep).replace_feature(a.features[keep] * 3)
        total = spconv.functional.sparse_add(b, a)
        expected = do.densify(a.features, a.indices.numpy(), SHAPE, 2) + do.densify(
            b.features, b.indices.numpy(), SHAPE, 2)
        assert torch.allclose(total.dense(), expected)


def test_select_by_index_refuses_a_wrong_selection():
    x = _tensor(15)
    rows = x.indices.shape[0]
    with pytest.raises(ValueError, match=rf"bool valid_indices must have one entry per site \({rows}\)"):
        x.select_by_index(torch.ones(rows + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=rf"valid_indices holds row {rows}, outside"):
        x.select_by_index(torch.tensor([0, rows]))
    with pytest.raises(TypeError, match="valid_indices must be a bool mask or an integer tensor"):
        x.select_by_index(torch.tensor([0.0, 1.0]))
    picked = x.select_by_index(torch.tensor([2, -1]))
    expected = do.densify(x.features[[2, rows - 1]], x.indices[[2, rows - 1]].numpy(), SHAPE, 2)
    assert torch.equal(picked.dense(), expected.to(x.features.dtype))
