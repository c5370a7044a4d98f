"""The pair primitives (`sparsecore.backends._kernel_pairs` and the NumPy backend's) against NumPy twins.

``compact_pairs`` and ``conv_candidate_pairs`` are checked on both backends
against the kernels' NumPy twins (``cuda_emulation/numpy_twins.py``), exactly.
The feature primitives over pairs (``scatter_add_pairs``, scatter plans,
``max_pool_pairs``, ``avg_pool_pairs``) are the NumPy backend's alone (the
kernel backend runs the fused map kernels instead): checked against the same
twins, exactly where the order of additions is the twins', within rounding
where the NumPy backend adds offset by offset; and the kernel backend's pools
run their map kernels, padded pair maps included.
"""

from __future__ import annotations

import numpy as np
import pytest

import sparsecore as sc
from sparsecore.backends import NUMPY_BACKEND

try:
    from cuda_emulation import numpy_twins
    from kernel_targets import assert_equal, random_sites, rng_for, target  # noqa: F401
except ImportError:  # tests/ imported as a package
    from tests.cuda_emulation import numpy_twins
    from tests.kernel_targets import assert_equal, random_sites, rng_for, target  # noqa: F401


def _random_table(rng: np.random.Generator, rows: int, length: int) -> np.ndarray:
    table = rng.integers(0, 10**6, size=(rows, length)).astype(np.int64)
    table[rng.random((rows, length)) < 0.6] = -1
    return table


# ================================================================ compact_pairs


@pytest.mark.parametrize("rows, length", [(0, 5), (3, 0), (1, 1), (4, 255), (3, 256), (13, 700)])
def test_compact_pairs_equals_the_twin(target, rows, length):
    table = _random_table(rng_for(30, rows, length), rows, length)
    columns, values, counts = numpy_twins.compact(table)
    starts = (0, *np.cumsum(counts).tolist())
    for backend, put, get in ((NUMPY_BACKEND, np.asarray, np.asarray), (target.backend, target.put, target.get)):
        actual_columns, actual_values, actual_starts = backend.compact_pairs(put(table))
        assert actual_starts == starts
        assert_equal(get(actual_columns), columns, "columns")
        assert_equal(get(actual_values), values, "values")


def test_compact_pairs_rejects_a_table_that_is_not_2d(target):
    with pytest.raises(ValueError, match="table must be a 2-D integer array"):
        target.backend.compact_pairs(target.put(np.zeros(4, np.int64)))


# ========================================================= conv_candidate_pairs


CANDIDATE_CASES = [
    # kind, spatial shape, kernel size, stride, padding, dilation, output padding
    ("regular", (60,), 3, 2, 1, 1, 0),
    ("regular", (9, 11), (2, 3), (2, 1), (0, 1), (1, 2), 0),
    ("regular", (7, 8, 6), 3, 2, 1, 1, 0),
    ("regular", (7, 8, 6), 3, 1, 2, 2, 0),
    ("transposed", (60,), 3, 2, 1, 1, 1),
    ("transposed", (6, 7, 5), (2, 2, 3), (2, 2, 1), 0, 1, 0),
]


@pytest.mark.parametrize("count", [0, 1, 90])
@pytest.mark.parametrize("case", CANDIDATE_CASES, ids=lambda case: f"{case[0]}-{len(case[1])}d")
def test_conv_candidate_pairs_equals_the_dense_formula(target, case, count):
    kind, shape, kernel_size, stride, padding, dilation, output_padding = case
    geometry = sc.ConvGeometry.create(len(shape), kernel_size, stride=stride, padding=padding, dilation=dilation,
                                      output_padding=output_padding, kind=kind)
    out_shape = geometry.output_spatial_shape(shape)
    indices = random_sites(rng_for(31, len(shape), count), count, shape, 2)
    positions = np.indices(geometry.kernel_size).reshape(geometry.ndim, -1).T
    keys = numpy_twins.conv_candidates(indices, positions, geometry.stride, geometry.padding, geometry.dilation,
                                       out_shape, kind == "transposed")
    offsets, rows = np.nonzero(keys >= 0)
    starts = (0, *np.cumsum(np.bincount(offsets, minlength=geometry.kernel_volume)).tolist())
    for backend, put, get in ((NUMPY_BACKEND, np.asarray, np.asarray), (target.backend, target.put, target.get)):
        actual_rows, actual_keys, actual_starts = backend.conv_candidate_pairs(put(indices), geometry, out_shape)
        assert actual_starts == starts
        assert_equal(get(actual_rows), rows.astype(np.int32), "input rows")
        assert_equal(get(actual_keys), keys[offsets, rows], "keys")


