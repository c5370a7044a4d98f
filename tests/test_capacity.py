"""Capacity mode (`sparsecore.capacity`): builds at a capacity with no read back, against exact mode.

Oracle: exact mode (itself checked against the dense convolution elsewhere), run on the same inputs:
the true rows of every capacity-mode output, input gradient and weight gradient must be bitwise equal.
On the CPU (NumPy backend) and on the kernel backend's g++ emulation, where `device_arrays` refuses every
read back while a forward with its builds, or a backward, runs; the emulation's guarded arrays catch any
write past a buffer (an overflowing capacity writes nothing past it).
"""

from __future__ import annotations


import numpy as np
import pytest

import sparsecore as sc
from sparsecore.buckets import Buckets
from sparsecore.capacity import (BoundCapacity, FixedCapacity, LearnedCapacity, as_capacity_policy, capacity_bound,
                                 true_rows)

try:
    from . import capacity_networks as networks
    from .cuda_emulation import device_arrays
    from .kernel_targets import emulated_backend, random_sites, rng_for
except ImportError:
    import capacity_networks as networks
    from cuda_emulation import device_arrays
    from kernel_targets import emulated_backend, random_sites, rng_for

SHAPES = {1: (40,), 2: (12, 10), 3: (10, 9, 8), 4: (6, 5, 6, 5)}


@pytest.fixture
def device(monkeypatch):
    """The emulated kernel backend on `device_arrays.DeviceArray`, routed as the core routes CuPy arrays;
    yields the reads back attempted (each refused while `forbid_host_reads` is active)."""
    backend = device_arrays.device_backend(emulated_backend())
    reads = device_arrays.route_to_emulated_backend(monkeypatch, backend)
    return reads


def _case(ndim: int, count: int = 60, seed: int = 0):
    count = min(count, 24) if ndim == 4 else count  # 81 offsets a layer: a cheap emulation
    rng = rng_for(3600, ndim, seed)
    shape = SHAPES[ndim]
    indices = random_sites(rng, count, shape, 2)
    features = rng.uniform(-1, 1, (count, networks.CHANNELS)).astype(np.float32)
    return rng, shape, indices, features, networks.parameters(ndim, 3600 + ndim)


def _padded_grad(grad: np.ndarray, rows: int) -> np.ndarray:
    padded = np.zeros((rows, grad.shape[1]), grad.dtype)
    padded[:grad.shape[0]] = grad
    return padded


def _assert_true_rows(exact_run, capacity_run, get=np.asarray) -> int:
    rows = exact_run.output.shape[0]
    output, sites = get(capacity_run.output), get(capacity_run.output_indices)
    assert output.shape[0] >= rows
    assert np.asarray(exact_run.output).tobytes() == output[:rows].tobytes()
    np.testing.assert_array_equal(np.asarray(exact_run.output_indices), sites[:rows])
    assert (sites[rows:] == -1).all()  # padding: sites of -1
    return rows


@pytest.mark.parametrize("ndim", [1, 2, 3, 4])
def test_cpu_capacity_mode_gives_the_exact_true_rows_and_gradients(ndim):
    rng, shape, indices, features, params = _case(ndim)
    exact = networks.forward(features, indices, shape, 2, params)
    policy = LearnedCapacity()
    for step in range(2):  # the bound, then what the policy learned
        run = networks.forward(features, indices, shape, 2, params, capacity=policy)
        rows = _assert_true_rows(exact, run)
        grad = rng.uniform(-1, 1, (rows, networks.CHANNELS)).astype(np.float32)
        want_input, want_weights = networks.backward(exact, grad, params)
        got_input, got_weights = networks.backward(run, _padded_grad(grad, run.output.shape[0]), params)
        assert want_input.tobytes() == got_input.tobytes()
        for want, got in zip(want_weights, got_weights):
            assert (want is None and got is None) or want.tobytes() == got.tobytes()
        needed = sc.check_capacity(networks.rulebooks(run), policy)
        assert needed == {name: count for name, count in needed.items() if count <= 2 * 60 * 27}
        assert set(policy.observed) == set(needed)


