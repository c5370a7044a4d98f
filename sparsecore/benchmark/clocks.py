"""Clocks for the network benchmark: host timers on the CPU, CUDA events on the GPU.

A clock hands out marks (a ``time.perf_counter`` reading, or a CUDA event
recorded on the current stream) and turns two marks into milliseconds once
the device has caught up. Two clocks share that shape: `HostClock` (NumPy)
and `EventClock`, made for CuPy (`CupyEventClock`, sparsecore on CuPy arrays)
or for torch (`TorchEventClock`, spconv on torch CUDA tensors). `StageRecorder` sums marked intervals per label, and
`InstrumentedBackend` wraps an array backend so that its gather, matrix
product and scatter primitives are recorded as stages: that is how the
benchmark splits a convolution into gather, GEMM and scatter time without
touching the core.

On the GPU an interval between two events is the stream's time between
them, idle gaps included: while the host is still launching (the usual case
for many small launches), it measures launch-bound wall time, which is
where such a network's time goes.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol, Sequence

__all__ = [
    "Clock",
    "HostClock",
    "EventClock",
    "CupyEventClock",
    "TorchEventClock",
    "TimedWork",
    "measure_interleaved_ms",
    "measure_median_ms",
    "StageRecorder",
    "NULL_RECORDER",
    "InstrumentedBackend",
]


class Clock(Protocol):
    """Marks points in time on one device and measures between them."""

    def mark(self) -> Any:
        """A mark of the present moment (a host reading, or a recorded event)."""

    def synchronize(self) -> None:
        """Waits until the device has done all the work issued so far."""

    def elapsed_ms(self, start: Any, stop: Any) -> float:
        """Milliseconds between two marks (call `synchronize` first)."""


@dataclass(frozen=True)
class HostClock:
    """``time.perf_counter`` marks, for work that runs synchronously on the CPU."""

    def mark(self) -> float:
        return time.perf_counter()

    def synchronize(self) -> None:
        return None

    def elapsed_ms(self, start: float, stop: float) -> float:
        return (stop - start) * 1000.0


@dataclass(frozen=True)
class EventClock:
    """CUDA events recorded on a library's current stream; `CupyEventClock` and `TorchEventClock` make one.

    Attributes:
        new_event: makes an (unrecorded) timing event.
        wait: waits for the library's current stream (or device).
        event_ms: milliseconds between two recorded events, once they have completed.
    """

    new_event: Callable[[], Any]
    wait: Callable[[], None]
    event_ms: Callable[[Any, Any], float]

    def mark(self) -> Any:
        event = self.new_event()
        event.record()
        return event

    def synchronize(self) -> None:
        self.wait()

    def elapsed_ms(self, start: Any, stop: Any) -> float:
        return float(self.event_ms(start, stop))


def CupyEventClock(cupy: Any) -> EventClock:  # noqa: N802 (named as the clock it makes)
    """CUDA events on CuPy's current stream (sparsecore on CuPy arrays); ``cupy``: the module."""
    return EventClock(cupy.cuda.Event, lambda: cupy.cuda.get_current_stream().synchronize(),
                      cupy.cuda.get_elapsed_time)


def TorchEventClock(torch: Any) -> EventClock:  # noqa: N802 (named as the clock it makes)
    """CUDA events on torch's current stream (spconv on torch CUDA tensors); ``torch``: the module."""
    return EventClock(lambda: torch.cuda.Event(enable_timing=True), torch.cuda.synchronize,
                      lambda start, stop: start.elapsed_time(stop))


@dataclass(frozen=True)
class TimedWork:
    """One engine's work in an interleaved measurement (`measure_interleaved_ms`).

    Attributes:
        clock: the clock of the device the work runs on.
        function: the work to time, given what ``setup`` returned.
        setup: builds one run's argument (not timed), e.g. a fresh autograd graph.
    """

    clock: Clock
    function: Callable[[Any], Any]
    setup: Callable[[], Any] = field(default=lambda: None)


def measure_interleaved_ms(works: Sequence[TimedWork], repeat: int, warmup: int,
                           max_seconds: float) -> list[tuple[float, int]]:
    """Median time of each work's ``function(setup())``, the works taking turns run by run.

    Taking turns (sparsecore, spconv, sparsecore, spconv, ...) spreads a shared
    machine's changing load over every engine alike, so the ratio of two
    medians compares the engines under the same conditions. The number of
    timed runs is ``repeat`` for every work, fewer when the last warm-up round
    (the first may compile kernels) shows that ``repeat`` runs of the slowest
    work would take longer than ``max_seconds`` (at least 3 then, or
    ``repeat`` if smaller).

    Args:
        works: what to time, in the order each round runs them.
        repeat: timed runs wanted per work (at least 1).
        warmup: untimed rounds first (at least 1: it sizes the repeat count).
        max_seconds: time budget per work for its timed runs.

    Returns:
        Per work, in order: ``(median milliseconds, number of timed runs)``.

    Raises:
        ValueError: when ``repeat`` is below 1.
    """
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    per_run = [0.0] * len(works)
    for _ in range(max(warmup, 1)):
        for position, work in enumerate(works):
            argument = work.setup()
            work.clock.synchronize()
            started = time.perf_counter()
            work.function(argument)
            work.clock.synchronize()
            per_run[position] = time.perf_counter() - started
    runs = repeat
    slowest = max(per_run, default=0.0)
    if slowest * repeat > max_seconds:
        runs = max(min(repeat, 3), int(max_seconds / max(slowest, 1e-9)))
    durations: list[list[float]] = [[] for _ in works]
    for _ in range(runs):
        for position, work in enumerate(works):
            argument = work.setup()
            work.clock.synchronize()
            start = work.clock.mark()
            work.function(argument)
            stop = work.clock.mark()
            work.clock.synchronize()
            durations[position].append(work.clock.elapsed_ms(start, stop))
    return [(statistics.median(times), runs) for times in durations]


