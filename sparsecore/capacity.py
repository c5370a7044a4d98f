"""Capacity mode: rulebook builds that allocate at a capacity and read nothing back.

In the default, exact mode a strided, transposed or pooling build reads its
output count back to the host to size its outputs (one read, a wait for the
device, per build), and the first layer reads its site checks back. In
capacity mode (``capacity=`` on `sparsecore.SparseTensor`,
`sparsecore.find_layer_rulebook` or `sparsecore.build_rulebook`) a build
allocates its outputs at a capacity chosen on the host, before the build, by
a policy; the count stays on the device, in the rulebook's `CapacityStatus`;
rows past it are padding (sites of -1, neighbour rows of -1: every later build
skips them and the feature passes compute nothing from them); a build that
needs more rows than its capacity writes none past it and records what it
needed. So a forward with its builds, and a backward, read nothing back: what
a CUDA graph or an XLA command buffer needs.

The count and the site-check verdicts are read when the caller asks,
`check_capacity` (one read for a whole network), which raises
`CapacityOverflowError` naming the layer, the rows it needed, its capacity
and how to raise it; nothing is dropped silently.

Policies (`as_capacity_policy`), each answering ``build_capacity(name, bound)``
from the layer's name and `capacity_bound` (the most rows the layer can
produce from its input rows and kernel, capped by `sparsecore.memory_budget`):

- `BoundCapacity`: the bound itself (never overflows unless the budget caps it;
  the most memory);
- `FixedCapacity`: explicit rows (one for every layer, or per layer name);
- `LearnedCapacity` (the default of ``capacity=True``): the bound until a
  layer has been seen, then what `check_capacity` observed times a margin,
  rounded up on `sparsecore.buckets.Buckets`' ladder (the bucket design of
  ``sparsecore.jax``), never above the bound. A warm-up step and a
  ``check_capacity`` teach it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol, Sequence, runtime_checkable

from .buckets import Buckets, CapacityError, Fixed
from .memory_budget import NEVER_CHECKED_BYTES, current_budget

__all__ = ["BuildCapacityPolicy", "BoundCapacity", "FixedCapacity", "LearnedCapacity", "as_capacity_policy",
           "capacity_bound", "layer_capacity", "CapacityStatus", "CapacityOverflowError", "check_capacity",
           "true_rows"]


@runtime_checkable
class BuildCapacityPolicy(Protocol):
    """What a capacity build asks of a policy."""

    def build_capacity(self, name: str, bound: int) -> int:
        """The output rows to allocate for layer ``name`` (``bound``: the most it can need, `capacity_bound`)."""

    def observe(self, name: str, needed: int) -> None:
        """Told by `check_capacity` how many rows layer ``name`` needed."""


class BoundCapacity:
    """The bound: as many rows as the layer can produce from its input's rows (the most memory, no warm-up)."""

    def __repr__(self) -> str:
        return "BoundCapacity()"

    def build_capacity(self, name: str, bound: int) -> int:
        return max(1, int(bound))

    def observe(self, name: str, needed: int) -> None:
        return None


class FixedCapacity:
    """Explicit output rows: one int for every layer, or a mapping from layer name to rows.

    Args:
        rows: a positive int, or ``{layer name: rows}`` (names as `CapacityStatus.layer` and
            `check_capacity` report them; a layer missing from it gets its bound).
    """

    def __init__(self, rows: int | Mapping[str, int]) -> None:
        self._fixed = Fixed(rows)  # the checks of sparsecore.buckets.Fixed
        self.rows = self._fixed.rows

    def __repr__(self) -> str:
        return f"FixedCapacity({self.rows!r})"

    def build_capacity(self, name: str, bound: int) -> int:
        if isinstance(self.rows, dict):
            return int(self.rows.get(name, max(1, int(bound))))
        return int(self.rows)

    def observe(self, name: str, needed: int) -> None:
        return None


