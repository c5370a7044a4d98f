"""The compiled CPU kernels (sparsecore.backends._cpu_kernels) and the conv dataflow choice.

Oracles: an integer reference of the neighbour table (plain loops over the
pairs), a float64 pair loop (``np.add.at``) for the fused row kernel, and the
dense float64 convolution (tests/dense_oracle.py) for whole passes on both CPU
dataflows (fused and per-offset BLAS).
"""

from __future__ import annotations

import numpy as np
import pytest

import sparsecore as sc
from sparsecore import conv, cpu_dataflow
from sparsecore.backends import NUMPY_BACKEND, _cpu_kernels

import dense_oracle as do  # noqa: E402  (tests/ is on the path)


def _random_pairs(rng: np.random.Generator, volume: int, num_source: int, num_destination: int):
    """Pairs grouped by offset, injective within each offset, in random order inside an offset."""
    inputs, outputs, starts = [], [], [0]
    for _ in range(volume):
        count = int(rng.integers(0, min(num_source, num_destination) + 1))
        inputs.append(rng.choice(num_source, count, replace=False))
        outputs.append(rng.choice(num_destination, count, replace=False))
        starts.append(starts[-1] + count)
    as_int32 = lambda parts: np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)  # noqa: E731
    return as_int32(inputs), as_int32(outputs), tuple(starts)


