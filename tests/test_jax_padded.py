"""`sparsecore.jax.padded`: feature passes on a plan's padded arrays, against the core on the true rows.

The plan stores each rulebook once, ``[K, Q]`` rows with -1 = no pair. The
``buffer_callback`` bridge's GPU path reads it as it is (`padded.pair_map`, no
count read back to the host); it needs a backend that skips row -1, so it runs
here on the kernel backend under the CPU emulation of CUDA (and on CuPy where
a GPU is); so does the padded neighbour map the GPU callback carries
(`padded.neighbour_map` over `layout.map_arrays`), here also on the host, where
the core turns it into pairs. Its CPU path joins the true pairs
(`padded.true_pair_map`) for the NumPy backend and runs the same passes over
the full padded rows. Padding
rows of the inputs are filled with large values, to show they are masked out;
the oracle is the core on the true rows with the NumPy backend (itself tested
against dense torch convolutions), and padding rows of every result must be 0.
"""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import sparsecore as sc  # noqa: E402
from sparsecore.backends import NUMPY_BACKEND  # noqa: E402
from sparsecore.jax import padded  # noqa: E402
from sparsecore.jax.layout import map_arrays  # noqa: E402
from sparsecore.jax.plan import PaddedRulebook, SitesInfo  # noqa: E402

try:
    from cuda_emulation import device_arrays
    from kernel_targets import emulated_backend, random_sites, rng_for, target  # noqa: F401
except ImportError:  # tests/ imported as a package
    from tests.cuda_emulation import device_arrays
    from tests.kernel_targets import emulated_backend, random_sites, rng_for, target  # noqa: F401

SHAPE = (7, 8, 6)
GEOMETRIES = {
    "subm": sc.ConvGeometry.create(3, 3, kind="subm"),
    "regular": sc.ConvGeometry.create(3, 3, stride=2, padding=1),
    "transposed": sc.ConvGeometry.create(3, (2, 2, 3), stride=(2, 2, 1), kind="transposed"),
    "pool": sc.ConvGeometry.create(3, 2, stride=2),
}


def _layout(kind: str, count: int, seed: int):
    """(true core rulebook, its PaddedRulebook, capacities) for ``count`` random sites."""
    indices = random_sites(rng_for(40, seed, count), count, SHAPE, 2)
    rulebook = sc.build_rulebook(indices, SHAPE, 2, GEOMETRIES[kind])
    capacity_in = count + 13
    # a submanifold layer's output sites are its input sites: one capacity
    capacity_out = capacity_in if rulebook.identity_offset >= 0 else rulebook.num_output + 9
    sites_in = SitesInfo("input", SHAPE, 2, capacity_in)
    sites_out = SitesInfo("out", tuple(rulebook.output_spatial_shape), 2, capacity_out)
    return rulebook, PaddedRulebook.from_core(rulebook, "layer", sites_in, sites_out), capacity_in, capacity_out


def _padded_rows(rng: np.random.Generator, true_rows: np.ndarray, capacity: int) -> np.ndarray:
    rows = np.full((capacity, true_rows.shape[1]), 1e3, dtype=true_rows.dtype)  # garbage in the padding
    rows[: true_rows.shape[0]] = true_rows
    rows[true_rows.shape[0]:] *= rng.uniform(-1, 1, (capacity - true_rows.shape[0], 1))
    return rows


def _map(put, layout):
    """The padded neighbour map of the GPU callback path (`layout.map_arrays`, computed by XLA on the host)."""
    rulebook, padded_rb, capacity_in, capacity_out = layout
    tables = jax.jit(map_arrays, static_argnums=(2, 3, 4))(padded_rb.pair_input, padded_rb.pair_output,
                                                            capacity_in, capacity_out, rulebook.identity_offset >= 0)
    return padded.neighbour_map(tuple(put(np.asarray(table)) for table in tables), capacity_in, capacity_out,
                                rulebook.kernel_size)


def _pairs(target, layout, form="pairs"):
    if form == "map":
        return _map(target.put, layout)
    rulebook, padded_rb, capacity_in, capacity_out = layout
    if target is HOST:
        return padded.true_pair_map(padded_rb.pair_input, padded_rb.pair_output, padded_rb.counts, capacity_in,
                                    capacity_out, rulebook.kernel_size, rulebook.identity_offset)
    return padded.pair_map(target.put(padded_rb.pair_input), target.put(padded_rb.pair_output), capacity_in,
                           capacity_out, rulebook.kernel_size, rulebook.identity_offset)


