"""sparsecore.interop: the shared argument checks, their messages, the duplicate-sites rule,
and the entry points that used to truncate, wrap or collide (pack_keys, HashTable.lookup,
PairMap, union_sites, sparse_add, voxelize, to_dense)."""

from __future__ import annotations

import ast
import os

import numpy as np
import pytest

import sparsecore as sc
from sparsecore import interop

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

SHAPE = (5, 6, 7)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sites(seed: int, batch: int = 2, num: int | None = None) -> np.ndarray:
    return do.random_indices(do.make_rng(16000, seed), SHAPE, batch, num=num)


# --------------------------------------------------------------------------- spatial_shape, batch_size


@pytest.mark.parametrize("value", [(1.9, 2, 2), (4.0, 5.0, 6.0), (float("nan"), 2, 2), "456", ("4", 5, 6),
                                   (True, 5, 6), (4, 0, 6), (4, -1, 6), (), (1, 2, 3, 4, 5), None,
                                   [[4, 5], [6, 7]], (2**31 + 1, 2, 2)])
def test_spatial_shape_refuses_what_it_would_truncate(value):
    with pytest.raises(ValueError, match=r"^spatial_shape"):
        interop.as_spatial_shape(value)


@pytest.mark.parametrize("value", [(4, 5, 6), [4, 5, 6], np.array([4, 5, 6], np.int64),
                                   np.array([4, 5, 6], np.uint16), (np.int32(4), 5, 6)])
def test_spatial_shape_accepts_integers_of_any_container(value):
    assert interop.as_spatial_shape(value) == (4, 5, 6)
    assert all(type(size) is int for size in interop.as_spatial_shape(value))


@pytest.mark.parametrize("value", [0, -1, 1.0, True, "2", None])
def test_batch_size_must_be_a_positive_int(value):
    with pytest.raises(ValueError, match=r"^batch_size must be a positive int .* got"):
        interop.as_batch_size(value)


