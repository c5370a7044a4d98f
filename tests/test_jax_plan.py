"""sparsecore.jax plans: capacity buckets, eager geometry, pytrees, recipes, and bad input.

Expected values here are either simple arithmetic (bucket ladders), the core's
own NumPy engine (a planned jitted network against the core's eager layers,
which the dense oracles of test_jax_ops check independently), or the same
computation at a different padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsecore as sc
import sparsecore.jax as sj

try:
    from .test_jax_oracle import random_features, random_sites, x64  # noqa: F401 (fixture)
except ImportError:
    from test_jax_oracle import random_features, random_sites, x64  # type: ignore[no-redef]  # noqa: F401

pytestmark = pytest.mark.usefixtures("x64")


def _cloud(seed=0, shape=(8, 9, 7), batch=2, num=120, channels=3, capacity=None, name="input"):
    rng = np.random.default_rng(seed)
    indices = random_sites(rng, shape, batch, num)
    features = random_features(rng, indices.shape[0], channels)
    return sj.SparseTensor.from_arrays(features, indices, shape, batch, capacity=capacity, name=name), indices, features


def _weights(seed=1, channels=3):
    rng = np.random.default_rng(seed)
    return {
        "a": jnp.asarray(rng.uniform(-1, 1, (4, 3, 3, 3, channels))),
        "b": jnp.asarray(rng.uniform(-1, 1, (4, 3, 3, 3, 4))),
        "down": jnp.asarray(rng.uniform(-1, 1, (5, 3, 3, 3, 4))),
        "up": jnp.asarray(rng.uniform(-1, 1, (4, 3, 3, 3, 5))),
        "bias": jnp.asarray(rng.uniform(-1, 1, (4,))),
    }


def _unet(p, x, impl=None):
    x = sj.subm_conv(x, p["a"], p["bias"], impl=impl)
    x = x.replace(jnp.tanh(x.features))
    skip = sj.subm_conv(x, p["b"], impl=impl)
    y = sj.sparse_conv(skip, p["down"], stride=2, padding=1, impl=impl)
    y = sj.sparse_max_pool(y, 3, 1, 1, subm=True, impl=impl)
    up = sj.inverse_conv(y, p["up"], impl=impl)
    return sj.sparse_add(up, skip)


def _core_unet(p, features, indices, shape, batch):
    w = {k: np.asarray(v) for k, v in p.items()}
    x = sc.SparseTensor(features, indices, shape, batch)
    x = sc.sparse_conv(x, w["a"], w["bias"], kind="subm")
    x = x.replace(np.tanh(x.features))
    skip = sc.sparse_conv(x, w["b"], kind="subm")
    y = sc.sparse_conv(skip, w["down"], stride=2, padding=1, indice_key="down")
    y = sc.sparse_max_pool(y, 3, 1, 1, subm=True)
    up = sc.sparse_conv(y, w["up"], kind="inverse", indice_key="down")
    return up.features + skip.features


# ---------------------------------------------------------------------------- buckets


def test_bucket_ladders():
    assert sj.Buckets(minimum=256, steps_per_octave=1).ladder(1, 3000) == [256, 512, 1024, 2048, 4096]
    assert sj.Buckets(minimum=256, steps_per_octave=2).ladder(300, 1600) == [384, 512, 768, 1024, 1536, 2048]
    assert sj.Buckets(minimum=256, steps_per_octave=4).ladder(257, 512) == [320, 384, 448, 512]
    buckets = sj.Buckets()
    assert buckets.round_up(0) == 256
    for count in (1, 255, 256, 257, 1000, 5000, 49_999, 50_000, 123_457):
        size = buckets.round_up(count)
        assert count <= size <= max(256, 1.5 * count)
        assert size in buckets.ladder(1, 200_000)


def test_buckets_maximum_and_linked():
    with pytest.raises(sj.CapacityError, match="needs 2000 rows but its capacity is 1000"):
        sj.Buckets(maximum=1000).capacity(2000, "input")
    assert sj.Buckets(maximum=1000).capacity(900, "input") == 1000
    linked = sj.Buckets(linked=True).finalize({"a": 100, "b": 3000, "c": 700})
    assert linked == {"a": 3072, "b": 3072, "c": 3072}
    assert sj.Buckets().finalize({"a": 5}) is None


def test_fixed_capacity_overflow_is_an_error_never_a_truncation():
    x, _, _ = _cloud(num=100, capacity=sj.Fixed(128))
    assert x.capacity == 128
    with pytest.raises(sj.CapacityError, match="'input' needs 100 rows but its capacity is 64"):
        _cloud(num=100, capacity=64)
    # the strided layer's output sites overflow the same fixed capacity
    x, _, _ = _cloud(num=100, shape=(20, 20, 20), capacity=sj.Fixed(100))
    weight = jnp.ones((2, 3, 3, 3, 3))
    with pytest.raises(sj.CapacityError, match="input/regular3d_k3s2p1d1"):
        sj.plan(lambda t: sj.sparse_conv(t, weight, stride=2, padding=1), x)
    with pytest.raises(ValueError, match="name no capacity for site set .input."):
        _cloud(capacity=sj.Fixed({"other": 500}))


# ---------------------------------------------------------------------------- plans


def test_planned_jit_network_matches_core_layers_for_both_impls():
    x, indices, features = _cloud()
    p = _weights()
    expected = _core_unet(p, features, indices, x.spatial_shape, x.batch_size)
    plan = sj.plan(_unet, p, x)
    assert len(plan.rulebooks) == 3  # subm (shared by both subm convs and the subm pool) is one rulebook
    x = x.with_plan(plan)
    for impl in ("jnp", "callback"):
        out = jax.jit(_unet, static_argnums=2)(p, x, impl)
        assert out.sites_name == "input"
        np.testing.assert_allclose(np.asarray(out.features[: indices.shape[0]]), expected, rtol=1e-10, atol=1e-10)
        assert not np.any(np.asarray(out.features[indices.shape[0]:]))


def test_eager_use_builds_geometry_on_the_fly():
    x, indices, features = _cloud(seed=3)
    p = _weights()
    out = _unet(p, x, "callback")  # no plan: every layer builds its rulebook eagerly
    expected = _core_unet(p, features, indices, x.spatial_shape, x.batch_size)
    np.testing.assert_allclose(out.valid_features(), expected, rtol=1e-10, atol=1e-10)


def test_recipe_rebuilds_the_plan_for_a_new_cloud():
    x, _, _ = _cloud(seed=4)
    p = _weights()
    recipe = x.with_plan(sj.plan(_unet, p, x)).plan.recipe
    y, indices, features = _cloud(seed=5, num=150)
    y = recipe.apply(y)
    assert sorted(y.plan.rulebooks) == sorted(sj.plan(_unet, p, y).rulebooks)
    out = jax.jit(_unet, static_argnums=2)(p, y, "callback")
    expected = _core_unet(p, features, indices, y.spatial_shape, y.batch_size)
    np.testing.assert_allclose(np.asarray(out.features[: indices.shape[0]]), expected, rtol=1e-10, atol=1e-10)


def test_plan_retraces_for_each_cloud_even_with_nested_jit():
    """Planning must not reuse a cached trace whose geometry belongs to another cloud."""
    inner = jax.jit(lambda t, w: sj.sparse_conv(t, w, stride=2, padding=1))
    weight = jnp.ones((2, 3, 3, 3, 3))
    outputs = []
    for seed in (6, 7):
        x, indices, _ = _cloud(seed=seed, capacity=sj.Fixed(256))
        plan = sj.plan(lambda t: inner(t, weight), x)
        child = plan.site("input/regular3d_k3s2p1d1")
        core = sc.build_rulebook(indices, x.spatial_shape, 2, sc.ConvGeometry.create(3, 3, 2, 1))
        np.testing.assert_array_equal(child.numpy_indices(), core.output_indices)
        outputs.append(child.numpy_indices())
    assert not np.array_equal(outputs[0], outputs[1])


def test_same_bucket_means_same_treedef_and_one_compile():
    traces = []

    def net(p, t):
        traces.append(1)
        return sj.global_avg_pool(_unet(p, t, "callback"))  # the fast-compiling impl

    jitted = jax.jit(net)
    p = _weights()
    seen = set()
    for seed, num in ((8, 100), (9, 110), (10, 120), (11, 300)):  # three share the 128-row input bucket
        x, _, _ = _cloud(seed=seed, num=num, capacity=sj.Buckets(minimum=128))
        x = x.with_plan(sj.plan(_unet, p, x))
        new = x.plan.signature not in seen
        seen.add(x.plan.signature)
        traces.clear()
        jitted(p, x)
        assert len(traces) == (1 if new else 0)
    assert len(seen) < 4


def test_pytree_roundtrip_and_repad_keep_values():
    x, indices, _ = _cloud(seed=11)
    p = _weights()
    x = x.with_plan(sj.plan(_unet, p, x))
    leaves, treedef = jax.tree_util.tree_flatten(x)
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert again.sites_name == x.sites_name and again.plan.signature == x.plan.signature
    bigger = sj.repad(x, {name: 2 * s.info.capacity for name, s in x.plan.sites.items()})
    assert bigger.capacity == 2 * x.capacity
    a = jax.jit(_unet, static_argnums=2)(p, x, "jnp").features[: indices.shape[0]]
    b = jax.jit(_unet, static_argnums=2)(p, bigger, "jnp").features[: indices.shape[0]]
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-12)


def test_padding_rows_never_leak_into_results():
    """Garbage in the padding rows of the input (user elementwise ops) changes nothing."""
    x, indices, _ = _cloud(seed=12)
    p = _weights()
    x = x.with_plan(sj.plan(_unet, p, x))
    n = indices.shape[0]
    dirty = x.replace(x.features.at[n:].set(jnp.nan))
    for impl in ("jnp", "callback"):
        clean = jax.jit(_unet, static_argnums=2)(p, x, impl).features
        noisy = jax.jit(_unet, static_argnums=2)(p, dirty, impl).features
        np.testing.assert_array_equal(np.asarray(clean[:n]), np.asarray(noisy[:n]))
        assert not np.any(np.isnan(np.asarray(noisy)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_feature_dtypes_are_kept(dtype):
    x, indices, features = _cloud(seed=13)
    x = x.replace(x.features.astype(dtype))
    weight = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (4, 3, 3, 3, 3)), dtype)
    for impl in ("jnp", "callback"):
        out = jax.jit(lambda t, w: sj.subm_conv(t, w, impl=impl))(x.with_plan(sj.plan(sj.subm_conv, x, weight)),
                                                                  weight)
        assert out.features.dtype == dtype
        expected = sc.conv_forward(features.astype(np.float32), np.asarray(weight, np.float32),
                                   sc.build_rulebook(indices, x.spatial_shape, 2,
                                                     sc.ConvGeometry.create(3, 3, kind="subm")))
        tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
        np.testing.assert_allclose(np.asarray(out.features[: indices.shape[0]], np.float32), expected,
                                   rtol=tolerance, atol=tolerance * 10)


def _callback_calls(fn, *args):
    """How many ``buffer_callback`` calls the jaxpr of ``fn(*args)`` holds (the core's passes), at any depth."""
    def count(jaxpr):
        total = 0
        for eqn in jaxpr.eqns:
            total += "callback" in eqn.primitive.name
            for value in eqn.params.values():
                for item in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(item, "jaxpr", item)
                    if hasattr(inner, "eqns"):
                        total += count(inner)
        return total

    return count(jax.make_jaxpr(fn)(*args).jaxpr)


def test_impl_is_chosen_explicitly_per_layer_or_by_the_plan(monkeypatch):
    x, indices, features = _cloud(seed=11)
    p = _weights()
    x = x.with_plan(sj.plan(_unet, p, x))
    assert x.plan.impl is None and sj.default_impl() == "jnp"
    monkeypatch.setenv("SPARSECORE_JAX_IMPL", "callback")  # no environment variable is read any more
    assert _callback_calls(lambda q, t: _unet(q, t).features, p, x) == 0
    # the plan's static configuration: every layer without impl= runs the core through callbacks
    configured = x.with_plan(x.plan.with_impl("callback"))
    assert configured.plan.impl == "callback" and "impl='callback'" in repr(configured.plan)
    assert _callback_calls(lambda q, t: _unet(q, t).features, p, configured) == 5  # five layers
    # a layer's own impl= wins over the plan's
    assert _callback_calls(lambda q, t: _unet(q, t, impl="jnp").features, p, configured) == 0
    # the configuration survives jit (it is static pytree structure) and gives the same values
    reference = jax.jit(lambda q, t: _unet(q, t).features)(p, x)
    through_core = jax.jit(lambda q, t: _unet(q, t).features)(p, configured)
    np.testing.assert_allclose(np.asarray(through_core), np.asarray(reference), rtol=1e-9, atol=1e-9)
    # the recipe keeps it for the next cloud
    fresh, _, _ = _cloud(seed=12)
    assert configured.plan.recipe.apply(fresh).plan.impl == "callback"
    with pytest.raises(ValueError, match="impl must be one of"):
        x.plan.with_impl("numpy")


def test_the_planner_travels_with_the_traced_tensors_only():
    x, _, _ = _cloud(seed=13)
    other, _, _ = _cloud(seed=14, name="other")
    p = _weights()
    seen = []

    def net(q, t):
        seen.append(t.plan.planner)
        sj.subm_conv(other, q["a"])  # a concrete tensor closed over: built eagerly on its own plan
        return sj.subm_conv(t, q["a"])

    planned = sj.plan(net, p, x)
    assert seen and seen[0] is not None  # the traced tensor's plan carried the planner explicitly
    assert planned.planner is None and x.plan.planner is None and other.plan.planner is None
    assert sorted(planned.sites) == ["input"] and len(planned.rulebooks) == 1
    with pytest.raises(TypeError, match="policy, impl and planner"):
        planned.configured(capacity=3)


def test_set_default_impl_refuses_module_state():
    sj.set_default_impl(None)  # the automatic choice is what holds: nothing to change
    with pytest.raises(RuntimeError, match=r"no module state.*impl='callback'.*with_impl\('callback'\)"):
        sj.set_default_impl("callback")
    assert sj.default_impl() == "jnp"
    with pytest.raises(ValueError, match="impl must be one of"):
        sj.set_default_impl("numpy")


# ---------------------------------------------------------------------------- bad input


def test_tracer_indices_say_to_plan_outside_jit():
    rng = np.random.default_rng(14)
    indices = random_sites(rng, (5, 5), 1, 10)

    @jax.jit
    def make(idx):
        return sj.SparseTensor.from_arrays(jnp.ones((10, 2)), idx, (5, 5), 1).features

    with pytest.raises(TypeError, match="Build the plan outside jit"):
        make(jnp.asarray(indices))


def test_missing_rulebook_inside_jit_is_a_clear_error():
    x, _, _ = _cloud(seed=15)
    weight = jnp.ones((2, 3, 3, 3, 3))
    with pytest.raises(sj.PlanError, match="Build the complete plan outside jit"):
        jax.jit(lambda t: sj.sparse_conv(t, weight, stride=2, padding=1).features)(x)


def test_plan_inside_jit_is_refused():
    x, _, _ = _cloud(seed=16)
    weight = jnp.ones((2, 3, 3, 3, 3))
    with pytest.raises(TypeError, match="outside jit"):
        jax.jit(lambda t: len(sj.plan(sj.subm_conv, t, weight).rulebooks))(x)


def test_mismatched_shapes_are_rejected():
    x, indices, features = _cloud(seed=17)
    # the core's weight-layout check and messages (shared with sparsecore and sparsecore.torch)
    with pytest.raises(ValueError,
                       match=r"last axis must be 3 \(in_channels 3 // groups 1\), got shape \(2, 3, 3, 3, 4\)"):
        sj.subm_conv(x, jnp.ones((2, 3, 3, 3, 4)))
    with pytest.raises(ValueError, match="5 axes for a 3-D conv"):
        sj.subm_conv(x, jnp.ones((2, 3, 3, 3)))
    with pytest.raises(ValueError, match="bias must have shape \\[2\\]"):
        sj.subm_conv(x, jnp.ones((2, 3, 3, 3, 3)), jnp.ones(3))
    with pytest.raises(ValueError, match="groups=2 must divide"):
        sj.subm_conv(x, jnp.ones((2, 3, 3, 3, 1)), groups=2)
    with pytest.raises(ValueError, match="features must have shape \\[capacity, C\\]"):
        x.replace(jnp.ones((indices.shape[0], 3)))
    with pytest.raises(ValueError, match="features has 119 rows"):
        sj.SparseTensor.from_arrays(features[:-1], indices, x.spatial_shape, 2)
    with pytest.raises(ValueError, match="shape \\[N, 4\\]"):
        sj.SparseTensor.from_arrays(features, indices[:, :3], x.spatial_shape, 2)
    with pytest.raises(ValueError, match="duplicate sites"):
        sj.SparseTensor.from_arrays(np.concatenate([features, features[:1]]),
                                    np.concatenate([indices, indices[:1]]), x.spatial_shape, 2)
    bad = indices.copy()
    bad[0, 1] = 99
    with pytest.raises(ValueError, match="outside"):
        sj.SparseTensor.from_arrays(features, bad, x.spatial_shape, 2)
    with pytest.raises(TypeError, match="float"):
        sj.SparseTensor.from_arrays(indices, indices, x.spatial_shape, 2)


def test_inverse_and_add_errors():
    x, _, _ = _cloud(seed=18)
    with pytest.raises(ValueError, match="are input sites"):
        sj.inverse_conv(x, jnp.ones((2, 3, 3, 3, 3)))
    y = sj.sparse_conv(x, jnp.ones((3, 2, 2, 2, 3)), stride=2)
    with pytest.raises(ValueError, match="kernel_size \\(3, 3, 3\\) differs"):
        sj.inverse_conv(y, jnp.ones((3, 3, 3, 3, 3)))
    with pytest.raises(ValueError, match="must live on the same grid"):
        sj.sparse_add(x, y)
