"""The compiled CPU kernels (sparsecore.backends._cpu_kernels) and the conv dataflow choice.

Oracles: integer references of the neighbour table and the tile plan (plain
loops over the pairs), a float64 pair loop (``np.add.at``) for the fused row kernel and the
tiled kernels, and the dense float64 convolution (tests/dense_oracle.py) for
whole passes on the three CPU dataflows (fused, tiled and per-offset BLAS). The tiled
tests run twice (``kernel_path``): on the compiled kernels and on their NumPy twins
(`_tile_twins`, which small layers run), whatever the sizes.
"""

from __future__ import annotations

import numpy as np
import pytest

import sparsecore as sc
from sparsecore import conv, cpu_dataflow
from sparsecore.backends import NUMPY_BACKEND, _cpu_kernels

import dense_oracle as do  # noqa: E402  (tests/ is on the path)


@pytest.fixture(params=["compiled", "numpy-twin"])
def kernel_path(request, monkeypatch) -> str:
    """Every tiled kernel of the test compiled, or every one its NumPy twin (`_cpu_kernels.compiled_kernel`)."""
    monkeypatch.setattr(_cpu_kernels, "NUMPY_MAX_WORK", -1 if request.param == "compiled" else 2**62)
    return request.param


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


# the generic kernel at both dtypes; each compiled-in shape at one dtype, both dtypes among them (a
# specialisation is compiled per shape and dtype, and these shapes run nowhere else)
@pytest.mark.parametrize("specialised, groups, in_per_group, out_per_group, dtype",
                         [(False, 2, 3, 5, np.float32), (False, 2, 3, 5, np.float64), (True, 2, 3, 5, np.float64),
                          (False, 1, 16, 32, np.float32), (False, 1, 16, 32, np.float64), (True, 4, 8, 4, np.float32)],
                         ids=["generic-float32", "generic-float64", "specialised-float64", "generic16x32-float32",
                              "generic16x32-float64", "specialised4x8x4-float32"])
def test_accumulate_rows_against_pair_loop(specialised, groups, in_per_group, out_per_group, dtype, monkeypatch):
    if specialised:  # compile the channel counts in even for this small layer
        monkeypatch.setattr(_cpu_kernels, "SPECIALISE_MIN_PAIR_FLOPS", 0)
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


def test_dataflow_rule_follows_the_measurements():
    rule = lambda *arguments: conv.dataflow_on_cpu(NUMPY_BACKEND, *arguments)  # noqa: E731
    # ungrouped: tiled at both stages, whatever the channels
    for channels_in, channels_out in ((1, 1), (4, 4), (1, 4), (3, 16), (8, 8), (16, 16), (16, 32), (32, 32), (64, 64),
                                      (128, 128), (256, 64)):
        assert rule(channels_in, channels_out, 1) == rule(channels_in, channels_out, 1, "backward") == "tiled"
    # grouped: the forward fused up to 64 x 64 per group, the backward up to 8 x 8 per group
    assert rule(64, 64, 64) == rule(256, 256, 4) == "fused"
    assert rule(256, 256, 2) == "per_offset"
    assert rule(64, 64, 8, "backward") == "fused" and rule(64, 64, 4, "backward") == "per_offset"
    assert conv.dataflow_on_cpu(object(), 64, 64, 1) == "per_offset"  # only the NumPy backend has compiled passes
    assert conv.fused_on_cpu(NUMPY_BACKEND, 64, 64, 64) and not conv.fused_on_cpu(NUMPY_BACKEND, 64, 64, 1)


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


_LAYERS = [("subm", 5, 7, 1), ("regular", 6, 4, 2), ("subm", 4, 4, 4), ("subm", 16, 16, 1), ("regular", 32, 16, 1),
           ("subm", 16, 32, 1)]


# the tiled dataflow (ungrouped layers) on both kernel paths; the fused and per-offset dataflows call no
# tiled kernel (the path changes only how the rulebook is built, which test_rulebook_kernels checks both
# ways): each layer on one path, the two paths alternating
_PATHS = ("compiled", "numpy-twin")
_DATAFLOW_CASES = ([("tiled", path) + layer for layer in _LAYERS if layer[3] == 1 for path in _PATHS]
                   + [(dataflow, _PATHS[(index + shift) % 2]) + layer
                      for shift, dataflow in enumerate(("fused", "per_offset")) for index, layer in enumerate(_LAYERS)])