# ============================================================ scatter_add_pairs


def _storage(target, dtype_name: str, array: np.ndarray) -> np.ndarray:
    """The twin's storage array (bfloat16 as uint16 bits) as the target's dtype."""
    return array.view(target.dtype("bfloat16")) if dtype_name == "bfloat16" else array


def _pair_runs(rng: np.random.Generator, num_rows: int, run_lengths: list[int]) -> tuple[np.ndarray, tuple]:
    """Rows unique within each run, repeating across runs."""
    rows = np.concatenate([rng.choice(num_rows, size=length, replace=False) for length in run_lengths]
                          + [np.zeros(0, np.int64)]).astype(np.int32)
    return rows, (0, *np.cumsum(run_lengths).tolist())


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
@pytest.mark.parametrize("run_lengths", [[], [17], [0, 17, 0], [30, 5, 0, 41, 12]])
def test_scatter_add_pairs_equals_the_segment_sum_twin(dtype_name, run_lengths):
    """The NumPy backend adds offset by offset: equal to the in-order segment sums within rounding."""
    rng = rng_for(32, len(run_lengths), sum(run_lengths))
    rows, run_starts = _pair_runs(rng, 45, run_lengths)
    start = numpy_twins.random_features(rng, (45, 3), dtype_name)
    values = numpy_twins.random_features(rng, (rows.shape[0], 3), dtype_name)
    order = np.argsort(rows, kind="stable").astype(np.int32)
    segment_starts = np.searchsorted(rows[order], np.arange(46)).astype(np.int64)
    expected = numpy_twins.segment_sum_rows(start, values, order, segment_starts, np.arange(45, dtype=np.int32),
                                            dtype_name)
    numpy_target = start.copy()
    NUMPY_BACKEND.scatter_add_pairs(numpy_target, rows, values, run_starts)
    np.testing.assert_allclose(numpy_target, expected, rtol=1e-5 if dtype_name == "float32" else 1e-12)


@pytest.mark.parametrize("run_lengths", [[], [17], [0, 17, 0], [30, 5, 0, 41, 12]])
def test_one_scatter_plan_serves_several_values(run_lengths):
    # a plan built once adds fresh values each time, as float64 np.add.at does
    rng = rng_for(33, len(run_lengths), sum(run_lengths))
    rows, run_starts = _pair_runs(rng, 45, run_lengths)
    plan = NUMPY_BACKEND.scatter_plan(rows, run_starts, 45)
    target = rng.standard_normal((45, 3))
    expected = target.copy()
    for _ in range(2):
        values = rng.standard_normal((rows.shape[0], 3))
        NUMPY_BACKEND.scatter_add_planned(target, plan, values)
        np.add.at(expected, rows, values)
    np.testing.assert_allclose(target, expected, rtol=1e-12, atol=1e-12)


def test_scatter_plans_reject_bad_arguments():
    with pytest.raises(TypeError, match="plan must come from scatter_plan"):
        NUMPY_BACKEND.scatter_add_planned(np.zeros((4, 2)), (np.zeros(3, np.int32), (0, 2, 3)), np.ones((3, 2)))
    with pytest.raises(ValueError, match="run_starts must run from 0 to 3"):
        NUMPY_BACKEND.scatter_plan(np.array([0, 1, 0], np.int32), (0, 1), 4)


def _grouping(rows: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """``(order, starts)``: a stable argsort of ``rows`` and the int64 CSR starts of its ``count`` groups."""
    order = np.argsort(rows, kind="stable")
    return order, np.searchsorted(rows[order], np.arange(count + 1)).astype(np.int64)


def _pool_pairs(rng: np.random.Generator, num_input: int, num_output: int, runs: int, length: int,
                empty_outputs: int = 0) -> tuple[np.ndarray, np.ndarray, tuple]:
    """``runs`` offsets of ``length`` pairs, rows unique within a run; the last ``empty_outputs`` outputs get none."""
    input_rows = np.concatenate([rng.choice(num_input, size=length, replace=False) for _ in range(runs)])
    output_rows, run_starts = _pair_runs(rng, num_output - empty_outputs, [length] * runs)
    return input_rows.astype(np.int32), output_rows, run_starts


# =============================================================== max_pool_pairs


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "float64"])
def test_max_pool_pairs_equal_the_twin(dtype_name):
    rng = rng_for(33, len(dtype_name))
    num_input, num_output = 50, 30  # the last 3 outputs get no pair
    input_rows, output_rows, run_starts = _pool_pairs(rng, num_input, num_output, 4, 18, empty_outputs=3)
    features = numpy_twins.random_features(rng, (num_input, 4), dtype_name)
    features[10:20] = features[20:30]  # ties between rows
    order, output_starts = _grouping(output_rows, num_output)
    out, argmax = numpy_twins.max_pool_forward(features, input_rows[order], output_starts, dtype_name)
    actual_out, actual_argmax = NUMPY_BACKEND.max_pool_pairs(features, input_rows, output_rows, run_starts,
                                                             num_output)
    assert_equal(actual_out, out, "max")
    assert_equal(actual_argmax, argmax, "argmax")
    assert (argmax[-3:] == -1).all() and (out[-3:] == 0).all()


