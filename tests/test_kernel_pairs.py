"""The pair primitives (`sparsecore.backends._kernel_pairs` and the NumPy backend's) against NumPy twins.

``compact_pairs``, ``conv_candidate_pairs``, ``scatter_add_pairs``,
``max_pool_pairs`` and ``avg_pool_pairs`` are checked on both backends against the kernels' NumPy
twins (``cuda_emulation/numpy_twins.py``): integer results exactly, the kernel
backend's float results exactly too (same additions in the same order), the
NumPy backend's within rounding (it adds offset by offset into the target).
"""

from __future__ import annotations

import numpy as np
import pytest

import sparsecore as sc
from sparsecore import conv
from sparsecore.backends import NUMPY_BACKEND
from sparsecore.backends.kernel_backend import KernelBackend

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


@pytest.mark.parametrize("dtype_name", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("run_lengths", [[], [17], [0, 17, 0], [30, 5, 0, 41, 12]])
def test_scatter_add_pairs_equals_the_segment_sum_twin(target, dtype_name, run_lengths):
    rng = rng_for(32, len(run_lengths), sum(run_lengths))
    rows, run_starts = _pair_runs(rng, 45, run_lengths)
    start = numpy_twins.random_features(rng, (45, 3), dtype_name)
    values = numpy_twins.random_features(rng, (rows.shape[0], 3), dtype_name)
    order = np.argsort(rows, kind="stable").astype(np.int32)
    segment_starts = np.searchsorted(rows[order], np.arange(46)).astype(np.int64)
    expected = numpy_twins.segment_sum_rows(start, values, order, segment_starts, np.arange(45, dtype=np.int32),
                                            dtype_name)
    device_target = target.put(_storage(target, dtype_name, start.copy()))
    target.backend.scatter_add_pairs(device_target, target.put(rows), target.put(_storage(target, dtype_name, values)),
                                     run_starts)
    actual = target.get(device_target)
    if dtype_name == "bfloat16":
        actual = actual.view(np.uint16)
    assert_equal(actual, expected, "scatter_add_pairs")
    if dtype_name in ("float32", "float64"):  # the NumPy backend adds offset by offset: equal within rounding
        numpy_target = start.copy()
        NUMPY_BACKEND.scatter_add_pairs(numpy_target, rows, values, run_starts)
        np.testing.assert_allclose(numpy_target, expected, rtol=1e-5 if dtype_name == "float32" else 1e-12)


@pytest.mark.parametrize("run_lengths", [[], [17], [0, 17, 0], [30, 5, 0, 41, 12]])
@pytest.mark.parametrize("padding", [0, 6])
def test_one_scatter_plan_serves_several_values(target, run_lengths, padding):
    # a plan built once adds fresh values each time, as float64 np.add.at does; rows of -1 are dropped
    rng = rng_for(33, len(run_lengths), sum(run_lengths), padding)
    rows, run_starts = _pair_runs(rng, 45, run_lengths)
    if padding and rows.size:
        rows[rng.choice(rows.shape[0], size=min(padding, rows.shape[0]), replace=False)] = -1
    plan = target.backend.scatter_plan(target.put(rows), run_starts, 45)
    start = rng.standard_normal((45, 3))
    device_target = target.put(start.copy())
    expected = start.copy()
    for _ in range(2):
        values = rng.standard_normal((rows.shape[0], 3))
        target.backend.scatter_add_planned(device_target, plan, target.put(values))
        kept = rows >= 0
        np.add.at(expected, rows[kept], values[kept])
    np.testing.assert_allclose(target.get(device_target), expected, rtol=1e-12, atol=1e-12)
    numpy_target = start.copy()  # the NumPy backend's plan (no padding there: it cannot skip rows of -1)
    if not padding:
        numpy_plan = NUMPY_BACKEND.scatter_plan(rows, run_starts, 45)
        NUMPY_BACKEND.scatter_add_planned(numpy_target, numpy_plan, values)
        np.add.at(start, rows, values)
        np.testing.assert_allclose(numpy_target, start, rtol=1e-12, atol=1e-12)


def test_scatter_plans_reject_bad_arguments(target):
    rows = target.put(np.array([0, 1, 0], np.int32))
    with pytest.raises(ValueError, match="scatter_plan: run_starts must run from 0 to 3"):
        target.backend.scatter_plan(rows, (0, 2), 4)
    plan = target.backend.scatter_plan(rows, (0, 2, 3), 4)
    with pytest.raises(ValueError, match="the plan scatters 3 rows into 4"):
        target.backend.scatter_add_planned(target.put(np.zeros((5, 2))), plan, target.put(np.ones((3, 2))))
    with pytest.raises(TypeError, match="plan must come from scatter_plan"):
        target.backend.scatter_add_planned(target.put(np.zeros((4, 2))), (rows, (0, 2, 3)), target.put(np.ones((3, 2))))
    with pytest.raises(TypeError, match="plan must come from scatter_plan"):
        NUMPY_BACKEND.scatter_add_planned(np.zeros((4, 2)), plan, np.ones((3, 2)))
    with pytest.raises(ValueError, match="run_starts must run from 0 to 3"):
        NUMPY_BACKEND.scatter_plan(np.array([0, 1, 0], np.int32), (0, 1), 4)


def test_scatter_add_pairs_rejects_bad_arguments(target):
    rows = target.put(np.array([0, 1, 0], np.int32))
    data = target.put(np.ones((3, 2), np.float32))
    with pytest.raises(ValueError, match="scatter_add_pairs: run_starts must run from 0 to 3"):
        target.backend.scatter_add_pairs(target.put(np.zeros((4, 2), np.float32)), rows, data, (0, 2))
    with pytest.raises(ValueError, match=r"values must have shape \[3, 2\]"):
        target.backend.scatter_add_pairs(target.put(np.zeros((4, 2), np.float32)), rows, data[:, :1], (0, 2, 3))
    with pytest.raises(ValueError, match="scatter_add_pairs: target must be C-contiguous"):
        target.backend.scatter_add_pairs(target.put(np.zeros((2, 4), np.float32)).T, rows, data, (0, 2, 3))


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
def test_max_pool_pairs_equals_the_twin_and_numpy(target, dtype_name):
    rng = rng_for(33, len(dtype_name))
    num_input, num_output = 50, 30  # the last 3 outputs get no pair
    input_rows, output_rows, run_starts = _pool_pairs(rng, num_input, num_output, 4, 18, empty_outputs=3)
    features = numpy_twins.random_features(rng, (num_input, 4), dtype_name)
    features[10:20] = features[20:30]  # ties between rows
    order, output_starts = _grouping(output_rows, num_output)
    out, argmax = numpy_twins.max_pool_forward(features, input_rows[order], output_starts, dtype_name)
    for backend, put, get in ((NUMPY_BACKEND, np.asarray, np.asarray), (target.backend, target.put, target.get)):
        actual_out, actual_argmax = backend.max_pool_pairs(put(features), put(input_rows), put(output_rows),
                                                           run_starts, num_output)
        assert_equal(get(actual_out), out, "max")
        assert_equal(get(actual_argmax), argmax, "argmax")
    assert (argmax[-3:] == -1).all() and (out[-3:] == 0).all()


def test_max_pool_forward_runs_its_kernel(target):
    backend, launcher = target.recording()
    indices = target.put(random_sites(rng_for(34), 80, (6, 7, 5), 1))
    rulebook = sc.build_pool_rulebook(indices, (6, 7, 5), 1, 2, backend=backend)
    features = target.put(rng_for(35).standard_normal((80, 3)).astype(np.float32))
    sc.max_pool_forward(features, rulebook, backend=backend)
    assert "sc_max_pool_forward" in launcher.kernel_names()


# =============================================================== avg_pool_pairs


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "float64"])
def test_avg_pool_pairs_equal_the_twins_and_numpy(target, dtype_name):
    rng = rng_for(36, len(dtype_name))
    input_rows, output_rows, run_starts = _pool_pairs(rng, 50, 30, 4, 18, empty_outputs=3)
    num_input, num_output = 50, 30
    features, grad_output = (numpy_twins.random_features(rng, (rows, 5), dtype_name) for rows in (50, 30))
    by_output, output_starts = _grouping(output_rows, num_output)
    by_input, input_starts = _grouping(input_rows, num_input)
    out = numpy_twins.avg_pool_forward(features, input_rows[by_output], output_starts, dtype_name)
    grad = numpy_twins.avg_pool_backward(grad_output, output_rows[by_input], input_starts, output_starts, dtype_name)
    for backend, put, get in ((NUMPY_BACKEND, np.asarray, np.asarray), (target.backend, target.put, target.get)):
        actual = backend.avg_pool_pairs(put(features), put(input_rows), put(output_rows), run_starts, num_output)
        assert_equal(get(actual), out, f"{backend.name} avg_pool_pairs")
        actual = backend.avg_pool_backward_pairs(put(grad_output), put(input_rows), put(output_rows), run_starts,
                                                 num_input)
        assert_equal(get(actual), grad, f"{backend.name} avg_pool_backward_pairs")
    assert (out[-3:] == 0).all()