@pytest.mark.parametrize("ndim", [1, 3, 4])
def test_emulated_capacity_mode_reads_nothing_back_and_matches_exact_mode(device, ndim):
    reads = device
    rng, shape, indices, features, params = _case(ndim, count=60 if ndim == 1 else 32, seed=1)
    put = device_arrays.to_device
    exact = networks.forward(features, indices, shape, 2, params, put=put)
    policy = LearnedCapacity()
    for step in range(2 if ndim == 1 else 1):  # the bound, then the learned capacities (1-D: cheap)
        reads.clear()
        with device_arrays.forbid_host_reads():
            run = networks.forward(features, indices, shape, 2, params, capacity=policy, put=put)
        assert reads == []
        rows = _assert_true_rows(exact, run)
        grad = rng.uniform(-1, 1, (rows, networks.CHANNELS)).astype(np.float32)
        want_input, want_weights = networks.backward(exact, put(grad), params, put=put)
        padded = put(_padded_grad(grad, run.output.shape[0]))
        with device_arrays.forbid_host_reads():
            got_input, got_weights = networks.backward(run, padded, params, put=put)
        assert reads == []
        np.testing.assert_array_equal(np.asarray(want_input), np.asarray(got_input))
        for want, got in zip(want_weights, got_weights):
            if want is not None:  # a weight gradient sums over rows: same terms, the padding adds zeros; the
                # splits (tile_shapes.weight_gradient_splits) follow the map's row count, so the capacity's map
                # sums them in another order: equal within float32 rounding of a reordered sum
                want, got = np.asarray(want), np.asarray(got)
                bound = 64 * np.finfo(np.float32).eps * np.abs(want).max()
                np.testing.assert_allclose(got, want, rtol=1e-6, atol=bound)
        run.tensor.check_capacity()  # one read: the counts, taught to the policy
    assert all(isinstance(rulebook.neighbour_map.output_neighbours, device_arrays.DeviceArray)
               for rulebook in networks.rulebooks(run))


def test_an_overflowing_capacity_writes_nothing_past_it_and_check_names_the_layer(device):
    """On the emulation every kernel argument runs between guard pages: a write past a table would raise."""
    rng, shape, indices, features, params = _case(3, seed=2)
    put = device_arrays.to_device
    for where, source in (("emulation", put), ("cpu", lambda array: array)):
        with device_arrays.forbid_host_reads():
            run = networks.forward(features, indices, shape, 2, params, capacity=FixedCapacity(5), put=source)
        assert run.saved[1][1].num_output == 5
        with pytest.raises(sc.CapacityOverflowError) as raised:
            run.tensor.check_capacity()
        error = raised.value
        assert error.name == "a regular layer [d0] on grid (10, 9, 8)" and error.capacity == 5, where
        exact = networks.forward(features, indices, shape, 2, params)
        assert error.needed == exact.saved[1][1].num_output > 5
        for phrase in ("needed", "capacity was 5", "FixedCapacity", "LearnedCapacity(margin=", "exact mode"):
            assert phrase in str(error)


@pytest.mark.parametrize("problem", ["duplicate", "outside"])
def test_first_layer_site_checks_stay_on_the_device_until_checked(device, problem):
    reads = device
    _, shape, indices, features, params = _case(3, seed=3)
    if problem == "duplicate":
        indices[40] = indices[7]
    else:
        indices[12, 2] = shape[1]
    with pytest.raises(ValueError) as expected:
        sc.SparseTensor(features, indices, shape, 2)
    put = device_arrays.to_device
    with device_arrays.forbid_host_reads():
        run = networks.forward(features, indices, shape, 2, params, capacity=True, put=put)
    assert reads == []
    with pytest.raises(ValueError) as actual:
        run.tensor.check_capacity()
    assert str(actual.value) == str(expected.value)


@pytest.mark.parametrize("padding_rows", [0, 17])
def test_padded_and_empty_inputs(device, padding_rows):
    """Static input buffers: rows of -1 after the true ones are skipped by every build; an empty cloud works."""
    _, shape, indices, features, params = _case(2, seed=4)
    for count in (60, 0):
        sites = np.concatenate([indices[:count], np.full((padding_rows, 3), -1, np.int32)])
        values = np.concatenate([features[:count], np.zeros((padding_rows, networks.CHANNELS), np.float32)])
        assert true_rows(sites) == count
        for put in (device_arrays.to_device, lambda array: array):
            exact = networks.forward(features[:count], indices[:count], shape, 2, params, put=put)
            with device_arrays.forbid_host_reads():
                run = networks.forward(values, sites, shape, 2, params, capacity=True, put=put)
            _assert_true_rows(exact, run)
            needed = run.tensor.check_capacity()
            assert needed["a regular layer [d0] on grid (12, 10)"] == exact.saved[1][1].num_output


