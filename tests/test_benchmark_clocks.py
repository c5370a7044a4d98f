"""The benchmark's clocks: engines timed taking turns (`measure_interleaved_ms`).

The oracle is a scripted clock: each work advances it by durations the test
chose, so the medians and the order of the calls are known in advance
(no real time is asserted).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from sparsecore.benchmark.clocks import HostClock, TimedWork, measure_interleaved_ms, measure_median_ms


@dataclass
class _ScriptedClock:
    """Marks are a number each work advances by its next scripted duration (milliseconds)."""

    now: float = 0.0
    log: list[str] = field(default_factory=list)

    def mark(self) -> float:
        return self.now

    def synchronize(self) -> None:
        self.log.append("sync")

    def elapsed_ms(self, start: float, stop: float) -> float:
        return stop - start


def _scripted_work(clock: _ScriptedClock, name: str, durations: list[float]) -> TimedWork:
    remaining = list(durations)

    def setup() -> str:
        clock.log.append(f"setup {name}")
        return name

    def function(argument: Any) -> None:
        assert argument == name  # the run gets its own setup's value
        clock.log.append(name)
        clock.now += remaining.pop(0)

    return TimedWork(clock, function, setup)


def test_works_take_turns_and_each_gets_its_own_median() -> None:
    generator = np.random.default_rng(7)
    repeat, warmup = 5, 2
    # whole milliseconds: the scripted clock's sums stay exact
    ours = generator.integers(1, 10, warmup + repeat).astype(float).tolist()
    theirs = generator.integers(10, 31, warmup + repeat).astype(float).tolist()
    clock = _ScriptedClock()
    results = measure_interleaved_ms([_scripted_work(clock, "ours", ours), _scripted_work(clock, "theirs", theirs)],
                                     repeat, warmup, math.inf)
    assert results == [(statistics.median(ours[warmup:]), repeat), (statistics.median(theirs[warmup:]), repeat)]
    calls = [entry for entry in clock.log if entry in ("ours", "theirs")]
    assert calls == ["ours", "theirs"] * (warmup + repeat)
    # every run: its setup first, then the device caught up before and after the timed call
    first_timed = clock.log.index("setup ours", clock.log.index("theirs"))
    assert clock.log[first_timed:first_timed + 4] == ["setup ours", "sync", "ours", "sync"]


def test_a_budget_too_small_keeps_three_runs_of_every_work() -> None:
    clock = _ScriptedClock()
    works = [_scripted_work(clock, name, [1.0] * 12) for name in ("a", "b")]
    assert [runs for _, runs in measure_interleaved_ms(works, 10, 1, 0.0)] == [3, 3]
    clock = _ScriptedClock()
    works = [_scripted_work(clock, name, [1.0] * 3) for name in ("a", "b")]
    assert [runs for _, runs in measure_interleaved_ms(works, 2, 1, 0.0)] == [2, 2]


def test_one_work_is_measure_median_ms() -> None:
    clock = _ScriptedClock()
    durations = [4.0, 3.0, 8.0, 1.0]
    work = _scripted_work(clock, "only", durations)
    assert measure_median_ms(clock, work.function, work.setup, 3, 1, math.inf) == (3.0, 3)


def test_host_clock_times_real_work() -> None:
    array = np.random.default_rng(3).standard_normal(10_000)
    [(milliseconds, runs)] = measure_interleaved_ms([TimedWork(HostClock(), lambda _: np.sort(array))], 3, 1,
                                                    math.inf)
    assert runs == 3 and milliseconds > 0.0


def test_repeat_below_one_is_an_error() -> None:
    with pytest.raises(ValueError, match="repeat must be at least 1, got 0"):
        measure_interleaved_ms([TimedWork(HostClock(), lambda _: None)], 0, 1, math.inf)
