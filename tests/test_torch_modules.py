"""Containers and utilities: SparseSequential, ToDense, RemoveGrid, Sparse{BatchNorm,ReLU,Identity},
tables, HashTable, PointToVoxel, gather_features_by_pc_voxel_id, benchmark records, ConvAlgo.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest

torch = pytest.importorskip("torch")
spconv = pytest.importorskip("sparsecore.torch")
from torch import nn  # noqa: E402

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

SHAPE = [5, 6, 4]


def _tensor(seed=0, channels=3, batch=2):
    rng = do.make_rng(93000, seed)
    indices = do.random_indices(rng, SHAPE, batch, 0.3)
    features = torch.tensor(do.random_features(rng, indices.shape[0], channels))
    return spconv.SparseConvTensor(features, torch.from_numpy(indices), SHAPE, batch)


def _dense_numpy(x):
    """``[B, C, *spatial]``: ``x``'s features written at its sites into zeros, with NumPy (the oracle of .dense())."""
    features, indices = x.features.detach().numpy(), x.indices.numpy()
    dense = np.zeros((x.batch_size, *x.spatial_shape, features.shape[1]), dtype=features.dtype)
    dense[tuple(indices.T)] = features
    return np.moveaxis(dense, -1, 1)


def test_sparse_sequential_applies_plain_modules_to_features():
    x = _tensor()
    conv = spconv.SubMConv3d(3, 4, 3).double()
    bn = nn.BatchNorm1d(4).double()
    model = spconv.SparseSequential(conv, bn, nn.ReLU())
    out = model(x)
    expected = torch.relu(nn.functional.batch_norm(conv(x).features, None, None, bn.weight, bn.bias, True))
    assert torch.allclose(out.features, expected)
    assert len(model) == 3 and model[0] is conv and model[-1].__class__ is nn.ReLU
    with pytest.raises(IndexError):
        model[3]


def test_sparse_sequential_names_and_state_dict():
    model = spconv.SparseSequential(OrderedDict([("conv", spconv.SubMConv3d(3, 4, 3)),
                                                 ("bn", nn.BatchNorm1d(4))]), relu=nn.ReLU())
    assert list(dict(model.named_children())) == ["conv", "bn", "relu"]
    model.add(spconv.ToDense())
    assert list(dict(model.named_children()))[-1] == "3"
    assert list(model.state_dict())[:2] == ["conv.weight", "conv.bias"]
    with pytest.raises(ValueError, match="exists"):
        spconv.SparseSequential(OrderedDict([("a", nn.ReLU())]), a=nn.ReLU())


def test_sparse_sequential_skips_plain_modules_when_empty():
    x = spconv.SparseConvTensor(torch.zeros((0, 4), dtype=torch.float64), torch.zeros((0, 4), dtype=torch.int32),
                                SHAPE, 2)
    model = spconv.SparseSequential(nn.BatchNorm1d(4).double(), nn.ReLU())
    model.train()
    out = model(x)  # BatchNorm1d on an empty batch would raise; spconv skips it
    assert out.features.shape == (0, 4)


def test_to_dense_remove_grid_and_sparse_wrappers():
    x = _tensor(1)
    dense = spconv.ToDense()(x)
    assert dense.shape == (2, 3, *SHAPE)
    np.testing.assert_array_equal(dense.numpy(), _dense_numpy(x))
    x.grid = torch.zeros(3)
    assert spconv.RemoveGrid()(x).grid is None
    bn = spconv.SparseBatchNorm(3).double()
    assert torch.allclose(bn(x).features, nn.BatchNorm1d(3).double()(x.features))
    assert torch.equal(spconv.SparseReLU()(x).features, torch.relu(x.features))
    assert torch.equal(spconv.SparseIdentity()(x).features, x.features)
    assert spconv.Identity()(x) is x
    model = spconv.SparseSequential(spconv.SparseBatchNorm(3).double(), spconv.SparseReLU())
    assert torch.allclose(model(x).features, torch.relu(nn.BatchNorm1d(3).double()(x.features)))


