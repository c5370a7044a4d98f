"""sparsecore.backends._int8_vnni_kernels: the VNNI int8 conv, bitwise against the integer reference.

The oracle is `int8_reference` (int64 loops over the pairs, then the documented
float32 epilogue). Every case runs through `sparsecore.int8_cpu_dataflow` with
the route forced to ``"vnni"`` on one and on two threads (the size threshold
that keeps small layers on the calling thread lowered), on small clouds cut
into several work items. Skipped where the CPU (or numba) has no avx512_vnni.
"""

from __future__ import annotations

import numpy as np
import pytest

import sparsecore as sc
from sparsecore import int8_cpu_dataflow as dataflow
from sparsecore.backends import NumpyBackend, _cpu_kernels, _int8_cpu_kernels, _int8_vnni_kernels, x86_features
from sparsecore.backends._numpy_int8 import Int8Epilogue

from int8_reference import integer_sums, random_int8, reference_epilogue, same_bits

pytestmark = pytest.mark.skipif(not (_int8_cpu_kernels.available() and x86_features.available_features().avx512_vnni),
                                reason="needs numba and a CPU with avx512_vnni")

SHAPE = (7, 8, 9)


@pytest.fixture(autouse=True)
def _small_layers_on_every_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cpu_kernels, "SERIAL_MAX_WORK", 0)  # these small layers run on the whole pool too
    monkeypatch.setattr(_cpu_kernels, "TILE_ITEMS", 1)  # work items of 64 destination rows: several per cloud
    monkeypatch.delenv(x86_features.ISA_VARIABLE, raising=False)


def _threads(count: int):
    import numba

    if count > int(numba.config.NUMBA_NUM_THREADS):
        pytest.skip(f"numba's pool has fewer than {count} threads")
    return sc.num_threads(count)


def _rulebook(rng: np.random.Generator, count: int, kind: str) -> sc.Rulebook:
    cells = rng.choice(2 * int(np.prod(SHAPE)), size=count, replace=False)
    indices = np.stack(np.unravel_index(cells, (2, *SHAPE)), axis=1).astype(np.int32)
    if kind == "subm":
        return sc.build_rulebook(indices, SHAPE, 2, sc.ConvGeometry.create(3, 3, kind="subm"))
    strided = sc.ConvGeometry.create(3, 3, stride=2, padding=1,
                                     kind="transposed" if kind == "transposed" else "regular")
    rulebook = sc.build_rulebook(indices, SHAPE, 2, strided)
    return sc.inverse_rulebook(rulebook) if kind == "inverse" else rulebook


def _epilogue(rng: np.random.Generator, rows: int, channels: int, bias: bool, residual: bool, relu: bool,
              output_scale: float | None) -> tuple[Int8Epilogue, dict]:
    scales = rng.uniform(2e-3, 2e-2, channels).astype(np.float32)
    values = dict(input_scale=0.05, weight_scales=scales, output_scale=output_scale, relu=relu,
                  bias=rng.standard_normal(channels).astype(np.float32) if bias else None,
                  residual=random_int8(rng, (rows, channels)) if residual else None,
                  residual_scale=0.07 if residual else None)
    steps = Int8Epilogue(multiplier=np.float32(0.05) * scales, bias=values["bias"], residual=values["residual"],
                         residual_scale=np.float32(values["residual_scale"] or 1), relu=relu,
                         output_scale=None if output_scale is None else np.float32(output_scale))
    return steps, values


def _vnni(features, weight, rulebook, groups, steps):
    return dataflow.int8_conv_on_cpu(NumpyBackend(), features, weight, rulebook, groups, steps, route="vnni")


CASES = [  # kind, in, out, groups, bias, residual, relu, output scale
    ("subm", 16, 16, 1, True, False, True, 0.3),
    ("subm", 3, 5, 1, False, False, False, None),
    ("subm", 33, 70, 1, True, True, True, 0.25),
    ("subm", 64, 128, 1, True, False, False, None),
    ("subm", 12, 40, 2, False, True, False, 0.2),
    ("subm", 6, 6, 6, True, False, True, 0.05),
    ("regular", 32, 64, 1, True, False, True, 0.3),
    ("regular", 5, 17, 1, False, False, True, None),
    ("transposed", 20, 24, 4, True, False, False, 0.4),
    ("inverse", 64, 32, 1, False, True, True, None),
]


