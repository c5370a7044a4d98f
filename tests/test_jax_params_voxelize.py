"""sparsecore.jax parameter helpers and voxelization."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsecore as sc
import sparsecore.jax as sj


def test_init_conv_is_spconv_kaiming_uniform():
    params = sj.init_conv(jax.random.PRNGKey(3), 16, 32, (3, 3, 3), bias=True)
    assert params["weight"].shape == (32, 3, 3, 3, 16) and params["weight"].dtype == jnp.float32
    bound = 1 / math.sqrt(16 * 27)
    weight = np.asarray(params["weight"])
    assert np.abs(weight).max() <= bound and np.abs(weight).max() > 0.95 * bound
    assert abs(weight.mean()) < 0.05 * bound and abs(weight.std() - bound / math.sqrt(3)) < 0.05 * bound
    assert params["bias"].shape == (32,) and np.abs(np.asarray(params["bias"])).max() <= bound
    grouped = sj.init_conv(jax.random.PRNGKey(4), 8, 4, 3, ndim=2, groups=2)
    assert grouped["weight"].shape == (4, 3, 3, 4) and "bias" not in grouped
    with pytest.raises(ValueError, match="groups=3 must divide"):
        sj.conv_weight_shape(8, 4, 3, groups=3)
    with pytest.raises(ValueError, match="kernel_size"):
        sj.conv_weight_shape(8, 4, (3, 3), ndim=3)


def test_init_conv_is_reproducible_from_the_key_and_compiles_nothing():
    import jax.monitoring

    raw, typed = jax.random.PRNGKey(5), jax.random.key(5)  # made (and compiled) before listening
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kwargs: compiles.append(event) if event.endswith("backend_compile_duration") else None)
    shapes = ((3, 8), (8, 16), (16, 24), (24, 40))
    first = [sj.init_conv(raw, cin, cout, 3, bias=True) for cin, cout in shapes]
    again = [sj.init_conv(raw, cin, cout, 3, bias=True) for cin, cout in shapes]
    other = sj.init_conv(jax.random.PRNGKey(6), 3, 8, 3)  # a new key, made inside the window: its own compile
    compiles_for_keys = len(compiles)
    norm, stats = sj.init_batch_norm(24)
    halves = sj.init_conv(typed, 8, 16, 3, dtype=jnp.bfloat16)
    assert len(compiles) == compiles_for_keys, "init_conv / init_batch_norm compiled an XLA computation"
    for made, remade in zip(first, again):  # same key, same values
        assert np.array_equal(np.asarray(made["weight"]), np.asarray(remade["weight"]))
        assert np.array_equal(np.asarray(made["bias"]), np.asarray(remade["bias"]))
    assert not np.array_equal(np.asarray(other["weight"]), np.asarray(first[0]["weight"]))
    assert halves["weight"].dtype == jnp.bfloat16 and halves["weight"].shape == (16, 3, 3, 3, 8)
    assert np.array_equal(np.asarray(norm["weight"]), np.ones(24)) and np.array_equal(np.asarray(stats["running_mean"]),
                                                                                       np.zeros(24))
    with pytest.raises(ValueError, match="one jax.random key"):
        sj.init_conv(jax.random.split(raw, 3), 3, 8, 3)


def test_params_from_state_dict():
    torch = pytest.importorskip("torch")
    state = {"net.0.weight": torch.ones(2, 3, 3, 3, 1), "net.0.bias": np.zeros(2, np.float32), "head.weight": [1.0]}
    tree = sj.params_from_state_dict(state)
    assert tree["net"]["0"]["weight"].shape == (2, 3, 3, 3, 1)
    assert isinstance(tree["net"]["0"]["bias"], jax.Array) and tree["head"]["weight"].shape == (1,)


def _clouds(rng):
    return [np.concatenate([rng.uniform([-4, -4, -1], [4, 4, 1], (n, 3)), rng.uniform(0, 1, (n, 1))], 1)
            .astype(np.float32) for n in (500, 300)]


def test_voxelize_batch_of_numpy_and_jax_clouds_matches_core():
    rng = np.random.default_rng(5)
    clouds = _clouds(rng)
    size, bounds = (0.5, 0.5, 0.5), (-4, -4, -1, 4, 4, 1)
    x, voxels = sj.voxelize([clouds[0], jnp.asarray(clouds[1])], size, bounds, max_num_points_per_voxel=8,
                            max_num_voxels=10_000)
    core = sc.voxelize_batch(clouds, size, bounds, 8, 10_000)
    assert x.batch_size == 2 and x.spatial_shape == core.grid_size == (4, 16, 16)
    np.testing.assert_array_equal(x.valid_indices(), core.indices)
    np.testing.assert_allclose(x.valid_features(), sc.voxel_means(core), rtol=1e-6)
    single, _ = sj.voxelize(clouds[0], size, bounds, max_num_points_per_voxel=8, max_num_voxels=10_000)
    assert single.batch_size == 1

    ids = voxels.point_voxel_id[0]
    got = jax.jit(sj.voxels_to_points)(x.features, ids)
    np.testing.assert_allclose(np.asarray(got), sc.gather_voxel_features(x.valid_features(), ids), rtol=1e-6)


def test_voxelize_refuses_tracers():
    points = jnp.zeros((10, 3))
    with pytest.raises(TypeError, match="outside jit"):
        jax.jit(lambda p: sj.voxelize(p, (1, 1, 1), (0, 0, 0, 4, 4, 4))[0].features)(points)