def test_tables():
    x = _tensor(2)
    branches = spconv.ConcatTable().add(spconv.SubMConv3d(3, 2, 3).double()).add(
        spconv.SubMConv3d(3, 3, 1).double())
    outs = branches(x)
    assert len(outs) == 2
    joined = spconv.JoinTable()(outs)
    assert torch.equal(joined.features, torch.cat([outs[0].features, outs[1].features], 1))
    same = [outs[1], outs[1].replace_feature(outs[1].features * 2)]
    added = spconv.AddTable()(same)
    assert torch.allclose(added.features, outs[1].features * 3)
    with pytest.raises(ValueError, match="AddTable.*channels"):
        spconv.AddTable()(outs)
    other = _tensor(3)
    with pytest.raises(ValueError, match="different indices"):
        spconv.JoinTable()([x, other])
    misaligned = spconv.AddTableMisaligned()([x, other])
    np.testing.assert_allclose(misaligned.dense().numpy(), _dense_numpy(x) + _dense_numpy(other), rtol=1e-14)


def test_conv_algo_is_accepted_and_recorded():
    layer = spconv.SubMConv3d(2, 2, 3, algo=spconv.ConvAlgo.MaskImplicitGemm, fp32_accum=True,
                              large_kernel_fast_algo=True)
    assert layer.algo is spconv.ConvAlgo.MaskImplicitGemm and layer.fp32_accum is True
    assert spconv.ConvAlgo.Native.value == 0 and spconv.ConvAlgo.MaskSplitImplicitGemm.value == 2


def test_benchmark_records():
    rng = do.make_rng(93100)
    indices = do.random_indices(rng, SHAPE, 1, 0.3)
    x = spconv.SparseConvTensor(torch.tensor(do.random_features(rng, indices.shape[0], 2)),
                                torch.from_numpy(indices), SHAPE, 1, benchmark=True)
    model = spconv.SparseSequential(spconv.SubMConv3d(2, 2, 3, name="subm").double(),
                                    spconv.SparseMaxPool3d(2, name="pool"))
    out = model(x)
    record = out.benchmark_record
    assert set(record) == {"subm", "pool"}
    assert record["subm"]["num_points"] == [indices.shape[0]] and len(record["pool"]["time"]) == 1
    assert record["pool"]["num_out_points"] == [out.indices.shape[0]]
    with pytest.raises(ValueError, match="named sparse modules"):
        spconv.SubMConv3d(2, 2, 3).double()(x)
    spconv.assign_name_for_sparse_modules(model)
    assert model[0]._sparse_unique_name == "0"


# --------------------------------------------------------------------------- HashTable


@pytest.mark.parametrize("key_dtype", [torch.int32, torch.int64])
def test_hash_table(key_dtype):
    table = spconv.HashTable(torch.device("cpu"), key_dtype, torch.float32, max_size=32)
    keys = torch.tensor([5, 3, 7, 4, 6, 2, 10, 8], dtype=key_dtype)
    values = torch.tensor([1, 6, 4, 77, 23, 756, 12, 12], dtype=torch.float32)
    table.insert(keys, values)
    queries = torch.tensor([8, 10, 2, 6, 11, 4, 7, 3, 5], dtype=key_dtype)
    found, empty = table.query(queries)
    assert empty.tolist() == [False, False, False, False, True, False, False, False, False]
    assert found[~empty].tolist() == [12, 12, 756, 23, 77, 4, 6, 1]
    table.insert(torch.tensor([3, 9, 9], dtype=key_dtype), torch.tensor([-1, 2, 3], dtype=torch.float32))
    found, empty = table.query(torch.tensor([3, 9], dtype=key_dtype))
    assert found.tolist() == [-1, 3] and not empty.any()
    fail = table.insert_exist_keys(torch.tensor([5, 100], dtype=key_dtype), torch.tensor([50.0, 1.0]))
    assert fail.dtype == torch.uint8 and fail.tolist() == [0, 1]
    k, v, count = table.items()
    assert int(count) == 9 == len(table)
    assert dict(zip(k.tolist(), v.tolist()))[5] == 50.0
    k, v, count = table.items(max_size=16)
    assert k.shape == (16,) and int(count) == 9
    if key_dtype == torch.int32:
        table.insert(torch.tensor([-7], dtype=key_dtype), torch.tensor([1.5]))
        assert table.query(torch.tensor([-7], dtype=key_dtype))[0].tolist() == [1.5]
    with pytest.raises(ValueError, match="assign_arange_ needs integer values"):
        table.assign_arange_()