def test_avg_pool_runs_one_kernel_per_pass_and_skips_padding(target):
    """One launch per pass; a padded pair map (-1 = no pair) gives the unpadded map's results."""
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
        "sc_avg_pool_forward", "sc_avg_pool_backward"]
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
    assert KernelBackend(np, _unused_launcher()).compute_dtype(np.float16) == np.float32
    assert KernelBackend(np, _unused_launcher(), native_float16=True).compute_dtype(np.float16) == np.float16
    assert KernelBackend(np, _unused_launcher(), native_float16=True).compute_dtype(np.float32) == np.float32


def _unused_launcher():
    class _Unused:
        def launch(self, expression, grid, block, args):  # pragma: no cover - never called
            raise AssertionError("no launch expected")

    return _Unused()


def test_native_float16_conv_is_close_to_float64(target):
    """float16 features multiplied as float16 (the GPU's cuBLAS path), summed across offsets in float32."""
    backend = target.with_launcher(target.base_launcher, native_float16=True)
    rng = rng_for(37)
    indices = random_sites(rng, 150, (8, 10, 9), 2)
    geometry = sc.ConvGeometry.create(3, 3, kind="subm")
    rulebook = sc.build_rulebook(target.put(indices), (8, 10, 9), 2, geometry, backend=backend)
    features = rng.uniform(-1, 1, (150, 8)).astype(np.float16)
    weight = rng.uniform(-1, 1, (4, 3, 3, 3, 8)).astype(np.float16)
    reference_rb = sc.build_rulebook(indices, (8, 10, 9), 2, geometry)
    expected = conv.conv_forward(features.astype(np.float64), weight.astype(np.float64), reference_rb)
    actual = target.get(conv.conv_forward(target.put(features), target.put(weight), rulebook, backend=backend))
    assert actual.dtype == np.float16
    np.testing.assert_allclose(actual.astype(np.float64), expected, rtol=0, atol=3e-2 * np.abs(expected).max())


