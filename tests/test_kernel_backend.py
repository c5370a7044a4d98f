"""`KernelBackend` against `NumpyBackend`: its primitives, then the core's algorithms run on it.

``KernelBackend(numpy, EmulatedLauncher())`` launches the very ``kernels_cu``
sources the GPU runs, compiled by g++ with ``cuda_emulation/cuda_shim.h``, so
these tests drive the whole core (rulebook builders, conv forward and backward,
pooling) through the GPU backend's launch wrappers and kernels without a GPU.
The emulated backend uses 32-thread blocks and at most 2 blocks per launch,
so every kernel's grid-stride loop goes round several times; the production
launch configuration is tested separately on inputs that span several blocks.

Integer results (rulebooks, hash lookups, argmax) must be exactly equal; float
results of the primitives too (same operations in the same order), those of
the algorithms within a float tolerance (matrix products may differ by BLAS).

The ``cupy`` variant (marked ``gpu``, skipped without a GPU) runs the same
tests with `CUPY_BACKEND` on CuPy arrays, plus a stream-capture test showing
that kernels launch on CuPy's current stream.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import types
from typing import Any

import numpy as np
import pytest

import sparsecore as sc
from sparsecore import conv, pool
from sparsecore.backends import NUMPY_BACKEND, kernel_registry
from sparsecore.backends.kernel_backend import KernelBackend

try:
    from cuda_emulation import harness
    from kernel_targets import (FLOAT_DTYPES, Target, assert_equal, random_floats, random_sites, rng_for,  # noqa: F401
                                target)
except ImportError:  # tests/ imported as a package
    from tests.cuda_emulation import harness
    from tests.kernel_targets import (FLOAT_DTYPES, Target, assert_equal, random_floats,  # noqa: F401
                                      random_sites, rng_for, target)

# =================================================================== primitives


@pytest.mark.parametrize("count", [0, 1, 2, 150])
def test_hash_build_lookup_and_items(target, count):
    rng = rng_for(1, count)
    keys = rng.choice(10 * count + 10, size=count, replace=False).astype(np.int64)
    keys[: count // 5] += 2**50  # large keys too
    values = rng.permutation(count).astype(np.int64) * 3 - 7
    expected_table, expected_duplicate = NUMPY_BACKEND.hash_build(keys, values)
    table, duplicate = target.backend.hash_build(target.put(keys), target.put(values))
    assert duplicate is None and expected_duplicate is None
    queries = np.concatenate([keys, rng.integers(0, 10 * count + 20, size=40), [2**50 + 3, 2**62]])
    assert_equal(target.get(target.backend.hash_lookup(table, target.put(queries))),
                  NUMPY_BACKEND.hash_lookup(expected_table, queries), "hash_lookup")
    for actual, expected, what in zip(target.backend.hash_items(table), NUMPY_BACKEND.hash_items(expected_table),
                                      ("keys", "values")):
        assert_equal(target.get(actual), expected, f"hash_items {what}")
    assert table.capacity >= max(2, 2 * count) and table.capacity & (table.capacity - 1) == 0


def test_hash_lookup_keeps_the_query_shape(target):
    keys = np.array([4, 9, 100], dtype=np.int64)
    table, _ = target.backend.hash_build(target.put(keys), target.put(np.arange(3, dtype=np.int64)))
    found = target.get(target.backend.hash_lookup(table, target.put(np.array([[9, 5], [100, 4]], np.int64))))
    assert_equal(found, np.array([[1, -1], [2, 0]], dtype=np.int64), "2-D queries")
    empty = target.get(target.backend.hash_lookup(table, target.put(np.zeros(0, np.int64))))
    assert_equal(empty, np.zeros(0, np.int64), "no queries")


@pytest.mark.parametrize("keys,values", [
    ([5, 8, 2, 8, 11], [0, 1, 2, 3, 4]),  # one repeated key
    ([7, 7], [3, 3]),  # a repeated entry with equal values
    ([40, 3, 3, 40, 40, 9], [10, 11, 12, 13, 14, 15]),  # several repeats
])
def test_hash_build_reports_duplicates(target, keys, values):
    keys, values = np.array(keys, np.int64), np.array(values, np.int64)
    _, duplicate = target.backend.hash_build(target.put(keys), target.put(values))
    _, expected = NUMPY_BACKEND.hash_build(keys, values)
    assert duplicate is not None and expected is not None
    # Both report two entries sharing the smallest repeated key (order within the pair may differ).
    assert sorted(duplicate) == sorted(expected)
    # keys known to be unique skip the check: nothing is reported, the lookups still answer
    table, unchecked = target.backend.hash_build(target.put(keys), target.put(values), check_duplicates=False)
    numpy_table, numpy_unchecked = NUMPY_BACKEND.hash_build(keys, values, check_duplicates=False)
    assert unchecked is None and numpy_unchecked is None
    found = target.get(target.backend.hash_lookup(table, target.put(keys)))
    assert (found >= 0).all() and set(found.tolist()) <= set(values.tolist())


@pytest.mark.parametrize("count,deltas", [(0, (0, 1, 2)), (60, ()), (1, (0,)), (90, (-1, 0, 1)),
                                          (120, (-33, 7, 7, 0, 250, -5))])
def test_hash_lookup_offsets(target, count, deltas):
    rng = rng_for(2, count, len(deltas))
    keys = rng.choice(4 * count + 40, size=count, replace=False).astype(np.int64)
    values = rng.permutation(count).astype(np.int64)
    queries = np.sort(rng.integers(0, 4 * count + 40, size=count + 5)).astype(np.int64)
    # an integer reference: a dict of the keys
    stored = dict(zip(keys.tolist(), values.tolist()))
    expected = np.array([[stored.get(query + delta, -1) for query in queries.tolist()] for delta in deltas],
                        dtype=np.int64).reshape(len(deltas), len(queries))
    numpy_table = NUMPY_BACKEND.hash_build(keys, values)[0]
    assert_equal(NUMPY_BACKEND.hash_lookup_offsets(numpy_table, queries, deltas), expected, "NumPy lookup")
    table, _ = target.backend.hash_build(target.put(keys), target.put(values))
    actual = target.backend.hash_lookup_offsets(table, target.put(queries), deltas)
    assert_equal(target.get(actual), expected, "hash_lookup_offsets")


@pytest.mark.parametrize("count", [0, 1, 200])
def test_pack_and_unpack_keys_launch_one_kernel_each(target, count):
    # sparsecore.pack_keys / unpack_keys on the kernel backend: one launch each, the NumPy results
    rng = rng_for(40, count)
    shape, margin = (9, 40, 33), (1, 2, 1)
    indices = random_sites(rng, count, shape, 3).reshape(count, 4)
    backend, launcher = target.recording()
    keys = sc.pack_keys(target.put(indices), shape, 3, margin=margin, backend=backend)
    assert_equal(target.get(keys), sc.pack_keys(indices, shape, 3, margin=margin), "pack_keys")
    back = sc.unpack_keys(keys, shape, margin, backend=backend)
    assert_equal(target.get(back), indices.astype(np.int32), "unpack_keys")
    assert [record.expression for record in launcher.records] == (["sc_pack_keys", "sc_unpack_keys"] if count else [])


@pytest.mark.parametrize("count", [0, 1, 230])
def test_unique_inverse(target, count):
    keys = rng_for(3, count).integers(0, max(count // 3, 1), size=count).astype(np.int64)
    for actual, expected, what in zip(target.backend.unique_inverse(target.put(keys)),
                                      NUMPY_BACKEND.unique_inverse(keys), ("unique", "inverse")):
        assert_equal(target.get(actual), expected, what)


@pytest.mark.parametrize("size,count", [(0, 0), (7, 0), (1, 5), (40, 300), (500, 120)])
def test_index_add_is_bincount_bit_for_bit(target, size, count):
    rng = rng_for(6, size, count)
    index = rng.integers(0, max(size, 1), size=count).astype(np.int64)
    values = rng.standard_normal(count) * 10.0 ** rng.integers(-8, 8, size=count)  # cancellations
    # (NumPy's bincount answers int64 zeros when there are no values; the sums are float64.)
    expected = NUMPY_BACKEND.index_add(size, index, values).astype(np.float64, copy=False)
    first = target.get(target.backend.index_add(size, target.put(index), target.put(values)))
    second = target.get(target.backend.index_add(size, target.put(index), target.put(values)))
    assert_equal(first, expected, "index_add")
    assert_equal(second, first, "index_add, second run")


def test_matmul_against_a_sum_of_products(target):
    rng = rng_for(7)
    left, right = rng.standard_normal((3, 5, 4)), rng.standard_normal((3, 4, 2))
    expected = (left[:, :, :, None] * right[:, None, :, :]).sum(axis=2)  # no BLAS: products summed by NumPy
    np.testing.assert_allclose(target.get(target.backend.matmul(target.put(left), target.put(right))),
                               expected, rtol=1e-12, atol=1e-12)


def test_production_launch_configuration_spans_several_blocks(target):
    """Default 256-thread blocks: hashing 1,500 keys and summing 3,000 values into 2,000 bins need several blocks."""
    backend, launcher = target.recording(block_threads=256, max_blocks=4096)
    rng = rng_for(8)
    keys = rng.choice(10**6, size=1500, replace=False).astype(np.int64)
    values = np.arange(1500, dtype=np.int64)
    table, duplicate = backend.hash_build(target.put(keys), target.put(values))
    assert duplicate is None
    queries = rng.integers(0, 10**6, size=2000).astype(np.int64)
    queries[:700] = keys[:700]
    expected_table, _ = NUMPY_BACKEND.hash_build(keys, values)
    assert_equal(target.get(backend.hash_lookup(table, target.put(queries))),
                  NUMPY_BACKEND.hash_lookup(expected_table, queries), "hash_lookup")
    index = rng.integers(0, 2000, size=3000).astype(np.int64)
    values = rng.standard_normal(3000)
    assert_equal(target.get(backend.index_add(2000, target.put(index), target.put(values))),
                  NUMPY_BACKEND.index_add(2000, index, values), "index_add")
    launched = {record.expression.split("<")[0] for record in launcher.records}
    assert launched == {"sc_hash_insert", "sc_hash_lookup", "sc_segment_sum_rows"}, launched
    assert all(record.block == 256 and record.grid > 1 for record in launcher.records), launcher.records


def test_empty_inputs_launch_nothing(target):
    backend, launcher = target.recording()
    empty_keys = target.put(np.zeros(0, np.int64))
    table, duplicate = backend.hash_build(empty_keys, empty_keys)
    assert duplicate is None and table.capacity == 2
    assert target.get(backend.hash_lookup(table, empty_keys)).shape == (0,)
    assert target.get(backend.hash_lookup_offsets(table, empty_keys, (0, 1, 2))).shape == (3, 0)
    assert [target.get(part).shape for part in backend.hash_items(table)] == [(0,), (0,)]
    assert_equal(target.get(backend.index_add(5, empty_keys, target.put(np.zeros(0)))), np.zeros(5), "index_add")
    assert launcher.records == []


def test_bad_arguments_raise_naming_them(target):
    backend = target.backend
    passes = backend.fused_passes
    rulebook = sc.build_pool_rulebook(target.put(random_sites(rng_for(9), 20, (4, 5, 6), 1)), (4, 5, 6), 1, 2,
                                      backend=backend)
    with pytest.raises(TypeError, match="max_pool_forward: features must have dtype float32"):
        passes.max_pool_forward(target.put(np.zeros((20, 3), np.int32)), rulebook.neighbour_map)
    with pytest.raises(ValueError, match="avg_pool_forward: features must have 2 axes"):
        passes.avg_pool_forward(target.put(np.zeros(20, np.float32)), rulebook.neighbour_map)
    with pytest.raises(TypeError, match="index must be an integer array"):
        backend.index_add(5, target.put(np.zeros(2, np.float32)), target.put(np.ones(2)))
    with pytest.raises(ValueError, match="values has 1 entries, expected 2"):
        backend.hash_build(target.put(np.zeros(2, np.int64)), target.put(np.zeros(1, np.int64)))
    with pytest.raises(ValueError, match=r"index holds values from 0 to 9, outside \[0, 5\)"):
        backend.index_add(5, target.put(np.array([0, 9])), target.put(np.ones(2)))
    with pytest.raises(ValueError, match="block_threads"):
        dataclasses.replace(backend, block_threads=2048)
    with pytest.raises(TypeError, match="launcher must have a launch"):
        KernelBackend(target.xp, object())


# ============================================================ rulebook builders


RULEBOOK_CASES = [
    # kind, spatial shape, kernel size, stride, padding, dilation, output padding
    ("subm", (300,), 3, 1, 0, 1, 0),
    ("subm", (15, 17), (3, 5), 1, 0, (1, 2), 0),
    ("subm", (8, 10, 9), 3, 1, 0, 1, 0),
    ("subm", (8, 10, 9), (1, 3, 3), 1, 0, 2, 0),
    ("regular", (300,), 3, 2, 1, 1, 0),
    ("regular", (15, 17), (2, 3), (2, 1), (0, 1), (1, 2), 0),
    ("regular", (8, 10, 9), 3, 2, 1, 1, 0),
    ("regular", (8, 10, 9), 2, 2, 0, 1, 0),
    ("transposed", (300,), 3, 2, 1, 1, 1),
    ("transposed", (15, 17), 3, 2, 0, 1, 0),
    ("transposed", (6, 7, 5), (2, 2, 3), (2, 2, 1), 0, 1, 0),
]


def _geometry(case: tuple) -> sc.ConvGeometry:
    kind, shape, kernel_size, stride, padding, dilation, output_padding = case
    if kind == "subm":
        return sc.ConvGeometry.create(len(shape), kernel_size, dilation=dilation, kind="subm")
    return sc.ConvGeometry.create(len(shape), kernel_size, stride=stride, padding=padding, dilation=dilation,
                                  output_padding=output_padding, kind=kind)


def _assert_same_rulebook(actual: sc.Rulebook, expected: sc.Rulebook, target: Target) -> None:
    """The same sites and, per kernel offset, the same set of (input row, output row) pairs.

    The kernel backend stores a neighbour map and derives its pair lists ordered by output
    row within an offset; the NumPy backend's builders order them by key or input row, so
    pairs are compared per offset as sets (tests/test_rulebook_maps.py compares the maps).
    """
    assert actual.offset_starts == expected.offset_starts
    assert actual.identity_offset == expected.identity_offset
    assert actual.output_spatial_shape == expected.output_spatial_shape
    for field_name in ("input_indices", "output_indices"):
        assert_equal(target.get(getattr(actual, field_name)), getattr(expected, field_name), field_name)
    for offset in range(expected.kernel_volume):
        got = np.stack([target.get(rows) for rows in actual.pairs(offset)], axis=1)
        want = np.stack(expected.pairs(offset), axis=1)
        assert got.dtype == want.dtype == np.int32, offset
        np.testing.assert_array_equal(got[np.lexsort(got.T[::-1])], want[np.lexsort(want.T[::-1])],
                                      err_msg=f"offset {offset}")


@pytest.mark.parametrize("count", [0, 180])
@pytest.mark.parametrize("case", RULEBOOK_CASES, ids=lambda case: f"{case[0]}-{len(case[1])}d-k{case[2]}")
def test_build_rulebook_equals_numpy_exactly(target, case, count):
    shape, batch_size = case[1], 2
    indices = random_sites(rng_for(9, len(shape), count), count, shape, batch_size)
    geometry = _geometry(case)
    expected = sc.build_rulebook(indices, shape, batch_size, geometry, backend=NUMPY_BACKEND)
    actual = sc.build_rulebook(target.put(indices), shape, batch_size, geometry, backend=target.backend)
    _assert_same_rulebook(actual, expected, target)


@pytest.mark.parametrize("subm", [False, True])
def test_build_pool_rulebook_equals_numpy_exactly(target, subm):
    shape = (8, 10, 9)
    indices = random_sites(rng_for(10, int(subm)), 200, shape, 2)
    kernel_size = 3 if subm else 2
    expected = sc.build_pool_rulebook(indices, shape, 2, kernel_size, subm=subm, backend=NUMPY_BACKEND)
    actual = sc.build_pool_rulebook(target.put(indices), shape, 2, kernel_size, subm=subm, backend=target.backend)
    _assert_same_rulebook(actual, expected, target)


@pytest.mark.parametrize("kind", ["subm", "regular"])
def test_duplicate_sites_raise_the_same_error(target, kind):
    shape = (6, 7, 5)
    indices = random_sites(rng_for(11), 50, shape, 1)
    indices[31] = indices[12]
    geometry = _geometry((kind, shape, 3, 2 if kind == "regular" else 1, 1 if kind == "regular" else 0, 1, 0))
    with pytest.raises(ValueError, match="duplicate sites") as expected:
        sc.build_rulebook(indices, shape, 1, geometry, backend=NUMPY_BACKEND)
    with pytest.raises(ValueError, match="duplicate sites") as actual:
        sc.build_rulebook(target.put(indices), shape, 1, geometry, backend=target.backend)
    assert str(actual.value) == str(expected.value)


@pytest.mark.parametrize("case, kernels", [
    (RULEBOOK_CASES[2], ["sc_map_insert_sites", "sc_map_check_sites", "sc_map_submanifold", "sc_map_row_plan"]),
    (RULEBOOK_CASES[6], ["sc_map_insert_sites", "sc_map_candidates", "sc_map_mark_outputs", "sc_map_check_sites",
                         "sc_map_strided"]),
    (RULEBOOK_CASES[10], ["sc_map_insert_sites", "sc_map_candidates", "sc_map_mark_outputs", "sc_map_check_sites",
                          "sc_map_strided"]),
], ids=["subm", "regular", "transposed"])
@pytest.mark.parametrize("assume_unique", [False, True])
def test_rulebook_builders_run_the_kernels(target, case, kernels, assume_unique):
    # the rulebook as a neighbour map, one launch per kernel and none per kernel offset: subm
    # inserts the sites, writes every site's row in one launch and its row plan in one; strided writes candidates,
    # marks the first of each output key after an argsort, and writes both sides in one launch.
    # Unchecked sites (assume_unique) skip the check kernel and the strided build's site table.
    backend, launcher = target.recording()
    indices = target.put(random_sites(rng_for(12), 100, case[1], 1))
    sc.build_rulebook(indices, case[1], 1, _geometry(case), backend=backend, assume_unique=assume_unique)
    if assume_unique:
        kernels = [name for name in kernels if name != "sc_map_check_sites"]
        kernels = kernels if case[0] == "subm" else kernels[1:]
    assert [record.expression for record in launcher.records] == kernels


# ============================================================== feature passes


CONV_CASES = [
    # name, rulebook case, in channels, out channels, groups, bias, dtype
    ("subm3d", RULEBOOK_CASES[2], 4, 6, 1, True, "float32"),
    ("regular3d-groups2", RULEBOOK_CASES[6], 4, 6, 2, False, "float32"),
    ("transposed2d", RULEBOOK_CASES[9], 3, 5, 1, True, "float32"),
    ("subm1d-float64", RULEBOOK_CASES[0], 2, 4, 2, True, "float64"),
    ("subm2d-float16", RULEBOOK_CASES[1], 4, 4, 1, False, "float16"),
    ("inverse3d-groups2", RULEBOOK_CASES[6], 6, 4, 2, True, "float32"),
]
TOLERANCE = {"float32": 1e-5, "float64": 1e-12, "float16": 2e-3}


def _conv_setup(target: Target, case: tuple, count: int = 100):  # 100 sites: two row tiles of the fused kernels
    name, rulebook_case, in_channels, out_channels, groups, with_bias, dtype_name = case
    shape, batch_size = rulebook_case[1], 2
    rng = rng_for(13, len(name), count)
    indices = random_sites(rng, count, shape, batch_size)
    geometry = _geometry(rulebook_case)
    expected_rb = sc.build_rulebook(indices, shape, batch_size, geometry, backend=NUMPY_BACKEND)
    actual_rb = sc.build_rulebook(target.put(indices), shape, batch_size, geometry, backend=target.backend)
    if name.startswith("inverse"):
        expected_rb, actual_rb = sc.inverse_rulebook(expected_rb), sc.inverse_rulebook(actual_rb)
    dtype = np.dtype(dtype_name)
    features = random_floats(rng, (expected_rb.num_input, in_channels), dtype)
    weight = random_floats(rng, (out_channels, *geometry.kernel_size, in_channels // groups), dtype)
    bias = random_floats(rng, (out_channels,), dtype) if with_bias else None
    grad_output = random_floats(rng, (expected_rb.num_output, out_channels), dtype)
    return expected_rb, actual_rb, features, weight, bias, grad_output, groups


def _assert_close(actual: Any, expected: np.ndarray, dtype_name: str, what: str) -> None:
    actual = np.asarray(actual)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
    tolerance = TOLERANCE[dtype_name]
    scale = max(float(np.abs(expected.astype(np.float64)).max(initial=0.0)), 1.0)
    np.testing.assert_allclose(actual.astype(np.float64), expected.astype(np.float64), rtol=tolerance,
                               atol=tolerance * scale, err_msg=what)


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda case: case[0])
def test_conv_forward_and_backward_match_numpy(target, case):
    expected_rb, actual_rb, features, weight, bias, grad_output, groups = _conv_setup(target, case)
    dtype_name = case[-1]
    expected = conv.conv_forward(features, weight, expected_rb, bias, groups, backend=NUMPY_BACKEND)
    actual = conv.conv_forward(target.put(features), target.put(weight), actual_rb,
                               None if bias is None else target.put(bias), groups, backend=target.backend)
    _assert_close(target.get(actual), expected, dtype_name, "conv_forward")
    expected_grads = conv.conv_backward(grad_output, features, weight, expected_rb, groups, backend=NUMPY_BACKEND)
    actual_grads = conv.conv_backward(target.put(grad_output), target.put(features), target.put(weight),
                                      actual_rb, groups, backend=target.backend)
    for actual_grad, expected_grad, what in zip(actual_grads, expected_grads, ("grad_features", "grad_weight")):
        _assert_close(target.get(actual_grad), expected_grad, dtype_name, what)


@pytest.mark.parametrize("case", [CONV_CASES[0], CONV_CASES[2]], ids=lambda case: case[0])
def test_conv_runs_the_fused_kernels_and_is_deterministic(target, case):
    """A forward is one sc_implicit_gemm launch, a backward one more plus one sc_weight_gradient; no matrix
    product goes through the backend's GEMM; two runs are bitwise equal."""
    backend, launcher = target.recording()
    expected_rb, actual_rb, features, weight, bias, grad_output, groups = _conv_setup(target, case, count=80)
    counting = _CountingMatmul(backend)
    forward_args = (target.put(features), target.put(weight), actual_rb, None if bias is None else target.put(bias),
                    groups)
    backward_args = (target.put(grad_output), target.put(features), target.put(weight), actual_rb, groups)
    runs = []
    for _ in range(2):
        first = len(launcher.records)
        out = conv.conv_forward(*forward_args, backend=counting)
        forward_records = launcher.records[first:]
        grads = conv.conv_backward(*backward_args, backend=counting)
        backward_records = launcher.records[first + len(forward_records):]
        runs.append([target.get(value) for value in (out, *grads)])
        # a strided map builds each side's row plan when a pass first asks for it (a submanifold one with
        # the map), and its input side's masks (which its build leaves out): once per map, so never in the
        # second run
        plans = [record for record in forward_records + backward_records if record.expression == "sc_map_row_plan"]
        assert len(plans) <= (2 if not runs[1:] else 0)
        masks = [record for record in backward_records if record.expression == "sc_map_row_masks"]
        assert len(masks) <= (1 if not runs[1:] else 0)
        plans += masks
        forward_records = [record for record in forward_records if record not in plans]
        backward_records = [record for record in backward_records if record not in plans]
        assert [record.expression.split("<")[0] for record in forward_records] == ["sc_implicit_gemm"]
        assert [record.expression.split("<")[0] for record in backward_records] == ["sc_implicit_gemm",
                                                                                     "sc_weight_gradient"]
    assert counting.calls == 0
    for one, two in zip(*runs):
        assert_equal(two, one, "second run")
    expected = conv.conv_backward(grad_output, features, weight, expected_rb, groups, backend=NUMPY_BACKEND)
    for actual_grad, expected_grad, what in zip(runs[0][1:], expected, ("grad_features", "grad_weight")):
        _assert_close(actual_grad, expected_grad, "float32", what)


