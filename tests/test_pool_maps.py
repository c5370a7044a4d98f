"""Pooling over neighbour maps (``kernels_cu/pool_maps.cu``): kernels against twins, passes against the dense oracle.

The kernels run through `sparsecore.backends._kernel_fused.FusedPasses` on the
CPU emulation (and on CuPy where a GPU is present) and must equal the NumPy
twins of ``cuda_emulation/fused_twins.py`` bitwise on random data (the twins
follow the kernels' order: offsets ascending, sums in the accumulator type).
Then `sparsecore.pool`'s passes on the emulated kernel backend (rulebooks
built there, as maps) against the dense float64 oracle of ``dense_oracle``,
forward and backward, and one launch per pass.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import sparsecore as sc
from sparsecore import pool
from sparsecore.backends._kernel_fused import FusedPasses
from sparsecore.neighbour_map import neighbour_map_from_pairs, stored_masks

try:
    from . import dense_oracle as do
    from .cuda_emulation import fused_twins as twins
    from .cuda_emulation.emulated_launcher import RecordingLauncher
    from .cuda_emulation.numpy_twins import narrow
    from .kernel_targets import emulated_backend, rng_for, target  # noqa: F401
    from .fused_maps import bits, on_target, random_map, storage, symmetric_map
except ImportError:
    import dense_oracle as do
    from cuda_emulation import fused_twins as twins
    from cuda_emulation.emulated_launcher import RecordingLauncher
    from cuda_emulation.numpy_twins import narrow
    from kernel_targets import emulated_backend, rng_for, target  # noqa: F401
    from fused_maps import bits, on_target, random_map, storage, symmetric_map

DTYPES = ("float32", "float64", "float16", "bfloat16")


def _random(rng, shape, dtype_name):
    return narrow(rng.uniform(-2, 2, size=shape).astype(np.float32), dtype_name)


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("symmetric", [False, True])
def test_pool_kernels_equal_their_twins(target, dtype_name, symmetric):
    rng = rng_for(50, DTYPES.index(dtype_name), int(symmetric))
    neighbour_map = symmetric_map(rng, 70, (3, 3)) if symmetric else random_map(rng, 80, 60, (2, 3), density=0.6)
    features = _random(rng, (neighbour_map.num_input, 5), dtype_name)
    features[:20] = features[20:40]  # ties between inputs
    if dtype_name in ("float32", "float64"):
        features[3, 1] = np.nan  # a NaN wins its windows
    grad_output = _random(rng, (neighbour_map.num_output, 5), dtype_name)
    passes = FusedPasses(target.backend.device)
    device_map = on_target(target, neighbour_map)
    put = lambda array: storage(target, array, dtype_name)  # noqa: E731
    out, argmax = passes.max_pool_forward(put(features), device_map)
    expected_out, expected_argmax = twins.max_pool_map(features, neighbour_map.output_neighbours, dtype_name)
    np.testing.assert_array_equal(bits(target, out, dtype_name), expected_out, "max forward")
    np.testing.assert_array_equal(target.get(argmax), expected_argmax, "argmax")
    table, _, _, reversed_offsets = neighbour_map.input_side()
    grad = passes.max_pool_backward(put(grad_output), argmax, device_map)
    expected = twins.max_pool_map_backward(grad_output, expected_argmax, table, reversed_offsets, dtype_name)
    np.testing.assert_array_equal(bits(target, grad, dtype_name), expected, "max backward")
    out = passes.avg_pool_forward(put(features), device_map)
    expected = twins.avg_pool_map(features, neighbour_map.output_neighbours, dtype_name)
    np.testing.assert_array_equal(bits(target, out, dtype_name), expected, "avg forward")
    grad = passes.avg_pool_backward(put(grad_output), device_map)
    expected = twins.avg_pool_map_backward(grad_output, table, neighbour_map.output_neighbours, reversed_offsets,
                                           dtype_name)
    np.testing.assert_array_equal(bits(target, grad, dtype_name), expected, "avg backward")


def test_windows_without_inputs_give_zero_and_argmax_minus_one(target):
    neighbour_map = random_map(rng_for(51), 30, 25, (3,), empty_rows=5)
    passes = FusedPasses(target.backend.device)
    features = target.put(np.full((30, 2), 7.0, np.float32))
    out, argmax = passes.max_pool_forward(features, on_target(target, neighbour_map))
    empty = ~np.any(neighbour_map.output_neighbours >= 0, axis=1)
    assert empty[-5:].all()
    np.testing.assert_array_equal(target.get(out)[empty], 0)
    np.testing.assert_array_equal(target.get(argmax)[empty], -1)
    np.testing.assert_array_equal(target.get(passes.avg_pool_forward(features, on_target(target, neighbour_map)))[empty],
                                  0)


EDGE_VALUES = {
    # Largest finite values, ties at the rounding boundary, subnormals, signed zeros.
    "float16": [0.0, -0.0, 2.0**-24, 3 * 2.0**-24, 2.0**-14, 65504.0, -65504.0, 32768.0, 16.0, 2048.0, 1.0, 3.0,
                -2.0**-24, 1e-3, 0.1],
    # Kept clear of float32 subnormals, which the GPU flushes to zero (CuPy compiles with -ftz=true).
    "bfloat16": [0.0, -0.0, 3.3895e38, -3.3895e38, 1.7e38, 2.0**-120, 2.0**-124, 256.0, 1.0, 3.0, 1e-3, 0.1],
}


@pytest.mark.parametrize("dtype_name", sorted(EDGE_VALUES))
def test_16_bit_rounding_edge_cases(target, dtype_name):
    """Means of every pair and triple of edge values (rounding ties, into subnormals), and the sums of the
    backward (overflow to inf), bit for bit."""
    values = narrow(np.array(EDGE_VALUES[dtype_name], dtype=np.float32)[:, None], dtype_name)
    count = values.shape[0]
    windows = np.array([(a, b, c) for a in range(count) for b in range(count) for c in range(count)
                        if c == b or len({a, b, c}) == 3], dtype=np.int32)
    windows[windows[:, 1] == windows[:, 2], 2] = -1  # pairs: a window with two inputs
    inputs, offsets = windows.T.reshape(-1), np.repeat(np.arange(3), windows.shape[0])
    keep = inputs >= 0
    outputs = np.tile(np.arange(windows.shape[0]), 3)[keep]
    starts = np.concatenate([[0], np.cumsum(np.bincount(offsets[keep], minlength=3))])
    neighbour_map = neighbour_map_from_pairs(np, inputs[keep].astype(np.int32), outputs.astype(np.int32),
                                             tuple(int(v) for v in starts), count, windows.shape[0], (3,))
    passes = FusedPasses(target.backend.device)
    device_map = on_target(target, neighbour_map)
    out = passes.avg_pool_forward(storage(target, values, dtype_name), device_map)
    expected = twins.avg_pool_map(values, neighbour_map.output_neighbours, dtype_name)
    np.testing.assert_array_equal(bits(target, out, dtype_name).view(np.uint16), expected.view(np.uint16))
    grad_output = values[np.arange(windows.shape[0]) % count]
    grad = passes.avg_pool_backward(storage(target, grad_output, dtype_name), device_map)
    expected = twins.avg_pool_map_backward(grad_output, neighbour_map.input_neighbours,
                                           neighbour_map.output_neighbours, False, dtype_name)
    np.testing.assert_array_equal(bits(target, grad, dtype_name).view(np.uint16), expected.view(np.uint16))


POOL_CASES = do.sample_cases("regular", 6, ndims=(1, 2, 3), base_seed=5200, grouped=False, max_kernel=3) + \
    do.sample_cases("subm", 4, ndims=(2, 3), base_seed=5300, grouped=False, max_kernel=3)


@pytest.mark.parametrize("case", POOL_CASES, ids=str)
def test_pools_on_the_emulated_backend_against_the_dense_oracle(case):
    """Max and average pools, forward and backward, one launch per pass, against dense float64 torch ops."""
    backend = emulated_backend()
    features, indices, _ = case.inputs()
    rulebook = sc.build_pool_rulebook(indices, case.spatial_shape, case.batch_size, case.kernel_size,
                                      stride=None if case.kind == "subm" else case.stride,
                                      padding=0 if case.kind == "subm" else case.padding, dilation=case.dilation,
                                      subm=case.kind == "subm", backend=backend)
    sites = do.pool_sites(case, indices)
    do.assert_sites(rulebook.output_indices, sites)
    grad_output = do.random_features(case.rng(), sites.shape[0], case.in_channels)
    for oracle_fn, forward, backward in (
            (do.max_pool_oracle, pool.max_pool_forward,
             lambda grad, state: pool.max_pool_backward(grad, state[1], rulebook.num_input, rulebook=rulebook,
                                                        backend=backend)),
            (do.avg_pool_oracle, pool.avg_pool_forward,
             lambda grad, state: pool.avg_pool_backward(grad, rulebook, backend=backend))):
        oracle = do.evaluate(oracle_fn(case, indices), features, sites, grad_output=grad_output)
        state = forward(features, rulebook, backend=backend)
        out = state[0] if isinstance(state, tuple) else state
        do.assert_close(out, oracle.values, f"{forward.__name__}")
        do.assert_close(backward(grad_output, state), oracle.grad_features, f"{forward.__name__} backward")


def test_a_pool_pass_is_one_launch_and_reads_no_pairs():
    backend = emulated_backend()
    launcher = RecordingLauncher(backend.launcher)
    recording = dataclasses.replace(backend, launcher=launcher)
    rng = rng_for(52)
    indices = np.unique(rng.integers(0, 6, size=(90, 4)), axis=0).astype(np.int32)
    indices[:, 0] = indices[:, 0] % 2
    indices = np.unique(indices, axis=0)
    rulebook = sc.build_pool_rulebook(indices, (6, 6, 6), 2, 2, stride=2, backend=recording)
    features = rng.uniform(-1, 1, (indices.shape[0], 3)).astype(np.float32)
    built = len(launcher.records)
    out, argmax = pool.max_pool_forward(features, rulebook, backend=recording)
    pool.max_pool_backward(np.ones_like(out), argmax, indices.shape[0], rulebook=rulebook, backend=recording)
    pool.avg_pool_backward(np.ones_like(out), rulebook, backend=recording)
    names = [record.expression.split("<")[0] for record in launcher.records[built:]]
    assert names == ["sc_max_pool_map", "sc_max_pool_map_backward", "sc_avg_pool_map_backward"]
    assert "pair_map" not in rulebook.stored_map.derived  # no pair list was derived
    assert stored_masks(rulebook.stored_map, "input") is None  # nor the input masks, which no pool kernel reads