def measure_median_ms(clock: Clock, function: Callable[[Any], Any], setup: Callable[[], Any],
                      repeat: int, warmup: int, max_seconds: float) -> tuple[float, int]:
    """Median time of ``function(setup())`` after warm-up, timing ``function`` only: one work of
    `measure_interleaved_ms` (whose arguments this shares).

    Returns:
        ``(median milliseconds, number of timed runs)``.
    """
    return measure_interleaved_ms([TimedWork(clock, function, setup)], repeat, warmup, max_seconds)[0]


@dataclass
class StageRecorder:
    """Sums the intervals marked under each label.

    Labels are free strings; intervals may nest (a layer's interval holds its
    rulebook's). Marks are kept until `totals_ms`, so on the GPU no interval
    forces a synchronization while the work runs.

    Attributes:
        clock: the device's clock.
        intervals: ``(label, start mark, stop mark)`` in the order they closed.
    """

    clock: Clock
    intervals: list[tuple[str, Any, Any]] = field(default_factory=list)

    @contextlib.contextmanager
    def interval(self, label: str) -> Iterator[None]:
        """Marks the time spent inside the ``with`` block under ``label``."""
        start = self.clock.mark()
        try:
            yield
        finally:
            self.intervals.append((label, start, self.clock.mark()))

    def totals_ms(self) -> dict[str, float]:
        """Milliseconds per label, summed over its intervals (synchronizes first)."""
        self.clock.synchronize()
        totals: dict[str, float] = {}
        for label, start, stop in self.intervals:
            totals[label] = totals.get(label, 0.0) + self.clock.elapsed_ms(start, stop)
        return totals


@dataclass(frozen=True)
class _NullRecorder:
    """A recorder that records nothing (for the timed runs)."""

    @contextlib.contextmanager
    def interval(self, label: str) -> Iterator[None]:
        yield


NULL_RECORDER = _NullRecorder()


@dataclass(frozen=True)
class InstrumentedBackend:
    """An `ArrayBackend` that records its feature primitives as stages.

    ``gather_rows`` is recorded as ``"gather"``, ``matmul`` as ``"GEMM"``,
    ``scatter_add_rows``, ``scatter_add_pairs`` and ``scatter_add_planned`` as ``"scatter"``,
    ``index_add`` as ``"index add"``; every other attribute and primitive
    (hashing, sorting, compaction, candidate generation, the max-pool pair
    passes) is the inner backend's, unrecorded: rulebook builds and pools are
    timed whole by the caller.

    Attributes:
        inner: the backend that does the work.
        recorder: where the intervals go.
    """

    inner: Any
    recorder: StageRecorder

    def __getattr__(self, name: str) -> Any:
        # every attribute and primitive that is not recorded comes from the inner backend as it is
        # (only called for names this class does not define; dunder lookups and "inner" itself, as
        # during copy or unpickling before the fields exist, must not recurse)
        if name == "inner" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def gather_rows(self, source: Any, rows: Any) -> Any:
        with self.recorder.interval("gather"):
            return self.inner.gather_rows(source, rows)

    def scatter_add_rows(self, target: Any, rows: Any, values: Any) -> None:
        with self.recorder.interval("scatter"):
            self.inner.scatter_add_rows(target, rows, values)

    def scatter_add_pairs(self, target: Any, rows: Any, values: Any, run_starts: tuple[int, ...]) -> None:
        with self.recorder.interval("scatter"):
            self.inner.scatter_add_pairs(target, rows, values, run_starts)

    def scatter_add_planned(self, target: Any, plan: Any, values: Any) -> None:
        with self.recorder.interval("scatter"):
            self.inner.scatter_add_planned(target, plan, values)

    def index_add(self, size: int, index: Any, values: Any) -> Any:
        with self.recorder.interval("index add"):
            return self.inner.index_add(size, index, values)

    def matmul(self, left: Any, right: Any) -> Any:
        with self.recorder.interval("GEMM"):
            return self.inner.matmul(left, right)
