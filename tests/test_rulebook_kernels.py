"""Tests of `sparsecore.backends._rulebook_kernels`: the compiled CPU rulebook builders and sort.

Oracles: NumPy's stable argsort and ``np.unique``, the builder's generic
windowed-lookup path on the same backend, and naive pairs (`dense_oracle.naive_rulebook`).
The tests run twice (``kernel_path``): on the compiled kernels and on their NumPy twins
(which small clouds run), whatever the sizes; the twins must give the same arrays.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import sparsecore as sc
from sparsecore.backends import NUMPY_BACKEND, _cpu_kernels, _rulebook_kernels

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do


@pytest.fixture(params=["compiled", "numpy-twin"], autouse=True)
def kernel_path(request, monkeypatch) -> str:
    """Every rulebook kernel compiled, or every one its NumPy twin (`_cpu_kernels.compiled_kernel`)."""
    monkeypatch.setattr(_cpu_kernels, "NUMPY_MAX_WORK", -1 if request.param == "compiled" else 2**62)
    return request.param


def _pair_set(ins, outs):
    return set(zip(np.asarray(ins).tolist(), np.asarray(outs).tolist()))


@pytest.mark.parametrize("count,high", [(0, 10), (1, 10), (5000, 40), (70_000, 2**40), (3000, 2**62)])
def test_numpy_backend_sorts_keys_as_a_stable_argsort(count, high):
    """Radix sort (packed with the index where 63 bits allow, else two arrays) == NumPy's stable sort."""
    rng = np.random.default_rng(14_200 + count)
    keys = rng.integers(0, high, size=count, dtype=np.int64)  # repeats included where high is small
    sorted_keys, order = _rulebook_kernels.argsort_keys(keys)
    expected = np.argsort(keys, kind="stable")
    np.testing.assert_array_equal(order, expected)
    np.testing.assert_array_equal(sorted_keys, keys[expected])


def test_numpy_backend_sorts_negative_keys_too():
    keys = np.random.default_rng(14_201).integers(-(2**40), 2**40, size=4000, dtype=np.int64)
    sorted_keys, order = _rulebook_kernels.argsort_keys(keys)
    np.testing.assert_array_equal(order, np.argsort(keys, kind="stable"))
    np.testing.assert_array_equal(sorted_keys, np.sort(keys))


@pytest.mark.parametrize("count,high", [(0, 5), (1, 5), (9000, 300), (50_000, 2**33)])
def test_numpy_backend_unique_inverse_equals_numpy_unique(count, high):
    keys = np.random.default_rng(14_300 + count).integers(0, high, size=count, dtype=np.int64)
    unique, inverse = NUMPY_BACKEND.unique_inverse(keys)
    expected_unique, expected_inverse = np.unique(keys, return_inverse=True)
    np.testing.assert_array_equal(unique, expected_unique)
    np.testing.assert_array_equal(inverse, expected_inverse.reshape(-1))
    assert unique.dtype == np.int64 and inverse.dtype == np.int64


class _WindowedLookupBackend:
    """The NumPy backend without its fused subm kernel: the builder's generic windowed-lookup path."""

    def __init__(self):
        self._inner = NUMPY_BACKEND

    def __getattr__(self, name):
        if name == "submanifold_pairs":
            raise AttributeError(name)
        return getattr(self._inner, name)


def _scattered_sites(rng, shape, batch_size, count):
    volume = batch_size * int(np.prod(shape))
    flat = rng.choice(volume, size=min(count, volume), replace=False)
    return np.stack(np.unravel_index(flat, (batch_size, *shape)), axis=1).astype(np.int32)


def _assert_same_rulebook(actual, expected, what):
    for name in ("pair_input", "pair_output", "output_indices"):
        np.testing.assert_array_equal(getattr(actual, name), getattr(expected, name), err_msg=f"{what}: {name}")
    assert tuple(actual.offset_starts) == tuple(expected.offset_starts), what
    assert actual.identity_offset == expected.identity_offset, what


@pytest.mark.parametrize("ndim,kernel,dilation", [(1, 5, 2), (2, 3, 1), (2, (5, 3), (1, 2)), (3, 3, 1), (3, 5, 1),
                                                  (3, (3, 1, 5), (2, 1, 1)), (4, 3, 1)])
def test_fused_subm_pairs_equal_the_windowed_lookup(ndim, kernel, dilation, monkeypatch):  # twin and kernel alike
    monkeypatch.setattr(_rulebook_kernels, "_CHUNK", 1024)  # work items of 1,024 keys instead of 16,384
    rng = np.random.default_rng(14_000 + ndim)
    shape = tuple(int(v) for v in rng.integers(4, 40 if ndim < 4 else 9, size=ndim))
    indices = _scattered_sites(rng, shape, 3, 4_000)  # more sites than one work item
    geometry = sc.ConvGeometry.create(ndim, kernel, dilation=dilation, kind="subm")
    fused = sc.build_rulebook(indices, shape, 3, geometry)
    generic = sc.build_rulebook(indices, shape, 3, geometry, backend=_WindowedLookupBackend())
    _assert_same_rulebook(fused, generic, "fused vs windowed lookup")


@pytest.mark.parametrize("kind,stride,padding", [("subm", 1, 0), ("regular", 2, 1), ("regular", (1, 3, 2), 0),
                                                  ("transposed", 2, 1)])
