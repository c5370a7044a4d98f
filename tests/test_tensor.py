"""sparsecore.SparseTensor and the functional API keep the caller's array library.

A tensor built from torch tensors (or JAX arrays) keeps them in its fields and
every tensor the functional API derives from it holds torch tensors (or JAX
arrays) too, zero-copy; the core computes on the NumPy views ``core_features``
/ ``core_indices``. Values are checked against the dense float64 oracle.
"""

from __future__ import annotations

import numpy as np
import pytest

import sparsecore as sc

torch = pytest.importorskip("torch")

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

SHAPE, BATCH = (6, 7, 5), 2


def _problem(seed: int):
    rng = do.make_rng(98000, seed)
    indices = do.random_indices(rng, SHAPE, BATCH, 0.3)
    features = do.random_features(rng, indices.shape[0], 3)
    weight = do.random_weight(rng, 4, (3, 3, 3), 3)
    return rng, indices, features, weight


def test_torch_fields_stay_torch_and_results_come_back_as_torch():
    rng, indices, features, weight = _problem(1)
    f, i = torch.from_numpy(features), torch.from_numpy(indices)
    x = sc.SparseTensor(f, i, SHAPE, BATCH)
    assert x.features is f and x.indices is i, "inputs that need no conversion are kept as they are"
    assert isinstance(x.core_features, np.ndarray) and x.core_features.ctypes.data == f.data_ptr()
    dense_in = do.densify(features, indices, SHAPE, BATCH)
    subm = sc.sparse_conv(x, torch.from_numpy(weight), kind="subm", indice_key="s")
    assert isinstance(subm.features, torch.Tensor) and subm.indices is i
    expected = do.read_sites(do.dense_conv(dense_in, torch.from_numpy(weight), 1, 1, 1), indices)
    do.assert_close(subm.features.numpy(), expected.numpy(), "subm, torch in")
    second = torch.from_numpy(rng.standard_normal((4, 3, 3, 3, 4)))
    again = sc.sparse_conv(subm.replace(torch.relu(subm.features)), second, kind="subm", indice_key="s")
    assert again.core_indices is x.core_indices, "the cached rulebook is reused through one core view"
    down = sc.sparse_conv(x, torch.from_numpy(weight[:, :2, :2, :2, :].copy()), stride=2)
    assert isinstance(down.features, torch.Tensor) and isinstance(down.indices, torch.Tensor)
    assert down.indices.dtype == torch.int32
    sites = do.regular_sites(indices, SHAPE, BATCH, 2, 2, 0, 1)
    do.assert_sites(down.indices.numpy(), sites)
    dense_down = do.dense_conv(dense_in, torch.from_numpy(weight[:, :2, :2, :2, :].copy()), 2, 0, 1)
    do.assert_close(down.features.numpy(), do.read_sites(dense_down, sites).numpy(), "strided, torch in")
    pooled = sc.sparse_max_pool(x, 2)
    assert isinstance(pooled.features, torch.Tensor) and isinstance(pooled.indices, torch.Tensor)
    for result in (sc.global_max_pool(x), sc.global_avg_pool(x), x.dense()):
        assert isinstance(result, torch.Tensor)
    torch.testing.assert_close(x.dense(), dense_in.to(torch.float64))
    back = sc.SparseTensor.from_dense(x.dense(), channels_first=True)
    assert isinstance(back.features, torch.Tensor) and isinstance(back.indices, torch.Tensor)


def test_sparse_add_keeps_torch_and_the_residual_order():
    _, indices, features, _ = _problem(2)
    x = sc.SparseTensor(torch.from_numpy(features), torch.from_numpy(indices), SHAPE, BATCH)
    residual = sc.sparse_add(x, x.replace(2 * x.features))
    assert residual.indices is x.indices and isinstance(residual.features, torch.Tensor)
    torch.testing.assert_close(residual.features, 3 * x.features)
    other = sc.SparseTensor(torch.from_numpy(features[:5]), torch.from_numpy(indices[:5]), SHAPE, BATCH)
    union = sc.sparse_add(x, other)
    assert isinstance(union.features, torch.Tensor) and isinstance(union.indices, torch.Tensor)
    torch.testing.assert_close(union.dense(), x.dense() + other.dense())


def test_int64_torch_indices_come_back_int32_torch():
    _, indices, features, _ = _problem(3)
    x = sc.SparseTensor(torch.from_numpy(features), torch.from_numpy(indices.astype(np.int64)), SHAPE, BATCH)
    assert isinstance(x.indices, torch.Tensor) and x.indices.dtype == torch.int32
    np.testing.assert_array_equal(x.indices.numpy(), indices)


def test_jax_in_jax_out():
    jax = pytest.importorskip("jax")
    _, indices, features, weight = _problem(4)
    x = sc.SparseTensor(jax.numpy.asarray(features, jax.numpy.float32), jax.numpy.asarray(indices), SHAPE, BATCH)
    y = sc.sparse_conv(x, weight.astype(np.float32), kind="subm")
    assert isinstance(y.features, jax.Array) and isinstance(y.indices, jax.Array)
    expected = do.read_sites(do.dense_conv(do.densify(features, indices, SHAPE, BATCH), torch.from_numpy(weight),
                                           1, 1, 1), indices)
    np.testing.assert_allclose(np.asarray(y.features), expected.numpy(), rtol=1e-5, atol=1e-5)
    assert isinstance(sc.global_avg_pool(x), jax.Array) and isinstance(x.dense(), jax.Array)


def test_numpy_tensors_are_unchanged():
    _, indices, features, weight = _problem(5)
    x = sc.SparseTensor(features, indices, SHAPE, BATCH)
    assert x.features is x.core_features and x.indices is x.core_indices
    y = sc.sparse_conv(x, weight, kind="subm")
    assert isinstance(y.features, np.ndarray) and y.indices is x.indices


def test_repr_is_one_short_line_without_the_arrays() -> None:
    rng = np.random.default_rng(11)
    sites = rng.choice(20 * 20 * 20, size=500, replace=False)
    coords = np.stack(np.unravel_index(sites, (20, 20, 20)), axis=1)
    indices = np.concatenate([rng.integers(0, 2, (500, 1)), coords], axis=1).astype(np.int32)
    features = rng.standard_normal((500, 7)).astype(np.float32)
    tensor = sc.SparseTensor(features, indices, (20, 20, 20), 2)
    text = repr(tensor)
    assert "\n" not in text and len(text) < 300, text
    for expected in ("active_sites=500", "channels=7", "features=[500, 7] float32", "indices=[500, 4] int32",
                     "spatial_shape=(20, 20, 20)", "batch_size=2", "library=numpy", "device=cpu",
                     "cached_rulebooks=0"):
        assert expected in text, (expected, text)
    assert f"{features[0, 0]:.4f}"[:6] not in text and "array(" not in text
    assert str(tensor) == text
    empty = sc.SparseTensor(np.zeros((0, 3), np.float64), np.zeros((0, 4), np.int32), (4, 4, 4), 1)
    assert "active_sites=0" in repr(empty) and "float64" in repr(empty)
