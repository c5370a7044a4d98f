"""`sparsecore.backends._kernel_layouts`: pair layouts written by one kernel launch each.

On the kernel backend (the CPU emulation of the GPU kernels, and CuPy where a
GPU is present), against the generic array code they replace: `chunk_rows` with
a `scatter_plan`, and the gather-slice-concatenate of a submanifold rulebook
(the NumPy backend's rulebook is the oracle).
"""

from __future__ import annotations

import numpy as np
import pytest

import sparsecore as sc
from sparsecore._chunks import chunk_rows, pair_chunks
from sparsecore.backends import NUMPY_BACKEND

try:
    from kernel_targets import random_sites, rng_for, target  # noqa: F401
except ImportError:  # tests/ imported as a package
    from tests.kernel_targets import random_sites, rng_for, target  # noqa: F401


def test_padded_chunk_layout_equals_chunk_rows_and_its_plan(target):
    # the one-launch layout gives the rows of sparsecore._chunks.chunk_rows and the same scatter
    rng = rng_for(34)
    rows_in = rng.integers(0, 30, size=40).astype(np.int32)
    rows_out = np.concatenate([rng.choice(30, size=n, replace=False) for n in (12, 0, 20, 8)]).astype(np.int32)
    chunk = pair_chunks((0, 12, 12, 32, 40), 3, 1 << 20)[0]
    assert len(chunk.offsets) == 3
    got_in, got_out, plan = target.backend.padded_chunk_layout(
        target.put(rows_in), target.put(rows_out), (0, 12, 32), (12, 20, 8), 24, True, 30)
    want_in, want_out = chunk_rows(np, (rows_in, rows_out), chunk, 24)
    np.testing.assert_array_equal(target.get(got_in), want_in.reshape(-1))
    np.testing.assert_array_equal(target.get(got_out), want_out.reshape(-1))
    values = rng.standard_normal((72, 2))
    out = target.put(np.zeros((30, 2)))
    target.backend.scatter_add_planned(out, plan, target.put(values))
    expected = np.zeros((30, 2))
    kept = want_out.reshape(-1) >= 0
    np.add.at(expected, want_out.reshape(-1)[kept], values[kept])
    np.testing.assert_allclose(target.get(out), expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="at most 10 each"):
        target.backend.padded_chunk_layout(target.put(rows_in), target.put(rows_out), (0, 12), (12, 20), 10, True, 30)


@pytest.mark.parametrize("shape, kernel, count", [((9, 10, 11), 3, 150), ((7, 8), 5, 40), ((12,), 3, 0),
                                                 ((6, 6, 6), 1, 30)])
def test_submanifold_pairs_equal_the_numpy_rulebook(target, shape, kernel, count):
    rng = rng_for(35, len(shape), kernel, count)
    indices = random_sites(rng, count, shape, 2)
    geometry = sc.ConvGeometry.create(len(shape), kernel, kind="subm")
    expected = sc.build_rulebook(indices, shape, 2, geometry, backend=NUMPY_BACKEND)
    actual = sc.build_rulebook(target.put(indices), shape, 2, geometry, backend=target.backend)
    assert tuple(actual.offset_starts) == tuple(expected.offset_starts)
    assert actual.identity_offset == expected.identity_offset
    for offset in range(expected.kernel_volume):
        for got, want in zip(actual.pairs(offset), expected.pairs(offset)):  # pair order within an offset
            np.testing.assert_array_equal(np.sort(target.get(got)), np.sort(want))
        pairs = {tuple(pair) for pair in zip(*(target.get(rows).tolist() for rows in actual.pairs(offset)))}
        assert pairs == {tuple(pair) for pair in zip(*(rows.tolist() for rows in expected.pairs(offset)))}
