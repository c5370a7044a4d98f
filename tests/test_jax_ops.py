"""sparsecore.jax ops against dense ``jax.lax`` oracles in float64: forward and gradients.

Each case runs through the public API (plan built eagerly, the op jitted with
``jax.value_and_grad``) with both feature-pass implementations, and compares
with the dense computation on the densified input (`test_jax_oracle`) read at
the output's active sites, which themselves come from the dense op on the
occupancy mask. Covers 1-3 spatial axes, odd / even / anisotropic kernels,
strides, paddings, dilations, output padding, groups, batches, empty inputs,
and `jax.test_util.check_grads` on every op.

Every case runs on "jnp" and "callback"; the two emulated GPU branches of the
callback run a covering subset (`DEVICE_CONV_CASES`, `DEVICE_POOL_CASES`: every
kind, dimensionality, groups, dilation, output padding and an empty input on
each, checked by `test_device_subsets_cover_every_class`). A case's inputs and
its dense oracle's value and gradients are computed once (`_conv_expected`,
`_pool_expected`) and shared by its impls.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zlib
from jax.test_util import check_grads

import sparsecore as sc
import sparsecore.jax as sj

try:
    from .test_jax_oracle import (
        active_sites, as_tuple, dense_avg_pool, dense_conv, dense_conv_transpose, dense_max_pool, densify,
        mask_of, ones_kernel, random_features, random_sites, read_sites, x64)  # noqa: F401 (x64: fixture)
except ImportError:
    from test_jax_oracle import (  # type: ignore[no-redef]
        active_sites, as_tuple, dense_avg_pool, dense_conv, dense_conv_transpose, dense_max_pool, densify,
        mask_of, ones_kernel, random_features, random_sites, read_sites, x64)  # noqa: F401 (x64: fixture)

try:
    from .cuda_emulation import device_arrays
    from .kernel_targets import emulated_backend
except ImportError:
    from cuda_emulation import device_arrays  # type: ignore[no-redef]
    from kernel_targets import emulated_backend  # type: ignore[no-redef]

pytestmark = pytest.mark.usefixtures("x64")
IMPLS = ["jnp", "callback"]
# "callback-device": impl="callback" taking its GPU branch (padded pairs, counts on the device), with the
# buffers left on the CPU and the GPU kernels run by the CPU emulation of CUDA; "callback-device-map": the
# same with the rulebook carried as the padded neighbour map XLA computes (the form traced on a GPU)
ORACLE_IMPLS = IMPLS + ["callback-device", "callback-device-map"]


def _use_impl(impl, monkeypatch):
    """The impl to pass to the ops; for "callback-device", routes the callback through its GPU branch.

    The callback's buffers become `device_arrays.DeviceArray` views and its
    backend the emulated kernels on `device_arrays.DEVICE_NUMPY`, and the GPU
    branch runs with host reads forbidden: any device-to-host read (int(),
    float(), bool(), item(), tolist(), get(), asnumpy, a boolean mask, bincount,
    nonzero...) fails the test, whichever function makes it.
    """
    if not impl.startswith("callback-device"):
        return impl
    from sparsecore.jax import callback

    if impl == "callback-device-map":
        monkeypatch.setattr(callback, "rulebook_form", lambda: "map")

    backend = device_arrays.device_backend(emulated_backend())
    core_view = callback._view
    device_arrays.use_device_arrays(monkeypatch)
    monkeypatch.setattr(callback, "_view", lambda buffer, name: core_view(buffer, name).view(
        device_arrays.DeviceArray))
    monkeypatch.setattr(callback, "is_cupy_array", lambda value: True)
    monkeypatch.setattr(callback, "_core_scope", lambda ctx, probe: device_arrays.forbid_host_reads())
    monkeypatch.setattr(callback, "_gpu_backend", lambda: backend)
    return "callback"
TOL = dict(rtol=1e-10, atol=1e-10)


@dataclass(frozen=True)
class ConvCase:
    """A conv layer under test: its geometry (the core's public `ConvGeometry`), grid and sizes (see `_case`)."""

    name: str
    shape: tuple
    geometry: sc.ConvGeometry
    groups: int
    batch: int
    num: int
    cin: int
    cout: int
    bias: bool
    minimum: int

    kind = property(lambda self: self.geometry.kind)
    kernel = property(lambda self: self.geometry.kernel_size)
    stride = property(lambda self: self.geometry.stride)
    padding = property(lambda self: self.geometry.padding)
    dilation = property(lambda self: self.geometry.dilation)
    output_padding = property(lambda self: self.geometry.output_padding)
    ndim = property(lambda self: self.geometry.ndim)


def _case(name, kind, shape, kernel, stride=1, padding=0, dilation=1, output_padding=0, *, groups=1, batch=2,
          num=40, cin=4, cout=6, bias=True, minimum=8):
    """A `ConvCase` whose geometry the core builds and validates (`sparsecore.ConvGeometry.create`)."""
    geometry = sc.ConvGeometry.create(len(shape), kernel, stride, padding, dilation, output_padding, kind=kind)
    return ConvCase(name, shape, geometry, groups, batch, num, cin, cout, bias, minimum)


CONV_CASES = [
    _case("1d-regular-k3s2p1", "regular", (23,), 3, 2, 1),
    _case("1d-subm-k5d2", "subm", (30,), 5, dilation=2, cin=3, cout=2),
    _case("1d-transposed-k4s3p1op2", "transposed", (9,), 4, 3, 1, output_padding=2, num=10),
    _case("2d-regular-k3d2g2", "regular", (9, 8), 3, 1, 0, 2, groups=2),
    _case("2d-regular-even-k2s2", "regular", (8, 7), 2, 2, 0, bias=False),
    _case("2d-regular-aniso", "regular", (9, 10), (3, 2), (2, 1), (1, 0), (1, 2), cin=2, cout=3),
    _case("2d-transposed-k3s2p1op1g2", "transposed", (5, 6), 3, 2, 1, 1, output_padding=1, groups=2, num=14),
    _case("2d-subm-depthwise", "subm", (8, 8), 3, groups=4, cin=4, cout=4),
    _case("2d-inverse-k2s2g2", "inverse", (8, 9), 2, 2, 0, groups=2),
    _case("3d-subm-k3", "subm", (6, 7, 5), 3, num=60, minimum=256),
    _case("3d-subm-1x1", "subm", (5, 5, 5), 1, num=30),
    _case("3d-subm-aniso-k(3,1,5)", "subm", (5, 6, 7), (3, 1, 5), dilation=(1, 1, 2), cin=3, cout=3),
    _case("3d-regular-k3s2p1", "regular", (7, 6, 8), 3, 2, 1, num=70),
    _case("3d-regular-k(3,1,2)s(2,1,1)d(1,2,1)", "regular", (6, 5, 6), (3, 1, 2), (2, 1, 1), (1, 0, 0),
          (1, 2, 1), groups=2),
    _case("3d-transposed-k2s2", "transposed", (4, 3, 4), 2, 2, 0, num=12, bias=False),
    _case("3d-inverse-k3s2p1", "inverse", (7, 6, 6), 3, 2, 1, num=50),
    _case("3d-subm-empty", "subm", (4, 4, 4), 3, num=0),
    _case("3d-regular-empty", "regular", (4, 4, 4), 3, 2, 1, num=0),
]


def _weights(rng, case):
    k = as_tuple(case.kernel, case.ndim)
    weight = rng.uniform(-1, 1, (case.cout,) + k + (case.cin // case.groups,))
    bias = rng.uniform(-1, 1, (case.cout,)) if case.bias else None
    return jnp.asarray(weight), None if bias is None else jnp.asarray(bias)


def _input(rng, case, channels):
    indices = random_sites(rng, case.shape, case.batch, case.num)
    features = random_features(rng, indices.shape[0], channels)
    x = sj.SparseTensor.from_arrays(features, indices, case.shape, case.batch,
                                    capacity=sj.Buckets(minimum=case.minimum))
    return x, indices, features


def _sparse_layer(case, impl):
    def layer(x, weight, bias):
        if case.kind == "inverse":
            return sj.inverse_conv(x, weight, bias, groups=case.groups, impl=impl)
        return sj.sparse_conv(x, weight, bias, kind=case.kind, stride=case.stride, padding=case.padding,
                              dilation=case.dilation, output_padding=case.output_padding, groups=case.groups,
                              impl=impl)
    return layer


def _prepare_conv(case, seed):
    """(x on the layer's input sites, its true indices and features, input grid, output sites, oracle fn)."""
    rng = np.random.default_rng(seed)
    weight, bias = _weights(rng, case)
    if case.kind == "inverse":
        a, a_indices, _ = _input(rng, case, case.cin)
        down = jnp.asarray(rng.uniform(-1, 1, (case.cin,) + as_tuple(case.kernel, case.ndim) + (case.cin,)))
        b = sj.sparse_conv(a, down, stride=case.stride, padding=case.padding, dilation=case.dilation)
        b_indices = b.valid_indices()
        b_features = random_features(rng, b_indices.shape[0], case.cin)
        x = b.replace(jnp.zeros((b.capacity, case.cin)).at[: b_indices.shape[0]].set(b_features))

        def oracle(f, w, bb):
            dense = densify(f, b_indices, b.spatial_shape, case.batch)
            out = dense_conv_transpose(dense, w, case.stride, case.padding, case.dilation, groups=case.groups,
                                       out_shape=case.shape)
            out = read_sites(out, a_indices)
            return out if bb is None else out + bb
        return x, b_indices, b_features, a_indices, weight, bias, oracle

    x, indices, features = _input(rng, case, case.cin)
    mask = mask_of(indices, case.shape, case.batch)
    ones = ones_kernel(case.ndim, case.kernel)
    if case.kind == "subm":
        k, d = as_tuple(case.kernel, case.ndim), as_tuple(case.dilation, case.ndim)
        padding = tuple(di * (ki - 1) // 2 for ki, di in zip(k, d))
        stride, out_sites = 1, indices
    elif case.kind == "regular":
        stride, padding = case.stride, case.padding
        out_sites = active_sites(jax.jit(dense_conv, static_argnums=(2, 3, 4))(
            mask, ones, case.stride, case.padding, case.dilation))
    else:
        out_sites = active_sites(jax.jit(dense_conv_transpose, static_argnums=(2, 3, 4, 5))(
            mask, ones, case.stride, case.padding, case.dilation, case.output_padding))

    def oracle(f, w, bb):
        dense = densify(f, indices, case.shape, case.batch)
        if case.kind == "transposed":
            out = dense_conv_transpose(dense, w, case.stride, case.padding, case.dilation, case.output_padding,
                                       case.groups)
        else:
            out = dense_conv(dense, w, stride, padding, case.dilation, case.groups)
        out = read_sites(out, out_sites)
        return out if bb is None else out + bb
    return x, indices, features, out_sites, weight, bias, oracle


@dataclass(frozen=True)
class Expected:
    """One case's inputs and its dense float64 oracle, shared by the impls that run the case.

    ``x`` holds the layer's input (no plan yet); ``n_in`` its true rows; ``out_sites`` the oracle's output
    sites; ``cotangent`` ``[len(out_sites), C_out]`` the loss weights; ``value``, ``out`` and ``grads`` the
    dense loss, its output rows and its gradients with respect to ``argnums`` of (features, weight, bias).
    """

    x: object
    n_in: int
    out_sites: np.ndarray
    weight: object
    bias: object
    argnums: tuple
    cotangent: np.ndarray
    value: float
    out: np.ndarray
    grads: tuple


def _dense_expected(x, features, out_sites, oracle, weight, bias, rng, channels, argnums):
    """Runs the dense oracle once, jitted with value_and_grad on JAX's CPU device: an `Expected`."""
    cotangent = random_features(rng, out_sites.shape[0], channels)

    def dense_loss(f, w, b):
        out = oracle(f, w, b)
        return jnp.vdot(out, jnp.asarray(cotangent)), out

    # The oracle runs on JAX's CPU device wherever the sparse layer runs: cuDNN has no float64
    # transposed convolution for some strided shapes (seen on an H200, 2026-12-04).
    cpu = jax.devices("cpu")[0]
    on_cpu = jax.device_put((np.asarray(features), weight, bias), cpu)
    with jax.default_device(cpu):
        (value, out), grads = jax.jit(jax.value_and_grad(dense_loss, argnums=argnums, has_aux=True))(*on_cpu)
    return Expected(x, int(features.shape[0]), out_sites, weight, bias, argnums, cotangent, float(value),
                    np.asarray(out), tuple(np.asarray(g) for g in grads))


def _check_layer(layer, expected):
    """Runs ``layer`` jitted with value_and_grad and compares it with the dense oracle's `Expected`."""
    x, weight, bias, out_sites, n_in = expected.x, expected.weight, expected.bias, expected.out_sites, expected.n_in
    x = x.with_plan(sj.plan(layer, x, weight, bias))  # eager geometry, no arithmetic
    shape = jax.eval_shape(layer, x, weight, bias)
    out_name = shape.sites_name
    np.testing.assert_array_equal(x.plan.site(out_name).numpy_indices(), out_sites)
    assert shape.features.shape[1] == expected.cotangent.shape[1], (shape.features.shape, expected.cotangent.shape)
    padded_cotangent = jnp.zeros(shape.features.shape).at[: out_sites.shape[0]].set(expected.cotangent)

    def sparse_loss(f, w, b):
        out = layer(x.replace(f), w, b).features
        return jnp.vdot(out, padded_cotangent), out

    (value, out), grads = jax.jit(jax.value_and_grad(sparse_loss, argnums=expected.argnums, has_aux=True))(
        x.features, weight, bias)
    np.testing.assert_allclose(np.asarray(out[: out_sites.shape[0]]), expected.out, **TOL)
    assert not np.any(np.asarray(out[out_sites.shape[0]:])), "padding rows must be zero"
    np.testing.assert_allclose(float(value), expected.value, **TOL)
    np.testing.assert_allclose(np.asarray(grads[0][:n_in]), expected.grads[0], **TOL)
    assert not np.any(np.asarray(grads[0][n_in:])), "padding rows get no gradient"
    assert len(grads) == len(expected.grads)
    for got, want in zip(grads[1:], expected.grads[1:]):
        np.testing.assert_allclose(np.asarray(got), want, **TOL)


def _impl_cases(cases, device_cases):
    """(case, impl) pairs: every case on `IMPLS`, the named subset on each emulated GPU branch."""
    by_name = {case.name: case for case in cases}
    pairs = [pytest.param(case, impl, id=f"{case.name}-{impl}") for case in cases for impl in IMPLS]
    for impl, names in device_cases.items():
        pairs += [pytest.param(by_name[name], impl, id=f"{name}-{impl}") for name in names]
    return pairs


# The emulated GPU branches run these cases: on each, every kind (subm, regular, transposed, inverse), every
# dimensionality, groups, dilation, output padding, an even kernel and an empty input.
DEVICE_CONV_CASES = {
    "callback-device": ["1d-transposed-k4s3p1op2", "2d-regular-k3d2g2", "2d-inverse-k2s2g2", "3d-subm-k3",
                        "3d-regular-empty"],
    "callback-device-map": ["1d-subm-k5d2", "2d-transposed-k3s2p1op1g2", "3d-inverse-k3s2p1",
                            "3d-regular-k(3,1,2)s(2,1,1)d(1,2,1)", "3d-subm-empty"],
}


@functools.cache
def _conv_expected(name):
    """The inputs and dense oracle of conv case ``name`` (computed once, shared by its impls)."""
    case = next(case for case in CONV_CASES if case.name == name)
    seed = zlib.crc32(f"conv {case.name}".encode())
    x, _, features, out_sites, weight, bias, oracle = _prepare_conv(case, seed)
    argnums = (0, 1, 2) if bias is not None else (0, 1)
    return _dense_expected(x, features, out_sites, oracle, weight, bias, np.random.default_rng(seed + 1), case.cout,
                           argnums)


@pytest.mark.parametrize("case, impl", _impl_cases(CONV_CASES, DEVICE_CONV_CASES))
def test_conv_matches_dense(case, impl, monkeypatch):
    expected = _conv_expected(case.name)  # before `_use_impl` patches anything
    _check_layer(_sparse_layer(case, _use_impl(impl, monkeypatch)), expected)


@dataclass(frozen=True)
class PoolCase:
    name: str
    which: str
    shape: tuple
    kernel: object
    stride: object = None
    padding: object = 0
    dilation: object = 1
    subm: bool = False
    batch: int = 2
    num: int = 40
    channels: int = 3
    minimum: int = 8
    cin: int = field(default=3, repr=False)

    @property
    def ndim(self):
        return len(self.shape)


POOL_CASES = [
    PoolCase("1d-max-k3s1p1d2", "max", (20,), 3, 1, 1, 2),
    PoolCase("2d-max-k2", "max", (8, 9), 2),
    PoolCase("2d-max-k3s2p1", "max", (9, 8), 3, 2, 1),
    PoolCase("3d-max-k3s2p1", "max", (6, 7, 6), 3, 2, 1, num=60),
    PoolCase("3d-max-subm-k3", "max", (5, 6, 5), 3, subm=True),
    PoolCase("3d-max-aniso", "max", (6, 5, 6), (2, 1, 3), (2, 1, 2), (0, 0, 1)),
    PoolCase("1d-avg-k2", "avg", (17,), 2),
    PoolCase("2d-avg-k3s2p1", "avg", (9, 9), 3, 2, 1),
    PoolCase("2d-avg-subm-k3d2", "avg", (8, 8), 3, dilation=2, subm=True),
    PoolCase("3d-avg-k2", "avg", (6, 6, 6), 2, num=60, minimum=256),
    PoolCase("3d-max-empty", "max", (4, 4, 4), 2, num=0),
    PoolCase("3d-avg-empty", "avg", (4, 4, 4), 2, num=0),
]


def _prepare_pool(case, seed):
    rng = np.random.default_rng(seed)
    indices = random_sites(rng, case.shape, case.batch, case.num)
    features = random_features(rng, indices.shape[0], case.channels)
    x = sj.SparseTensor.from_arrays(features, indices, case.shape, case.batch,
                                    capacity=sj.Buckets(minimum=case.minimum))
    k, d = as_tuple(case.kernel, case.ndim), as_tuple(case.dilation, case.ndim)
    if case.subm:
        stride, padding, out_sites = 1, tuple(di * (ki - 1) // 2 for ki, di in zip(k, d)), indices
    else:
        stride = case.kernel if case.stride is None else case.stride
        padding = case.padding
        mask = mask_of(indices, case.shape, case.batch)
        out_sites = active_sites(jax.jit(dense_conv, static_argnums=(2, 3, 4))(
            mask, ones_kernel(case.ndim, case.kernel), stride, padding, d))

    def oracle(f, w, b):
        if case.which == "max":
            dense = densify(f, indices, case.shape, case.batch, fill=-jnp.inf)
            out = dense_max_pool(dense, case.kernel, stride, padding, case.dilation)
        else:
            dense = densify(f, indices, case.shape, case.batch)
            out = dense_avg_pool(dense, mask_of(indices, case.shape, case.batch), case.kernel, stride, padding,
                                 case.dilation)
        return read_sites(out, out_sites)
    return x, indices, features, out_sites, oracle


# On each emulated GPU branch: max and avg, each regular and submanifold, 1-3 axes, dilation, an empty input.
DEVICE_POOL_CASES = {
    "callback-device": ["1d-max-k3s1p1d2", "2d-avg-k3s2p1", "3d-max-subm-k3", "2d-avg-subm-k3d2", "3d-avg-empty"],
    "callback-device-map": ["1d-avg-k2", "2d-max-k3s2p1", "3d-max-aniso", "2d-avg-subm-k3d2", "3d-max-subm-k3",
                            "3d-max-empty"],
}


@functools.cache
def _pool_expected(name):
    """The inputs and dense oracle of pool case ``name`` (computed once, shared by its impls)."""
    case = next(case for case in POOL_CASES if case.name == name)
    seed = zlib.crc32(f"pool {case.name}".encode())
    x, _, features, out_sites, oracle = _prepare_pool(case, seed)
    return _dense_expected(x, features, out_sites, oracle, None, None, np.random.default_rng(seed + 1),
                           case.channels, (0,))


@pytest.mark.parametrize("case, impl", _impl_cases(POOL_CASES, DEVICE_POOL_CASES))
def test_pool_matches_dense(case, impl, monkeypatch):
    expected = _pool_expected(case.name)  # before `_use_impl` patches anything
    impl = _use_impl(impl, monkeypatch)
    run = sj.sparse_max_pool if case.which == "max" else sj.sparse_avg_pool

    def layer(t, w, b):
        return run(t, case.kernel, case.stride, case.padding, case.dilation, subm=case.subm, impl=impl)

    _check_layer(layer, expected)


def test_device_subsets_cover_every_class():
    """Each emulated GPU branch runs every conv kind, 1-3 axes, groups, dilation, output padding, an even
    kernel and an empty input, and every pool (max / avg, regular / submanifold) on 1-3 axes."""
    conv_by_name = {case.name: case for case in CONV_CASES}
    pool_by_name = {case.name: case for case in POOL_CASES}
    assert sorted(DEVICE_CONV_CASES) == sorted(DEVICE_POOL_CASES) == sorted(set(ORACLE_IMPLS) - set(IMPLS))
    for impl in DEVICE_CONV_CASES:
        convs = [conv_by_name[name] for name in DEVICE_CONV_CASES[impl]]
        assert {c.kind for c in convs} == {"subm", "regular", "transposed", "inverse"}, impl
        assert {c.ndim for c in convs} == {1, 2, 3}, impl
        assert any(c.groups > 1 for c in convs) and any(c.num == 0 for c in convs), impl
        assert any(max(c.dilation) > 1 for c in convs) and any(max(c.output_padding) > 0 for c in convs), impl
        assert any(any(k % 2 == 0 for k in c.kernel) for c in convs), impl
        pools = [pool_by_name[name] for name in DEVICE_POOL_CASES[impl]]
        assert {(p.which, p.subm) for p in pools} == {(w, s) for w in ("max", "avg") for s in (False, True)}, impl
        assert {p.ndim for p in pools} == {1, 2, 3}, impl
        assert any(p.num == 0 for p in pools) and any(as_tuple(p.dilation, p.ndim) != (1,) * p.ndim
                                                      for p in pools), impl


@pytest.mark.parametrize("which", ["max", "avg"])
def test_global_pools_match_dense(which):
    rng = np.random.default_rng(77 if which == "max" else 78)
    shape, batch = (5, 6, 4), 3
    indices = random_sites(rng, shape, batch, 40, empty_batches=(1,))
    features = random_features(rng, indices.shape[0], 5)
    x = sj.SparseTensor.from_arrays(features, indices, shape, batch)
    pool = sj.global_max_pool if which == "max" else sj.global_avg_pool
    cotangent = jnp.asarray(random_features(rng, batch, 5))

    def sparse_loss(f):
        return jnp.vdot(pool(x.replace(f)), cotangent)

    def dense_pool(f):
        axes = tuple(range(2, 2 + len(shape)))
        if which == "max":
            out = jnp.max(densify(f, indices, shape, batch, fill=-jnp.inf), axis=axes)
            return jnp.where(jnp.isfinite(out), out, 0.0)
        total = jnp.sum(densify(f, indices, shape, batch), axis=axes)
        count = jnp.sum(mask_of(indices, shape, batch), axis=axes)
        return total / jnp.maximum(count, 1)

    out = jax.jit(pool)(x)
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense_pool(jnp.asarray(features))), **TOL)
    assert not np.any(np.asarray(out[1])), "an empty batch element pools to zeros"
    grad = jax.jit(jax.grad(sparse_loss))(x.features)
    expected = jax.grad(lambda f: jnp.vdot(dense_pool(f), cotangent))(jnp.asarray(features))
    np.testing.assert_allclose(np.asarray(grad[: indices.shape[0]]), np.asarray(expected), **TOL)
    assert not np.any(np.asarray(grad[indices.shape[0]:]))


@pytest.mark.parametrize("channels_first", [True, False])
def test_to_dense_matches_scatter(channels_first):
    rng = np.random.default_rng(5)
    shape = (4, 5)
    indices = random_sites(rng, shape, 2, 13)
    features = random_features(rng, 13, 3)
    x = sj.SparseTensor.from_arrays(features, indices, shape, 2)
    got = np.asarray(jax.jit(lambda t: sj.to_dense(t, channels_first))(x))
    expected = np.zeros((2,) + shape + (3,))
    expected[tuple(indices.T)] = features
    if channels_first:
        expected = np.moveaxis(expected, -1, 1)
    np.testing.assert_array_equal(got, expected)
    cotangent = jnp.asarray(rng.standard_normal(expected.shape))
    grad = jax.grad(lambda f: jnp.vdot(sj.to_dense(x.replace(f), channels_first), cotangent))(x.features)
    moved = np.moveaxis(np.asarray(cotangent), 1, -1) if channels_first else np.asarray(cotangent)
    np.testing.assert_allclose(np.asarray(grad[:13]), moved[tuple(indices.T)])
    assert not np.any(np.asarray(grad[13:]))


# ---------------------------------------------------------------------------- check_grads on every op

GRAD_CASES = [
    _case("subm-2d", "subm", (6, 6), 3, num=15, cin=2, cout=3),
    _case("regular-3d-g2", "regular", (4, 5, 4), 3, 2, 1, groups=2, num=20, cin=2, cout=2),
    _case("transposed-2d", "transposed", (4, 4), 3, 2, 1, 1, 1, num=6, cin=2, cout=2),
    _case("inverse-2d", "inverse", (6, 6), 3, 2, 1, num=14, cin=2, cout=2),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.name)
def test_check_grads_conv(case, impl):
    x, *_, weight, bias, _ = _prepare_conv(case, 11)
    layer = _sparse_layer(case, impl)
    x = x.with_plan(sj.plan(layer, x, weight, bias))
    check_grads(jax.jit(lambda f, w, b: layer(x.replace(f), w, b).features), (x.features, weight, bias),
                order=1, modes=["rev"])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("which,subm", [("max", False), ("max", True), ("avg", False), ("avg", True)])
def test_check_grads_pools(which, subm, impl):
    case = PoolCase(f"{which}", which, (5, 6), 3, 2 if not subm else 1, 1, subm=subm, num=16)
    x, *_ = _prepare_pool(case, 12)
    run = sj.sparse_max_pool if which == "max" else sj.sparse_avg_pool
    x = x.with_plan(sj.plan(lambda t: run(t, 3, case.stride, 1, subm=subm), x))
    check_grads(jax.jit(lambda f: run(x.replace(f), 3, case.stride, 1, subm=subm, impl=impl).features),
                (x.features,), order=1, modes=["rev"])


@pytest.mark.parametrize("op", ["global_max", "global_avg", "to_dense"])
def test_check_grads_global_and_dense(op):
    rng = np.random.default_rng(13)
    indices = random_sites(rng, (4, 4), 2, 9)
    x = sj.SparseTensor.from_arrays(random_features(rng, 9, 2), indices, (4, 4), 2)
    fn = {"global_max": sj.global_max_pool, "global_avg": sj.global_avg_pool, "to_dense": sj.to_dense}[op]
    check_grads(jax.jit(lambda f: fn(x.replace(f))), (x.features,), order=1, modes=["rev"])


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_conv_on_the_cpu_matches_dense(impl, monkeypatch):
    """bfloat16 features and weights on both impls (the callback runs the core's bfloat16 CPU passes, on the
    compiled kernels here), forward and gradients, against the dense float64 oracle on the same bfloat16
    values, within tests/test_bf16_cpu_dataflow.py's bound doubled (the gradients' cotangent is rounded too)."""
    from sparsecore.backends import _cpu_kernels

    monkeypatch.setattr(_cpu_kernels, "NUMPY_MAX_WORK", -1)
    rng = np.random.default_rng(67200)
    shape = (6, 7, 5)
    indices = random_sites(rng, shape, 2, 120)
    bfloat16 = jnp.bfloat16
    features = jnp.asarray(random_features(rng, indices.shape[0], 16), bfloat16)
    weight = jnp.asarray(random_features(rng, 24 * 27, 16).reshape(24, 3, 3, 3, 16) / 12, bfloat16)
    x = sj.SparseTensor.from_arrays(features, indices, shape, 2)
    layer = lambda t, w: sj.subm_conv(t, w, None, impl=impl)  # noqa: E731
    x = x.with_plan(sj.plan(layer, x, weight))
    rows = indices.shape[0]

    def sparse_loss(f, w):
        out = layer(x.replace(f), w).features
        return jnp.sum(out[:rows].astype(jnp.float32)), out

    (_, out), (grad_features, grad_weight) = jax.jit(jax.value_and_grad(sparse_loss, argnums=(0, 1),
                                                                         has_aux=True))(x.features, weight)
    assert out.dtype == grad_features.dtype == grad_weight.dtype == bfloat16

    def dense_loss(f, w):
        out = read_sites(dense_conv(densify(f, indices, shape, 2), w, 1, 1, 1), indices)
        return jnp.sum(out), out

    exact = (jnp.asarray(features[:rows], jnp.float64), jnp.asarray(weight, jnp.float64))
    (_, expected), expected_grads = jax.value_and_grad(dense_loss, argnums=(0, 1), has_aux=True)(*exact)
    (_, magnitude), magnitude_grads = jax.value_and_grad(dense_loss, argnums=(0, 1), has_aux=True)(
        *(jnp.abs(value) for value in exact))
    for got, want, scale, terms in ((out[:rows], expected, magnitude, 27 * 16),
                                    (grad_features[:rows], expected_grads[0], magnitude_grads[0], 27 * 24),
                                    (grad_weight, expected_grads[1], magnitude_grads[1], rows)):
        bound = 2 * (2.0 ** -8 + 3 * terms * 2.0 ** -24) * np.asarray(scale) + 1e-12
        assert np.all(np.abs(np.asarray(got, np.float64) - np.asarray(want)) <= bound)