@pytest.mark.parametrize("dataflow, kernel_path, kind, channels_in, channels_out, groups", _DATAFLOW_CASES,
                         indirect=["kernel_path"])
def test_every_cpu_dataflow_matches_the_dense_oracle(dataflow, kind, channels_in, channels_out, groups, monkeypatch,
                                                    kernel_path):
    calls = []

    def choose(*arguments, **keywords):
        calls.append(arguments)
        return dataflow

    monkeypatch.setattr(conv, "dataflow_on_cpu", choose)  # the conv passes ask this name: both stages forced
    monkeypatch.setattr(_cpu_kernels, "TILE_ITEMS", 1)  # several tiled work items even on this small layer
    features, weight, rulebook, grad_output, oracle = _layer_case(1403, kind, channels_in, channels_out, groups)
    out = sc.conv_forward(features, weight, rulebook, groups=groups)
    do.assert_close(out, oracle.values, "conv_forward")
    grad_features, grad_weight = sc.conv_backward(grad_output, features, weight, rulebook, groups=groups)
    do.assert_close(grad_features, oracle.grad_features, "grad_features")
    do.assert_close(grad_weight, oracle.grad_weight, "grad_weight")
    assert len(calls) == 2  # the forward and the backward each asked once


def _pair_loop(source, grad, matrices, pair_input, pair_output, starts, num_destination):
    """float64 oracle: the forward sums, d-source and d-matrices of ``out[o] += source[i] @ M_k``."""
    source64, grad64, matrices64 = (array.astype(np.float64) for array in (source, grad, matrices))
    out = np.zeros((num_destination, matrices.shape[2]))
    grad_source = np.zeros(source.shape)
    grad_matrices = np.zeros(matrices.shape)
    for offset in range(matrices.shape[0]):
        rows = slice(starts[offset], starts[offset + 1])
        inputs, outputs = pair_input[rows], pair_output[rows]
        np.add.at(out, outputs, source64[inputs] @ matrices64[offset])
        np.add.at(grad_source, inputs, grad64[outputs] @ matrices64[offset].T)
        grad_matrices[offset] = source64[inputs].T @ grad64[outputs]
    return out, grad_source, grad_matrices


