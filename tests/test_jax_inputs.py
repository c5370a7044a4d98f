"""Issue 16's sparsecore.jax items: no silent wrong answer, clear errors for bad input.

Oracles: dense sums of the densified inputs (sparse_add), NumPy gathers
(voxels_to_points), the dense float64 convolution (non-finite weights leave the
true rows as the dense oracle says and the padding rows zero).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsecore.jax as sj
from dense_oracle import dense_conv, densify, to_torch

GRID = (6, 6, 6)


def _indices(rng: np.random.Generator, rows: int, batch_size: int = 2) -> np.ndarray:
    flat = rng.choice(batch_size * int(np.prod(GRID)), rows, replace=False)
    per = int(np.prod(GRID))
    rest = flat % per
    return np.stack([flat // per, rest // 36, (rest // 6) % 6, rest % 6], 1).astype(np.int32)


def _dense(x: sj.SparseTensor) -> np.ndarray:
    return np.asarray(x.dense(channels_first=False))


# ----------------------------------------------------------------------------- sparse_add


def test_issue_example_disjoint_sites_give_the_four_site_union() -> None:
    a = sj.SparseTensor.from_arrays(np.ones((2, 1), np.float32), np.array([[0, 0, 0, 0], [0, 0, 0, 1]]), (2, 2, 2), 1)
    b = sj.SparseTensor.from_arrays(np.ones((2, 1), np.float32), np.array([[0, 0, 1, 0], [0, 0, 1, 1]]), (2, 2, 2), 1)
    total = sj.sparse_add(a, b)
    assert int(total.num_active) == 4
    np.testing.assert_array_equal(total.valid_features(), np.ones((4, 1)))
    np.testing.assert_array_equal(_dense(total), _dense(a) + _dense(b))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_union_of_overlapping_site_sets_equals_the_dense_sum(seed: int) -> None:
    rng = np.random.default_rng(seed)
    shared = _indices(rng, 40)
    tensors = []
    for extra in (15, 22, 9):
        more = _indices(rng, 60)
        more = more[~(more[:, None, :] == shared[None]).all(-1).any(1)][:extra]
        indices = np.concatenate([shared[rng.permutation(40)[:30]], more])
        indices = indices[rng.permutation(len(indices))]
        tensors.append(sj.SparseTensor.from_arrays(rng.standard_normal((len(indices), 3)).astype(np.float32),
                                                   indices, GRID, 2))
    total = sj.sparse_add(*tensors)
    np.testing.assert_allclose(_dense(total), sum(_dense(t) for t in tensors), rtol=1e-6, atol=1e-6)
    assert total.sites_name == "union"
    np.testing.assert_array_equal(np.asarray(total.features)[int(total.num_active):], 0)
    # differentiable in the features: d sum(total * g) / d features_i = g at each input's union row
    cotangent = jnp.asarray(rng.standard_normal(total.features.shape).astype(np.float32))

    def loss(features):
        parts = [t.replace(f) for t, f in zip(tensors, features)]
        return jnp.vdot(sj.sparse_add(*parts).features, cotangent)

    grads = jax.grad(loss)([t.features for t in tensors])
    dense_cotangent = np.asarray(total.replace(cotangent).dense(channels_first=False))
    for t, g in zip(tensors, grads):
        idx = t.valid_indices()
        expected = dense_cotangent[idx[:, 0], idx[:, 1], idx[:, 2], idx[:, 3]]
        np.testing.assert_allclose(np.asarray(g)[: len(idx)], expected, rtol=1e-6)


def test_same_sites_add_row_by_row_and_keep_the_plan() -> None:
    rng = np.random.default_rng(3)
    x = sj.SparseTensor.from_arrays(rng.standard_normal((20, 2)).astype(np.float32), _indices(rng, 20), GRID, 2)
    y = x.replace(x.features * 3)
    for total in (sj.sparse_add(x, y), jax.jit(sj.sparse_add)(x, y)):
        assert total.sites_name == "input"
        np.testing.assert_allclose(np.asarray(total.features), np.asarray(x.features) * 4, rtol=1e-6)


def test_different_sites_under_jit_raise_at_run_time() -> None:
    rng = np.random.default_rng(4)
    a = sj.SparseTensor.from_arrays(np.ones((2, 1), np.float32), np.array([[0, 0, 0, 0], [0, 0, 0, 1]]), (2, 2, 2), 1)
    b = sj.SparseTensor.from_arrays(np.ones((2, 1), np.float32), np.array([[0, 0, 1, 0], [0, 0, 1, 1]]), (2, 2, 2), 1)
    add = jax.jit(sj.sparse_add)
    with pytest.raises(Exception, match="its sites differ .*outside jit, where sparse_add returns their union"):
        jax.block_until_ready(add(a, b).features)
    del rng


def test_different_site_set_names_under_jit_and_grids_are_refused() -> None:
    rng = np.random.default_rng(5)
    x = sj.SparseTensor.from_arrays(rng.standard_normal((30, 3)).astype(np.float32), _indices(rng, 30), GRID, 2)
    y = sj.sparse_conv(x, jnp.ones((3, 2, 2, 2, 3)), stride=2)
    with pytest.raises(ValueError, match=r"same grid: input 0 .* spatial_shape \(6, 6, 6\) .* input 1 .*\(3, 3, 3\)"):
        sj.sparse_add(x, y)
    other = sj.SparseTensor.from_arrays(np.asarray(x.valid_features()), x.valid_indices(), GRID, 2, name="other")
    with pytest.raises(ValueError, match="inside jit inputs must be on the same site set"):
        jax.jit(sj.sparse_add)(x, other)
    with pytest.raises(ValueError, match="input 1 has 2 channels, input 0 has 3"):
        sj.sparse_add(x, x.replace(x.features[:, :2]))


# ----------------------------------------------------------------------------- voxels_to_points


def test_voxels_to_points_matches_a_numpy_gather_and_refuses_out_of_range_ids() -> None:
    rng = np.random.default_rng(6)
    features = rng.standard_normal((7, 3)).astype(np.float32)
    ids = rng.integers(-1, 7, 50)
    expected = np.where((ids >= 0)[:, None], features[np.maximum(ids, 0)], -2.0)
    np.testing.assert_array_equal(np.asarray(sj.voxels_to_points(jnp.asarray(features), ids, -2.0)), expected)
    np.testing.assert_array_equal(np.asarray(jax.jit(sj.voxels_to_points)(jnp.asarray(features), ids, -2.0)),
                                  expected)
    for bad, shown in ((7, "got 7 at point 3"), (-2, "got -2 at point 3")):
        wrong = ids.copy()
        wrong[3] = bad
        with pytest.raises(ValueError, match=rf"point_voxel_id must hold -1 .* \[0, 7\).*{shown}"):
            sj.voxels_to_points(jnp.asarray(features), wrong)
        out = np.asarray(jax.jit(sj.voxels_to_points)(jnp.asarray(features), wrong))
        assert np.isnan(out[3]).all() and not np.isnan(np.delete(out, 3, 0)).any()
    with pytest.raises(TypeError, match="point_voxel_id must be an integer array"):
        sj.voxels_to_points(jnp.asarray(features), ids.astype(np.float32))


def test_voxels_to_points_on_a_tensor_bounds_ids_by_its_true_rows() -> None:
    rng = np.random.default_rng(7)
    x = sj.SparseTensor.from_arrays(rng.standard_normal((5, 2)).astype(np.float32), _indices(rng, 5), GRID, 2,
                                    capacity=16)
    out = sj.voxels_to_points(x, np.array([4, -1, 0]))
    np.testing.assert_array_equal(np.asarray(out), np.stack([x.valid_features()[4], np.zeros(2), x.valid_features()[0]]))
    with pytest.raises(ValueError, match=r"\[0, 5\) \(the rows of the tensor\), got 9"):
        sj.voxels_to_points(x, np.array([9]))  # a padding row: a plausible zero before


# ----------------------------------------------------------------------------- non-finite weights


@pytest.mark.parametrize("impl", ["jnp", "callback"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("kind", ["subm", "regular"])
def test_non_finite_weights_leave_padding_rows_zero(impl: str, bad: float, kind: str) -> None:
    rng = np.random.default_rng(8)
    x = sj.SparseTensor.from_arrays(rng.standard_normal((25, 2)).astype(np.float32), _indices(rng, 25), GRID, 2,
                                    capacity=64)
    weight = rng.uniform(-1, 1, (3, 3, 3, 3, 2)).astype(np.float32)
    weight[1, 1, 1, 1, 0] = bad  # output channel 1 (the centre tap), output channel 0 stays finite

    def run(w):
        return sj.sparse_conv(x, w, kind=kind, stride=1 if kind == "subm" else 2, padding=1, impl=impl)

    out = jax.jit(run)(jnp.asarray(weight))
    rows = int(out.num_active)
    assert np.all(np.asarray(out.features)[rows:] == 0)
    # the finite output channel matches the dense float64 oracle at the output sites
    dense_in = densify(x.valid_features().astype(np.float64), x.valid_indices(), GRID, 2)
    expected = dense_conv(dense_in, to_torch(weight[:1].astype(np.float64)), stride=1 if kind == "subm" else 2,
                          padding=1, dilation=1).numpy()
    idx = out.valid_indices()
    np.testing.assert_allclose(np.asarray(out.features)[:rows, 0],
                               expected[idx[:, 0], 0, idx[:, 1], idx[:, 2], idx[:, 3]], rtol=1e-5, atol=1e-5)
    masked_sum = jnp.sum(out.features * out.mask[:, None], axis=0)  # the masked reduction the docs recommend
    assert np.isfinite(np.asarray(masked_sum)[0])
    # gradients of the padding rows of the input are zero too
    grad = jax.grad(lambda f: jnp.sum(jnp.nan_to_num(sj.sparse_conv(
        x.replace(f), jnp.asarray(weight), kind=kind, stride=1 if kind == "subm" else 2, padding=1,
        impl=impl).features)))(x.features)
    assert np.all(np.asarray(grad)[25:] == 0)


# ----------------------------------------------------------------------------- capacities and sizes


@pytest.mark.parametrize("capacity", [0, -3])
def test_capacity_zero_or_negative_names_the_argument(capacity: int) -> None:
    with pytest.raises(ValueError, match=rf"capacity must be a positive int .*got {capacity}"):
        sj.SparseTensor.from_arrays(np.ones((2, 1), np.float32), np.array([[0, 0, 0, 0], [0, 0, 0, 1]]), GRID, 1,
                                    capacity=capacity)


def test_empty_cloud_with_a_small_capacity() -> None:
    x = sj.SparseTensor.from_arrays(np.zeros((0, 2), np.float32), np.zeros((0, 4), np.int32), GRID, 1, capacity=1)
    assert x.capacity == 1 and int(x.num_active) == 0
    np.testing.assert_array_equal(_dense(x), 0)


def test_dense_of_an_unaddressable_grid_is_a_clear_error_not_an_abort() -> None:
    x = sj.SparseTensor.from_arrays(np.ones((1, 3), np.float32), np.array([[0, 5, 5, 5]]), (2 ** 20,) * 3, 1)
    # the core's dense-size check and message
    with pytest.raises(ValueError, match=r"to_dense: a dense grid of batch_size 1 x spatial_shape "
                                         r"\(1048576, 1048576, 1048576\) x 3 channels .*crop"):
        x.dense()
