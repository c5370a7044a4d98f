"""Capacity policies: how many rows a plan pads each site set to (shared by the core's capacity mode and
``sparsecore.jax``).

``jax.jit`` compiles once per set of input shapes, and a CUDA graph replays
only the shapes it recorded (`sparsecore.capacity`). A plan pads the rows of
every site set (and so the feature arrays on it) to a capacity from a small
ladder of sizes, so a stream of point clouds of varying size compiles once per
*bucket*, not once per cloud. The true counts travel alongside as array values.
Rulebook pair arrays need no capacity of their own: an offset never has more
pairs than the smaller of its two site sets has rows, so their length follows
from the row capacities, and the feature passes loop only over true pairs.

Policies:

- `Buckets` (the default): a geometric ladder ``minimum * 2**e * (1 + j / s)``
  for ``j < s`` (``s = steps_per_octave``). ``s = 1`` gives powers of two
  (at most 2x padding), ``s = 2`` gives ``1, 1.5, 2, 3, 4, 6, ...`` times the
  minimum (at most 1.5x), ``s = 4`` steps of 1.25x or less. Each site set is
  rounded up on its own; with ``linked=True`` every site set of a plan gets the
  rung of the largest one, so a stream compiles at most once per rung, whatever
  the network (at the price of padding the coarse levels more). An optional
  ``maximum`` turns any larger count into a `CapacityError`.
- `Fixed`: explicit capacities (one for every site set, or one per site-set
  name). A cloud that needs more raises `CapacityError`, naming the site set,
  what it needs and what it was given: never a silent truncation.

A policy answers ``capacity(count, name)`` (``name``: the site set, for
per-name overrides and messages); a policy with ``finalize(rows)`` may revise
all capacities of a plan once the whole network is known.
"""

from __future__ import annotations

import math
from typing import Mapping, Protocol, runtime_checkable

__all__ = ["CapacityError", "CapacityPolicy", "Buckets", "Fixed", "as_policy"]


class CapacityError(ValueError):
    """A cloud needs more rows than an explicit capacity allows.

    Attributes:
        name: the site set.
        needed: the rows the cloud needs.
        capacity: the capacity that was allowed.
    """

    def __init__(self, name: str, needed: int, capacity: int) -> None:
        self.name, self.needed, self.capacity = name, int(needed), int(capacity)
        super().__init__(
            f"capacity overflow: site set {name!r} needs {needed} rows but its capacity is {capacity}. "
            "sparsecore never truncates a cloud; raise the capacity (Fixed(...) / "
            "Buckets(maximum=...)), skip this cloud (catch CapacityError), or use the default "
            "Buckets() policy, which grows to fit."
        )


@runtime_checkable
class CapacityPolicy(Protocol):
    """What a plan asks of a capacity policy."""

    def capacity(self, count: int, name: str) -> int:
        """The padded size (>= ``count``) for ``count`` rows of site set ``name``."""


def _check_count(count: int) -> int:
    if isinstance(count, bool) or int(count) != count or count < 0:
        raise ValueError(f"count must be a non-negative int, got {count!r}")
    return int(count)