def test_cpu_rulebooks_are_identical_at_every_thread_count(kind, stride, padding, kernel_path, monkeypatch):
    # Thresholds lowered instead of a large cloud: every build runs on the pool (SERIAL_MAX_WORK), and the
    # subm kernels split 2,500 sites into 10 work items of 256 keys (_CHUNK), several per thread.
    monkeypatch.setattr(_cpu_kernels, "SERIAL_MAX_WORK", 0)
    monkeypatch.setattr(_rulebook_kernels, "_CHUNK", 256)
    rng = np.random.default_rng(14_100)
    shape = (12, 30, 25)
    indices = _scattered_sites(rng, shape, 2, 2_500)
    geometry = (sc.ConvGeometry.create(3, 3, kind="subm") if kind == "subm"
                else sc.ConvGeometry.create(3, 3, stride, padding, kind=kind))
    lanes = []  # the threads each compiled kernel was given
    pooled = _rulebook_kernels.kernel_threads

    @contextlib.contextmanager
    def recorded(work):
        with pooled(work) as count:
            lanes.append(count)
            yield count

    monkeypatch.setattr(_rulebook_kernels, "kernel_threads", recorded)
    built = []
    counts = (1, 2)  # the pool may hold no more (SPARSECORE_NUM_THREADS); the work split is fixed anyway
    for threads in counts:
        with sc.num_threads(threads):
            built.append(sc.build_rulebook(indices, shape, 2, geometry))
        if kernel_path == "compiled":
            assert lanes and set(lanes) == {threads}, (threads, lanes)  # each kernel ran on the whole pool
        lanes.clear()
    for threads, rulebook in zip(counts[1:], built[1:]):
        _assert_same_rulebook(rulebook, built[0], f"{threads} threads vs 1")
    naive = do.naive_rulebook(indices, shape, 2, kind, 3, stride, padding, 1, 0)
    do.assert_sites(built[0].output_indices, naive.output_indices)
    for offset in range(built[0].kernel_volume):
        assert _pair_set(*built[0].pairs(offset)) == _pair_set(*naive.pairs[offset]), f"offset {offset}"
        if kind != "subm":  # strided candidates keep the input order within an offset
            assert (np.diff(built[0].pairs(offset)[0]) > 0).all(), f"offset {offset}"


@pytest.mark.parametrize("kind", ["subm", "regular", "transposed"])
def test_cpu_rulebook_of_no_sites(kind):
    geometry = (sc.ConvGeometry.create(3, 3, kind="subm") if kind == "subm"
                else sc.ConvGeometry.create(3, 3, 2, 1, kind=kind))
    rulebook = sc.build_rulebook(np.zeros((0, 4), np.int32), (9, 8, 7), 2, geometry)
    assert rulebook.num_pairs == 0 and rulebook.num_output == 0
    assert tuple(rulebook.offset_starts) == (0,) * 28


@pytest.mark.parametrize("kind,stride,padding", [("subm", 1, 0), ("regular", 2, 1), ("transposed", (1, 2, 3), 1)])
def test_the_numpy_twins_build_the_compiled_rulebook(kind, stride, padding, monkeypatch):
    rng = np.random.default_rng(14_400)
    shape = (12, 40, 30)
    indices = _scattered_sites(rng, shape, 2, 3000)
    geometry = (sc.ConvGeometry.create(3, 3, kind="subm") if kind == "subm"
                else sc.ConvGeometry.create(3, 3, stride, padding, kind=kind))
    built = {}
    for limit in (-1, 2**62):  # every kernel compiled, then every one its twin
        monkeypatch.setattr(_cpu_kernels, "NUMPY_MAX_WORK", limit)
        built[limit] = sc.build_rulebook(indices, shape, 2, geometry)
    _assert_same_rulebook(built[2**62], built[-1], "twins vs compiled")


@pytest.mark.parametrize("rows, volume, per_offset", [(0, 3, 0), (7, 1, 5), (300, 27, 120), (90, 5, 0),
                                                      (60, 40, 30)])
def test_neighbour_table_places_every_pair_and_drops_padding(rows, volume, per_offset):
    """One side's table and row masks of pairs grouped by offset equal a loop over the pairs (padding pairs,
    -1 on either side, dropped; pairs past ``offset_starts[-1]`` ignored), on the compiled kernel and the twin."""
    rng = np.random.default_rng(14_400 + rows + volume)
    keys, values, starts = [], [], [0]
    for _ in range(volume):
        count = min(rows, per_offset)
        chosen = rng.choice(rows, size=count, replace=False) if count else np.zeros(0, np.int64)
        others = rng.integers(0, 500, size=count)
        padding = rng.random(count) < 0.1  # -1 on one side or the other
        side = rng.random(count) < 0.5
        keys.append(np.where(padding & side, -1, chosen))
        values.append(np.where(padding & ~side, -1, others))
        starts.append(starts[-1] + count)
    keys = np.concatenate(keys + [np.array([0, 1])]).astype(np.int32)[:starts[-1] + (2 if rows > 1 else 0)]
    values = np.concatenate(values + [np.array([3, 4])]).astype(np.int32)[:keys.shape[0]]  # trailing extra pairs
    expected = np.full((rows, volume), -1, np.int32)
    for offset in range(volume):
        for pair in range(starts[offset], starts[offset + 1]):
            if keys[pair] >= 0 and values[pair] >= 0:
                expected[keys[pair], offset] = values[pair]
    table, masks = _rulebook_kernels.neighbour_table(keys, values, tuple(starts), rows)
    assert table.dtype == np.int32 and table.shape == (rows, volume)
    np.testing.assert_array_equal(table, expected)
    expected_masks = np.zeros((rows, (volume + 31) // 32), np.uint32)
    for row, offset in zip(*np.nonzero(expected >= 0)):
        expected_masks[row, offset // 32] |= np.uint32(1 << (offset % 32))
    assert masks.dtype == np.uint32
    np.testing.assert_array_equal(masks, expected_masks)
