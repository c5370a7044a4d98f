"""The core's convolutions on the emulated kernel backend (the fused map kernels) against the dense float64 oracle.

Rulebooks are built on the emulated backend (neighbour maps written by
kernels), then `sparsecore.conv_forward` / `conv_backward` run the fused
kernels of ``kernels_cu/implicit_gemm.cu`` over them, in float32, float64
(SIMT), float16 and bfloat16 (tensor cores through the emulation's wmma), for
submanifold, strided, transposed and inverse layers, with and without groups
and bias. Expected values come from dense torch convolutions of the densified
input in float64 (``dense_oracle``); the tolerance is a GEMM error bound from
the same computation on absolute values. Also: outputs without neighbours,
`NeighbourMap` arguments on both backends, empty inputs, and the passes
running without a single read back to the host.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import sparsecore as sc
from sparsecore import conv, pool
from sparsecore.backends import NUMPY_BACKEND
from sparsecore.neighbour_map import row_masks, stored_masks

try:
    from . import conv_cases
    from . import dense_oracle as do
    from .cuda_emulation import device_arrays
    from .cuda_emulation.fused_twins import gemm_error_bound
    from .cuda_emulation.numpy_twins import narrow, widen
    from .kernel_targets import BFLOAT16, emulated_backend
except ImportError:
    import conv_cases
    import dense_oracle as do
    from cuda_emulation import device_arrays
    from cuda_emulation.fused_twins import gemm_error_bound
    from cuda_emulation.numpy_twins import narrow, widen
    from kernel_targets import BFLOAT16, emulated_backend

_geometry = conv_cases.case_geometry
_dense_fn = conv_cases.case_dense_fn

DTYPES = ("float32", "float64", "float16", "bfloat16")
CASES = (do.sample_cases("regular", 4, base_seed=6100) + do.sample_cases("subm", 4, base_seed=6200)
         + do.sample_cases("transposed", 4, base_seed=6300))
INVERSE = do.sample_cases("regular", 3, base_seed=6400)
# The 3-D inverse case (a 5x5x2 kernel: two mask words) on one batch instead of three: 195 sites, 4 row tiles.
INVERSE[2] = dataclasses.replace(INVERSE[2], batch_size=1)

# A covering design instead of every case in every dtype: each case runs one SIMT dtype (float32, float64)
# and one tensor-core dtype (float16, bfloat16), so that every dtype meets every kind (regular, subm,
# transposed, inverse), every dimensionality, groups, bias and two mask words (the 36- and 50-offset
# kernels of CASES[2] and INVERSE[2]).
_DESIGN = (("float32", "float16"), ("float64", "bfloat16"), ("float64", "float16"), ("float32", "bfloat16"),
           ("float64", "bfloat16"), ("float32", "float16"), ("float32", "bfloat16"), ("float64", "float16"),
           ("float32", "float16"), ("float64", "bfloat16"), ("float32", "bfloat16"), ("float64", "bfloat16"))
_INVERSE_DESIGN = (("float64", "float16"), ("float32", "bfloat16"), ("float32", "bfloat16"))
CASE_DTYPES = [pytest.param(case, dtype_name, id=f"{case}-{dtype_name}")
               for case, dtypes in zip(CASES, _DESIGN) for dtype_name in dtypes]
INVERSE_DTYPES = [pytest.param(case, dtype_name, id=f"{case}-{dtype_name}")
                  for case, dtypes in zip(INVERSE, _INVERSE_DESIGN) for dtype_name in dtypes]


def _stored(values: np.ndarray, dtype_name: str):
    """``(array in the dtype, its exact float64 value)``: the oracle sees what the kernels see."""
    bits = narrow(np.asarray(values, np.float32), dtype_name) if dtype_name != "float64" else values
    exact = widen(bits, dtype_name).astype(np.float64) if dtype_name != "float64" else values
    if dtype_name == "bfloat16":
        if BFLOAT16 is None:
            pytest.skip("bfloat16 needs ml_dtypes")
        return bits.view(BFLOAT16), exact
    return bits, exact


def _check(actual, expected, magnitude, dtype_name: str, what: str) -> None:
    actual = np.asarray(actual).astype(np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}"
    bound = gemm_error_bound(magnitude, dtype_name) + 1e-12
    error = np.abs(actual - expected)
    assert np.all(error <= bound), f"{what}: worst error {float((error - bound).max())} above the bound"


def _run_against_oracle(dtype_name: str, fn, features, weight, bias, grad_output, sites, rulebook, groups,
                        backend) -> None:
    (x, x_exact), (w, w_exact), (g, g_exact) = (_stored(v, dtype_name) for v in (features, weight, grad_output))
    b, b_exact = _stored(bias, dtype_name) if bias is not None else (None, None)
    oracle = do.evaluate(fn, x_exact, sites, w_exact, b_exact, grad_output=g_exact)
    magnitude = do.evaluate(fn, np.abs(x_exact), sites, np.abs(w_exact), None if bias is None else np.abs(b_exact),
                            grad_output=np.abs(g_exact))
    out = conv.conv_forward(x, w, rulebook, b, groups, backend=backend)
    assert out.dtype == x.dtype
    _check(out, oracle.values, magnitude.values, dtype_name, "forward")
    grad_features, grad_weight = conv.conv_backward(g, x, w, rulebook, groups, backend=backend)
    assert grad_features.dtype == x.dtype and grad_weight.dtype == w.dtype
    _check(grad_features, oracle.grad_features, magnitude.grad_features, dtype_name, "grad_features")
    _check(grad_weight, oracle.grad_weight, magnitude.grad_weight, dtype_name, "grad_weight")


def test_the_dtype_design_covers_every_kind_dimensionality_groups_bias_and_two_mask_words():
    runs = [(case, dtype_name) for case, dtypes in zip(CASES, _DESIGN) for dtype_name in dtypes]
    inverse_runs = [(case, dtype_name) for case, dtypes in zip(INVERSE, _INVERSE_DESIGN) for dtype_name in dtypes]
    for dtype_name in DTYPES:
        met = {case.kind for case, name in runs if name == dtype_name}
        met |= {"inverse" for _, name in inverse_runs if name == dtype_name}
        assert met == {"regular", "subm", "transposed", "inverse"}, (dtype_name, met)
        assert {case.ndim for case, name in runs if name == dtype_name} == {1, 2, 3}, dtype_name
        assert any(case.groups > 1 for case, name in runs if name == dtype_name), dtype_name
        assert any(case.seed % 2 for case, name in runs if name == dtype_name), dtype_name  # with a bias
        assert any(int(np.prod(case.kernel_size)) > 32 for case, name in runs + inverse_runs
                   if name == dtype_name), dtype_name


@pytest.mark.parametrize("case, dtype_name", CASE_DTYPES)
def test_conv_on_the_kernel_backend_against_the_dense_oracle(case, dtype_name):
    backend = emulated_backend()
    features, indices, weight = case.inputs()
    rulebook = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, _geometry(case), backend=backend)
    sites = rulebook.output_indices
    rng = do.make_rng(case.seed, 71)
    bias = do.random_features(rng, 1, case.out_channels)[0] if case.seed % 2 else None
    grad_output = do.random_features(rng, sites.shape[0], case.out_channels)
    fn = _dense_fn(case, indices, case.spatial_shape, case.kind == "transposed")
    _run_against_oracle(dtype_name, fn, features, weight, bias, grad_output, sites, rulebook, case.groups, backend)


@pytest.mark.parametrize("case, dtype_name", INVERSE_DTYPES)
def test_inverse_conv_on_the_kernel_backend_against_the_dense_oracle(case, dtype_name):
    backend = emulated_backend()
    _, indices, _ = case.inputs()
    down = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, _geometry(case, "regular"), backend=backend)
    inverse = sc.inverse_rulebook(down)
    rng = do.make_rng(case.seed, 73)
    coarse = do.random_features(rng, down.num_output, case.out_channels)
    weight = do.random_weight(rng, case.in_channels, case.kernel_size, case.out_channels // case.groups)
    coarse_shape = tuple(down.output_spatial_shape)
    default = do.output_shape("transposed", coarse_shape, case.kernel_size, case.stride, case.padding, case.dilation)
    output_padding = tuple(n - m for n, m in zip(case.spatial_shape, default))
    fn = _dense_fn(case, down.output_indices, coarse_shape, True, output_padding)
    grad_output = do.random_features(rng, indices.shape[0], case.in_channels)
    _run_against_oracle(dtype_name, fn, coarse, weight, None, grad_output, indices, inverse, case.groups, backend)


def test_outputs_without_neighbours_hold_the_bias_and_a_neighbour_map_runs_on_both_backends():
    backend = emulated_backend()
    case = CASES[0]
    features, indices, weight = case.inputs(np.float32)
    rulebook = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, _geometry(case), backend=NUMPY_BACKEND)
    extra = 3  # output rows no pair reaches
    padded = sc.PairMap(rulebook.pair_input, rulebook.pair_output, rulebook.offset_starts, rulebook.num_input,
                        rulebook.num_output + extra, rulebook.kernel_size)
    bias = np.linspace(-1, 1, case.out_channels).astype(np.float32)
    expected = conv.conv_forward(features, weight, rulebook, bias, case.groups, backend=NUMPY_BACKEND)
    out = conv.conv_forward(features, weight, padded, bias, case.groups, backend=backend)
    np.testing.assert_allclose(out[:-extra], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[-extra:], np.tile(bias, (extra, 1)))
    neighbour_map = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, _geometry(case),
                                      backend=backend).neighbour_map
    on_kernels = conv.conv_forward(features, weight, neighbour_map, bias, case.groups, backend=backend)
    on_numpy = conv.conv_forward(features, weight, neighbour_map, bias, case.groups, backend=NUMPY_BACKEND)
    np.testing.assert_allclose(on_kernels, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(on_numpy, expected, rtol=1e-5, atol=1e-5)
    assert neighbour_map.derived["pair_map"] is not None  # the NumPy backend derived the pairs once


@pytest.mark.parametrize("kind", ["subm", "regular", "transposed"])
def test_empty_inputs_on_the_kernel_backend(kind):
    backend = emulated_backend()
    geometry = (sc.ConvGeometry.create(2, 3, kind="subm") if kind == "subm"
                else sc.ConvGeometry.create(2, 3, stride=2, padding=1, kind=kind))
    rulebook = sc.build_rulebook(np.zeros((0, 3), np.int32), (8, 8), 1, geometry, backend=backend)
    weight = np.ones((4, 3, 3, 2), np.float32)
    out = conv.conv_forward(np.zeros((0, 2), np.float32), weight, rulebook, np.ones(4, np.float32), backend=backend)
    assert out.shape == (0, 4)
    grad_features, grad_weight = conv.conv_backward(np.zeros((0, 4), np.float32), np.zeros((0, 2), np.float32),
                                                    weight, rulebook, backend=backend)
    assert grad_features.shape == (0, 2) and grad_weight.shape == weight.shape and not grad_weight.any()


def test_feature_passes_read_nothing_back_and_derive_no_pairs(monkeypatch):
    """Once a layer's rulebook exists, its conv and pool passes never wait for the device. A strided map's
    input masks are made by the first conv over its input side (a strided conv's input gradient), not by
    the pools, on the device and bitwise those of its input table."""
    device_arrays.use_device_arrays(monkeypatch)  # array_module answers the device library, as for CuPy
    backend = device_arrays.device_backend(emulated_backend())
    rng = do.make_rng(6500)
    shape = (6, 6, 5)  # ~100 sites: two row tiles
    indices = do.random_indices(rng, shape, 2, 0.3)
    device = device_arrays.to_device
    subm = sc.build_rulebook(device(indices), shape, 2, sc.ConvGeometry.create(3, 3, kind="subm"),
                             backend=backend)
    down = sc.build_pool_rulebook(device(indices), shape, 2, 2, backend=backend)
    features = device(rng.uniform(-1, 1, (indices.shape[0], 8)).astype(np.float32))
    weight = device(rng.uniform(-1, 1, (8, 3, 3, 3, 8)).astype(np.float32))
    with device_arrays.forbid_host_reads():
        out = conv.conv_forward(features, weight, subm, device(np.ones(8, np.float32)), backend=backend)
        conv.conv_backward(out, features, weight, subm, backend=backend)
        pooled, argmax = pool.max_pool_forward(out, down, backend=backend)
        pool.max_pool_backward(pooled, argmax, subm.num_output, rulebook=down, backend=backend)
        pool.avg_pool_backward(pool.avg_pool_forward(out, down, backend=backend), down, backend=backend)
        assert stored_masks(down.neighbour_map, "input") is None
        strided = device(rng.uniform(-1, 1, (8, 2, 2, 2, 8)).astype(np.float32))
        coarse = conv.conv_forward(out, strided, down, None, backend=backend)
        conv.conv_backward(coarse, out, strided, down, backend=backend)
    made = stored_masks(down.neighbour_map, "input")
    assert isinstance(made, device_arrays.DeviceArray)
    np.testing.assert_array_equal(np.asarray(made), row_masks(np, np.asarray(down.neighbour_map.input_neighbours)))
    for rulebook in (subm, down):
        assert rulebook.stored_pairs is None and "pair_map" not in rulebook.neighbour_map.derived


def test_bfloat16_mixed_with_float32_on_the_numpy_backend_is_refused_by_name():
    """The NumPy backend runs bfloat16 passes (tests/test_bf16_cpu_dataflow.py); mixed with float32, refused."""
    if BFLOAT16 is None:
        pytest.skip("bfloat16 needs ml_dtypes")
    case = CASES[1]
    features, indices, weight = case.inputs(np.float32)
    rulebook = sc.build_rulebook(indices, case.spatial_shape, case.batch_size, _geometry(case), backend=NUMPY_BACKEND)
    with pytest.raises(TypeError, match=r"bfloat16 operands only: features is bfloat16, weight is float32"):
        conv.conv_forward(features.astype(BFLOAT16), weight, rulebook, groups=case.groups, backend=NUMPY_BACKEND)