def test_neighbour_table_against_integer_reference():
    rng = np.random.default_rng(1401)
    for volume, num_source, num_destination in ((27, 300, 200), (1, 5, 130), (8, 64, 64), (3, 1, 1)):
        pair_input, pair_output, starts = _random_pairs(rng, volume, num_source, num_destination)
        table = _cpu_kernels.neighbour_table(pair_output, pair_input, starts, num_destination)
        block = _cpu_kernels.ROW_BLOCK
        expected = np.full((-(-num_destination // block) * block, volume), -1, dtype=np.int64)
        for offset in range(volume):
            for pair in range(starts[offset], starts[offset + 1]):
                expected[int(pair_output[pair]), offset] = int(pair_input[pair])
        got = table.transpose(0, 2, 1).reshape(-1, volume)
        assert table.dtype == np.int32
        np.testing.assert_array_equal(got, expected)


def test_neighbour_table_refuses_a_repeated_row_within_an_offset():
    pair_input = np.array([0, 1, 2], dtype=np.int32)
    pair_output = np.array([4, 4, 1], dtype=np.int32)
    with pytest.raises(ValueError, match="repeats a row within kernel offset 0"):
        _cpu_kernels.neighbour_table(pair_output, pair_input, (0, 3), 5)


def test_neighbour_table_empty():
    empty = np.zeros(0, dtype=np.int32)
    assert _cpu_kernels.neighbour_table(empty, empty, (0, 0, 0), 0).shape == (0, 2, _cpu_kernels.ROW_BLOCK)
    table = _cpu_kernels.neighbour_table(empty, empty, (0, 0), 3)
    assert (table == -1).all()


@pytest.mark.parametrize("specialised, groups, in_per_group, out_per_group",
                         [(False, 2, 3, 5), (True, 2, 3, 5), (False, 1, 16, 16), (False, 1, 16, 32),
                          (False, 1, 32, 16), (False, 1, 24, 20)],
                         ids=["generic", "specialised", "narrow16x16", "narrow16x32", "narrow32x16", "narrow24x20"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_accumulate_rows_against_pair_loop(specialised, groups, in_per_group, out_per_group, dtype, monkeypatch):
    if specialised:  # compile the channel counts in even for this small layer
        monkeypatch.setattr(_cpu_kernels, "SPECIALISE_MIN_PAIR_FLOPS", 0)
    assert _cpu_kernels.is_narrow(groups, in_per_group, out_per_group) == (in_per_group >= 16)
    rng = np.random.default_rng(1402)
    volume, num_source, num_destination = 5, 150, 170
    pair_input, pair_output, starts = _random_pairs(rng, volume, num_source, num_destination)
    source = rng.standard_normal((num_source, groups * in_per_group)).astype(dtype)
    matrices = rng.standard_normal((volume, groups, in_per_group, out_per_group)).astype(dtype)
    initial = rng.standard_normal((num_destination, groups * out_per_group)).astype(dtype)
    expected = initial.astype(np.float64)
    for offset in range(volume):
        rows = slice(starts[offset], starts[offset + 1])
        for group in range(groups):
            block = source[pair_input[rows], group * in_per_group:(group + 1) * in_per_group].astype(np.float64)
            product = block @ matrices[offset, group].astype(np.float64)
            np.add.at(expected[:, group * out_per_group:(group + 1) * out_per_group], pair_output[rows], product)
    out = initial.copy()
    table = _cpu_kernels.neighbour_table(pair_output, pair_input, starts, num_destination)
    _cpu_kernels.accumulate_rows(source, table, matrices, out, int(starts[-1]))
    tolerance = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, expected, rtol=tolerance, atol=tolerance)


def test_fused_rule_follows_the_measurements():
    # ungrouped: the forward runs fused from 16 x 16 (the narrow kernel up to 32 channels) up to
    # 64 x 64; the backward only on the narrow kernel, when the outputs are no wider than the inputs
    assert not conv.fused_on_cpu(NUMPY_BACKEND, 8, 8, 1)
    assert conv.fused_on_cpu(NUMPY_BACKEND, 16, 16, 1)
    assert conv.fused_on_cpu(NUMPY_BACKEND, 16, 32, 1)
    assert conv.fused_on_cpu(NUMPY_BACKEND, 32, 32, 1)
    assert conv.fused_on_cpu(NUMPY_BACKEND, 48, 48, 1)
    assert conv.fused_on_cpu(NUMPY_BACKEND, 64, 64, 1)
    assert not conv.fused_on_cpu(NUMPY_BACKEND, 128, 128, 1)
    for channels_in, channels_out in ((16, 16), (32, 32), (32, 16)):
        assert conv.fused_on_cpu(NUMPY_BACKEND, channels_in, channels_out, 1, "backward")
    for channels_in, channels_out in ((16, 32), (48, 48), (64, 64)):
        assert not conv.fused_on_cpu(NUMPY_BACKEND, channels_in, channels_out, 1, "backward")
    # grouped: the forward up to 64 x 64 per group, the backward up to 8 x 8 per group
    assert conv.fused_on_cpu(NUMPY_BACKEND, 64, 64, 64)
    assert conv.fused_on_cpu(NUMPY_BACKEND, 256, 256, 4)
    assert not conv.fused_on_cpu(NUMPY_BACKEND, 256, 256, 2)
    assert conv.fused_on_cpu(NUMPY_BACKEND, 64, 64, 8, "backward")
    assert not conv.fused_on_cpu(NUMPY_BACKEND, 64, 64, 4, "backward")
    assert not conv.fused_on_cpu(object(), 64, 64, 1)  # only the NumPy backend has fused kernels


def _layer_case(seed: int, kind: str, channels_in: int, channels_out: int, groups: int):
    rng = do.make_rng(seed)
    spatial_shape, batch_size = (7, 8, 6), 2
    indices = do.random_indices(rng, spatial_shape, batch_size, 0.3)
    features = do.random_features(rng, indices.shape[0], channels_in)
    weight = do.random_weight(rng, channels_out, (3, 3, 3), channels_in // groups)
    stride, padding = (1, 1) if kind == "subm" else (2, 1)
    geometry = sc.ConvGeometry.create(3, 3, stride=stride, padding=0 if kind == "subm" else padding, kind=kind)
    rulebook = sc.build_rulebook(indices, spatial_shape, batch_size, geometry)
    sites = np.asarray(rulebook.output_indices)
    grad_output = do.random_features(rng, sites.shape[0], channels_out)

    def dense(feats, w):
        x = do.densify(feats, indices, spatial_shape, batch_size)
        return do.dense_conv(x, w, stride, padding, 1, groups)

    oracle = do.evaluate(dense, features, sites, weight, grad_output=grad_output)
    return features, weight, rulebook, grad_output, oracle


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "blas"])
@pytest.mark.parametrize("kind, channels_in, channels_out, groups",
                         [("subm", 5, 7, 1), ("regular", 6, 4, 2), ("subm", 4, 4, 4), ("subm", 16, 16, 1),
                          ("regular", 32, 16, 1), ("subm", 16, 32, 1)])
def test_both_cpu_dataflows_match_the_dense_oracle(fused, kind, channels_in, channels_out, groups, monkeypatch):
    calls = []

    def choose(*arguments, **keywords):
        calls.append(arguments)
        return fused

    monkeypatch.setattr(conv, "fused_on_cpu", choose)  # the conv passes ask this name: both stages forced
    features, weight, rulebook, grad_output, oracle = _layer_case(1403, kind, channels_in, channels_out, groups)
    out = sc.conv_forward(features, weight, rulebook, groups=groups)
    do.assert_close(out, oracle.values, "conv_forward")
    grad_features, grad_weight = sc.conv_backward(grad_output, features, weight, rulebook, groups=groups)
    do.assert_close(grad_features, oracle.grad_features, "grad_features")
    do.assert_close(grad_weight, oracle.grad_weight, "grad_weight")
    assert len(calls) == 2  # the forward and the backward each asked once


def test_narrow_kernel_sums_as_the_generic_kernel():
    # same sums in the same order, only the loops turned: the narrow kernel equals the generic one
    rng = np.random.default_rng(1406)
    pair_input, pair_output, starts = _random_pairs(rng, 27, 400, 300)
    source = rng.standard_normal((400, 16)).astype(np.float32)
    matrices = rng.standard_normal((27, 1, 16, 32)).astype(np.float32)
    initial = rng.standard_normal((300, 32)).astype(np.float32)
    table = _cpu_kernels.neighbour_table(pair_output, pair_input, starts, 300)
    narrow, generic = initial.copy(), initial.copy()
    _cpu_kernels.accumulate_rows(source, table, matrices, narrow, int(starts[-1]))
    _cpu_kernels._rows_kernel(1, 16, 32)(source, table, matrices, generic)
    np.testing.assert_allclose(narrow, generic, rtol=1e-6, atol=1e-6)


def test_neighbour_tables_are_built_once_per_rulebook(monkeypatch):
    features, weight, rulebook, grad_output, _ = _layer_case(1407, "subm", 16, 16, 1)
    built = []
    build = _cpu_kernels.neighbour_table

    def counting(*arguments):
        built.append(arguments[-1])
        return build(*arguments)

    monkeypatch.setattr(_cpu_kernels, "neighbour_table", counting)
    first = sc.conv_forward(features, weight, rulebook)
    sc.conv_backward(grad_output, features, weight, rulebook)
    second = sc.conv_forward(features, weight * 2, rulebook)  # a second layer on the same rulebook
    sc.conv_backward(grad_output, features, weight, rulebook)
    assert built == [rulebook.num_output, rulebook.num_input]  # one forward and one backward table
    np.testing.assert_allclose(second, 2 * first, rtol=1e-5, atol=1e-5)
    table = cpu_dataflow.neighbour_table(rulebook, "forward")
    assert table is cpu_dataflow.neighbour_table(rulebook.pair_map, "forward")  # one slot for both forms
    assert not table.flags.writeable
    with pytest.raises(ValueError, match="direction must be 'forward' or 'backward', got 'sideways'"):
        cpu_dataflow.neighbour_table(rulebook, "sideways")


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_fused_low_precision_storage(dtype):
    features, weight, rulebook, _, _ = _layer_case(1404, "subm", 8, 8, 2)
    assert conv.fused_on_cpu(NUMPY_BACKEND, 8, 8, 2)
    out = sc.conv_forward(features.astype(dtype), weight.astype(dtype), rulebook, groups=2)
    assert out.dtype == dtype
    reference = sc.conv_forward(features.astype(dtype).astype(np.float64), weight.astype(dtype).astype(np.float64),
                                rulebook, groups=2)
    np.testing.assert_allclose(out.astype(np.float64), reference, rtol=2e-3 if dtype == np.float16 else 1e-5,
                               atol=2e-2 if dtype == np.float16 else 1e-5)


def test_fused_empty_input():
    geometry = sc.ConvGeometry.create(3, 3, kind="subm")
    indices = np.zeros((0, 4), dtype=np.int32)
    rulebook = sc.build_rulebook(indices, (4, 4, 4), 1, geometry)
    features = np.zeros((0, 8), dtype=np.float32)
    weight = np.random.default_rng(1405).standard_normal((8, 3, 3, 3, 2)).astype(np.float32)
    assert conv.fused_on_cpu(NUMPY_BACKEND, 8, 8, 4) and conv.fused_on_cpu(NUMPY_BACKEND, 8, 8, 4, "backward")
    assert sc.conv_forward(features, weight, rulebook, groups=4).shape == (0, 8)
    grad_features, grad_weight = sc.conv_backward(np.zeros((0, 8), np.float32), features, weight, rulebook, groups=4)
    assert grad_features.shape == (0, 8) and grad_weight.shape == weight.shape
    assert not grad_weight.any()


def test_import_sparsecore_does_not_import_numba():
    import subprocess
    import sys

    code = "import sys, sparsecore; print('numba' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.strip() == "False"
