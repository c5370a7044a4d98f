"""A stream of clouds of varying size compiles once per capacity bucket, not once per cloud.

10 clouds of 4,000 to 24,000 voxels (crops of a synthetic LiDAR scene around
the sensor, like scans of different range; their largest site sets span three
capacity buckets, so most clouds land in a bucket compiled before) go through one jitted training
step of a 4-layer network (two subm convs sharing a rulebook, a strided conv,
a subm conv on the coarse sites, global average pool). Traces are counted with
a Python side effect inside the jitted function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsecore.jax as sj

scenes = pytest.importorskip("sparsecore.benchmark.scenes")
CLOUDS, SMALLEST, LARGEST = 10, 4_000, 24_000


def _net(params, x):
    x = sj.subm_conv(x, params[0])
    x = x.replace(jax.nn.relu(x.features))
    x = sj.subm_conv(x, params[1])
    x = x.replace(jax.nn.relu(x.features))
    x = sj.sparse_conv(x, params[2], stride=2, padding=1)
    x = x.replace(jax.nn.relu(x.features))
    x = sj.subm_conv(x, params[3])
    return sj.global_avg_pool(x)


def test_stream_of_clouds_compiles_within_bucket_count():
    scene = scenes.synthetic_voxel_scene(scenes.SYNTHETIC_SCALES["full"], seed=3)
    indices, shape = scene.indices, tuple(scene.spatial_shape)
    assert indices.shape[0] >= LARGEST
    centre = np.asarray(shape) // 2
    order = np.argsort(np.abs(indices[:, 2] - centre[1]) + np.abs(indices[:, 3] - centre[2]), kind="stable")
    weight_rng = np.random.default_rng(0)  # NumPy, not jax.random: each eager jax.random shape compiles (~3 s)
    params = [jnp.asarray(weight_rng.uniform(-1, 1, (8, 3, 3, 3, cin)) / np.sqrt(27 * cin), jnp.float32)
              for cin in (4, 8, 8, 8)]
    target = jnp.ones((1, 8), jnp.float32)
    traces = []

    @jax.jit
    def step(params, x):
        traces.append(x.plan.signature)  # runs once per trace

        def loss(p):
            return jnp.sum((_net(p, x) - target) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        return value, jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads)

    policy = sj.Buckets(steps_per_octave=1, linked=True)
    rng = np.random.default_rng(20261202)
    recipe, sizes, largest, signatures = None, [], [], set()
    for _ in range(CLOUDS):
        n = int(rng.integers(SMALLEST, LARGEST + 1))
        sizes.append(n)
        features = rng.uniform(0.5, 1.5, (n, 4)).astype(np.float32)
        x = sj.SparseTensor.from_arrays(features, indices[order[:n]], shape, 1, capacity=policy)
        x = recipe.apply(x) if recipe is not None else x.with_plan(sj.plan(_net, params, x))
        recipe = x.plan.recipe
        signatures.add(x.plan.signature)
        largest.append(max(x.plan.rows().values()))
        value, params = step(params, x)
        assert np.isfinite(float(value))
    rungs = policy.ladder(min(sizes), max(largest))
    assert len(traces) == len(signatures), "one trace per distinct plan signature"
    # linked buckets: one capacity per plan, the rung of its largest site set
    assert len(traces) <= len(rungs), (len(traces), rungs)
    assert len(traces) < CLOUDS
    assert len(signatures) >= 2, "the clouds span several buckets"