def test_hash_table_assign_arange_and_errors():
    table = spconv.HashTable(torch.device("cpu"), torch.int64, torch.int64)
    table.insert(torch.tensor([40, 10, 30]))
    count = table.assign_arange_()
    keys, values, _ = table.items()
    assert int(count) == 3 and values.tolist() == [0, 1, 2] and keys.tolist() == [40, 10, 30]
    with pytest.raises(ValueError, match="1-D torch.int64"):
        table.insert(torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="key_dtype"):
        spconv.HashTable(torch.device("cpu"), torch.float32, torch.int64)


# --------------------------------------------------------------------------- voxelization


def _naive_voxels(points, vsize, lower, grid_zyx, max_points, max_voxels):
    coords, ids, members = {}, [], []
    for row, p in enumerate(points):
        cell = tuple(int(np.floor((np.float32(p[a]) - np.float32(lower[a])) / np.float32(vsize[a])))
                     for a in range(3))[::-1]
        if any(c < 0 or c >= g for c, g in zip(cell, grid_zyx)):
            ids.append(-1)
            continue
        if cell not in coords:
            if len(coords) == max_voxels:
                ids.append(-1)
                continue
            coords[cell] = len(coords)
            members.append([])
        ids.append(coords[cell])
        members[coords[cell]].append(row)
    return list(coords), ids, members


def test_point_to_voxel_matches_a_naive_loop():
    rng = np.random.default_rng(93200)
    points = (rng.random((300, 4)) * np.array([2.2, 3.4, 1.8, 1.0]) - np.array([0.1, 0.1, 0.1, 0])).astype(np.float32)
    gen = spconv.utils.PointToVoxel([0.2, 0.4, 0.3], [0, 0, 0, 2.0, 3.2, 1.5], 4, 40, 3)
    assert gen.grid_size == [5, 8, 10] and gen.ndim == 3
    assert gen.vsize == pytest.approx([0.3, 0.4, 0.2]) and gen.grid_stride == [80, 10, 1]
    voxels, coords, counts, ids = gen.generate_voxel_with_id(torch.from_numpy(points))
    cells, naive_ids, members = _naive_voxels(points, [0.2, 0.4, 0.3], [0, 0, 0], [5, 8, 10], 3, 40)
    assert coords.dtype == torch.int32 and counts.dtype == torch.int32 and ids.dtype == torch.int64
    assert coords.tolist() == [list(c) for c in cells]
    assert ids.tolist() == naive_ids
    assert counts.tolist() == [min(len(m), 3) for m in members]
    for v, m in enumerate(members):
        stored = points[m[:3]]
        assert np.array_equal(voxels[v, :len(stored)].numpy(), stored)
        assert not voxels[v, len(stored):].any()
    three = gen(torch.from_numpy(points))
    assert len(three) == 3 and torch.equal(three[1], coords)
    with pytest.raises(ValueError, match=r"\[num_points, 4\]"):
        gen(torch.from_numpy(points[:, :3]))


def test_gather_features_by_pc_voxel_id():
    features = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(93300),
                           requires_grad=True)
    ids = torch.tensor([2, -1, 0, 2, 3, -1])
    out = spconv.utils.gather_features_by_pc_voxel_id(features, ids, invalid_value=-5)
    expected = torch.stack([features[2], torch.full((3,), -5.0, dtype=torch.float64), features[0], features[2],
                            features[3], torch.full((3,), -5.0, dtype=torch.float64)])
    assert torch.equal(out, expected)
    out.sum().backward()
    assert features.grad.tolist() == [[1.0] * 3, [0.0] * 3, [2.0] * 3, [1.0] * 3]
    with pytest.raises(ValueError, match=r"must lie in \[-1, 4\)"):
        spconv.utils.gather_features_by_pc_voxel_id(features, torch.tensor([4]))
