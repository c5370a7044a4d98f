"""sparsecore.jax on a real GPU: the callback path against jnp against the dense float64 oracle.

Marked ``gpu`` (skipped without a CUDA device, and without a JAX that sees a
GPU). On the device these run what no CPU test can: ``impl="callback"`` taking
its GPU branch inside XLA (``buffer_callback`` buffers viewed by
``cupy.from_dlpack``, the rulebook carried as the padded neighbour map XLA
computes in the program (`layout.map_arrays`), the core's fused map kernels
launched on XLA's stream through ``cupy.cuda.Stream.from_external``), under
``jit`` and ``value_and_grad``, for convolutions (submanifold, strided,
transposed, grouped) and max / average pools, forward and backward. Each case is checked
against the dense oracle of `test_jax_ops` and the two implementations against
each other; a chained network under ``jit`` + ``lax.scan`` checks the stream
ordering between callbacks and XLA's own kernels.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import sparsecore.jax as sj  # noqa: E402

try:
    from . import test_jax_ops as ops
    from .test_jax_oracle import random_features, x64  # noqa: F401 (x64: fixture)
except ImportError:
    import test_jax_ops as ops  # type: ignore[no-redef]
    from test_jax_oracle import random_features, x64  # type: ignore[no-redef]  # noqa: F401


def _jax_sees_a_gpu() -> bool:
    try:
        return any(device.platform == "gpu" for device in jax.devices())
    except RuntimeError:
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("x64"),
              pytest.mark.skipif(not _jax_sees_a_gpu(), reason="JAX sees no GPU")]

CONV_CASES = {case.name: case for case in ops.CONV_CASES}
POOL_CASES = {case.name: case for case in ops.POOL_CASES}
GPU_CONV_CASES = ["3d-subm-k3", "3d-regular-k3s2p1", "2d-transposed-k3s2p1op1g2", "2d-subm-depthwise",
                  "3d-inverse-k3s2p1", "3d-subm-empty"]
GPU_POOL_CASES = ["3d-max-k3s2p1", "3d-max-subm-k3", "2d-avg-k3s2p1", "3d-avg-k2"]


@pytest.fixture
def gpu_branch_calls(monkeypatch):
    """Counts the callback's GPU-branch entries that read a neighbour map (each fetches the CuPy backend
    once and views the map's tables)."""
    from sparsecore.jax import callback, padded

    assert callback.rulebook_form() == "map", "on a GPU the callback passes carry the padded neighbour map"
    calls, maps = [], []
    original, view = callback._gpu_backend, padded.neighbour_map

    def counted():
        calls.append(1)
        return original()

    monkeypatch.setattr(callback, "_gpu_backend", counted)
    monkeypatch.setattr(padded, "neighbour_map", lambda *args: maps.append(1) or view(*args))
    yield calls
    assert not calls or maps, "the GPU branch ran without the neighbour map"


def _on_gpu(array) -> bool:
    return all(device.platform == "gpu" for device in array.devices())


@pytest.mark.parametrize("impl", ["callback", "jnp"])
@pytest.mark.parametrize("name", GPU_CONV_CASES)
def test_conv_on_the_gpu_matches_dense(name, impl, gpu_branch_calls):
    case = CONV_CASES[name]
    seed = zlib.crc32(f"conv {case.name}".encode())
    x, in_sites, features, out_sites, weight, bias, oracle = ops._prepare_conv(case, seed)
    assert _on_gpu(x.features) and _on_gpu(weight)
    argnums = (0, 1, 2) if bias is not None else (0, 1)
    ops._check_layer(x, in_sites.shape[0], out_sites, ops._sparse_layer(case, impl), oracle, weight, bias,
                     features, np.random.default_rng(seed + 1), argnums)
    if impl == "callback":
        assert gpu_branch_calls, "the callback did not take its GPU branch"


@pytest.mark.parametrize("impl", ["callback", "jnp"])
@pytest.mark.parametrize("name", GPU_POOL_CASES)
def test_pool_on_the_gpu_matches_dense(name, impl, gpu_branch_calls):
    case = POOL_CASES[name]
    seed = zlib.crc32(f"pool {case.name}".encode())
    x, indices, features, out_sites, oracle = ops._prepare_pool(case, seed)
    assert _on_gpu(x.features)
    run = sj.sparse_max_pool if case.which == "max" else sj.sparse_avg_pool

    def layer(t, w, b):
        return run(t, case.kernel, case.stride, case.padding, case.dilation, subm=case.subm, impl=impl)

    ops._check_layer(x, indices.shape[0], out_sites, layer, oracle, None, None, features,
                     np.random.default_rng(seed + 1), (0,))
    if impl == "callback":
        assert gpu_branch_calls, "the callback did not take its GPU branch"


def _planned(t, w1, w2, w3, impl):
    t = sj.sparse_conv(t, w1, kind="subm", impl=impl)
    t = sj.sparse_max_pool(t, 2, impl=impl)
    t = sj.sparse_conv(t, w2, stride=2, padding=1, impl=impl)
    t = sj.sparse_avg_pool(t, 3, 1, 1, subm=True, impl=impl)
    return sj.sparse_conv(t, w3, kind="subm", impl=impl)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_callback_equals_jnp_through_a_network_under_scan(dtype, gpu_branch_calls):
    """Five chained layers, jitted with their gradients inside ``lax.scan``: callback == jnp on the GPU.

    Consecutive callbacks and XLA's own ops (relu, the loss) share XLA's
    stream: a callback that ran on another stream, or read its inputs before
    XLA wrote them, gives different numbers from the jnp formulation.
    """
    rng = np.random.default_rng(zlib.crc32(f"network {dtype}".encode()))
    shape, batch = (12, 11, 10), 2
    indices = ops.random_sites(rng, shape, batch, 300)
    features = random_features(rng, indices.shape[0], 4).astype(dtype)
    weights = tuple(jnp.asarray(rng.uniform(-0.5, 0.5, size).astype(dtype))
                    for size in ((8, 3, 3, 3, 4), (8, 3, 3, 3, 8), (5, 3, 3, 3, 8)))
    x = sj.SparseTensor.from_arrays(features, indices, shape, batch, capacity=sj.Buckets(minimum=64))
    results = {}
    for impl in ("callback", "jnp"):
        planned = x.with_plan(sj.plan(lambda t, a, b, c, impl=impl: _planned(t, a, b, c, impl), x, *weights))

        def loss(f, w1, w2, w3, planned=planned, impl=impl):
            out = _planned(planned.replace(f), w1, w2, w3, impl).features
            return jnp.sum(out * jnp.cos(out)), out

        step = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)

        def body(carry, scale, step=step, planned=planned):
            (value, out), grads = step(planned.features * scale, *weights)
            return carry + value, (out, grads)

        total, (outs, grads) = jax.jit(lambda scales: jax.lax.scan(body, jnp.zeros((), dtype), scales))(
            jnp.asarray([1.0, -0.5, 2.0], dtype))
        results[impl] = (total, outs, grads)
    assert gpu_branch_calls, "the callback did not take its GPU branch"
    tolerance = dict(rtol=1e-9, atol=1e-9) if dtype == "float64" else dict(rtol=2e-3, atol=2e-3)
    for got, want in zip(jax.tree_util.tree_leaves(results["callback"]), jax.tree_util.tree_leaves(results["jnp"])):
        assert _on_gpu(got)
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), **tolerance)