def test_policies():
    geometry = sc.ConvGeometry.create(3, 2, 2, kind="regular")
    assert capacity_bound(geometry, 1000, (4, 4, 4), 2) == 128  # capped by the output grid's cells
    assert capacity_bound(sc.ConvGeometry.create(3, 3, 2, 1, kind="regular"), 10, (50, 50, 50), 1) == 80
    assert BoundCapacity().build_capacity("a", 300) == 300
    assert FixedCapacity(50).build_capacity("a", 300) == 50
    assert FixedCapacity({"a": 7}).build_capacity("b", 300) == 300
    learned = LearnedCapacity(margin=1.25, buckets=Buckets(minimum=16, steps_per_octave=4))
    assert learned.build_capacity("a", 1000) == 1000  # not seen yet: the bound
    learned.observe("a", 100)
    learned.observe("a", 90)
    assert learned.observed == {"a": 100}
    assert learned.build_capacity("a", 1000) == Buckets(minimum=16, steps_per_octave=4).round_up(125) == 128
    assert learned.build_capacity("a", 110) == 110  # never above the bound
    assert isinstance(as_capacity_policy(True), LearnedCapacity) and as_capacity_policy(None) is None
    assert isinstance(as_capacity_policy("bound"), BoundCapacity) and as_capacity_policy(12).rows == 12
    with pytest.raises(TypeError, match="capacity must be"):
        as_capacity_policy(1.5)
    with pytest.raises(ValueError, match="margin"):
        LearnedCapacity(margin=0.5)
    with pytest.raises(ValueError, match="rows"):
        FixedCapacity(0)


def test_the_bound_respects_the_memory_budget():
    import sparsecore.memory_budget as memory

    geometry = sc.ConvGeometry.create(3, 3, 1, 1, kind="regular")
    with memory.budget("4M"):
        bound = capacity_bound(geometry, 10**6, (500, 500, 500), 1)
    assert bound * 4 * (4 + 2 * 27) <= 4 * 2**20 < (bound + 1) * 4 * (4 + 2 * 27) + 4 * 2**20


def test_padding_rows_must_come_last():
    _, shape, indices, features, params = _case(2, seed=5)
    sites = np.concatenate([indices[:10], np.full((3, 3), -1, np.int32), indices[10:20]])
    values = np.concatenate([features[:10], np.zeros((3, networks.CHANNELS), np.float32), features[10:20]])
    with pytest.raises(ValueError, match="padding rows come after every true row"):
        networks.forward(values, sites, shape, 2, params, capacity=True)


@pytest.mark.gpu
def test_cupy_capacity_step_does_not_synchronise():  # pragma: no cover - needs a GPU
    """On CuPy a capacity-mode forward with its builds, and a backward, run under cupyx.allow_synchronize(False)."""
    import cupy
    import cupyx

    rng, shape, indices, features, params = _case(3, seed=6)
    policy = LearnedCapacity()
    put = cupy.asarray
    exact = networks.forward(features, indices, shape, 2, params, put=put)
    sc.check_capacity(networks.rulebooks(networks.forward(features, indices, shape, 2, params, capacity=policy,
                                                          put=put)), policy)
    sites, values = put(indices), put(features)
    cupy.cuda.Device().synchronize()
    with cupyx.allow_synchronize(False):
        run = networks.forward(values, sites, shape, 2, params, capacity=policy, put=put)
        grad = cupy.zeros(run.output.shape, dtype=run.output.dtype)
        grad[:8] = 1
        networks.backward(run, grad, params, put=put)
    rows = exact.output.shape[0]
    np.testing.assert_allclose(cupy.asnumpy(run.output[:rows]), cupy.asnumpy(exact.output), rtol=1e-5, atol=1e-5)
    run.tensor.check_capacity()


def test_core_global_pools_leave_the_padding_out():
    _, shape, indices, features, params = _case(3, seed=7)
    exact = sc.SparseTensor(features, indices, shape, 2)
    sites = np.concatenate([indices, np.full((9, 4), -1, np.int32)])
    values = np.concatenate([features, np.ones((9, networks.CHANNELS), np.float32)])  # padding: any values
    padded = sc.SparseTensor(values, sites, shape, 2, capacity=True)
    for pool in (sc.global_max_pool, sc.global_avg_pool):
        assert pool(padded).tobytes() == pool(exact).tobytes()


def test_sparse_add_of_other_sites_is_refused_in_capacity_mode():
    _, shape, indices, features, _ = _case(2, seed=8)
    first = sc.SparseTensor(features[:30], indices[:30], shape, 2, capacity=True)
    second = sc.SparseTensor(features[30:], indices[30:], shape, 2, capacity=True)
    assert sc.sparse_add(first, first).core_features.tobytes() == (features[:30] * 2).tobytes()
    with pytest.raises(ValueError, match="not available in capacity mode"):
        sc.sparse_add(first, second)
