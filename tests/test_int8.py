"""sparsecore.int8 on the NumPy backend: bit-exact against an integer reference, and its errors.

Expected values come from `int8_reference` (int64 loops over the pairs, then
the documented float32 epilogue), from torch's own quantize functions, and
once from the dense float64 oracle (`dense_oracle`).
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest

import sparsecore as sc
from sparsecore import int8 as q8
from sparsecore import int8_cpu_dataflow
from sparsecore.backends import NumpyBackend, _int8_cpu_kernels, _numpy_int8

from int8_reference import (
    integer_sums,
    random_int8,
    reference_int8_conv,
    reference_int8_max_pool,
    same_bits,
)

SHAPE = (7, 6, 5)


@dataclasses.dataclass(frozen=True)
class _Engine:
    """The NumPy backend with its int8 conv on one engine ("compiled": numba; "blas": exact float32 GEMMs)."""

    engine: str
    inner: NumpyBackend = NumpyBackend()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def int8_conv_pairs(self, *args):
        if self.engine == "compiled" and not _int8_cpu_kernels.available():
            pytest.skip("numba is not installed")
        return _numpy_int8.conv_pairs(self.inner, *args, engine=self.engine)


class _Route(NumpyBackend):
    """The plain NumPy backend with `sparsecore.int8_cpu_dataflow`'s route forced ("float_pass"), or its
    own per-layer choice ("auto")."""

    def __init__(self, route: str) -> None:
        self.route = route


ENGINES = {"compiled": _Engine("compiled"), "blas": _Engine("blas"), "float_pass": _Route("float_pass"),
           "auto": _Route("auto")}


def _forward(engine: str, *args, **kwargs):
    backend = ENGINES[engine]
    if isinstance(backend, _Route) and backend.route == "float_pass":
        with mock.patch.object(int8_cpu_dataflow, "compiled_on_cpu", lambda *sizes: False):
            return q8.int8_conv_forward(*args, backend=backend, **kwargs)
    return q8.int8_conv_forward(*args, backend=backend, **kwargs)


def _rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng([8120, *seed])


def _sites(rng: np.random.Generator, count: int, shape=SHAPE, batch_size: int = 2) -> np.ndarray:
    cells = rng.choice(batch_size * int(np.prod(shape)), size=count, replace=False)
    return np.stack(np.unravel_index(cells, (batch_size, *shape)), axis=1).astype(np.int32).reshape(count, 1 + len(shape))


def _rulebook(kind: str, indices: np.ndarray, shape=SHAPE, batch_size: int = 2, kernel=3) -> sc.Rulebook:
    if kind == "subm":
        return sc.build_rulebook(indices, shape, batch_size, sc.ConvGeometry.create(3, kernel, kind="subm"))
    if kind in ("regular", "inverse"):
        regular = sc.build_rulebook(indices, shape, batch_size,
                                    sc.ConvGeometry.create(3, kernel, stride=2, padding=1, kind="regular"))
        return regular if kind == "regular" else sc.inverse_rulebook(regular)
    if kind == "transposed":
        return sc.build_rulebook(indices, shape, batch_size,
                                 sc.ConvGeometry.create(3, kernel, stride=2, padding=1, kind="transposed"))
    raise AssertionError(kind)


def _layer(rng: np.random.Generator, rulebook: sc.Rulebook, in_channels: int, out_channels: int, groups: int = 1,
           low: int = -128, high: int = 127):
    """Random int8 features for the rulebook's inputs, an int8 weight and per-channel scales."""
    features = random_int8(rng, (rulebook.num_input, in_channels), low, high)
    weight = random_int8(rng, (out_channels, *rulebook.kernel_size, in_channels // groups), low, high)
    scales = rng.uniform(2e-3, 2e-2, out_channels).astype(np.float32)
    return features, weight, scales


CHANNELS = [(1, 1), (3, 5), (13, 7), (32, 32), (33, 17), (64, 64), (96, 40)]


@pytest.mark.parametrize("kind", ["subm", "regular", "transposed", "inverse"])
@pytest.mark.parametrize("in_channels, out_channels", CHANNELS)
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_conv_matches_integer_reference(kind: str, in_channels: int, out_channels: int, engine: str) -> None:
    rng = _rng(len(kind), in_channels, out_channels)
    rulebook = _rulebook(kind, _sites(rng, 40))
    features, weight, scales = _layer(rng, rulebook, in_channels, out_channels)
    bias = rng.standard_normal(out_channels).astype(np.float32)
    common = dict(input_scale=0.05, weight_scales=scales, bias=bias)
    for output_scale, relu in ((0.4, False), (0.4, True), (None, False), (None, True)):
        actual = _forward(engine, features, weight, rulebook, output_scale=output_scale, relu=relu, **common)
        expected = reference_int8_conv(features, weight, rulebook, output_scale=output_scale, relu=relu, **common)
        same_bits(actual, expected, f"{kind} {in_channels}->{out_channels} out_scale={output_scale} relu={relu}")
    quantized = _forward(engine, features, weight, rulebook, output_scale=0.4, **common)
    assert len(np.unique(quantized)) > min(8, quantized.size // 4), "requantized output collapsed to few values"


@pytest.mark.parametrize("groups, in_channels, out_channels", [(2, 12, 8), (3, 9, 6), (4, 20, 8), (6, 6, 6)])
@pytest.mark.parametrize("kind", ["subm", "regular"])
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_grouped_conv_matches_integer_reference(groups: int, in_channels: int, out_channels: int, kind: str,
                                                 engine: str) -> None:
    rng = _rng(groups, in_channels, len(kind))
    rulebook = _rulebook(kind, _sites(rng, 35))
    features, weight, scales = _layer(rng, rulebook, in_channels, out_channels, groups)
    common = dict(input_scale=0.03, weight_scales=scales, output_scale=0.25, groups=groups)
    same_bits(_forward(engine, features, weight, rulebook, **common),
              reference_int8_conv(features, weight, rulebook, **common), f"groups={groups}")


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("output_scale", [0.3, None])
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_residual_and_relu(with_bias: bool, output_scale: float | None, engine: str) -> None:
    rng = _rng(7, int(with_bias), output_scale is None)
    rulebook = _rulebook("subm", _sites(rng, 50))
    features, weight, scales = _layer(rng, rulebook, 24, 16)
    residual = random_int8(rng, (rulebook.num_output, 16))
    bias = rng.standard_normal(16).astype(np.float32) if with_bias else None
    common = dict(input_scale=0.02, weight_scales=scales, output_scale=output_scale, bias=bias, residual=residual,
                  residual_scale=0.07, relu=True)
    actual = _forward(engine, features, weight, rulebook, **common)
    same_bits(actual, reference_int8_conv(features, weight, rulebook, **common), "residual + relu")
    assert (np.asarray(actual) >= 0).all()
    without = _forward(engine, features, weight, rulebook, **{**common, "residual": None, "residual_scale": None})
    assert not np.array_equal(actual, without), "the residual changed nothing"


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_saturation_at_both_ends(engine: str) -> None:
    rng = _rng(11)
    dense_block = _sites(rng, 2 * 27, shape=(3, 3, 3))  # every site of two 3x3x3 grids: centres see 27 inputs
    rulebook = sc.build_rulebook(dense_block, (3, 3, 3), 2, sc.ConvGeometry.create(3, 3, kind="subm"))
    features = np.full((rulebook.num_input, 64), -128, dtype=np.int8)
    weight = np.full((64, 3, 3, 3, 64), -128, dtype=np.int8)
    weight[32:] = 127  # half the channels go to large negatives
    scales = np.full(64, 0.01, dtype=np.float32)
    common = dict(input_scale=0.01, weight_scales=scales, output_scale=0.01)
    actual = _forward(engine, features, weight, rulebook, **common)
    same_bits(actual, reference_int8_conv(features, weight, rulebook, **common), "saturated")
    acc = integer_sums(features, weight, rulebook, 1)
    assert np.abs(acc).max() > 2**24, "the case must exceed float32's exact integers (exercises the int32 spill)"
    assert (actual[:, :32] == 127).all() and (actual[:, 32:] == -128).all()


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_large_sums_stay_exact_in_float(engine: str) -> None:
    """Sums beyond 2^24 with distinct values: float32(acc) must be the int32 sum rounded once."""
    rng = _rng(12)
    rulebook = _rulebook("subm", _sites(rng, 120, batch_size=1), batch_size=1)
    features, weight, scales = _layer(rng, rulebook, 96, 8, low=100, high=127)
    common = dict(input_scale=1.0, weight_scales=np.ones(8, np.float32))
    actual = _forward(engine, features, weight, rulebook, **common)
    acc = integer_sums(features, weight, rulebook, 1)
    assert np.abs(acc).max() > 2**24
    same_bits(actual, acc.astype(np.int32).astype(np.float32), "float32(acc)")


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_wide_reduction_is_split_into_exact_slices(engine: str) -> None:
    rng = _rng(13)
    indices = _sites(rng, 9)
    rulebook = sc.build_rulebook(indices, SHAPE, 2, sc.ConvGeometry.create(3, 1, kind="subm"))
    features, weight, _ = _layer(rng, rulebook, 1500, 3, low=120, high=127)  # 1500 * 127 * 127 > 2^24
    common = dict(input_scale=1.0, weight_scales=np.ones(3, np.float32))
    acc = integer_sums(features, weight, rulebook, 1)
    same_bits(_forward(engine, features, weight, rulebook, **common),
              acc.astype(np.int32).astype(np.float32), "1500-channel reduction")


def test_rows_without_pairs_get_the_epilogue_of_zero() -> None:
    rng = _rng(14)
    regular = _rulebook("regular", _sites(rng, 30))
    pair_map = sc.PairMap(regular.pair_input, regular.pair_output, regular.offset_starts, regular.num_input,
                          regular.num_output + 3, regular.kernel_size)
    features, weight, scales = _layer(rng, regular, 8, 4)
    bias = np.array([0.5, -0.5, 1.25, -2.0], dtype=np.float32)
    out = q8.int8_conv_forward(features, weight, pair_map, input_scale=0.1, weight_scales=scales, bias=bias,
                               relu=True)
    same_bits(out[-3:], np.tile(np.array([0.5, 0.0, 1.25, 0.0], np.float32), (3, 1)), "rows without pairs")


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_zero_channels(engine: str) -> None:
    rulebook = _rulebook("subm", _sites(_rng(24), 12))
    bias = np.array([1.0, -2.0, 0.5], np.float32)
    out = _forward(engine, np.zeros((12, 0), np.int8), np.zeros((3, 3, 3, 3, 0), np.int8), rulebook, input_scale=0.1,
                   weight_scales=np.ones(3, np.float32), bias=bias)
    same_bits(out, np.tile(bias, (12, 1)), "no input channels")
    none = _forward(engine, np.zeros((12, 4), np.int8), np.zeros((0, 3, 3, 3, 4), np.int8), rulebook, input_scale=0.1,
                    weight_scales=np.ones(0, np.float32), output_scale=0.1)
    assert none.shape == (12, 0) and none.dtype == np.int8


@pytest.mark.parametrize("kind", ["subm", "regular"])
def test_empty_inputs(kind: str) -> None:
    empty = _rulebook(kind, np.zeros((0, 4), dtype=np.int32))
    features = np.zeros((0, 5), dtype=np.int8)
    weight = random_int8(_rng(15), (3, 3, 3, 3, 5))
    for output_scale, dtype in ((0.1, np.int8), (None, np.float32)):
        out = q8.int8_conv_forward(features, weight, empty, input_scale=0.1, weight_scales=np.ones(3, np.float32),
                                   output_scale=output_scale)
        assert out.shape == (empty.num_output, 3) and out.dtype == dtype
    pooled = q8.int8_max_pool_forward(features, empty)
    assert pooled.shape == (empty.num_output, 5) and pooled.dtype == np.int8
    assert q8.quantize(np.zeros((0, 4), np.float32), 0.1).shape == (0, 4)


@pytest.mark.parametrize("channels", [1, 5, 32, 33, 96])
@pytest.mark.parametrize("pool", ["window", "subm"])
def test_max_pool_matches_reference(channels: int, pool: str) -> None:
    rng = _rng(16, channels, len(pool))
    indices = _sites(rng, 70)
    rulebook = (sc.build_pool_rulebook(indices, SHAPE, 2, 2) if pool == "window"
                else sc.build_pool_rulebook(indices, SHAPE, 2, 3, subm=True))
    features = random_int8(rng, (len(indices), channels))
    same_bits(q8.int8_max_pool_forward(features, rulebook), reference_int8_max_pool(features, rulebook), pool)
    # all-negative windows keep their (negative) maximum, not 0
    negative = random_int8(rng, (len(indices), channels), -128, -1)
    pooled = q8.int8_max_pool_forward(negative, rulebook)
    assert (pooled < 0).all()


def test_dequantized_conv_equals_the_dense_float_conv() -> None:
    torch = pytest.importorskip("torch")
    import dense_oracle as oracle

    rng = _rng(17)
    indices = _sites(rng, 80)
    rulebook = _rulebook("subm", indices)
    x = oracle.random_features(rng, len(indices), 10)
    w = oracle.random_weight(rng, 12, (3, 3, 3), 10)
    bias = rng.standard_normal(12).astype(np.float32)
    input_scale = float(np.abs(x).max() / 127)
    weight_scales = (np.abs(w).reshape(12, -1).max(axis=1) / 127).astype(np.float32)
    features = q8.quantize(x, input_scale)
    weight = q8.quantize(w, weight_scales, axis=0)
    out = q8.int8_conv_forward(features, weight, rulebook, input_scale=input_scale, weight_scales=weight_scales,
                               bias=bias)
    x_dq = q8.dequantize(features, input_scale).astype(np.float64)
    w_dq = q8.dequantize(weight, weight_scales, axis=0).astype(np.float64)
    dense = oracle.dense_conv(oracle.densify(oracle.to_torch(x_dq), indices, SHAPE, 2), oracle.to_torch(w_dq),
                              1, 1, 1, bias=torch.as_tensor(bias, dtype=torch.float64))
    expected = oracle.read_sites(dense, indices).numpy()
    scale = np.abs(expected).max()
    np.testing.assert_allclose(out, expected, rtol=0, atol=4e-7 * scale)
    # and the float conv of the unquantized inputs is close (quantization error only)
    reference = sc.conv_forward(x, w, rulebook, bias.astype(np.float64))
    assert np.abs(out - reference).max() < 0.05 * np.abs(reference).max()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_quantize_matches_torch() -> None:
    torch = pytest.importorskip("torch")
    rng = _rng(18)
    x = (rng.standard_normal((50, 6)) * 3).astype(np.float32)
    x[0, :4] = [0.25, 0.75, -0.25, -1.25]  # ties at scale 0.5: even rounding
    x[1, :2] = [1e3, -1e3]  # saturation
    scale = 0.5
    expected = torch.quantize_per_tensor(torch.from_numpy(x), scale, 0, torch.qint8).int_repr().numpy()
    same_bits(q8.quantize(x, scale), expected, "per tensor")
    assert q8.quantize(x, scale)[0, :4].tolist() == [0, 2, 0, -2]
    scales = rng.uniform(0.01, 0.2, 6).astype(np.float32)
    expected = torch.quantize_per_channel(torch.from_numpy(x), torch.from_numpy(scales.astype(np.float64)),
                                          torch.zeros(6, dtype=torch.int64), 1, torch.qint8).int_repr().numpy()
    actual = q8.quantize(x, scales, axis=1)
    assert np.abs(actual.astype(int) - expected.astype(int)).max() <= 1  # torch multiplies by 1/scale
    assert (actual == expected).mean() > 0.97
    same_bits(actual, np.clip(np.rint(x / scales[None, :]), -128, 127).astype(np.int8), "per channel")
    same_bits(q8.dequantize(actual, scales, axis=1), actual.astype(np.float32) * scales, "dequantize")


def test_requant_parameters() -> None:
    scales = np.array([0.01, 0.02, 0.04], dtype=np.float32)
    bias = np.array([1.0, -0.5, 0.25], dtype=np.float32)
    params = q8.requant_parameters(0.1, scales, 0.2, bias)
    np.testing.assert_allclose(params.output_multiplier, 0.1 * scales.astype(np.float64) / 0.2, rtol=1e-7)
    np.testing.assert_allclose(params.output_bias, bias / 0.2, rtol=1e-7)
    assert params.output_multiplier.dtype == np.float32 and params.output_bias.dtype == np.float32
    np.testing.assert_allclose(params.input_dynamic_range, 12.7, rtol=1e-6)
    np.testing.assert_allclose(params.weight_dynamic_ranges, 127 * scales, rtol=1e-6)
    plain = q8.requant_parameters(0.1, scales)
    assert plain.output_scale is None and plain.output_dynamic_range is None
    np.testing.assert_array_equal(plain.output_bias, np.zeros(3, np.float32))
    # the deployment form computes what the fused layer computes, within a rounding
    rng = _rng(19)
    rulebook = _rulebook("subm", _sites(rng, 40))
    features, weight, _ = _layer(rng, rulebook, 8, 3)
    out = q8.int8_conv_forward(features, weight, rulebook, input_scale=0.1, weight_scales=scales, output_scale=0.2,
                               bias=bias)
    acc = integer_sums(features, weight, rulebook, 1)
    deployed = np.clip(np.rint(acc * params.output_multiplier.astype(np.float64) + params.output_bias), -128, 127)
    assert np.abs(out.astype(int) - deployed).max() <= 1


def test_bad_inputs_name_the_argument() -> None:
    rng = _rng(20)
    rulebook = _rulebook("subm", _sites(rng, 20))
    features, weight, scales = _layer(rng, rulebook, 8, 4)
    good = dict(input_scale=0.1, weight_scales=scales)
    cases = [
        (dict(features=features.astype(np.float32)), TypeError, "features must be int8"),
        (dict(weight=weight.astype(np.float32)), TypeError, "weight must be int8"),
        (dict(weight=weight.reshape(4, 27, 8)), ValueError, "weight must be int8 \\[out_channels"),
        (dict(weight=weight[..., :4]), ValueError, "weight's last axis is 4"),
        (dict(weight_scales=scales[:3]), ValueError, "weight_scales must have shape \\[4\\]"),
        (dict(weight_scales=np.array([0.1, 0.0, 0.1, 0.1], np.float32)), ValueError, "weight_scales\\[1\\]"),
        (dict(weight_scales=np.array([0.1, np.nan, 0.1, 0.1], np.float32)), ValueError, "weight_scales\\[1\\]"),
        (dict(input_scale=-1.0), ValueError, "input_scale must be a positive"),
        (dict(input_scale=float("inf")), ValueError, "input_scale must be a positive"),
        (dict(output_scale=0.0), ValueError, "output_scale must be a positive"),
        (dict(input_scale=1e-30, weight_scales=np.full(4, 1e-15, np.float32)), ValueError,
         "leaves the normal float32 range"),
        (dict(bias=np.ones(3, np.float32)), ValueError, "bias must have shape \\[4\\]"),
        (dict(bias=np.array([0.0, np.inf, 0.0, 0.0], np.float32)), ValueError, "bias holds NaN or infinity"),
        (dict(weight_scales=np.array([0.1, -0.1, 0.1, 0.1], np.float32)), ValueError, "weight_scales\\[1\\]"),
        (dict(residual=random_int8(rng, (rulebook.num_output, 4))), ValueError, "without residual_scale"),
        (dict(residual_scale=0.1), ValueError, "without a residual"),
        (dict(residual=random_int8(rng, (rulebook.num_output, 5)), residual_scale=0.1), ValueError,
         "residual has 5 channels"),
        (dict(features=features[:-1]), ValueError, "features has 19 rows"),
        (dict(groups=3), ValueError, "groups=3 must divide"),
    ]
    for change, error, message in cases:
        arguments = dict(features=features, weight=weight, **good)
        arguments.update(change)
        with pytest.raises(error, match=message):
            q8.int8_conv_forward(arguments.pop("features"), arguments.pop("weight"), rulebook, **arguments)
    with pytest.raises(ValueError, match="can overflow its int32 sums"):
        q8.int8_conv_forward(np.zeros((rulebook.num_input, 5000), np.int8), np.zeros((1, 3, 3, 3, 5000), np.int8),
                             rulebook, input_scale=1.0, weight_scales=1.0)
    with pytest.raises(TypeError, match="features must be int8"):
        q8.int8_max_pool_forward(features.astype(np.float32), rulebook)
    with pytest.raises(ValueError, match="x holds NaN"):
        q8.quantize(np.array([1.0, np.nan], np.float32), 0.1)
    with pytest.raises(TypeError, match="x must be a float array"):
        q8.quantize(features, 0.1)
    with pytest.raises(ValueError, match="scale must have shape \\[8\\]"):
        q8.quantize(np.ones((2, 8), np.float32), np.ones(3, np.float32))
    with pytest.raises(TypeError, match="q must be an int8 array"):
        q8.dequantize(np.ones(3, np.float32), 0.1)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_requantization_ties_round_to_even(engine: str) -> None:
    """With unit scales and output_scale 2, every odd sum lands on a tie x.5 (half of them)."""
    rng = _rng(23)
    rulebook = _rulebook("subm", _sites(rng, 60))
    features, weight, _ = _layer(rng, rulebook, 5, 6, low=-3, high=3)
    common = dict(input_scale=1.0, weight_scales=np.ones(6, np.float32), output_scale=2.0)
    acc = integer_sums(features, weight, rulebook, 1)
    assert (acc % 2 == 1).mean() > 0.3
    expected = np.clip(np.rint(acc / 2.0), -128, 127).astype(np.int8)  # numpy's rint: ties to even
    same_bits(_forward(engine, features, weight, rulebook, **common), expected, "ties")
    assert (expected[acc % 4 == 1] == (acc[acc % 4 == 1] - 1) // 2).all()  # 2k + 0.5 -> 2k (even), not up


def test_compiled_kernel_with_channels_compiled_in() -> None:
    """The specialised kernel (channel counts as constants, used for large layers) sums like the generic one."""
    if not _int8_cpu_kernels.available():
        pytest.skip("numba is not installed")
    rng = _rng(22)
    rulebook = _rulebook("regular", _sites(rng, 50))
    features, weight, _ = _layer(rng, rulebook, 12, 8, groups=2)
    table = _int8_cpu_kernels.neighbour_table(rulebook.pair_input, rulebook.pair_output, rulebook.offset_starts,
                                              rulebook.num_output)
    matrices = np.ascontiguousarray(weight.reshape(2, 4, 27, 6).transpose(2, 0, 3, 1), dtype=np.int16)
    ones = np.ones(8, np.float32)
    for output_scale in (None, 7.0):
        epilogue = _numpy_int8.Int8Epilogue(ones, None, None, np.float32(1), False,
                                            None if output_scale is None else np.float32(output_scale))
        generic = _int8_cpu_kernels.int8_rows(features, table, matrices, 0, epilogue)
        specialised = _int8_cpu_kernels.int8_rows(features, table, matrices, 10**9, epilogue)
        expected = reference_int8_conv(features, weight, rulebook, input_scale=1.0, weight_scales=ones,
                                       output_scale=output_scale, groups=2)
        same_bits(generic, expected, "generic kernel")
        same_bits(specialised, expected, "specialised kernel")


def test_compiled_engine_gives_the_same_bits_at_every_thread_count() -> None:
    if not _int8_cpu_kernels.available():
        pytest.skip("numba is not installed")
    rng = _rng(25)
    rulebook = _rulebook("subm", _sites(rng, 150))
    features, weight, scales = _layer(rng, rulebook, 16, 16)
    common = dict(input_scale=0.05, weight_scales=scales, output_scale=0.3, relu=True)
    with sc.num_threads(1):
        single = _forward("compiled", features, weight, rulebook, **common)
    with sc.num_threads(2):
        double = _forward("compiled", features, weight, rulebook, **common)
    same_bits(double, single, "2 threads vs 1")


def test_exported_from_the_package() -> None:
    for name in q8.__all__:
        assert name in sc.__all__ and callable(getattr(sc, name))
    x = _rng(21).standard_normal((6, 3)).astype(np.float32)
    same_bits(sc.quantize(x, 0.02), q8.quantize(x, 0.02), "sparsecore.quantize")
