"""kernels_cu/int8.cu under the CPU emulation (and on a GPU when present), bit-exact.

Two ways in: the kernels launched directly by `cuda_emulation.int8_launchers`
(operands packed from the kernel's comments, independently of the backend),
and `sparsecore.int8` on the `KernelBackend` (`kernel_targets.target`:
emulated, or CuPy marked ``gpu``). Both are compared bit for bit with the
integer reference (`int8_reference`), which the NumPy backend meets in
test_int8.py (so its compiled kernels are not loaded here).
"""

from __future__ import annotations

import numpy as np
import pytest

import sparsecore as sc
from sparsecore import int8 as q8

from int8_reference import random_int8, reference_int8_conv, reference_int8_max_pool, same_bits
from kernel_targets import target  # noqa: F401  (fixture)

try:
    from cuda_emulation import harness
    from cuda_emulation.int8_launchers import Int8Launcher, pack_lanes
except ImportError:  # tests/ imported as a package
    from tests.cuda_emulation import harness
    from tests.cuda_emulation.int8_launchers import Int8Launcher, pack_lanes

SHAPE = (6, 5, 7)


def _rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng([8121, *seed])


def _sites(rng: np.random.Generator, count: int, batch_size: int = 2) -> np.ndarray:
    cells = rng.choice(batch_size * int(np.prod(SHAPE)), size=count, replace=False)
    return np.stack(np.unravel_index(cells, (batch_size, *SHAPE)), axis=1).astype(np.int32).reshape(count, 4)


def _rulebook(kind: str, indices: np.ndarray) -> sc.Rulebook:
    if kind == "subm":
        return sc.build_rulebook(indices, SHAPE, 2, sc.ConvGeometry.create(3, 3, kind="subm"))
    regular = sc.build_rulebook(indices, SHAPE, 2, sc.ConvGeometry.create(3, 3, stride=2, padding=1))
    if kind == "regular":
        return regular
    if kind == "inverse":
        return sc.inverse_rulebook(regular)
    return sc.build_rulebook(indices, SHAPE, 2, sc.ConvGeometry.create(3, 2, stride=2, kind="transposed"))


@pytest.fixture(scope="module")
def launcher() -> Int8Launcher:
    if harness.compiler_path() is None:
        pytest.skip("g++ is not installed")
    return Int8Launcher(lambda file, expression: harness.load_module(file).get_function(expression))


def test_lane_packing_puts_byte_j_in_lane_j() -> None:
    values = np.array([[1, -1, 2, -128, 5]], dtype=np.int8)
    words = pack_lanes(values, 1).view(np.uint32)
    assert words.tolist() == [[0x80_02_FF_01, 0x00_00_00_05]]


@pytest.mark.parametrize("groups, in_channels, out_channels", [(1, 1, 1), (1, 5, 3), (1, 33, 17), (1, 96, 64),
                                                              (2, 14, 6), (3, 9, 9)])
