"""sparsecore.int8_cpu_dataflow: the per-layer CPU route of the int8 conv, bit-exact against the integer reference.

The oracle is `int8_reference` (int64 loops over the pairs, then the documented
float32 epilogue). The float32 pass must be taken exactly when its sums are
provably exact (and then give the same bits), and left otherwise.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

import sparsecore as sc
from sparsecore import int8_cpu_dataflow as dataflow
from sparsecore.backends import NumpyBackend, _cpu_kernels, _int8_cpu_kernels, _int8_vnni_kernels, x86_features
from sparsecore.backends._numpy_int8 import EXACT_FLOAT32_LIMIT, Int8Epilogue

from int8_reference import integer_sums, random_int8, reference_int8_conv, same_bits

SHAPE = (9, 8, 7)


def _rulebook(rng: np.random.Generator, count: int, kind: str = "subm") -> sc.Rulebook:
    cells = rng.choice(int(np.prod(SHAPE)), size=count, replace=False)
    indices = np.stack([np.zeros(count, np.int64), *np.unravel_index(cells, SHAPE)], axis=1).astype(np.int32)
    if kind == "subm":
        return sc.build_rulebook(indices, SHAPE, 1, sc.ConvGeometry.create(3, 3, kind="subm"))
    regular = sc.build_rulebook(indices, SHAPE, 1, sc.ConvGeometry.create(3, 3, stride=2, padding=1, kind="regular"))
    return regular if kind == "regular" else sc.inverse_rulebook(regular)


def _epilogue(out_channels: int, rng: np.random.Generator, output_scale: float | None) -> Int8Epilogue:
    multiplier = np.float32(0.05) * rng.uniform(2e-3, 2e-2, out_channels).astype(np.float32)
    return Int8Epilogue(multiplier=multiplier.astype(np.float32), bias=None, residual=None,
                        residual_scale=np.float32(1), relu=False,
                        output_scale=None if output_scale is None else np.float32(output_scale))


def test_exactness_bound_is_the_largest_input_times_the_largest_weight_row_sum() -> None:
    weight = np.zeros((2, 3, 3, 3, 4), np.int8)
    weight[1, 0, 0, 0, :] = 127  # row sum 508, the largest
    weight[0, 1, 1, 1, 0] = -100
    limit_input = EXACT_FLOAT32_LIMIT // 508  # 33,025 > 127: exact for every int8 input
    assert limit_input > 128
    features = np.array([[-128, 0, 3, 1]], np.int8)
    assert dataflow.float_pass_is_exact(features, weight)
    wide = np.full((1, 3, 3, 3, 1100), 127, np.int8)  # 27 * 1100 * 127 * 127 > 2^24
    assert not dataflow.float_pass_is_exact(np.full((1, 1100), 127, np.int8), wide)
    assert dataflow.float_pass_is_exact(np.zeros((1, 1100), np.int8), wide)  # all-zero inputs: sums are 0
    assert dataflow.float_pass_is_exact(np.zeros((0, 1100), np.int8), wide)  # no inputs


@pytest.mark.parametrize("kind", ["subm", "regular", "inverse"])
@pytest.mark.parametrize("in_channels, out_channels, groups", [(4, 16, 1), (16, 16, 1), (32, 64, 1), (12, 8, 2)])
@pytest.mark.parametrize("output_scale", [None, 0.3])
def test_float_pass_is_taken_and_matches_the_integer_reference(kind: str, in_channels: int, out_channels: int,
                                                               groups: int, output_scale: float | None) -> None:
    rng = np.random.default_rng([12, len(kind), in_channels, out_channels, groups])
    rulebook = _rulebook(rng, 60, kind)
    features = random_int8(rng, (rulebook.num_input, in_channels), -40, 40)
    weight = random_int8(rng, (out_channels, 3, 3, 3, in_channels // groups), -30, 30)
    epilogue = _epilogue(out_channels, rng, output_scale)
    assert dataflow.float_pass_is_exact(features, weight)
    with mock.patch.object(dataflow, "conv_forward", wraps=dataflow.conv_forward) as float_pass:
        actual = dataflow.int8_conv_on_cpu(NumpyBackend(), features, weight, rulebook, groups, epilogue,
                                           route="float_pass")
    assert float_pass.call_count == 1
    # the documented epilogue (multiply, then round half to even and saturate) on the int64 sums
    sums = integer_sums(features, weight, rulebook, groups).astype(np.int32).astype(np.float32)
    expected = sums * epilogue.multiplier
    if output_scale is not None:
        expected = np.clip(np.rint(expected / np.float32(output_scale)), -128, 127).astype(np.int8)
    same_bits(actual, expected, f"{kind} {in_channels}->{out_channels} groups={groups}")


def test_inexact_sums_leave_the_float_pass() -> None:
    rng = np.random.default_rng(1203)
    rulebook = _rulebook(rng, 50)
    features = random_int8(rng, (rulebook.num_input, 400), 100, 127)
    weight = random_int8(rng, (3, 3, 3, 3, 400), 100, 127)  # 27 * 400 * 100 * 100 > 2^24
    epilogue = Int8Epilogue(multiplier=np.ones(3, np.float32), bias=None, residual=None,
                            residual_scale=np.float32(1), relu=False, output_scale=None)
    assert not dataflow.float_pass_is_exact(features, weight)
    with mock.patch.object(dataflow, "conv_forward", wraps=dataflow.conv_forward) as float_pass:
        actual = dataflow.int8_conv_on_cpu(NumpyBackend(), features, weight, rulebook, 1, epilogue,
                                           route="float_pass")
    assert float_pass.call_count == 0
    acc = integer_sums(features, weight, rulebook, 1)
    assert np.abs(acc).max() > 2**24
    same_bits(actual, acc.astype(np.int32).astype(np.float32), "float32(acc) past 2^24")


def test_auto_route_by_channels_and_the_public_entry_point() -> None:
    compiled = _int8_cpu_kernels.available()
    assert dataflow.compiled_on_cpu(32, 64) == compiled
    assert not dataflow.compiled_on_cpu(16, 16) and not dataflow.compiled_on_cpu(64, 32)
    assert not dataflow.compiled_on_cpu(64, 64) and not dataflow.compiled_on_cpu(128, 128)  # float pass faster
    rng = np.random.default_rng(1204)
    rulebook = _rulebook(rng, 70)
    features, weight = random_int8(rng, (rulebook.num_input, 16)), random_int8(rng, (16, 3, 3, 3, 16))
    scales, bias = rng.uniform(2e-3, 2e-2, 16).astype(np.float32), rng.standard_normal(16).astype(np.float32)
    common = dict(input_scale=0.05, weight_scales=scales, bias=bias, relu=True, output_scale=0.2)
    with mock.patch.object(dataflow, "conv_forward", wraps=dataflow.conv_forward) as float_pass:
        actual = sc.int8_conv_forward(features, weight, rulebook, **common)
    assert float_pass.call_count == 1  # a 16 -> 16 layer of int8 values runs the float32 pass
    same_bits(actual, reference_int8_conv(features, weight, rulebook, **common), "auto route, 16 -> 16")


def test_unknown_route_is_refused() -> None:
    rng = np.random.default_rng(1205)
    rulebook = _rulebook(rng, 10)
    with pytest.raises(ValueError, match="route must be one of"):
        dataflow.int8_conv_on_cpu(NumpyBackend(), random_int8(rng, (rulebook.num_input, 2)),
                                  random_int8(rng, (2, 3, 3, 3, 2)), rulebook, 1, _epilogue(2, rng, None),
                                  route="fast")


@pytest.mark.skipif(not _int8_cpu_kernels.available(), reason="numba is not installed")
def test_compiled_route_builds_its_table_once_per_rulebook() -> None:
    rng = np.random.default_rng(1206)
    rulebook = _rulebook(rng, 80)
    features = random_int8(rng, (rulebook.num_input, 32))
    common = dict(input_scale=0.05, relu=True, output_scale=0.3)
    with mock.patch.object(_int8_cpu_kernels, "neighbour_table", wraps=_int8_cpu_kernels.neighbour_table) as build:
        for seed in range(2):  # two layers sharing the rulebook (one indice_key)
            weight = random_int8(rng, (64, 3, 3, 3, 32))
            scales = rng.uniform(2e-3, 2e-2, 64).astype(np.float32)
            epilogue = Int8Epilogue(multiplier=np.float32(0.05) * scales, bias=None, residual=None,
                                    residual_scale=np.float32(1), relu=True, output_scale=np.float32(0.3))
            actual = dataflow.int8_conv_on_cpu(NumpyBackend(), features, weight, rulebook, 1, epilogue,
                                               route="compiled")
            same_bits(actual, reference_int8_conv(features, weight, rulebook, weight_scales=scales, **common),
                      f"compiled route, layer {seed}")
    assert build.call_count == 1
    table = dataflow.int8_neighbour_table(rulebook)
    assert not table.flags.writeable and table.shape == (rulebook.num_output, 27)


def _vnni_available() -> bool:
    return _int8_cpu_kernels.available() and x86_features.available_features().avx512_vnni


@pytest.mark.parametrize("isa", ["auto", "generic"])
def test_auto_route_takes_the_vnni_kernel_only_where_the_switch_selects_it(isa: str, monkeypatch) -> None:
    """Above the size threshold (lowered here), ``auto`` runs the VNNI kernel where the CPU has avx512_vnni and
    SPARSECORE_CPU_ISA allows it; ``generic`` (a CPU without the feature, simulated) runs today's route. Both give
    the integer reference's bits."""
    monkeypatch.setattr(_cpu_kernels, "NUMPY_MAX_WORK", -1)
    rng = np.random.default_rng(1207)
    rulebook = _rulebook(rng, 90)
    features, weight = random_int8(rng, (rulebook.num_input, 24)), random_int8(rng, (40, 3, 3, 3, 24))
    scales, bias = rng.uniform(2e-3, 2e-2, 40).astype(np.float32), rng.standard_normal(40).astype(np.float32)
    common = dict(input_scale=0.05, weight_scales=scales, bias=bias, relu=True, output_scale=0.2)
    with x86_features.cpu_isa(isa), \
            mock.patch.object(_int8_vnni_kernels, "conv", wraps=_int8_vnni_kernels.conv) as vnni:
        actual = sc.int8_conv_forward(features, weight, rulebook, **common)
        assert dataflow.vnni_on_cpu(rulebook.num_pairs, 24, 40) == (isa == "auto" and _vnni_available())
    assert vnni.call_count == (1 if isa == "auto" and _vnni_available() else 0)
    same_bits(actual, reference_int8_conv(features, weight, rulebook, **common), f"auto route under {isa}")


def test_vnni_route_is_refused_where_the_switch_leaves_it_out() -> None:
    rng = np.random.default_rng(1208)
    rulebook = _rulebook(rng, 10)
    with x86_features.cpu_isa("generic"), pytest.raises(ValueError, match="route='vnni' needs .*avx512_vnni"):
        dataflow.int8_conv_on_cpu(NumpyBackend(), random_int8(rng, (rulebook.num_input, 4)),
                                  random_int8(rng, (4, 3, 3, 3, 4)), rulebook, 1, _epilogue(4, rng, None), route="vnni")