def test_max_pool_forward_runs_its_map_kernel(target):
    backend, launcher = target.recording()
    indices = target.put(random_sites(rng_for(34), 80, (6, 7, 5), 1))
    rulebook = sc.build_pool_rulebook(indices, (6, 7, 5), 1, 2, backend=backend)
    features = target.put(rng_for(35).standard_normal((80, 3)).astype(np.float32))
    built = len(launcher.records)
    sc.max_pool_forward(features, rulebook, backend=backend)
    assert [record.expression.split("<")[0] for record in launcher.records[built:]] == ["sc_max_pool_map"]


# =============================================================== avg_pool_pairs


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "float64"])
def test_avg_pool_pairs_equal_the_twins(dtype_name):
    rng = rng_for(36, len(dtype_name))
    input_rows, output_rows, run_starts = _pool_pairs(rng, 50, 30, 4, 18, empty_outputs=3)
    num_input, num_output = 50, 30
    features, grad_output = (numpy_twins.random_features(rng, (rows, 5), dtype_name) for rows in (50, 30))
    by_output, output_starts = _grouping(output_rows, num_output)
    by_input, input_starts = _grouping(input_rows, num_input)
    out = numpy_twins.avg_pool_forward(features, input_rows[by_output], output_starts, dtype_name)
    grad = numpy_twins.avg_pool_backward(grad_output, output_rows[by_input], input_starts, output_starts, dtype_name)
    actual = NUMPY_BACKEND.avg_pool_pairs(features, input_rows, output_rows, run_starts, num_output)
    assert_equal(actual, out, "avg_pool_pairs")
    actual = NUMPY_BACKEND.avg_pool_backward_pairs(grad_output, input_rows, output_rows, run_starts, num_input)
    assert_equal(actual, grad, "avg_pool_backward_pairs")
    assert (out[-3:] == 0).all()


def test_avg_pool_runs_one_kernel_per_pass_and_skips_padding(target):
    """On the kernel backend one map kernel per pass; a padded pair map (-1 = no pair) gives the unpadded
    map's results."""
    backend, launcher = target.recording()
    indices = random_sites(rng_for(37), 90, (6, 7, 5), 1)
    rulebook = sc.build_pool_rulebook(indices, (6, 7, 5), 1, 2)
    rng = rng_for(38)
    features = rng.standard_normal((90, 3))
    grad_output = rng.standard_normal((rulebook.num_output, 3))
    expected_out = sc.avg_pool_forward(features, rulebook)
    expected_grad = sc.avg_pool_backward(grad_output, rulebook)
    starts = tuple(rulebook.offset_starts)
    pair_input, pair_output, padded_starts = [], [], [0]
    for offset in range(len(starts) - 1):  # every offset padded with 3 pairs of -1 on one side or both
        pair_input += list(rulebook.pair_input[starts[offset]:starts[offset + 1]]) + [-1, -1, 4]
        pair_output += list(rulebook.pair_output[starts[offset]:starts[offset + 1]]) + [-1, 2, -1]
        padded_starts.append(len(pair_input))
    padded = sc.PairMap(target.put(np.asarray(pair_input, np.int32)), target.put(np.asarray(pair_output, np.int32)),
                        tuple(padded_starts), 90, rulebook.num_output, tuple(rulebook.kernel_size), padded=True)
    out = sc.avg_pool_forward(target.put(features), padded, backend=backend)
    grad = sc.avg_pool_backward(target.put(grad_output), padded, backend=backend)
    assert [record.expression.split("<")[0] for record in launcher.records] == [
        "sc_avg_pool_map", "sc_avg_pool_map_backward"]
    assert_equal(target.get(out), expected_out, "padded avg_pool_forward")
    assert_equal(target.get(grad), expected_grad, "padded avg_pool_backward")