@pytest.mark.parametrize("dtype_name", ["float32", "float16", "float64"])
def test_max_pool_backward_pairs_equals_the_twin_and_numpy(target, dtype_name):
    rng = rng_for(38, len(dtype_name))
    num_input, num_output = 40, 30
    input_rows, output_rows, run_starts = _pool_pairs(rng, num_input, num_output, 3, 20)
    features = numpy_twins.random_features(rng, (num_input, 5), dtype_name)
    order, output_starts = _grouping(output_rows, num_output)
    _, argmax = numpy_twins.max_pool_forward(features, input_rows[order], output_starts, dtype_name)
    grad_output = numpy_twins.random_features(rng, (num_output, 5), dtype_name)
    by_input, input_starts = _grouping(input_rows, num_input)
    expected = numpy_twins.max_pool_backward(grad_output, argmax, output_rows[by_input], input_starts, dtype_name)
    for backend, put, get in ((NUMPY_BACKEND, np.asarray, np.asarray), (target.backend, target.put, target.get)):
        actual = backend.max_pool_backward_pairs(put(grad_output), put(argmax), put(input_rows), put(output_rows),
                                                 run_starts, num_input)
        assert_equal(get(actual), expected, f"{backend.name} max_pool_backward_pairs")


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
    """The kernels number rows in int32: larger inputs get a clear error, not a wrapped index.

    The huge arrays are zero-stride views (no memory); every check runs before
    anything is copied or launched.
    """
    if target.xp is not np:
        pytest.skip("zero-stride views of 2^31 rows are a NumPy device-free trick")
    backend, launcher = target.recording()
    huge = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), shape=(2**31 + 3, 2), strides=(0, 0))
    rows = np.zeros(2, np.int32)
    with pytest.raises(ValueError, match="more than the kernels' int32 row numbers"):
        backend.gather_rows(huge, rows)
    with pytest.raises(ValueError, match="more than the kernels' int32 row numbers"):
        backend.scatter_add_rows(huge, rows, np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="more than the kernels' int32 row numbers"):
        backend.scatter_add_pairs(huge, rows, np.zeros((2, 2), np.float32), (0, 1, 2))
    with pytest.raises(ValueError, match="more than the kernels' int32 row numbers"):
        backend.max_pool_pairs(np.zeros((3, 2), np.float32), rows, rows, (0, 2), 2**31 + 3)
    with pytest.raises(ValueError, match="more than the kernels' int32 row numbers"):
        backend.max_pool_backward_pairs(np.zeros((2, 2), np.float32), np.zeros((2, 2), np.int32), rows, rows,
                                        (0, 2), 2**31 + 3)
    assert launcher.records == []


