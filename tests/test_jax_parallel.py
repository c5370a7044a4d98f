"""Data parallelism: a shard_map training step on 2 CPU devices equals the single-device result.

One point cloud per device (stacked with `sparsecore.jax.stack`, padded to the
common capacities), gradients averaged across devices with ``pmean``. The
reference computes each cloud's loss and gradients alone, on one device, with
its own plan (through the core: impl="callback"), and averages them; the
data-parallel step of each impl must equal it. Runs in a subprocess because the
device count (``XLA_FLAGS=--xla_force_host_platform_device_count=2``) is fixed
when JAX starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import json
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    import sparsecore.jax as sj

    assert len(jax.devices()) == 2, jax.devices()
    rng = np.random.default_rng(20261202)
    shape, channels = (10, 12, 9), 3

    def cloud(num):
        cells = rng.choice(int(np.prod(shape)), num, replace=False)
        indices = np.concatenate([np.zeros((num, 1), np.int64), np.stack(np.unravel_index(cells, shape), 1)], 1)
        features = rng.uniform(0.5, 1.5, (num, channels))
        return sj.SparseTensor.from_arrays(features, indices, shape, 1)

    weight_rng = np.random.default_rng(7)  # NumPy, not jax.random: each eager jax.random shape compiles (~3 s)

    def conv_params(cin, cout, bias=False):
        bound = 1.0 / np.sqrt(27 * cin)
        layer = {"weight": jnp.asarray(weight_rng.uniform(-bound, bound, (cout, 3, 3, 3, cin)))}
        if bias:
            layer["bias"] = jnp.asarray(weight_rng.uniform(-bound, bound, (cout,)))
        return layer

    params = {"a": conv_params(channels, 4, bias=True), "down": conv_params(4, 5), "b": conv_params(5, 5)}

    def make_loss(impl):
        def loss(p, x, target):
            y = sj.subm_conv(x, p["a"]["weight"], p["a"]["bias"], impl=impl)
            y = y.replace(jax.nn.relu(y.features))
            y = sj.sparse_conv(y, p["down"]["weight"], stride=2, padding=1, impl=impl)
            y = sj.sparse_max_pool(y, 3, 1, 1, subm=True, impl=impl)
            y = sj.subm_conv(y, p["b"]["weight"], impl=impl)
            return jnp.mean((sj.global_avg_pool(y) - target) ** 2)
        return loss

    clouds = [cloud(150), cloud(260)]  # different sizes: different buckets before stacking
    plan_fn = lambda p, x, t: make_loss("jnp")(p, x, t)
    targets = [jnp.asarray(rng.uniform(-1, 1, (1, 5))) for _ in clouds]
    planned = [x.with_plan(sj.plan(plan_fn, params, x, t)) for x, t in zip(clouds, targets)]
    stacked = sj.stack(planned)
    stacked_targets = jnp.stack(targets)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    result = {"capacities": [x.capacity for x in planned], "stacked": int(stacked.features.shape[1])}
    # the reference, once for both impls: each cloud alone on one device with its own plan, through the
    # core on its true rows (impl="callback")
    single = jax.jit(jax.value_and_grad(make_loss("callback")))
    singles = [single(params, x, t) for x, t in zip(planned, targets)]
    expected_value = sum(v for v, _ in singles) / len(singles)
    expected_grads = jax.tree_util.tree_map(lambda *g: sum(g) / len(g), *[g for _, g in singles])
    for impl in ("jnp", "callback"):
        loss = make_loss(impl)
        step = sj.data_parallel_grad(loss, mesh, "data")
        value, grads = step(params, stacked, stacked_targets)
        errors = jax.tree_util.tree_map(lambda a, b: float(jnp.max(jnp.abs(a - b))), grads, expected_grads)
        result[impl] = {
            "value": float(value), "expected": float(expected_value),
            "max_grad_error": max(jax.tree_util.tree_leaves(errors)),
            "grad_scale": max(float(jnp.max(jnp.abs(g))) for g in jax.tree_util.tree_leaves(expected_grads)),
            "devices": len(value.sharding.device_set) if hasattr(value, "sharding") else 0,
        }
    print("RESULT", json.dumps(result))
    """
)


def test_shard_map_step_on_two_cpu_devices_equals_single_device():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    line = next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    assert result["capacities"][0] != result["capacities"][1]  # the stack really re-padded one of them
    for impl in ("jnp", "callback"):
        info = result[impl]
        assert abs(info["value"] - info["expected"]) <= 1e-12 * max(1.0, abs(info["expected"])), info
        assert info["max_grad_error"] <= 1e-12 * max(1.0, info["grad_scale"]), info
        assert info["grad_scale"] > 0