# ========================================= offset lookups, compute dtypes, half GEMMs


def test_hash_lookup_offsets_answers_minus_one_for_negative_queries(target):
    # every delta of a negative query is -1, on both backends, even where query + delta is a stored key
    rng = rng_for(36)
    keys = rng.choice(5000, size=300, replace=False).astype(np.int64)
    values = np.arange(300, dtype=np.int64)
    queries = np.concatenate([[-5, -1], np.sort(rng.choice(5000, size=120, replace=False))]).astype(np.int64)
    deltas = (int(keys[0]) + 5, int(keys[1]) + 1, 0, 3)  # -5 + deltas[0] and -1 + deltas[1] are keys
    stored = dict(zip(keys.tolist(), values.tolist()))
    expected = np.array([[stored.get(query + delta, -1) if query >= 0 else -1 for query in queries.tolist()]
                         for delta in deltas], dtype=np.int64)
    table, _ = target.backend.hash_build(target.put(keys), target.put(values))
    assert_equal(target.get(target.backend.hash_lookup_offsets(table, target.put(queries), deltas)), expected,
                 "kernel lookup")
    numpy_table, _ = NUMPY_BACKEND.hash_build(keys, values)
    assert_equal(NUMPY_BACKEND.hash_lookup_offsets(numpy_table, queries, deltas), expected, "NumPy lookup")


def test_compute_dtypes():
    assert NUMPY_BACKEND.compute_dtype(np.float16) == np.float32
    assert NUMPY_BACKEND.compute_dtype(np.float64) == np.float64


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "float64"])
def test_max_pool_backward_pairs_equal_the_twin(dtype_name):
    rng = rng_for(38, len(dtype_name))
    num_input, num_output = 40, 30
    input_rows, output_rows, run_starts = _pool_pairs(rng, num_input, num_output, 3, 20)
    features = numpy_twins.random_features(rng, (num_input, 5), dtype_name)
    order, output_starts = _grouping(output_rows, num_output)
    _, argmax = numpy_twins.max_pool_forward(features, input_rows[order], output_starts, dtype_name)
    grad_output = numpy_twins.random_features(rng, (num_output, 5), dtype_name)
    by_input, input_starts = _grouping(input_rows, num_input)
    expected = numpy_twins.max_pool_backward(grad_output, argmax, output_rows[by_input], input_starts, dtype_name)
    actual = NUMPY_BACKEND.max_pool_backward_pairs(grad_output, argmax, input_rows, output_rows, run_starts, num_input)
    assert_equal(actual, expected, "max_pool_backward_pairs")


def test_max_pool_backward_with_the_rulebook_equals_the_argmax_scatter(target):
    """The two ways of `sparsecore.max_pool_backward` agree (float64: no rounding difference)."""
    rng = rng_for(39)
    indices = random_sites(rng, 150, (8, 10, 9), 2)
    rulebook = sc.build_pool_rulebook(indices, (8, 10, 9), 2, 3, stride=2, padding=1)
    features = rng.standard_normal((150, 3))
    features[:30] = features[30:60]
    out, argmax = sc.max_pool_forward(features, rulebook)
    grad_output = rng.standard_normal(out.shape)
    expected = sc.max_pool_backward(grad_output, argmax, 150)
    device_rulebook = sc.build_pool_rulebook(target.put(indices), (8, 10, 9), 2, 3, stride=2, padding=1,
                                             backend=target.backend)
    for backend, put, get, book in ((NUMPY_BACKEND, np.asarray, np.asarray, rulebook),
                                    (target.backend, target.put, target.get, device_rulebook)):
        actual = sc.max_pool_backward(put(grad_output), put(argmax), 150, rulebook=book, backend=backend)
        np.testing.assert_allclose(get(actual), expected, rtol=1e-14, atol=1e-14)
    with pytest.raises(ValueError, match="pass the forward's rulebook"):
        sc.max_pool_backward(grad_output, argmax, 149, rulebook=rulebook)


def test_row_counts_beyond_int32_are_refused_before_any_launch(target):
    """The kernels number rows in int32: larger inputs get a clear error, not a wrapped index."""
    backend, launcher = target.recording()
    with pytest.raises(ValueError, match="more than the kernels' int32 row numbers"):
        backend.index_add(2**31 + 3, target.put(np.zeros(2, np.int64)), target.put(np.ones(2)))
    assert launcher.records == []