def _plan_reference(keys, values, starts, num_rows, capacity):
    """Integer reference of a tile plan: per (work item, offset), the pairs in their order."""
    volume, works = len(starts) - 1, -(-num_rows // capacity)
    ranges = [[[] for _ in range(volume)] for _ in range(works)]
    for offset in range(volume):
        for pair in range(starts[offset], starts[offset + 1]):
            ranges[keys[pair] // capacity][offset].append((int(values[pair]), int(keys[pair]) % capacity))
    return [pair for work in ranges for offset in work for pair in offset], [len(r) for work in ranges for r in work]


@pytest.mark.parametrize("items", [1, 2, 4, 32])
def test_tile_plan_against_integer_reference(items, kernel_path):
    rng = np.random.default_rng(1411)
    capacity = items * _cpu_kernels.ROW_BLOCK
    for volume, num_source, num_destination in ((27, 300, 200), (1, 5, 130), (8, 64, 700), (3, 1, 1)):
        pair_input, pair_output, starts = _random_pairs(rng, volume, num_source, num_destination)
        plan = _cpu_kernels.tile_plan(pair_output, pair_input, starts, num_destination, items)
        expected_pairs, expected_counts = _plan_reference(pair_output, pair_input, starts, num_destination, capacity)
        assert plan.capacity == capacity
        assert plan.starts.shape == (-(-num_destination // capacity) * volume + 1,)
        np.testing.assert_array_equal(np.diff(plan.starts), expected_counts)
        assert plan.most == max(expected_counts, default=0)
        assert list(zip(plan.sources.tolist(), plan.local_rows.tolist())) == expected_pairs
        assert not (plan.starts.flags.writeable or plan.sources.flags.writeable or plan.local_rows.flags.writeable)


def test_tile_plan_empty_and_bad_items(kernel_path):
    empty = np.zeros(0, dtype=np.int32)
    plan = _cpu_kernels.tile_plan(empty, empty, (0, 0, 0), 0, 4)
    assert plan.starts.tolist() == [0] and plan.sources.size == 0 and plan.most == 0
    plan = _cpu_kernels.tile_plan(empty, empty, (0, 0, 0), 300, 1)  # rows, no pairs: empty ranges
    assert plan.starts.tolist() == [0] * (5 * 2 + 1) and plan.most == 0
    with pytest.raises(ValueError, match="items must be a power of two"):
        _cpu_kernels.tile_plan(empty, empty, (0, 0), 10, 3)


def _tiled_passes(source, grad, matrices, pair_input, pair_output, starts, num_destination, items, initial):
    pairs = int(starts[-1])
    out = initial.copy()
    forward_plan = _cpu_kernels.tile_plan(pair_output, pair_input, starts, num_destination, items)
    _cpu_kernels.tiled_forward(source, forward_plan, matrices, out, pairs)
    backward_plan = _cpu_kernels.tile_plan(pair_input, pair_output, starts, source.shape[0], items)
    grad_source, grad_matrices = _cpu_kernels.tiled_backward(source, grad, backward_plan, matrices, pairs)
    return out, grad_source, grad_matrices


@pytest.mark.parametrize("items", [1, 2, 32])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("slice_rows", [None, 1, 7])
def test_tiled_kernels_against_pair_loop(items, dtype, slice_rows, monkeypatch, kernel_path):
    if slice_rows is not None:  # every GEMM in slices of this many rows, the d-weights slices summed
        monkeypatch.setattr(_cpu_kernels, "SMALL_GEMM_WORK", slice_rows * 6 * 9)
        monkeypatch.setattr(_cpu_kernels, "SMALL_GEMM_MIN_ROWS", 1)
        assert _cpu_kernels.gemm_chunk_rows(6, 9) == slice_rows
    rng = np.random.default_rng(1408)
    volume, num_source, num_destination, channels_in, channels_out = 7, 290, 330, 6, 9
    pair_input, pair_output, starts = _random_pairs(rng, volume, num_source, num_destination)
    source = rng.standard_normal((num_source, channels_in)).astype(dtype)
    matrices = rng.standard_normal((volume, channels_in, channels_out)).astype(dtype)
    grad = rng.standard_normal((num_destination, channels_out)).astype(dtype)
    initial = rng.standard_normal((num_destination, channels_out)).astype(dtype)
    expected_out, expected_grad_source, expected_grad_matrices = _pair_loop(
        source, grad, matrices, pair_input, pair_output, starts, num_destination)
    out, grad_source, grad_matrices = _tiled_passes(source, grad, matrices, pair_input, pair_output, starts,
                                                    num_destination, items, initial)
    tolerance = 1e-5 if dtype == np.float32 else 1e-12
    assert out.dtype == grad_source.dtype == grad_matrices.dtype == dtype
    np.testing.assert_allclose(out, initial + expected_out, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(grad_source, expected_grad_source, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(grad_matrices, expected_grad_matrices, rtol=tolerance, atol=tolerance * 10)


def test_tiled_kernels_sum_rows_repeated_within_an_offset(kernel_path):
    # a hand-made pair map may pair one row several times through one offset: every pair is summed, and a
    # work item's range may then hold more pairs than it has rows (the tiles are sized from the plan)
    rng = np.random.default_rng(1412)
    volume, num_source, num_destination = 3, 40, 70
    counts = (300, 5, 90)
    pair_input = rng.integers(0, num_source, sum(counts)).astype(np.int32)
    pair_output = rng.integers(0, num_destination, sum(counts)).astype(np.int32)
    starts = tuple(np.concatenate([[0], np.cumsum(counts)]).tolist())
    source = rng.standard_normal((num_source, 5))
    matrices = rng.standard_normal((volume, 5, 4))
    grad = rng.standard_normal((num_destination, 4))
    initial = rng.standard_normal((num_destination, 4))
    expected_out, expected_grad_source, expected_grad_matrices = _pair_loop(
        source, grad, matrices, pair_input, pair_output, starts, num_destination)
    assert _cpu_kernels.tile_plan(pair_output, pair_input, starts, num_destination, 1).most > _cpu_kernels.ROW_BLOCK
    out, grad_source, grad_matrices = _tiled_passes(source, grad, matrices, pair_input, pair_output, starts,
                                                    num_destination, 1, initial)
    np.testing.assert_allclose(out, initial + expected_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grad_source, expected_grad_source, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grad_matrices, expected_grad_matrices, rtol=1e-12, atol=1e-11)


def test_gemm_slices_stay_within_the_small_gemm_work():
    for channels_in, channels_out in ((1, 1), (16, 16), (64, 64), (64, 96), (128, 128), (176, 176)):
        rows = _cpu_kernels.gemm_chunk_rows(channels_in, channels_out)
        assert rows * channels_in * channels_out <= _cpu_kernels.SMALL_GEMM_WORK
        assert (rows + 1) * channels_in * channels_out > _cpu_kernels.SMALL_GEMM_WORK  # the largest such slice
        assert rows >= _cpu_kernels.SMALL_GEMM_MIN_ROWS
    # wider layers keep whole products rather than slices of a few rows
    assert _cpu_kernels.gemm_chunk_rows(256, 256) >= 2**31 - 1


def test_tile_items_bounds_the_partial_weights():
    assert _cpu_kernels.tile_items(1000, 27, 16, 16, 4) == _cpu_kernels.TILE_ITEMS
    # small clouds: at least TILE_MIN_WORKS items where the table has that many blocks
    assert -(-100 // _cpu_kernels.tile_items(100)) >= _cpu_kernels.TILE_MIN_WORKS
    assert _cpu_kernels.tile_items(3) == 1 and _cpu_kernels.tile_items(17) == 2
    items = _cpu_kernels.tile_items(2000, 27, 256, 256, 4)
    assert items > _cpu_kernels.TILE_ITEMS
    assert -(-2000 // items) * 27 * 256 * 256 * 4 <= _cpu_kernels.TILE_PARTIAL_MAX_BYTES
    assert -(-2000 // (items // 2)) * 27 * 256 * 256 * 4 > _cpu_kernels.TILE_PARTIAL_MAX_BYTES  # the smallest such
    assert _cpu_kernels.tile_items(3, 27, 4096, 4096, 8) >= 3  # one work item when nothing smaller fits
    # backward: at most pairs / (TILE_MIN_PAIRS_PER_OFFSET * K) items
    assert -(-4 // _cpu_kernels.tile_items(4, 27, 224, 256, 4, pairs=1662)) == 1
    assert -(-17 // _cpu_kernels.tile_items(17, 27, 8, 8, 4, pairs=14295)) <= 14295 // (64 * 27)
    assert _cpu_kernels.tile_items(1962, 27, 64, 64, 4, pairs=788888) == _cpu_kernels.TILE_ITEMS


def test_tiled_empty_input(kernel_path):
    empty = np.zeros(0, dtype=np.int32)
    matrices = np.random.default_rng(1409).standard_normal((3, 4, 5)).astype(np.float32)
    plan = _cpu_kernels.tile_plan(empty, empty, (0, 0, 0, 0), 0, 1)
    out = np.zeros((0, 5), np.float32)
    _cpu_kernels.tiled_forward(np.zeros((0, 4), np.float32), plan, matrices, out, 0)
    grad_source, grad_matrices = _cpu_kernels.tiled_backward(np.zeros((0, 4), np.float32), out, plan, matrices, 0)
    assert grad_source.shape == (0, 4) and grad_matrices.shape == (3, 4, 5) and not grad_matrices.any()
    # sites but no pairs: the gradients are zeros of the right shapes
    rows = np.random.default_rng(1410).standard_normal((70, 4)).astype(np.float32)
    no_pairs = _cpu_kernels.tile_plan(empty, empty, (0, 0, 0, 0), 70, 1)
    grad_source, grad_matrices = _cpu_kernels.tiled_backward(rows, np.ones((70, 5), np.float32), no_pairs,
                                                             matrices, 0)
    assert grad_source.shape == (70, 4) and not grad_source.any() and not grad_matrices.any()


def test_the_numpy_twins_build_the_compiled_plan_and_agree_with_the_kernels():
    rng = np.random.default_rng(1415)
    pair_input, pair_output, starts = _random_pairs(rng, 27, 900, 1300)
    source = rng.standard_normal((900, 6)).astype(np.float32)
    matrices = rng.standard_normal((27, 6, 10)).astype(np.float32)
    grad = rng.standard_normal((1300, 10)).astype(np.float32)
    results = {}
    for compiled in (True, False):
        plans = [_cpu_kernels.tile_plan(keys, values, starts, rows, 2, compiled=compiled) for keys, values, rows in
                 ((pair_output, pair_input, 1300), (pair_input, pair_output, 900))]
        out = np.zeros((1300, 10), np.float32)
        _cpu_kernels.tiled_forward(source, plans[0], matrices, out, int(starts[-1]), compiled=compiled)
        results[compiled] = plans, out, *_cpu_kernels.tiled_backward(source, grad, plans[1], matrices,
                                                                     int(starts[-1]), compiled=compiled)
    for kernel_plan, twin_plan in zip(results[True][0], results[False][0]):  # the same plan, bitwise
        for name in ("starts", "sources", "local_rows", "capacity", "most"):
            np.testing.assert_array_equal(getattr(twin_plan, name), getattr(kernel_plan, name), err_msg=name)
    for kernel, twin in zip(results[True][1:], results[False][1:]):  # the passes, to float32 rounding
        np.testing.assert_allclose(twin, kernel, rtol=1e-5, atol=1e-4)
    # which one runs: the sizes alone
    assert _cpu_kernels.compiled_kernel(_cpu_kernels.NUMPY_MAX_WORK + 1)
    assert not _cpu_kernels.compiled_kernel(_cpu_kernels.NUMPY_MAX_WORK)


def test_layouts_are_built_once_per_rulebook(monkeypatch):
    built = []

    def counting(name):
        build = getattr(_cpu_kernels, name)

        def wrapper(*arguments):
            built.append((name, arguments[3]))
            return build(*arguments)
        return wrapper

    monkeypatch.setattr(_cpu_kernels, "neighbour_table", counting("neighbour_table"))
    monkeypatch.setattr(_cpu_kernels, "tile_plan", counting("tile_plan"))
    # 16 -> 16 runs tiled both ways: one forward and one backward plan
    features, weight, rulebook, grad_output, _ = _layer_case(1407, "subm", 16, 16, 1)
    first = sc.conv_forward(features, weight, rulebook)
    sc.conv_backward(grad_output, features, weight, rulebook)
    second = sc.conv_forward(features, weight * 2, rulebook)  # a second layer on the same rulebook
    sc.conv_backward(grad_output, features, weight, rulebook)
    assert built == [("tile_plan", rulebook.num_output), ("tile_plan", rulebook.num_input)]
    np.testing.assert_allclose(second, 2 * first, rtol=1e-5, atol=1e-5)
    items = _cpu_kernels.tile_items(-(-rulebook.num_output // _cpu_kernels.ROW_BLOCK))
    plan = cpu_dataflow.tile_plan(rulebook, "forward", items)
    assert plan is cpu_dataflow.tile_plan(rulebook.pair_map, "forward", items)  # one slot for both forms
    # a grouped layer runs fused: one forward and one backward table
    built.clear()
    features, weight, rulebook, grad_output, _ = _layer_case(1413, "subm", 8, 8, 2)
    sc.conv_forward(features, weight, rulebook, groups=2)
    sc.conv_backward(grad_output, features, weight, rulebook, groups=2)
    sc.conv_forward(features, weight, rulebook, groups=2)
    assert built == [("neighbour_table", rulebook.num_output), ("neighbour_table", rulebook.num_input)]
    table = cpu_dataflow.neighbour_table(rulebook, "forward")
    assert table is cpu_dataflow.neighbour_table(rulebook.pair_map, "forward")
    assert not table.flags.writeable
    for layout in (cpu_dataflow.neighbour_table, lambda rulebook, direction: cpu_dataflow.tile_plan(rulebook,
                                                                                                   direction, 1)):
        with pytest.raises(ValueError, match="direction must be 'forward' or 'backward', got 'sideways'"):
            layout(rulebook, "sideways")


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
