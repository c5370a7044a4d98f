"""`sparsecore._chunks.pair_chunks` against the properties a feature pass relies on, on random rulebooks."""

from __future__ import annotations

import numpy as np
import pytest

from sparsecore._chunks import chunk_rows, pair_chunks


def _random_starts(rng: np.random.Generator, volume: int) -> tuple[int, ...]:
    counts = rng.integers(0, 40, size=volume)
    counts[rng.random(volume) < 0.3] = 0
    return (0, *np.cumsum(counts).tolist())


@pytest.mark.parametrize("seed", range(40))
def test_chunks_cover_every_nonempty_offset_once_in_order(seed):
    rng = np.random.default_rng([20261202, seed])
    volume = int(rng.integers(1, 30))
    starts = _random_starts(rng, volume)
    channels = int(rng.integers(1, 9))
    budget = int(rng.choice([0, 1, 50, 300, 10**9]))
    skip = int(rng.integers(-1, volume))
    chunks = pair_chunks(starts, channels, budget, skip=skip)
    expected = [k for k in range(volume) if starts[k + 1] > starts[k] and k != skip]
    assert [k for chunk in chunks for k in chunk.offsets] == expected
    for chunk in chunks:
        # each offset is located by its own rulebook range, which may leave the skipped offset between two
        assert chunk.starts == tuple(starts[offset] for offset in chunk.offsets)
        assert chunk.counts == tuple(starts[offset + 1] - starts[offset] for offset in chunk.offsets)
        assert chunk.width == max(chunk.counts)
        # the padded [m, W] layout of a chunk keeps to the budget, unless it is one offset
        assert len(chunk.offsets) == 1 or len(chunk.offsets) * chunk.width * channels <= budget
    # the fewest chunks that keep to the budget, balanced (offset counts within one) where that count allows it
    assert len(chunks) == min((number for number in range(1, len(expected) + 1)
                               if _greedy_fits(expected, starts, channels, budget, number)), default=0)
    sizes = [len(chunk.offsets) for chunk in chunks]
    if chunks and _balanced_fits(expected, starts, channels, budget, len(chunks)):
        assert max(sizes) - min(sizes) <= 1, sizes
    if budget == 0:
        assert all(len(chunk.offsets) == 1 for chunk in chunks)
    if budget == 10**9:  # everything fits: one chunk, across the skipped offset too
        assert len(chunks) <= 1


def _greedy_fits(offsets, starts, channels, budget, number):
    """Whether ``number`` chunks of consecutive offsets can keep to the budget (greedy packing is optimal here)."""
    used, widest, members = 1, 0, 0
    for offset in offsets:
        count = starts[offset + 1] - starts[offset]
        if members and (members + 1) * max(widest, count) * channels > budget:
            used, widest, members = used + 1, 0, 0
        widest, members = max(widest, count), members + 1
    return used <= number


def test_no_pairs_no_chunks():
    assert pair_chunks((0, 0, 0, 0), 4, 100) == ()
    assert pair_chunks((0,), 4, 100) == ()


@pytest.mark.parametrize("seed", range(10))
def test_chunk_rows_pad_each_offset_to_the_widest(seed):
    rng = np.random.default_rng([20261203, seed])
    starts = _random_starts(rng, 20)
    pair_rows = rng.integers(0, 1000, size=starts[-1]).astype(np.int32)
    for chunk in pair_chunks(starts, 4, int(rng.choice([0, 200, 10**6]))):
        for source, rows in zip((pair_rows, pair_rows[::-1].copy()), chunk_rows(np, (pair_rows, pair_rows[::-1].copy()),
                                                                                 chunk)):
            assert rows.dtype == np.int32 and rows.shape == (len(chunk.offsets), chunk.width)
            for line, offset in zip(rows, chunk.offsets):
                mine = source[starts[offset]:starts[offset + 1]]
                np.testing.assert_array_equal(line[: mine.shape[0]], mine)
                assert (line[mine.shape[0]:] == -1).all()


def _balanced_fits(offsets, starts, channels, budget, number):
    """Whether ``number`` consecutive groups of near-equal size (in offsets) each keep to the budget."""
    for part in range(number):
        group = offsets[len(offsets) * part // number:len(offsets) * (part + 1) // number]
        widest = max(starts[offset + 1] - starts[offset] for offset in group)
        if len(group) > 1 and len(group) * widest * channels > budget:
            return False
    return True