def test_dtype_tables():
    assert interop.FLOAT_DTYPES == (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
    assert (interop.INT32_MIN, interop.INT32_MAX) == (np.iinfo(np.int32).min, np.iinfo(np.int32).max)
    assert interop.INT64_MAX == np.iinfo(np.int64).max


# --------------------------------------------------------------------------- the duplicate-sites rule


def test_check_unique_sites_finds_every_planted_duplicate():
    for seed in range(30):
        rng = do.make_rng(16001, seed)
        indices = _sites(seed)
        interop.check_unique_sites(indices, SHAPE, 2)  # unique: passes
        if indices.shape[0] < 2:
            continue
        first, second = sorted(rng.choice(indices.shape[0], 2, replace=False))
        indices[second] = indices[first]
        with pytest.raises(ValueError, match=rf"indices contains duplicate sites: rows {first} and {second} "):
            interop.check_unique_sites(indices, SHAPE, 2)


def test_check_unique_sites_with_colliding_hash_buckets():
    # keys that are multiples of a large power of two share their low bits
    indices = np.zeros((300, 2), np.int32)
    indices[:, 1] = np.arange(300) * 4096
    interop.check_unique_sites(indices, (300 * 4096,), 1)
    indices[299, 1] = indices[17, 1]
    with pytest.raises(ValueError, match="rows 17 and 299"):
        interop.check_unique_sites(indices, (300 * 4096,), 1)


def test_core_tensor_refuses_duplicates_where_it_is_made():
    indices = _sites(3)
    indices[-1] = indices[0]
    with pytest.raises(ValueError, match="duplicate sites: rows 0 and"):
        sc.SparseTensor(np.ones((indices.shape[0], 2)), indices, SHAPE, 2)


def test_unpickled_core_tensors_are_checked_again():
    import pickle

    indices = _sites(9)
    features = do.random_features(do.make_rng(16005), indices.shape[0], 2)
    x = sc.SparseTensor(features, indices, SHAPE, 2)
    copy = pickle.loads(pickle.dumps(x))
    assert np.array_equal(copy.dense(), x.dense()) and copy.spatial_shape == SHAPE
    state = x.__dict__.copy()  # what a crafted pickle could hold
    state["indices"] = np.concatenate([indices[:-1], indices[:1]])
    blank = sc.SparseTensor.__new__(sc.SparseTensor)
    with pytest.raises(ValueError, match="duplicate sites"):
        blank.__setstate__(state)


def test_to_dense_refuses_duplicates():
    indices = _sites(4)
    indices[1] = indices[0]
    with pytest.raises(ValueError, match="duplicate sites: rows 0 and 1"):
        sc.to_dense(np.ones((indices.shape[0], 2)), indices, SHAPE, 2)


def test_union_sites_refuses_a_set_with_a_duplicate():
    first, second = _sites(5), _sites(6)
    second[2] = second[0]
    with pytest.raises(ValueError, match=r"indices_list\[1\] contains duplicate sites: rows 0 and 2"):
        sc.union_sites([first, second], SHAPE, 2)


def test_core_sparse_add_matches_the_dense_sum():
    for seed in range(10):
        rng = do.make_rng(16002, seed)
        a_sites, b_sites = _sites(10 + seed), _sites(40 + seed)
        a_features = do.random_features(rng, a_sites.shape[0], 3)
        b_features = do.random_features(rng, b_sites.shape[0], 3)
        total = sc.sparse_add(sc.SparseTensor(a_features, a_sites, SHAPE, 2),
                              sc.SparseTensor(b_features, b_sites, SHAPE, 2))
        expected = do.densify(a_features, a_sites, SHAPE, 2) + do.densify(b_features, b_sites, SHAPE, 2)
        actual = do.densify(np.asarray(total.features), np.asarray(total.indices), SHAPE, 2)
        assert np.allclose(actual.numpy(), expected.numpy(), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- keys, hash tables, pair maps


def test_pack_keys_refuses_sites_that_would_collide():
    indices = _sites(7)
    keys = sc.pack_keys(indices, SHAPE, 2)
    assert np.array_equal(keys, np.ravel_multi_index(indices.T.astype(np.int64), (2,) + SHAPE))
    for column, value in ((1, SHAPE[0]), (2, -1), (0, 2), (3, SHAPE[2] + 5)):
        bad = indices.copy()
        bad[3, column] = value
        with pytest.raises(ValueError, match=r"indices\[3\] = .* outside .* pack into the key of another site"):
            sc.pack_keys(bad, SHAPE, 2)
    with pytest.raises(TypeError, match="indices must be an integer array"):
        sc.pack_keys(indices.astype(np.float64), SHAPE, 2)


def test_pack_keys_margin_allows_the_padded_grid():
    indices = np.array([[0, -1, 0, 7]], np.int32)
    margin = (1, 0, 1)
    keys = sc.pack_keys(indices, SHAPE, 1, margin=margin)
    padded = tuple(s + 2 * m for s, m in zip(SHAPE, margin))
    assert int(keys[0]) == np.ravel_multi_index((0, 0, 0, 8), (1,) + padded)
    assert np.array_equal(sc.unpack_keys(keys, SHAPE, margin), indices)


def test_hash_table_lookup_refuses_float_queries():
    table = sc.HashTable(np.array([20, 5, 7], np.int64))
    with pytest.raises(TypeError, match="queries must be an integer array, got dtype float64"):
        table.lookup(np.array([20.7]))
    assert table.lookup(np.array([20, 21, -4, 2**62], np.int64)).tolist() == [0, -1, -1, -1]
    assert table.lookup(np.array([7], np.uint8)).tolist() == [2]


def test_pair_map_refuses_negative_and_out_of_range_rows_unless_padded():
    rows = np.array([0, 1, 2], np.int32)
    starts = (0, 3)
    sc.PairMap(rows, rows, starts, 3, 3, (1,))
    with pytest.raises(ValueError, match=r"pair_input holds row -1, outside \[0, 3\).*never wrapped"):
        sc.PairMap(np.array([0, -1, 2], np.int32), rows, starts, 3, 3, (1,))
    with pytest.raises(ValueError, match=r"pair_output holds row 3, outside \[0, 3\)"):
        sc.PairMap(rows, np.array([0, 1, 3], np.int32), starts, 3, 3, (1,))
    with pytest.raises(TypeError, match="pair_input must be a 1-D integer array"):
        sc.PairMap(rows.astype(np.float32), rows, starts, 3, 3, (1,))
    # the kernels' padded convention: -1 = no pair, and only -1
    padded = sc.PairMap(np.array([0, -1, 2], np.int32), rows, starts, 3, 3, (1,), padded=True)
    assert padded.num_pairs == 3
    with pytest.raises(ValueError, match=r"outside \[-1, 3\)"):
        sc.PairMap(np.array([0, -2, 2], np.int32), rows, starts, 3, 3, (1,), padded=True)


def test_conv_forward_with_a_checked_pair_map_matches_the_naive_oracle():
    rng = do.make_rng(16003)
    indices = _sites(8)
    features = do.random_features(rng, indices.shape[0], 3)
    weight = do.random_weight(rng, 2, (3, 3, 3), 3)
    naive = do.naive_rulebook(indices, SHAPE, 2, "subm", 3)
    pairs = sc.PairMap(np.concatenate([i for i, _ in naive.pairs]).astype(np.int32),
                       np.concatenate([o for _, o in naive.pairs]).astype(np.int32),
                       tuple(int(v) for v in np.cumsum([0] + [len(i) for i, _ in naive.pairs])),
                       indices.shape[0], indices.shape[0], (3, 3, 3))
    expected = do.naive_conv(do.to_torch(features), do.to_torch(weight), naive).numpy()
    assert np.allclose(np.asarray(sc.conv_forward(features, weight, pairs)), expected, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- sizes


def test_dense_size_is_computed_before_allocating():
    with pytest.raises(ValueError, match=r"dense grid of batch_size 1 x spatial_shape \(1048576, 1048576, 1048576\)"):
        sc.to_dense(np.ones((1, 2), np.float32), np.zeros((1, 4), np.int32), (2**20,) * 3, 1)
    assert interop.check_dense_size(2, (3, 4), 5, 8) == 2 * 3 * 4 * 5 * 8


def test_voxelize_bounds_max_num_points_per_voxel_by_the_memory_and_names_the_densest_voxel():
    points = do.make_rng(16004).uniform(0, 4, (200, 4)).astype(np.float32)
    with pytest.raises(ValueError, match=r"max_num_points_per_voxel=1000000000 .* expected at most the number "
                                         r"of points \(200\), and here the densest voxel holds \d+"):
        sc.voxelize(points, (1.0, 1.0, 1.0), (0, 0, 0, 4, 4, 4), 10**9, 1000)
    # more slots than points is valid: every point is stored
    voxels = sc.voxelize(points, (1.0, 1.0, 1.0), (0, 0, 0, 4, 4, 4), 500, 1000)
    assert voxels.voxels.shape[1] == 500 and int(np.asarray(voxels.num_points_per_voxel).sum()) == 200


# --------------------------------------------------------------------------- layering


def test_interop_is_public_and_the_torch_frontend_imports_no_private_core_module():
    assert set(interop.__all__) <= set(dir(interop))
    frontend = os.path.join(ROOT, "frontends", "torch")
    private = []
    for folder, _, files in os.walk(frontend):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            tree = ast.parse(open(path, encoding="utf-8").read())
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sparsecore._"):
                    private.append(f"{os.path.relpath(path, ROOT)}: {node.module}")
    assert not private, private
