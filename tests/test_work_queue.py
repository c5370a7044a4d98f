"""sparsecore.backends._work_queue: threads claim every work item exactly once, whatever their number.

The oracle is counting: a kernel whose lanes claim items from the counter and
mark each one (and which lane ran it) must mark every item exactly once, and
leave the counter at ``items + lanes`` (each lane's last claim finds none).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from sparsecore.threads import numba_module


def _marking_kernel():
    numba_module()
    from numba import njit, prange

    from sparsecore.backends._work_queue import claim

    @njit(parallel=True)
    def mark(counter, marks, runner, lanes):
        items = marks.shape[0]
        for lane in prange(lanes):
            item = claim(counter)
            while item < items:
                marks[item] += 1
                runner[item] = lane
                for _ in range(item % 7 * 50):  # uneven items
                    marks[item] += 0
                item = claim(counter)

    return mark


@pytest.mark.parametrize("items, lanes", [(0, 1), (1, 1), (5, 2), (1000, 2), (3, 4), (997, 4)])
def test_every_item_is_claimed_exactly_once(items: int, lanes: int) -> None:
    from sparsecore.backends._work_queue import new_counter

    numba = numba_module()
    mark = _marking_kernel()
    previous = numba.get_num_threads()
    numba.set_num_threads(min(lanes, int(numba.config.NUMBA_NUM_THREADS)))
    try:
        counter = new_counter()
        marks = np.zeros(items, dtype=np.int64)
        runner = np.full(items, -1, dtype=np.int64)
        mark(counter, marks, runner, lanes)
    finally:
        numba.set_num_threads(previous)
    np.testing.assert_array_equal(marks, np.ones(items, dtype=np.int64))
    assert int(counter[0]) == items + lanes
    assert set(runner.tolist()) <= set(range(lanes))


def test_a_new_counter_starts_at_zero() -> None:
    numba_module()
    from numba import njit

    from sparsecore.backends._work_queue import claim, new_counter

    @njit
    def three_claims():
        counter = new_counter()
        return claim(counter), claim(counter), claim(counter), counter[0]

    assert three_claims() == (0, 1, 2, 3)


def test_a_counter_adds_no_parallel_region_of_its_own() -> None:
    """Inside a ``parallel=True`` kernel, `new_counter` adds no parallel loop to numba's record of the
    kernel's loops (each one a parallel region: a wake-up of the thread pool and a barrier, which a loaded
    machine makes wait for a descheduled thread); the same kernel with an ``np.zeros`` counter, the control,
    records two."""
    numba_module()
    from numba import njit, prange

    from sparsecore.backends._work_queue import claim, new_counter

    def marking(make_counter):
        @njit(parallel=True)
        def mark(marks, lanes):
            counter = make_counter()
            for lane in prange(lanes):  # noqa: B007 (one iteration per thread)
                item = claim(counter)
                while item < marks.shape[0]:
                    marks[item] += 1
                    item = claim(counter)

        return mark

    zeros_counter = njit(inline="always")(lambda: np.zeros(1, dtype=np.int64))
    regions = {}
    for name, make_counter in (("new_counter", new_counter), ("np.zeros", zeros_counter)):
        mark = marking(make_counter)
        marks = np.zeros(9, dtype=np.int64)
        mark(marks, 2)
        np.testing.assert_array_equal(marks, np.ones(9, dtype=np.int64))
        regions[name] = len(mark.overloads[mark.signatures[0]].metadata["parfor_diagnostics"].get_parfors())
    assert regions == {"new_counter": 1, "np.zeros": 2}



@functools.lru_cache(maxsize=1)
def _filling_kernel():
    numba_module()
    from numba import njit, prange

    from sparsecore.backends._work_queue import acquired, claim, new_counter, release

    @njit(parallel=True)
    def fill_then_sum(values, pieces, seen, lanes):
        size = values.shape[0] // max(pieces, 1)
        counter, done = new_counter(), new_counter()
        for lane in prange(lanes):
            piece = claim(counter)
            while piece < pieces:
                for index in range(piece * size, piece * size + size):
                    values[index] = index + 1
                release(done)
                piece = claim(counter)
            while acquired(done) < pieces:
                pass
            seen[lane] = values.sum()

    return fill_then_sum


@pytest.mark.parametrize("pieces, lanes", [(0, 2), (1, 2), (37, 2), (64, 4)])
def test_every_lane_sees_every_piece_after_the_released_count(pieces: int, lanes: int) -> None:
    """Lanes fill claimed pieces, `release` the count, wait for `acquired` to reach ``pieces``, then each
    sums the whole array: every lane must see every piece written (more lanes than threads included:
    a lane waits only for pieces that running lanes claimed)."""
    numba = numba_module()
    fill_then_sum = _filling_kernel()
    size = 1000
    values = np.zeros(pieces * size, dtype=np.int64)
    seen = np.full(lanes, -1, dtype=np.int64)
    previous = numba.get_num_threads()
    numba.set_num_threads(min(lanes, int(numba.config.NUMBA_NUM_THREADS)))
    try:
        fill_then_sum(values, pieces, seen, lanes)
    finally:
        numba.set_num_threads(previous)
    total = pieces * size
    np.testing.assert_array_equal(seen, np.full(lanes, total * (total + 1) // 2, dtype=np.int64))
