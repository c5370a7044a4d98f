"""Streaming clouds through sparsecore.jax compiles nothing per cloud (issue 16's 4.7 MB/cloud leak).

JAX keeps every XLA program it compiles, so a program compiled per distinct row
count is a leak when clouds stream by. Compilations are counted with
``jax.monitoring``'s backend-compile event (not RSS): after the first cloud of a
plan signature, building a tensor, replaying the plan and running the jitted
step must compile nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparsecore.jax as sj

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
GRID = (16, 16, 16)


@contextlib.contextmanager
def counting_compiles() -> Iterator[list[int]]:
    """Yields a one-element list holding the number of XLA compilations so far."""
    counter = [0]

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == COMPILE_EVENT:
            counter[0] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counter
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def _cloud(rng: np.random.Generator, rows: int) -> tuple[np.ndarray, np.ndarray]:
    flat = rng.choice(int(np.prod(GRID)), rows, replace=False)
    indices = np.stack([np.zeros(rows, np.int64), flat // 256, (flat // 16) % 16, flat % 16], 1).astype(np.int32)
    return rng.standard_normal((rows, 4)).astype(np.float32), indices


def _net(weights: dict[str, Any], x: sj.SparseTensor) -> Any:
    y = sj.subm_conv(x, weights["subm"])
    y = y.replace(jax.nn.relu(y.features))
    y = sj.sparse_conv(y, weights["down"], stride=2, padding=1)
    return sj.global_avg_pool(y)


def _weights(rng: np.random.Generator) -> dict[str, Any]:
    return {"subm": jnp.asarray(rng.uniform(-0.3, 0.3, (4, 3, 3, 3, 4)).astype(np.float32)),
            "down": jnp.asarray(rng.uniform(-0.3, 0.3, (8, 3, 3, 3, 4)).astype(np.float32))}


@pytest.mark.parametrize("capacity", [sj.Fixed(1024), sj.Buckets(minimum=256, steps_per_octave=1)],
                         ids=["fixed", "buckets"])
def test_stream_of_200_distinct_sizes_compiles_only_for_new_signatures(capacity: Any) -> None:
    rng = np.random.default_rng(7)
    weights = _weights(rng)
    sizes = rng.permutation(np.arange(300, 500))  # 200 distinct row counts
    step = jax.jit(_net)
    first_features, first_indices = _cloud(rng, int(sizes[0]))
    x0 = sj.SparseTensor.from_arrays(first_features, first_indices, GRID, 1, capacity=capacity)
    recipe = sj.plan(_net, weights, x0).recipe
    seen: set = set()
    late_compiles: list[tuple[int, int]] = []
    with counting_compiles() as compiles:
        for position, rows in enumerate(sizes.tolist()):
            features, indices = _cloud(rng, rows)
            before = compiles[0]
            x = recipe.apply(sj.SparseTensor.from_arrays(features, indices, GRID, 1, capacity=capacity))
            out = jax.block_until_ready(step(weights, x))
            new_signature = x.plan.signature not in seen
            seen.add(x.plan.signature)
            if position >= 3 and not new_signature and compiles[0] != before:
                late_compiles.append((rows, compiles[0] - before))
            if position % 50 == 0:  # the step computes the right thing on the streamed clouds
                expected = _net(weights, sj.SparseTensor.from_arrays(features, indices, GRID, 1))
                np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-6)
    assert late_compiles == [], f"clouds (rows, programs compiled) that compiled on a known signature: {late_compiles}"
    assert len(seen) <= 3


def test_building_tensors_and_plans_compiles_nothing_per_row_count() -> None:
    rng = np.random.default_rng(8)
    weights = _weights(rng)
    features, indices = _cloud(rng, 300)
    recipe = sj.plan(_net, weights, sj.SparseTensor.from_arrays(features, indices, GRID, 1)).recipe
    recipe.apply(sj.SparseTensor.from_arrays(features, indices, GRID, 1))  # first bucket: may compile
    with counting_compiles() as compiles:
        for rows in range(301, 341):
            features, indices = _cloud(rng, rows)
            x = sj.SparseTensor.from_arrays(features, indices, GRID, 1)
            x = recipe.apply(x)
            np.testing.assert_array_equal(x.valid_features(), features)
            np.testing.assert_array_equal(np.asarray(x.features)[rows:], 0)
    assert compiles[0] == 0


def test_from_arrays_pads_jax_and_float64_features_on_the_host() -> None:
    rng = np.random.default_rng(9)
    features, indices = _cloud(rng, 37)
    x = sj.SparseTensor.from_arrays(jnp.asarray(features), indices, GRID, 1, capacity=64)
    assert isinstance(x.features, jax.Array) and x.features.shape == (64, 4)
    np.testing.assert_array_equal(np.asarray(x.features)[:37], features)
    np.testing.assert_array_equal(np.asarray(x.features)[37:], 0)
    y = sj.SparseTensor.from_arrays(features.astype(np.float64), indices, GRID, 1, capacity=64)
    assert y.features.dtype == jax.dtypes.canonicalize_dtype(np.float64)  # float32 unless jax_enable_x64