class LearnedCapacity:
    """The bound until a layer is observed, then ``needed * margin`` rounded up on a bucket ladder.

    Args:
        margin: headroom over the largest count observed per layer, ``>= 1`` (default 1.1: 10%).
        buckets: the ladder the capacity is rounded up on (default ``Buckets(minimum=64,
            steps_per_octave=8)``: steps of at most 12.5%), so nearby clouds share a capacity
            (and a recorded CUDA graph).

    Attributes:
        observed: the largest count seen per layer name (filled by `check_capacity`); this
            instance's state, never module-level.
    """

    def __init__(self, margin: float = 1.1, buckets: Buckets | None = None) -> None:
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 1.0:
            raise ValueError(f"margin must be a number >= 1 (the headroom over the counts seen), got {margin!r}")
        self.margin = float(margin)
        self.buckets = Buckets(minimum=64, steps_per_octave=8) if buckets is None else buckets
        if not isinstance(self.buckets, Buckets):
            raise TypeError(f"buckets must be a sparsecore.buckets.Buckets, got {type(buckets).__name__}")
        self.observed: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"LearnedCapacity(margin={self.margin}, buckets={self.buckets!r}, observed={len(self.observed)} layers)"

    def build_capacity(self, name: str, bound: int) -> int:
        seen = self.observed.get(name)
        if seen is None:
            return max(1, int(bound))
        wanted = self.buckets.round_up(int(math.ceil(seen * self.margin)))
        return max(1, min(int(bound), wanted))

    def observe(self, name: str, needed: int) -> None:
        self.observed[name] = max(int(needed), self.observed.get(name, 0))


def as_capacity_policy(capacity: Any) -> BuildCapacityPolicy | None:
    """The policy of a ``capacity=`` argument.

    ``None`` / ``False``: exact mode (None). ``True`` or ``"learned"``: `LearnedCapacity()`.
    ``"bound"``: `BoundCapacity()`. An int or a mapping: `FixedCapacity`. A policy: itself.
    """
    if capacity is None or capacity is False:
        return None
    if capacity is True or capacity == "learned":
        return LearnedCapacity()
    if capacity == "bound":
        return BoundCapacity()
    if isinstance(capacity, (int, Mapping)) and not isinstance(capacity, bool):
        return FixedCapacity(capacity)
    if isinstance(capacity, BuildCapacityPolicy):
        return capacity
    raise TypeError(
        f"capacity must be None or False (exact mode), True or 'learned' (LearnedCapacity()), 'bound' "
        f"(BoundCapacity()), rows (an int or {{layer: rows}}: FixedCapacity), or a policy with "
        f"build_capacity(name, bound) and observe(name, needed); got {capacity!r}"
    )


