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
