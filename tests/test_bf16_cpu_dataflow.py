"""bfloat16 conv and pool passes on the CPU (`sparsecore.bf16_cpu_dataflow`, `backends._bf16_cpu_kernels`).

Every route runs on every machine that has it: ``"amx"`` (AMX tiles, ``SPARSECORE_CPU_ISA=auto``; skipped
where the CPU lacks AMX-BF16), ``"dpbf16ps"`` (the vdpbf16ps kernels, ``SPARSECORE_CPU_ISA=avx512_bf16``;
skipped without AVX-512 BF16) and ``"widened"`` (``SPARSECORE_CPU_ISA=generic``, the route of a CPU without
either). The size threshold is lowered so small clouds run the compiled kernels.

The oracle is the dense float64 convolution of the densified input (``dense_oracle``) on the bfloat16
values themselves (exact in float64). The bound, per output element, with ``M = sum |a| |b|`` over its
products (the same dense computation on absolute values) and ``n`` products:

- the operands are bfloat16 already: no input rounding against this oracle;
- a product of two bfloat16 values (8-bit significands) is exact in float32 (16 bits <= 24);
- float32 summation of ``n`` terms in any order: at most ``gamma_n M`` with ``gamma_n <= 2 n 2^-24``
  (``vdpbf16ps`` adds two products per step; denormals, which it flushes, cannot occur with these
  inputs: |features| >= 0.05 and weights of order 1 / sqrt(a));
- the one rounding to bfloat16 (nearest even): at most ``2^-8`` relative, so ``2^-8 (1 + gamma_n) M``.

So ``|out - oracle| <= (2^-8 + 3 n 2^-24) M`` (`bfloat16_bound`), with ``n`` the kernel volume times the
channels summed (forward, input gradient) or the pairs (weight gradient).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import sparsecore as sc
from sparsecore import conv, pool
from sparsecore.backends import _bf16_cpu_kernels, _cpu_kernels, x86_features

try:
    from . import conv_cases
    from . import dense_oracle as do
except ImportError:
    import conv_cases
    import dense_oracle as do

_geometry = conv_cases.case_geometry
_dense_fn = conv_cases.case_dense_fn

ml_dtypes = pytest.importorskip("ml_dtypes")
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
HAS_DPBF16PS = x86_features.available_features().avx512_bf16
HAS_AMX = HAS_DPBF16PS and _bf16_cpu_kernels.amx_available()
ROUTES = [pytest.param("auto", id="amx", marks=pytest.mark.skipif(not HAS_AMX, reason="no AMX-BF16")),
          pytest.param("avx512_bf16", id="dpbf16ps", marks=pytest.mark.skipif(not HAS_DPBF16PS,
                                                                               reason="no AVX-512 BF16")),
          pytest.param("generic", id="widened")]
EXPECTED_ROUTE = {"auto": "amx", "avx512_bf16": "dpbf16ps", "generic": None}


@pytest.fixture(autouse=True)
def compiled(monkeypatch):
    """Every pass above zero work runs compiled (the dpbf16ps route needs that; small clouds otherwise skip it)."""
    monkeypatch.setattr(_cpu_kernels, "NUMPY_MAX_WORK", -1)


def bfloat16_bound(magnitude: np.ndarray, terms: int) -> np.ndarray:
    """The module docstring's bound: ``(2^-8 + 3 n 2^-24) M`` (plus a floor far below any value here)."""
    return (2.0 ** -8 + 3 * terms * 2.0 ** -24) * magnitude + 1e-30