@pytest.mark.parametrize("output_scale", [0.3, None])
def test_kernel_contract_direct_launch(launcher: Int8Launcher, groups: int, in_channels: int, out_channels: int,
                                       output_scale: float | None) -> None:
    rng = _rng(groups, in_channels, output_scale is None)
    rulebook = _rulebook("subm", _sites(rng, 30))
    features = random_int8(rng, (rulebook.num_input, in_channels))
    weight = random_int8(rng, (out_channels, 3, 3, 3, in_channels // groups))
    scales = rng.uniform(1e-3, 1e-2, out_channels).astype(np.float32)
    bias = rng.standard_normal(out_channels).astype(np.float32)
    residual = random_int8(rng, (rulebook.num_output, out_channels))
    multiplier = np.float32(0.04) * scales
    actual = launcher.conv(features, weight, rulebook, groups, multiplier, bias, residual, 0.05, True, output_scale)
    expected = reference_int8_conv(features, weight, rulebook, input_scale=0.04, weight_scales=scales,
                                   output_scale=output_scale, bias=bias, residual=residual, residual_scale=0.05,
                                   relu=True, groups=groups)
    same_bits(actual, expected, "direct sc_int8_conv")


def test_max_pool_direct_launch(launcher: Int8Launcher) -> None:
    rng = _rng(3)
    indices = _sites(rng, 50)
    rulebook = sc.build_pool_rulebook(indices, SHAPE, 2, 2)
    features = random_int8(rng, (len(indices), 37))
    same_bits(launcher.max_pool(features, rulebook), reference_int8_max_pool(features, rulebook), "direct max pool")


@pytest.mark.parametrize("kind", ["subm", "regular", "transposed", "inverse"])
@pytest.mark.parametrize("in_channels, out_channels", [(1, 2), (7, 13), (32, 32), (40, 33), (96, 64)])
def test_backend_conv_matches_reference(target, kind: str, in_channels: int,  # noqa: F811
                                                  out_channels: int) -> None:
    rng = _rng(len(kind), in_channels, out_channels)
    rulebook = _rulebook(kind, _sites(rng, 28))
    features = random_int8(rng, (rulebook.num_input, in_channels))
    weight = random_int8(rng, (out_channels, *rulebook.kernel_size, in_channels))
    scales = rng.uniform(1e-3, 1e-2, out_channels).astype(np.float32)
    bias = rng.standard_normal(out_channels).astype(np.float32)
    device_rulebook = _on_target(target, rulebook)
    for output_scale, relu in ((0.2, True), (None, False)):
        common = dict(input_scale=0.06, weight_scales=scales, output_scale=output_scale, bias=bias, relu=relu)
        actual = q8.int8_conv_forward(target.put(features), target.put(weight), device_rulebook,
                                      backend=target.backend, **common)
        expected = reference_int8_conv(features, weight, rulebook, **common)
        same_bits(target.get(actual), expected, f"{target.name} {kind}")
        # (The NumPy backend meets the same reference in test_int8.py::test_conv_matches_integer_reference.)


def test_backend_groups_residual_and_saturation(target) -> None:  # noqa: F811
    rng = _rng(5)
    rulebook = _rulebook("subm", _sites(rng, 40))
    features = random_int8(rng, (rulebook.num_input, 18), 100, 127)
    weight = random_int8(rng, (12, 3, 3, 3, 6), 100, 127)
    weight[6:] = -weight[6:]
    scales = np.full(12, 0.01, dtype=np.float32)
    residual = random_int8(rng, (rulebook.num_output, 12))
    common = dict(input_scale=0.01, weight_scales=scales, output_scale=0.05, residual=residual,
                  residual_scale=0.1, groups=3)
    actual = target.get(q8.int8_conv_forward(target.put(features), target.put(weight), _on_target(target, rulebook),
                                             backend=target.backend,
                                             **{**common, "residual": target.put(residual)}))
    expected = reference_int8_conv(features, weight, rulebook, **common)
    same_bits(actual, expected, "grouped, residual, saturated")
    assert (expected == 127).any() and (expected == -128).any()


def test_backend_padded_pair_map(target) -> None:  # noqa: F811
    """Rows of -1 (a fixed-capacity pair map) are skipped by the kernels."""
    rng = _rng(6)
    rulebook = _rulebook("regular", _sites(rng, 30))
    starts = np.asarray(rulebook.offset_starts)
    pieces_in, pieces_out, padded_starts = [], [], [0]
    for k in range(len(starts) - 1):
        rows_in = np.asarray(rulebook.pair_input[starts[k]:starts[k + 1]])
        rows_out = np.asarray(rulebook.pair_output[starts[k]:starts[k + 1]])
        pieces_in += [rows_in, np.full(3, -1, np.int32)]
        pieces_out += [rows_out, np.full(3, -1, np.int32)]
        padded_starts.append(padded_starts[-1] + len(rows_in) + 3)
    padded = sc.PairMap(target.put(np.concatenate(pieces_in)), target.put(np.concatenate(pieces_out)),
                        tuple(padded_starts), rulebook.num_input, rulebook.num_output, rulebook.kernel_size,
                        padded=True)
    features = random_int8(rng, (rulebook.num_input, 9))
    weight = random_int8(rng, (5, 3, 3, 3, 9))
    common = dict(input_scale=0.1, weight_scales=np.full(5, 0.01, np.float32), output_scale=0.5)
    actual = q8.int8_conv_forward(target.put(features), target.put(weight), padded, backend=target.backend, **common)
    same_bits(target.get(actual), reference_int8_conv(features, weight, rulebook, **common), "padded")
    pooled = q8.int8_max_pool_forward(target.put(features), padded, backend=target.backend)
    same_bits(target.get(pooled), reference_int8_max_pool(features, rulebook), "padded max pool")
    with pytest.raises(ValueError, match="padded"):
        q8.int8_conv_forward(features, weight, sc.PairMap(np.concatenate(pieces_in), np.concatenate(pieces_out),
                                                          tuple(padded_starts), rulebook.num_input,
                                                          rulebook.num_output, rulebook.kernel_size, padded=True),
                             **common)


@pytest.mark.parametrize("channels", [1, 4, 33])
def test_backend_max_pool(target, channels: int) -> None:  # noqa: F811
    rng = _rng(7, channels)
    indices = _sites(rng, 45)
    rulebook = sc.build_pool_rulebook(indices, SHAPE, 2, 3, stride=2, padding=1)
    features = random_int8(rng, (len(indices), channels))
    actual = q8.int8_max_pool_forward(target.put(features), _on_target(target, rulebook), backend=target.backend)
    same_bits(target.get(actual), reference_int8_max_pool(features, rulebook), f"{target.name} max pool")


def test_backend_empty_inputs(target) -> None:  # noqa: F811
    rulebook = _rulebook("subm", np.zeros((0, 4), np.int32))
    device_rulebook = _on_target(target, rulebook)
    features = target.put(np.zeros((0, 6), np.int8))
    weight = target.put(random_int8(_rng(8), (4, 3, 3, 3, 6)))
    out = q8.int8_conv_forward(features, weight, device_rulebook, input_scale=0.1,
                               weight_scales=np.ones(4, np.float32), output_scale=0.1, backend=target.backend)
    assert out.shape == (0, 4) and out.dtype == np.int8
    pooled = q8.int8_max_pool_forward(features, device_rulebook, backend=target.backend)
    assert pooled.shape == (0, 6)
    # zero input channels: every sum is 0, the epilogue still runs (the bias comes out)
    rng = _rng(9)
    rulebook = _rulebook("subm", _sites(rng, 12))
    no_channels = q8.int8_conv_forward(target.put(np.zeros((12, 0), np.int8)),
                                       target.put(np.zeros((3, 3, 3, 3, 0), np.int8)), _on_target(target, rulebook),
                                       input_scale=0.1, weight_scales=np.ones(3, np.float32),
                                       bias=np.array([1.0, -2.0, 0.5], np.float32), backend=target.backend)
    same_bits(target.get(no_channels), np.tile(np.array([1.0, -2.0, 0.5], np.float32), (12, 1)), "no input channels")


def _on_target(target, rulebook: sc.Rulebook) -> sc.PairMap:  # noqa: F811
    return sc.PairMap(target.put(np.asarray(rulebook.pair_input)), target.put(np.asarray(rulebook.pair_output)),
                      tuple(rulebook.offset_starts), rulebook.num_input, rulebook.num_output,
                      tuple(rulebook.kernel_size), rulebook.identity_offset)