def test_vector_width_follows_channels_and_alignment():
    from sparsecore.backends._launch import vector_width

    base = np.zeros(64 + 8, np.float32)  # NumPy aligns allocations to at least 16 bytes
    aligned = base[:64].reshape(4, 16)
    assert vector_width(16, 4, aligned) == 4  # 16 bytes: four float32
    assert vector_width(6, 4, aligned) == 2
    assert vector_width(5, 4, aligned) == 1
    assert vector_width(16, 4, base[1:65].reshape(4, 16)) == 1  # 4 bytes off
    assert vector_width(16, 4, base[2:66].reshape(4, 16)) == 2  # 8 bytes off
    assert vector_width(16, 2, np.zeros((4, 16), np.float16)) == 8
    assert vector_width(16, 8, np.zeros((4, 16), np.float64)) == 2


def test_row_kernels_launch_one_thread_per_vector(target):
    """Aligned 16-channel float32 rows move four elements per thread: a quarter of the threads."""
    backend, launcher = target.recording(block_threads=256, max_blocks=4096)
    rng = rng_for(43)
    source = rng.standard_normal((500, 16)).astype(np.float32)
    rows = rng.integers(-1, 500, size=3000).astype(np.int32)
    gathered = backend.gather_rows(target.put(source), target.put(rows))
    expected = np.where(rows[:, None] >= 0, source[rows], 0)
    assert_equal(target.get(gathered), expected.astype(np.float32), "vectorised gather")
    odd = backend.gather_rows(target.put(source[:, :15]), target.put(rows))
    assert_equal(target.get(odd), np.where(rows[:, None] >= 0, source[rows, :15], 0).astype(np.float32), "odd")
    vectorised, plain = (record.grid for record in launcher.records)
    assert 3 * vectorised < plain, (vectorised, plain)  # four elements per thread against one