class _CountingMatmul:
    """A backend that counts its matrix products and forwards everything to ``inner``."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def matmul(self, left: Any, right: Any) -> Any:
        self.calls += 1
        return self.inner.matmul(left, right)


@pytest.mark.parametrize("kind", ["subm", "regular", "transposed"])
def test_empty_conv(target, kind):
    case = next(case for case in RULEBOOK_CASES if case[0] == kind and len(case[1]) == 3)
    backend, launcher = target.recording()
    indices = target.put(np.zeros((0, 4), np.int32))
    rulebook = sc.build_rulebook(indices, case[1], 1, _geometry(case), backend=backend)
    weight = target.put(np.ones((5, *rulebook.kernel_size, 3), np.float32))
    out = conv.conv_forward(target.put(np.zeros((0, 3), np.float32)), weight, rulebook, backend=backend)
    assert tuple(out.shape) == (0, 5) and launcher.records == []


POOL_CASES = [("regular3d", False, 2), ("subm3d", True, 3)]


@pytest.mark.parametrize("case", POOL_CASES, ids=lambda case: case[0])
def test_pooling_matches_numpy(target, case):
    _, subm, kernel_size = case
    shape = (8, 10, 9)
    rng = rng_for(14, int(subm))
    indices = random_sites(rng, 220, shape, 2)
    expected_rb = sc.build_pool_rulebook(indices, shape, 2, kernel_size, subm=subm, backend=NUMPY_BACKEND)
    actual_rb = sc.build_pool_rulebook(target.put(indices), shape, 2, kernel_size, subm=subm, backend=target.backend)
    features = random_floats(rng, (220, 3), np.dtype(np.float32))
    features[:40] = features[40:80]  # ties between rows
    grad_output = random_floats(rng, (expected_rb.num_output, 3), np.dtype(np.float32))

    out, argmax = pool.max_pool_forward(features, expected_rb, backend=NUMPY_BACKEND)
    actual_out, actual_argmax = pool.max_pool_forward(target.put(features), actual_rb, backend=target.backend)
    assert_equal(target.get(actual_out), out, "max_pool_forward")
    assert_equal(target.get(actual_argmax), argmax, "max_pool_forward argmax")
    expected = pool.max_pool_backward(grad_output, argmax, 220, backend=NUMPY_BACKEND)
    actual = pool.max_pool_backward(target.put(grad_output), actual_argmax, 220, backend=target.backend)
    assert_equal(target.get(actual), expected, "max_pool_backward")

    expected = pool.avg_pool_forward(features, expected_rb, backend=NUMPY_BACKEND)
    actual = pool.avg_pool_forward(target.put(features), actual_rb, backend=target.backend)
    _assert_close(target.get(actual), expected, "float32", "avg_pool_forward")
    expected = pool.avg_pool_backward(grad_output, expected_rb, backend=NUMPY_BACKEND)
    actual = pool.avg_pool_backward(target.put(grad_output), actual_rb, backend=target.backend)
    _assert_close(target.get(actual), expected, "float32", "avg_pool_backward")


def test_global_max_pool_backward_matches_numpy(target):
    rng = rng_for(15)
    indices = random_sites(rng, 90, (5, 6), 3)
    features = random_floats(rng, (90, 4), np.dtype(np.float64))
    _, argmax = pool.global_max_pool_forward(features, indices, 3)
    grad_output = random_floats(rng, (3, 4), np.dtype(np.float64))
    expected = pool.global_max_pool_backward(grad_output, argmax, 90, backend=NUMPY_BACKEND)
    actual = pool.global_max_pool_backward(target.put(grad_output), target.put(argmax), 90, backend=target.backend)
    assert_equal(target.get(actual), expected, "global_max_pool_backward")


# ============================================================== cupy_backend.py


def test_cupy_launcher_with_a_stand_in_cupy(monkeypatch):
    """cupy_backend.py on the CPU: a stand-in ``cupy`` module and emulated RawKernels.

    Checks what can be checked without a GPU: the module imports CuPy only by
    name, asks the registry for the kernel of the current device, and calls it
    the way a ``cupy.RawKernel`` is called (``kernel((grid,), (block,), args)``).
    """
    if harness.compiler_path() is None:
        pytest.skip("g++ is not installed")
    import sparsecore.backends as backends_package

    module_name = "sparsecore.backends.cupy_backend"
    saved_module, saved_attribute = sys.modules.get(module_name), backends_package.__dict__.get("cupy_backend")
    stand_in = types.ModuleType("cupy")
    stand_in.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 3))
    requested = []

    def get_kernel(expression, device_id):
        requested.append((expression, device_id))
        file = kernel_registry.file_of_kernel(expression.split("<", 1)[0])
        return harness.load_module(file).get_function(expression)

    monkeypatch.setitem(sys.modules, "cupy", stand_in)
    monkeypatch.setattr(kernel_registry, "get_kernel", get_kernel)
    sys.modules.pop(module_name, None)
    try:
        cupy_backend = importlib.import_module(module_name)
        assert cupy_backend.CUPY_BACKEND.xp is stand_in and cupy_backend.CUPY_BACKEND.name == "cupy"
        backend = KernelBackend(np, cupy_backend.CupyLauncher(), block_threads=32, max_blocks=2)
        index, values = np.array([3, 0, 3], dtype=np.int64), np.array([1.0, 2.0, 4.0])
        assert_equal(backend.index_add(5, index, values), np.array([2.0, 0, 0, 5.0, 0]), "index_add")
        assert requested == [("sc_segment_sum_rows<double, double>", 3)]
    finally:
        sys.modules.pop(module_name, None)
        if saved_module is not None:
            sys.modules[module_name] = saved_module
        if saved_attribute is not None:
            backends_package.cupy_backend = saved_attribute
        elif "cupy_backend" in backends_package.__dict__:
            del backends_package.cupy_backend


# ===================================================================== GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("channels, groups", [(16, 1), (8, 2)])
def test_feature_passes_do_not_synchronise_with_the_host(target, channels, groups):
    """Once a rulebook exists, conv forward and backward on CuPy never wait for the device.

    ``cupyx.allow_synchronize(False)`` makes every CuPy operation that would synchronise
    (a device read, a size from the device) raise; the first pass sorts the map's row orders it keeps.
    """
    if target.name != "cupy":
        pytest.skip("CuPy only")
    import cupyx

    rng = rng_for(17, channels, groups)
    indices = random_sites(rng, 3000, (30, 40, 50), 2)
    rulebook = sc.build_rulebook(target.put(indices), (30, 40, 50), 2, sc.ConvGeometry.create(3, 3, kind="subm"),
                                 backend=target.backend)
    features = target.put(random_floats(rng, (3000, channels), np.dtype(np.float32)))
    weight = target.put(random_floats(rng, (channels, 3, 3, 3, channels // groups), np.dtype(np.float32)))
    grad = target.put(random_floats(rng, (3000, channels), np.dtype(np.float32)))
    expected = (conv.conv_forward(features, weight, rulebook, groups=groups, backend=target.backend),
                *conv.conv_backward(grad, features, weight, rulebook, groups, backend=target.backend))
    with cupyx.allow_synchronize(False):
        actual = (conv.conv_forward(features, weight, rulebook, groups=groups, backend=target.backend),
                  *conv.conv_backward(grad, features, weight, rulebook, groups, backend=target.backend))
    for got, want in zip(actual, expected):  # deterministic: the same bits
        assert_equal(target.get(got), target.get(want), "second pass")


@pytest.mark.gpu
def test_cupy_kernels_launch_on_the_current_stream(target):
    """Captured into a CUDA graph on a new stream, a pool kernel runs only when the graph is replayed.

    Had the kernel gone to another stream, the capture (global mode) would have
    failed, or the output would have been written at once.
    """
    if target.name != "cupy":
        pytest.skip("CuPy streams only")
    import cupy

    from sparsecore.backends.cupy_backend import CUPY_BACKEND

    rng = rng_for(16)
    neighbours = cupy.asarray(rng.integers(-1, 50, size=(30, 4)).astype(np.int32))
    features = cupy.asarray(rng.standard_normal((50, 4)).astype(np.float32))
    buffer = cupy.zeros((30, 4), dtype=np.float32)
    args = (features, neighbours, np.int64(30), np.int32(4), np.int64(4), buffer)
    CUPY_BACKEND.launcher.launch("sc_avg_pool_map<float>", 1, 128, args)  # compiles the kernel
    buffer[...] = 0
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        CUPY_BACKEND.launcher.launch("sc_avg_pool_map<float>", 1, 128, args)  # no allocation, no host sync
        graph = stream.end_capture()
    cupy.cuda.Device().synchronize()
    assert float(cupy.abs(buffer).sum()) == 0.0, "the kernel ran outside the captured stream"
    graph.launch(stream)
    stream.synchronize()
    table, values = cupy.asnumpy(neighbours), cupy.asnumpy(features)
    expected = np.stack([values[row[row >= 0]].mean(axis=0) if (row >= 0).any() else np.zeros(4, np.float32)
                         for row in table]).astype(np.float32)
    np.testing.assert_allclose(cupy.asnumpy(buffer), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_cupy_backend_is_picked_for_cupy_arrays(target):
    if target.name != "cupy":
        pytest.skip("CuPy only")
    from sparsecore.backends import backend_for
    from sparsecore.backends.cupy_backend import CUPY_BACKEND

    assert backend_for(target.put(np.zeros(3))) is CUPY_BACKEND
    assert CUPY_BACKEND.name == "cupy"