def _outputs_per_site(geometry: Any, output_shape: Sequence[int]) -> int:
    """The most output sites one input site reaches (the memory budget's count of candidates per site)."""
    count = 1
    for axis in range(geometry.ndim):
        size, step, spacing = geometry.kernel_size[axis], geometry.stride[axis], geometry.dilation[axis]
        if geometry.kind == "regular":
            size = -(-size // (step // math.gcd(step, spacing)))
        count *= max(1, min(size, int(output_shape[axis])))
    return count


def capacity_bound(geometry: Any, input_rows: int, output_shape: Sequence[int], batch_size: int) -> int:
    """The most output rows a strided or transposed layer can produce from ``input_rows`` input rows.

    ``input_rows`` times the output sites one input reaches, at most the output grid's cells, and
    at most what the memory budget allows for the output tables (`sparsecore.memory_budget`:
    ``4 * (1 + D + 2 K)`` bytes a row: the site, the neighbour row and the input side's share).
    At least 1.
    """
    rows = int(input_rows) * _outputs_per_site(geometry, output_shape)
    rows = min(rows, int(batch_size) * math.prod(int(size) for size in output_shape))
    row_bytes = 4 * (1 + geometry.ndim + 2 * geometry.kernel_volume)
    if rows * row_bytes >= NEVER_CHECKED_BYTES:
        rows = min(rows, current_budget() // row_bytes)
    return max(1, rows)


def layer_capacity(policy: BuildCapacityPolicy, name: str, geometry: Any, input_rows: int,
                   output_shape: Sequence[int], batch_size: int) -> int:
    """The capacity ``policy`` gives layer ``name`` (a positive int; checked)."""
    bound = capacity_bound(geometry, input_rows, output_shape, batch_size)
    capacity = policy.build_capacity(name, bound)
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"the capacity policy {policy!r} gave layer {name!r} the capacity {capacity!r}; "
                         "a capacity is a positive int")
    return capacity


@dataclass(frozen=True, eq=False)
class CapacityStatus:
    """What a capacity build leaves on the device for `check_capacity` to read.

    Attributes:
        layer: the layer's name (the policy's key; in messages).
        capacity: the output rows allocated.
        status: int32 ``[2]`` device array: the output rows the build needed (may exceed
            ``capacity``: an overflow), then the problem bits of its site checks; None for a
            submanifold build (its output rows are its input's).
        problems: int64 ``[1]`` device array of a checked submanifold build's site problems, or None.
        sites: the build's input sites (to name a site problem when one is reported).
        spatial_shape: their grid.
        batch_size: batch elements.
    """

    layer: str
    capacity: int
    status: Any = field(default=None, repr=False)
    problems: Any = field(default=None, repr=False)
    sites: Any = field(default=None, repr=False)
    spatial_shape: tuple[int, ...] = ()
    batch_size: int = 1


class CapacityOverflowError(CapacityError):
    """A capacity build needed more output rows than its capacity (its rows past the capacity were not
    written: the step's results are not valid).

    Attributes:
        name: the layer.
        needed: the rows it needed.
        capacity: the rows it had.
    """

    def __init__(self, name: str, needed: int, capacity: int) -> None:
        ValueError.__init__(
            self,
            f"capacity overflow: layer {name!r} needed {needed} output rows but its capacity was {capacity}; "
            "the rows past the capacity were not written, so "
            "this step's results are not valid. Raise it: teach the policy this count and run the step again "
            "(check_capacity(..., policy) with a LearnedCapacity does so), give a larger margin "
            f"(LearnedCapacity(margin=...)) or FixedCapacity({{{name!r}: {needed}}}) or more, or use "
            "BoundCapacity() (capacity='bound'), or exact mode (capacity=None)."
        )
        self.name, self.needed, self.capacity = name, int(needed), int(capacity)


def _statuses(rulebooks: Iterable[Any]) -> list[CapacityStatus]:
    seen: dict[int, CapacityStatus] = {}
    for rulebook in rulebooks:
        status = getattr(rulebook, "capacity", None)
        if isinstance(status, CapacityStatus) and id(status) not in seen:
            seen[id(status)] = status
    return list(seen.values())


def check_capacity(rulebooks: Iterable[Any], policy: BuildCapacityPolicy | None = None) -> dict[str, int]:
    """Reads the counts and site checks of capacity builds (one read back for all of them).

    Args:
        rulebooks: the rulebooks of a step (e.g. ``SparseTensor.rulebooks`` values, or a frontend
            tensor's); exact-mode rulebooks are skipped.
        policy: told each count (`LearnedCapacity` learns from it), or None.

    Returns:
        ``{layer name: rows needed}`` (the largest, for a name built several times).

    Raises:
        ValueError: a checked build found sites outside the grid or duplicate sites (the exact
            builders' messages).
        CapacityOverflowError: a layer needed more rows than its capacity (the first such layer,
            after the policy has been told every count).
    """
    from ._kernel_builds import raise_site_problems
    from .backends import backend_for
    from .interop import array_module

    statuses = _statuses(rulebooks)
    if not statuses:
        return {}
    parts = []
    for status in statuses:
        xp = array_module(status.status if status.status is not None else status.problems)
        counts = status.status if status.status is not None else xp.zeros(2, dtype=xp.int32)
        problems = status.problems if status.problems is not None else xp.zeros(1, dtype=xp.int64)
        parts.append(xp.concatenate([counts.astype(xp.int64), problems.astype(xp.int64)]))
    values = array_module(parts[0]).stack(parts).tolist()  # the one read back
    needed: dict[str, int] = {}
    overflow: CapacityStatus | None = None
    for status, (count, bits, site_bits) in zip(statuses, values):
        if bits or site_bits:
            margin = (0,) * len(status.spatial_shape)
            sites = status.sites[:true_rows(status.sites)]  # the padding is not a problem
            raise_site_problems(int(bits) | int(site_bits), sites, tuple(status.spatial_shape),
                                int(status.batch_size), backend_for(status.sites), margin)
        if status.status is None:
            continue
        needed[status.layer] = max(int(count), needed.get(status.layer, 0))
        if count > status.capacity and overflow is None:
            overflow = status
    if policy is not None:
        for name, count in needed.items():
            policy.observe(name, count)
    if overflow is not None:
        raise CapacityOverflowError(overflow.layer, needed[overflow.layer], overflow.capacity)
    return needed


def true_rows(indices: Any) -> int:
    """The rows of a capacity-mode site array before its padding (rows whose batch index is -1 come last).

    A host read: for the NumPy builders (on the host it costs nothing) and a result's final count.

    Raises:
        ValueError: a row of batch index -1 (padding) before a true row.
    """
    if indices.shape[0] == 0:
        return 0
    padding = indices[:, 0] == -1
    rows = int(indices.shape[0]) - int(padding.sum())
    if rows and bool(padding[:rows].any()):
        first = int(padding[:rows].argmax())
        raise ValueError(
            f"indices: row {first} has batch index -1 (a capacity-mode padding row) but true rows follow it; "
            "padding rows come after every true row (fill a static buffer's tail with -1)"
        )
    return rows