def _positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class Buckets:
    """A geometric ladder of capacities (the default policy).

    Args:
        minimum: the smallest capacity (also used for empty inputs); a positive int.
        steps_per_octave: sizes per doubling, ``1 <= s <= 16``: ``minimum * 2**e * (1 + j/s)``.
        maximum: optional hard limit; a count above it raises `CapacityError`.
        linked: give every site set of a plan the rung of the largest (one bucket per plan).
    """

    def __init__(self, minimum: int = 256, steps_per_octave: int = 2, maximum: int | None = None,
                 linked: bool = False) -> None:
        self.linked = bool(linked)
        self.minimum = _positive_int(minimum, "minimum")
        self.steps_per_octave = _positive_int(steps_per_octave, "steps_per_octave")
        if self.steps_per_octave > 16:
            raise ValueError(f"steps_per_octave must be at most 16, got {steps_per_octave}")
        self.maximum = None if maximum is None else _positive_int(maximum, "maximum")

    def __repr__(self) -> str:
        return (f"Buckets(minimum={self.minimum}, steps_per_octave={self.steps_per_octave}, "
                f"maximum={self.maximum}, linked={self.linked})")

    def _size(self, octave: int, step: int) -> int:
        base = self.minimum << octave
        return base + (base * step + self.steps_per_octave - 1) // self.steps_per_octave

    def round_up(self, count: int) -> int:
        """The smallest ladder size that holds ``count`` (``minimum`` for 0)."""
        count = _check_count(count)
        if count <= self.minimum:
            return self.minimum
        octave = max(0, int(math.floor(math.log2(count / self.minimum))) - 1)
        while True:
            for step in range(self.steps_per_octave):
                size = self._size(octave, step)
                if size >= count:
                    return size
            octave += 1

    def ladder(self, low: int, high: int) -> list[int]:
        """Every ladder size a count in ``[low, high]`` can be rounded to, ascending."""
        sizes = []
        size = self.round_up(low)
        while True:
            sizes.append(size)
            if size >= high:
                return sizes
            size = self.round_up(size + 1)

    def capacity(self, count: int, name: str) -> int:
        count = _check_count(count)
        if self.maximum is not None and count > self.maximum:
            raise CapacityError(name, count, self.maximum)
        size = self.round_up(count)
        if self.maximum is not None:
            size = min(size, self.maximum)
        return size

    def finalize(self, rows: dict[str, int]) -> dict[str, int] | None:
        """With ``linked``: every site set gets the capacity of the largest count; else None."""
        if not self.linked or not rows:
            return None
        largest = max(rows.values())
        size = self.capacity(largest, max(rows, key=rows.get))
        return {name: size for name in rows}


class Fixed:
    """Explicit capacities: one static shape for every cloud, or an error.

    Args:
        rows: capacity of every site set (an int), or a mapping from site-set name
            to capacity (names missing from it raise).
    """

    def __init__(self, rows: int | Mapping[str, int]) -> None:
        self.rows = self._check(rows, "rows")

    @staticmethod
    def _check(value: int | Mapping[str, int], name: str) -> int | dict[str, int]:
        if isinstance(value, Mapping):
            return {str(key): _positive_int(size, f"{name}[{key!r}]") for key, size in value.items()}
        return _positive_int(value, name)

    def __repr__(self) -> str:
        return f"Fixed(rows={self.rows!r})"

    def capacity(self, count: int, name: str) -> int:
        count = _check_count(count)
        if isinstance(self.rows, dict):
            if name not in self.rows:
                raise ValueError(
                    f"Fixed capacities name no capacity for site set {name!r}; known: "
                    f"{sorted(self.rows)}. Add it, or give one int for every site set."
                )
            size = self.rows[name]
        else:
            size = self.rows
        if count > size:
            raise CapacityError(name, count, size)
        return size


def as_policy(capacity: CapacityPolicy | int | None) -> CapacityPolicy:
    """``None`` -> `Buckets()`; an int -> ``Fixed(int)``; a policy unchanged."""
    if capacity is None:
        return Buckets()
    if isinstance(capacity, int) and not isinstance(capacity, bool):
        if capacity < 1:
            raise ValueError(
                f"capacity must be a positive int (the padded rows of every site set), a Buckets(...) / "
                f"Fixed(...) policy, or None (Buckets(): grows to fit), got {capacity!r}; an empty cloud "
                "needs no capacity of 0, any positive capacity holds it"
            )
        return Fixed(capacity)
    if isinstance(capacity, CapacityPolicy):
        return capacity
    raise TypeError(
        f"capacity must be None, an int, Buckets(...), Fixed(...) or an object with a "
        f"capacity(count, name) method, got {type(capacity).__name__}"
    )