def _bfloat16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(bfloat16 array, its exact float64 values)``."""
    stored = np.asarray(values, np.float32).astype(BFLOAT16)
    return stored, stored.astype(np.float64)


def _case(kind: str, ndim: int, seed: int, in_channels: int, out_channels: int, groups: int = 1) -> do.ConvCase:
    case = do.sample_case(seed, kind, ndim, grouped=False)
    return dataclasses.replace(case, in_channels=in_channels, out_channels=out_channels, groups=groups)


# A covering subset: every kind (subm, regular, transposed, inverse), 1-3 axes, even and odd channel counts,
# 1 to 4 column blocks at once (16, 32, 48, 64 padded columns), rows in fours and a remainder, bias or not,
# and a grouped layer (always the widened route).
CASES = [
    pytest.param(_case("subm", 3, 8101, 16, 32), True, id="subm3d-16to32-bias"),
    pytest.param(_case("regular", 2, 8102, 5, 19), False, id="regular2d-5to19"),
    pytest.param(_case("transposed", 1, 8103, 33, 48), True, id="transposed1d-33to48-bias"),
    pytest.param(_case("subm", 2, 8104, 8, 12, groups=2), False, id="subm2d-grouped"),
]


def _check(actual, expected, magnitude, terms: int, what: str) -> None:
    actual = np.asarray(actual).astype(np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    error = np.abs(actual - expected) - bfloat16_bound(magnitude, terms)
    assert np.all(error <= 0), f"{what}: worst error {float(error.max())} above the bound"


def _against_oracle(fn, features, weight, bias, grad_output, sites, rulebook, groups, route, monkeypatch):
    (x, x_exact), (w, w_exact), (g, g_exact) = (_bfloat16(v) for v in (features, weight, grad_output))
    b, b_exact = _bfloat16(bias) if bias is not None else (None, None)
    oracle = do.evaluate(fn, x_exact, sites, w_exact, b_exact, grad_output=g_exact)
    magnitude = do.evaluate(fn, np.abs(x_exact), sites, np.abs(w_exact), None if b is None else np.abs(b_exact),
                            grad_output=np.abs(g_exact))
    monkeypatch.setenv(x86_features.ISA_VARIABLE, route)
    out = conv.conv_forward(x, w, rulebook, b, groups)
    grad_features, grad_weight = conv.conv_backward(g, x, w, rulebook, groups)
    assert out.dtype == grad_features.dtype == grad_weight.dtype == BFLOAT16
    volume = int(np.prod(weight.shape[1:-1]))
    _check(out, oracle.values, magnitude.values, volume * x.shape[1] + 1, "forward")
    _check(grad_features, oracle.grad_features, magnitude.grad_features, volume * g.shape[1], "grad_features")
    _check(grad_weight, oracle.grad_weight, magnitude.grad_weight, max(1, rulebook.num_pairs), "grad_weight")
    return out, grad_features, grad_weight


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case, with_bias", CASES)
def test_conv_against_the_dense_oracle(case, with_bias, route, monkeypatch):
    features, indices, weight = case.inputs()
    rulebook = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, _geometry(case))
    rng = do.make_rng(case.seed, 17)
    bias = do.random_features(rng, 1, case.out_channels)[0] if with_bias else None
    grad_output = do.random_features(rng, rulebook.num_output, case.out_channels)
    routes = []
    for name in ("dot_forward", "dot_backward"):  # the routes conv.py takes
        original = getattr(conv, name)
        monkeypatch.setattr(conv, name, lambda *a, _original=original: routes.append(a[-1]) or _original(*a))
    fn = _dense_fn(case, indices, case.spatial_shape, case.kind == "transposed")
    _against_oracle(fn, features, weight, bias, grad_output, rulebook.output_indices, rulebook, case.groups, route,
                    monkeypatch)
    expected = EXPECTED_ROUTE[route] if case.groups == 1 else None
    assert routes == ([expected] * 2 if expected else [])


@pytest.mark.parametrize("route", ROUTES)
def test_inverse_conv_against_the_dense_oracle(route, monkeypatch):
    case = _case("regular", 3, 8105, 64, 8)
    _, indices, _ = case.inputs()
    down = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, _geometry(case, "regular"))
    inverse = sc.inverse_rulebook(down)
    rng = do.make_rng(case.seed, 19)
    coarse = do.random_features(rng, down.num_output, 8)
    weight = do.random_weight(rng, 64, case.kernel_size, 8)  # the inverse maps 8 channels back to 64
    coarse_shape = tuple(down.output_spatial_shape)
    default = do.output_shape("transposed", coarse_shape, case.kernel_size, case.stride, case.padding, case.dilation)
    output_padding = tuple(n - m for n, m in zip(case.spatial_shape, default))
    fn = _dense_fn(case, down.output_indices, coarse_shape, True, output_padding)
    grad_output = do.random_features(rng, indices.shape[0], 64)
    _against_oracle(fn, coarse, weight, None, grad_output, indices, inverse, 1, route, monkeypatch)


@pytest.mark.skipif(not HAS_DPBF16PS, reason="no AVX-512 BF16")
def test_the_routes_agree_and_each_is_the_same_at_every_thread_count(monkeypatch):
    monkeypatch.setattr(_cpu_kernels, "SERIAL_MAX_WORK", 0)  # two threads really run
    case = _case("subm", 3, 8106, 37, 45)
    features, indices, weight = case.inputs()
    rulebook = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, _geometry(case))
    (x, x_exact), (w, w_exact) = _bfloat16(features), _bfloat16(weight)
    g, g_exact = _bfloat16(do.random_features(do.make_rng(case.seed, 23), rulebook.num_output, 45))
    routes = ("avx512_bf16", "auto") if HAS_AMX else ("avx512_bf16",)
    results = {}
    for route, threads in [("generic", 1)] + [(route, threads) for route in routes for threads in (1, 2)]:
        monkeypatch.setenv(x86_features.ISA_VARIABLE, route)
        with sc.num_threads(threads):
            results[route, threads] = (conv.conv_forward(x, w, rulebook), *conv.conv_backward(g, x, w, rulebook))
    fn = _dense_fn(case, indices, case.spatial_shape, False)
    magnitude = do.evaluate(fn, np.abs(x_exact), indices, np.abs(w_exact), None, grad_output=np.abs(g_exact))
    scales = (magnitude.values, magnitude.grad_features, magnitude.grad_weight)
    terms = (27 * 45, 27 * 45, rulebook.num_pairs)
    for route in routes:
        for one, two in zip(results[route, 1], results[route, 2]):
            np.testing.assert_array_equal(one.view(np.uint16), two.view(np.uint16))
        for what, fast, widened, scale, count in zip(("forward", "grad_features", "grad_weight"), results[route, 1],
                                                     results["generic", 1], scales, terms):
            difference = np.abs(fast.astype(np.float64) - widened.astype(np.float64))
            assert np.all(difference <= 2 * bfloat16_bound(scale, count)), (route, what)  # within the sums' rounding


@pytest.mark.parametrize("route", ROUTES)
def test_empty_inputs(route, monkeypatch):
    monkeypatch.setenv(x86_features.ISA_VARIABLE, route)
    for geometry in (sc.ConvGeometry.create(3, 3, kind="subm"), sc.ConvGeometry.create(3, 3, stride=2, padding=1)):
        rulebook = sc.build_rulebook(np.zeros((0, 4), np.int32), (6, 6, 6), 1, geometry)
        weight = np.ones((16, 3, 3, 3, 8), BFLOAT16)
        out = conv.conv_forward(np.zeros((0, 8), BFLOAT16), weight, rulebook, np.ones(16, np.float32))
        assert out.shape == (0, 16) and out.dtype == BFLOAT16
        grad_features, grad_weight = conv.conv_backward(np.zeros((0, 16), BFLOAT16), np.zeros((0, 8), BFLOAT16),
                                                        weight, rulebook)
        assert grad_features.shape == (0, 8) and grad_weight.shape == weight.shape and not grad_weight.any()
        pooled, argmax = pool.max_pool_forward(np.zeros((0, 8), BFLOAT16), rulebook)
        assert pooled.shape == (rulebook.num_output, 8) and pooled.dtype == BFLOAT16


def test_pools_against_the_dense_oracle():
    rng = do.make_rng(8107)
    indices = do.random_indices(rng, (7, 6, 5), 2, density=0.4)
    features, exact = _bfloat16(do.random_features(rng, indices.shape[0], 6))
    down = sc.build_pool_rulebook(indices, (7, 6, 5), 2, 3, stride=2, padding=1)
    grad, grad_exact = _bfloat16(do.random_features(rng, down.num_output, 6))
    sites = down.output_indices
    filled = do.densify(exact, indices, (7, 6, 5), 2, fill=-np.inf)
    expected_max = do.read_sites(do.dense_max_pool(filled, (3,) * 3, (2,) * 3, (1,) * 3, (1,) * 3), sites).numpy()
    out, argmax = pool.max_pool_forward(features, down)
    assert out.dtype == BFLOAT16
    np.testing.assert_array_equal(out.astype(np.float64), expected_max)  # a maximum of bfloat16 values is exact
    np.testing.assert_array_equal(exact[argmax, np.arange(6)], expected_max)
    grad_max = pool.max_pool_backward(grad, argmax, indices.shape[0], rulebook=down)
    expected_grad, grad_magnitude = np.zeros(exact.shape), np.zeros(exact.shape)
    np.add.at(expected_grad, (argmax, np.arange(6)), grad_exact)  # each output's gradient to its argmax row
    np.add.at(grad_magnitude, (argmax, np.arange(6)), np.abs(grad_exact))
    _check(grad_max, expected_grad, grad_magnitude, 27, "max_pool_backward")

    def mean(feats):
        total = do.dense_window_sum(do.densify(feats, indices, (7, 6, 5), 2), (3,) * 3, (2,) * 3, (1,) * 3, (1,) * 3)
        count = do.dense_window_sum(do.occupancy(indices, (7, 6, 5), 2), (3,) * 3, (2,) * 3, (1,) * 3, (1,) * 3)
        return total / count.clamp(min=1)

    oracle = do.evaluate(mean, exact, sites, grad_output=grad_exact)
    magnitude = do.evaluate(mean, np.abs(exact), sites, grad_output=np.abs(grad_exact))
    _check(pool.avg_pool_forward(features, down), oracle.values, magnitude.values, 27, "avg_pool_forward")
    _check(pool.avg_pool_backward(grad, down), oracle.grad_features, magnitude.grad_features, 27, "avg_pool_backward")


def test_mixed_dtypes_are_refused_by_name():
    rng = do.make_rng(8108)
    indices = do.random_indices(rng, (5, 5, 5), 1, density=0.5)
    rulebook = sc.build_rulebook(indices, (5, 5, 5), 1, sc.ConvGeometry.create(3, 3, kind="subm"))
    features = do.random_features(rng, indices.shape[0], 4, np.float32)
    weight = do.random_weight(rng, 8, (3, 3, 3), 4, np.float32)
    with pytest.raises(TypeError, match=r"features is bfloat16, weight is float32"):
        conv.conv_forward(features.astype(BFLOAT16), weight, rulebook)
    with pytest.raises(TypeError, match=r"features is float32, weight is bfloat16"):
        conv.conv_forward(features, weight.astype(BFLOAT16), rulebook)
    grad = np.ones((rulebook.num_output, 8), np.float32)
    with pytest.raises(TypeError, match=r"grad_output is float32"):
        conv.conv_backward(grad, features.astype(BFLOAT16), weight.astype(BFLOAT16), rulebook)


def test_torch_and_jax_bfloat16_arrays_go_in_and_come_back_in_their_library():
    """The public passes take torch and JAX bfloat16 arrays (NumPy's DLPack has no bfloat16) and hand their
    results back as the caller's arrays, with the same bits as the NumPy (ml_dtypes) call."""
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    rng = do.make_rng(8109)
    indices = do.random_indices(rng, (5, 6, 4), 1, density=0.5)
    rulebook = sc.build_rulebook(indices, (5, 6, 4), 1, sc.ConvGeometry.create(3, 3, kind="subm"))
    features, _ = _bfloat16(do.random_features(rng, indices.shape[0], 4))
    weight, _ = _bfloat16(do.random_weight(rng, 6, (3, 3, 3), 4))
    expected = conv.conv_forward(features, weight, rulebook).view(np.uint16)
    bits = torch.from_numpy(features.view(np.int16))
    from_torch = sc.conv_forward(bits.view(torch.bfloat16), torch.from_numpy(weight.view(np.int16)).view(
        torch.bfloat16), rulebook)
    assert isinstance(from_torch, torch.Tensor) and from_torch.dtype == torch.bfloat16
    np.testing.assert_array_equal(from_torch.view(torch.int16).numpy().view(np.uint16), expected)
    from_jax = sc.conv_forward(jnp.asarray(features), jnp.asarray(weight), rulebook)
    assert from_jax.dtype == jnp.bfloat16 and not isinstance(from_jax, np.ndarray)
    np.testing.assert_array_equal(np.asarray(from_jax).view(np.uint16), expected)