@pytest.mark.parametrize("kind, in_channels, out_channels, groups, bias, residual, relu, output_scale", CASES)
def test_vnni_route_matches_the_integer_reference_on_both_thread_counts(
        kind: str, in_channels: int, out_channels: int, groups: int, bias: bool, residual: bool, relu: bool,
        output_scale: float | None) -> None:
    rng = np.random.default_rng([3801, len(kind), in_channels, out_channels, groups])
    rulebook = _rulebook(rng, 300, kind)
    features = random_int8(rng, (rulebook.num_input, in_channels))
    weight = random_int8(rng, (out_channels, 3, 3, 3, in_channels // groups))
    steps, values = _epilogue(rng, rulebook.num_output, out_channels, bias, residual, relu, output_scale)
    expected = reference_epilogue(integer_sums(features, weight, rulebook, groups), **values)
    assert rulebook.num_output > 2 * 64, "the cloud must span several work items"
    for threads in (1, 2):
        with _threads(threads):
            same_bits(_vnni(features, weight, rulebook, groups, steps), expected,
                      f"{kind} {in_channels}->{out_channels} groups={groups} on {threads} threads")


def test_saturation_edges_and_int32_wraparound_of_the_unsigned_operand() -> None:
    """All inputs and weights at the int8 extremes: sums near the int32 bound (their unsigned form, x + 128,
    passes 2^31 and wraps inside the kernel) and outputs saturating at -128 and 127."""
    rng = np.random.default_rng(3802)
    cube = np.stack(np.unravel_index(np.arange(5 * 5 * 5), (1, 5, 5, 5)), axis=1).astype(np.int32)  # dense: 27 pairs
    rulebook = sc.build_rulebook(cube, SHAPE, 1, sc.ConvGeometry.create(3, 3, kind="subm"))  # for inner rows
    in_channels = 2600  # 27 * 2600 * 2^14 < 2^31 (allowed), but 27 * 2600 * 255 * 128 > 2^31
    features = np.where(rng.random((rulebook.num_input, in_channels)) < 0.02, -128, 127).astype(np.int8)
    weight = np.empty((16, 3, 3, 3, in_channels), np.int8)
    weight[:8] = -128
    weight[8:] = 127
    unsigned = integer_sums(features.astype(np.int64) + 128, weight, rulebook, 1)  # the kernel's operand form
    assert np.abs(unsigned).max() > 2**31, "the unsigned form must pass the int32 range"
    steps, values = _epilogue(rng, rulebook.num_output, 16, True, False, False, 0.5)
    acc = integer_sums(features, weight, rulebook, 1)
    assert np.abs(acc).max() > 2**29, "the sums must come near the int32 bound"
    expected = reference_epilogue(acc, **values)
    assert expected.min() == -128 and expected.max() == 127
    with _threads(2):
        same_bits(_vnni(features, weight, rulebook, 1, steps), expected, "extremes")
    steps, values = _epilogue(rng, rulebook.num_output, 16, False, False, False, None)
    same_bits(_vnni(features, weight, rulebook, 1, steps), reference_epilogue(acc, **values), "extremes, float32 out")


@pytest.mark.parametrize("count", [0, 1])
def test_empty_and_tiny_inputs(count: int) -> None:
    rng = np.random.default_rng([3803, count])
    indices = np.zeros((count, 4), np.int32)
    rulebook = sc.build_rulebook(indices, SHAPE, 1, sc.ConvGeometry.create(3, 3, kind="subm"))
    features = random_int8(rng, (count, 8))
    weight = random_int8(rng, (24, 3, 3, 3, 8))
    steps, values = _epilogue(rng, count, 24, True, False, True, 0.3)
    out = _vnni(features, weight, rulebook, 1, steps)
    same_bits(out, reference_epilogue(integer_sums(features, weight, rulebook, 1), **values), f"{count} sites")
    assert out.shape == (count, 24)


def test_zero_features_give_the_bias() -> None:
    rng = np.random.default_rng(3804)
    rulebook = _rulebook(rng, 200, "regular")
    features = random_int8(rng, (rulebook.num_input, 8))
    weight = random_int8(rng, (16, 3, 3, 3, 8))
    steps, values = _epilogue(rng, rulebook.num_output, 16, True, False, False, None)
    empty_offsets = dataflow.int8_conv_on_cpu(NumpyBackend(), np.zeros_like(features), weight, rulebook, 1, steps,
                                              route="vnni")
    same_bits(empty_offsets, np.broadcast_to(values["bias"], empty_offsets.shape).astype(np.float32), "zero sums")


def test_packed_weights_and_corrections() -> None:
    """The layout the kernel reads: quad q, vector lane c holds w[c, k, 4q:4q+4]; corrections 128 x row sums."""
    rng = np.random.default_rng(3805)
    weight = random_int8(rng, (2 * 20, 3, 3, 3, 7))  # groups of 20 outputs (padded to 32), 7 inputs (2 quads)
    packed, corrections = _int8_vnni_kernels.pack_weights(weight, 2)
    quads, padded_out = _int8_vnni_kernels.padded_sizes(7, 20)
    assert (quads, padded_out) == (2, 32)
    packed = packed.reshape(27, 2, quads, padded_out, 4)
    corrections = corrections.reshape(27, 2, padded_out)
    for group in range(2):
        for output in range(padded_out):
            for offset in (0, 13, 26):
                lanes = packed[offset, group, :, output].reshape(-1)
                expected = np.zeros(8, np.int8)
                if output < 20:
                    expected[:7] = weight[group * 20 + output].reshape(27, 7)[offset]
                np.testing.assert_array_equal(lanes, expected)
                assert corrections[offset, group, output] == 128 * int(expected.astype(np.int64).sum())
    features = random_int8(rng, (5, 14))
    source = _int8_vnni_kernels.unsigned_source(features, 2)  # two groups of 7 channels, each padded to 8
    assert source.shape == (5, 16) and source.dtype == np.uint8
    for group in range(2):
        np.testing.assert_array_equal(source[:, 8 * group:8 * group + 7].astype(np.int64) - 128,
                                      features[:, 7 * group:7 * group + 7])