class _Host:
    """The callback's CPU path: host arrays, the true pairs, the core's NumPy backend."""

    backend = NUMPY_BACKEND

    @staticmethod
    def put(array):
        return array

    @staticmethod
    def get(array):
        return np.asarray(array)


HOST = _Host()


@pytest.fixture(params=["host", "device"])
def where(request, target):
    """The callback's two paths: host (true pairs, NumPy) and device (padded pairs, the kernels)."""
    return HOST if request.param == "host" else target


@pytest.fixture(params=["pairs", "map"])
def form(request):
    """The rulebook form a pass carries: padded pairs, or the padded neighbour map (the GPU callback's)."""
    return request.param


def _check_rows(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    rows = expected.shape[0]
    np.testing.assert_allclose(actual[:rows], expected, rtol=1e-5, atol=1e-5, err_msg=what)
    assert (actual[rows:] == 0).all(), f"{what}: padding rows are not zero"


@pytest.mark.parametrize("count", [0, 120])
@pytest.mark.parametrize("kind", ["subm", "regular", "transposed"])
def test_padded_conv_equals_the_core_on_true_rows(where, form, kind, count):
    target = where
    layout = _layout(kind, count, len(kind))
    rulebook, _, capacity_in, capacity_out = layout
    rng = rng_for(41, len(kind), count)
    features = rng.standard_normal((rulebook.num_input, 4)).astype(np.float32)
    weight = rng.standard_normal((5, *rulebook.kernel_size, 4)).astype(np.float32)
    grad_output = rng.standard_normal((rulebook.num_output, 5)).astype(np.float32)
    expected = sc.conv_forward(features, weight, rulebook, backend=NUMPY_BACKEND)
    expected_grads = sc.conv_backward(grad_output, features, weight, rulebook, backend=NUMPY_BACKEND)

    pairs = _pairs(target, layout, form)
    n_in, n_out = (target.put(np.asarray(value, np.int32)) for value in (rulebook.num_input, rulebook.num_output))
    x = target.put(_padded_rows(rng, features, capacity_in))
    out = padded.conv_forward(target.backend, x, target.put(weight), pairs, n_in, n_out, groups=1)
    _check_rows(target.get(out), expected, "forward")
    grad = target.put(_padded_rows(rng, grad_output, capacity_out))
    grad_x, grad_w = padded.conv_backward(target.backend, grad, x, target.put(weight), pairs, n_in, n_out, groups=1)
    _check_rows(target.get(grad_x), expected_grads[0], "grad_features")
    np.testing.assert_allclose(target.get(grad_w), expected_grads[1], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["pool", "subm"])
def test_padded_pools_equal_the_core_on_true_rows(where, form, kind):
    target = where
    layout = _layout(kind, 150, 7)
    rulebook, _, capacity_in, capacity_out = layout
    rng = rng_for(42, len(kind))
    features = rng.standard_normal((rulebook.num_input, 3)).astype(np.float32)
    grad_output = rng.standard_normal((rulebook.num_output, 3)).astype(np.float32)
    pairs = _pairs(target, layout, form)
    x = target.put(_padded_rows(rng, features, capacity_in))
    grad = target.put(_padded_rows(rng, grad_output, capacity_out))

    expected, expected_argmax = sc.max_pool_forward(features, rulebook, backend=NUMPY_BACKEND)
    out, argmax = padded.max_pool_forward(target.backend, x, pairs)
    _check_rows(target.get(out), expected, "max pool")
    np.testing.assert_array_equal(target.get(argmax)[: rulebook.num_output], expected_argmax)
    assert (target.get(argmax)[rulebook.num_output:] == -1).all()
    expected = sc.max_pool_backward(grad_output, expected_argmax, rulebook.num_input, backend=NUMPY_BACKEND)
    _check_rows(target.get(padded.max_pool_backward(target.backend, grad, argmax, pairs)), expected,
                "max pool backward")

    expected = sc.avg_pool_forward(features, rulebook, backend=NUMPY_BACKEND)
    _check_rows(target.get(padded.avg_pool_forward(target.backend, x, pairs)), expected, "avg pool")
    expected = sc.avg_pool_backward(grad_output, rulebook, backend=NUMPY_BACKEND)
    _check_rows(target.get(padded.avg_pool_backward(target.backend, grad, pairs)), expected, "avg pool backward")


def test_padded_pair_maps_are_refused_by_the_numpy_backend():
    layout = _layout("subm", 40, 3)
    rulebook, padded_rb, capacity_in, capacity_out = layout
    pairs = padded.pair_map(padded_rb.pair_input, padded_rb.pair_output, capacity_in, capacity_out,
                            rulebook.kernel_size, rulebook.identity_offset)
    features = np.ones((capacity_in, 2), np.float32)
    with pytest.raises(ValueError, match="PairMap is padded .* numpy backend cannot skip"):
        sc.conv_forward(features, np.ones((2, 3, 3, 3, 2), np.float32), pairs)
    with pytest.raises(ValueError, match="PairMap is padded"):
        sc.max_pool_forward(features, pairs)


def _device_passes(kind: str, seed: int, form: str = "pairs"):
    """Runs every padded pass of one layer on emulated device arrays; returns the results on the host."""
    layout = _layout(kind, 90, seed)
    tables = _map(device_arrays.to_device, layout) if form == "map" else None
    rulebook, padded_rb, capacity_in, capacity_out = layout
    rng = rng_for(43, len(kind), seed)
    backend = device_arrays.device_backend(emulated_backend())
    put = device_arrays.to_device
    x = put(_padded_rows(rng, rng.standard_normal((rulebook.num_input, 3)).astype(np.float32), capacity_in))
    grad = put(_padded_rows(rng, rng.standard_normal((rulebook.num_output, 3)).astype(np.float32), capacity_out))
    weight = put(rng.standard_normal((4, *rulebook.kernel_size, 3)).astype(np.float32))
    grad_conv = put(_padded_rows(rng, rng.standard_normal((rulebook.num_output, 4)).astype(np.float32),
                                 capacity_out))
    n_in, n_out = (put(np.asarray(value, np.int32)) for value in (rulebook.num_input, rulebook.num_output))
    with device_arrays.forbid_host_reads():
        pairs = tables if form == "map" else padded.pair_map(
            put(padded_rb.pair_input), put(padded_rb.pair_output), capacity_in, capacity_out, rulebook.kernel_size,
            rulebook.identity_offset)
        results = {"conv": padded.conv_forward(backend, x, weight, pairs, n_in, n_out, groups=1)}
        results["conv grads"] = padded.conv_backward(backend, grad_conv, x, weight, pairs, n_in, n_out, groups=1)
        results["max"], argmax = padded.max_pool_forward(backend, x, pairs)
        results["max backward"] = padded.max_pool_backward(backend, grad, argmax, pairs)
        results["avg"] = padded.avg_pool_forward(backend, x, pairs)
        results["avg backward"] = padded.avg_pool_backward(backend, grad, pairs)
    return results


@pytest.mark.parametrize("form", ["pairs", "map"])
@pytest.mark.parametrize("kind", ["pool", "subm", "regular"])
def test_padded_passes_never_read_the_device(monkeypatch, kind, form):
    """The GPU callback's contract: no device-to-host read anywhere in a feature pass.

    The arrays are `device_arrays.DeviceArray`: any int()/float()/bool()/item()/
    tolist()/get()/asnumpy, boolean mask or data-sized function (bincount,
    nonzero, unique...) on them raises, whoever calls it.
    """
    device_arrays.use_device_arrays(monkeypatch)
    results = _device_passes(kind, 8, form)
    for name, value in results.items():  # all computed, and still "on the device"
        for array in (value if isinstance(value, tuple) else (value,)):
            assert isinstance(array, device_arrays.DeviceArray), name


def test_the_host_read_detector_catches_bincount_and_conversions(monkeypatch):
    """The detector itself: the reads CuPy would synchronise on are refused (bincount reads its max back)."""
    device_arrays.use_device_arrays(monkeypatch)
    xp = device_arrays.DEVICE_NUMPY
    rows = device_arrays.to_device(np.array([0, 2, 2, -1], np.int32))
    with device_arrays.forbid_host_reads():
        for read in (lambda: xp.bincount(rows + 1), lambda: np.bincount(rows + 1), lambda: int(rows[0]),
                     lambda: float(rows.sum()), lambda: bool((rows >= 0).all()), lambda: rows.max().item(),
                     lambda: rows.tolist(), lambda: rows.get(), lambda: xp.asnumpy(rows),
                     lambda: rows[rows >= 0], lambda: xp.nonzero(rows), lambda: xp.unique(rows),
                     lambda: list(rows), lambda: xp.repeat(rows, rows + 1)):
            with pytest.raises(device_arrays.HostReadError):
                read()
        total = xp.zeros(3, np.float32)  # device-side work is fine
        total[rows.clip(0)] += 1
    assert isinstance(total, device_arrays.DeviceArray) and total.tolist() == [1.0, 0.0, 1.0]
