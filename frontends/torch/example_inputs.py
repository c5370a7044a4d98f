"""A ``.pt2`` file's example inputs, loaded without running code and bounded before anything walks them.

The example inputs (``data/sample_inputs/model.pt``) are a ``torch.save``
archive inside the ``.pt2`` archive. `load_example_inputs` reads that inner
archive with the same strict reader (`strict_zip.read_archive`), loads it with
``torch.load(weights_only=True)`` (no code runs: the `SparseConvTensor` of
``sparsecore.torch`` is an allowed global), and counts what it holds with one
walk that visits every distinct object once (`count_structure`): a file whose
tuples share their children (a DAG of 100 levels that a tree walk would visit
2^100 times) is refused on its counts, not walked. It then writes the inputs
again with ``torch.save``: the bytes torch's deserializer reads are ones this
process wrote, so its fallback to an unrestricted pickle load, if it were ever
taken, would read those.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch

from .strict_zip import ArchiveError, pack_archive, read_archive
from .tensor import SparseConvTensor

__all__ = ["InputBounds", "count_structure", "load_example_inputs"]


@dataclass(frozen=True)
class InputBounds:
    """The most the example inputs may hold: nesting depth, leaves (as a tree walk counts them), tensor bytes."""

    depth: int = 32
    leaves: int = 10_000
    nbytes: int = 2**30


@dataclass(frozen=True)
class _Counts:
    depth: int
    leaves: int
    nbytes: int


def _children(value: Any) -> tuple:
    if isinstance(value, (tuple, list)):
        return tuple(value)
    if isinstance(value, dict):
        return tuple(value.keys()) + tuple(value.values())
    if isinstance(value, SparseConvTensor):
        return (value.features, value.indices)
    return ()


def count_structure(value: Any, bounds: InputBounds) -> _Counts:
    """Depth, leaves and tensor bytes of ``value`` as a tree walk would meet them, in time linear in the
    number of distinct objects (each container's counts are computed once, by identity), stopping at the first
    bound passed.

    Raises:
        ValueError: naming the bound passed.
    """
    done: dict[int, _Counts] = {}
    keep = []  # keeps every counted object alive, so that ids stay unique during the walk
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > bounds.depth:
            raise ValueError(f"nest deeper than {bounds.depth} levels")
        if id(item) in done:
            continue
        children = _children(item)
        pending = [child for child in children if id(child) not in done]
        if pending:
            stack.append((item, depth))
            stack.extend((child, depth + 1) for child in pending)
            continue
        if isinstance(item, torch.Tensor):
            counts = _Counts(0, 1, item.numel() * item.element_size())
        elif children:
            parts = [done[id(child)] for child in children]
            counts = _Counts(1 + max(p.depth for p in parts), sum(p.leaves for p in parts),
                             sum(p.nbytes for p in parts))
        else:
            counts = _Counts(0, 1, 0)
        if counts.depth > bounds.depth:
            raise ValueError(f"nest deeper than {bounds.depth} levels")
        if counts.leaves > bounds.leaves:
            raise ValueError(f"hold more than {bounds.leaves} leaves as a walk meets them ({counts.leaves}; "
                             "containers shared many times count each time)")
        if counts.nbytes > bounds.nbytes:
            raise ValueError(f"hold tensors of {counts.nbytes} bytes together (shared ones counted each time), "
                             f"more than {bounds.nbytes}")
        done[id(item)] = counts
        keep.append(item)
    return done[id(value)]


def load_example_inputs(where: str, data: bytes, bounds: InputBounds, max_bytes: int) -> bytes:
    """The example inputs of a ``.pt2`` member, checked and written again (see the module docstring).

    Args:
        where: how messages name the member (the file and the member's name).
        data: the member's bytes (a ``torch.save`` archive).
        bounds: what the inputs may hold.
        max_bytes: the most bytes the inner archive's members may declare together.

    Returns:
        The inputs saved again with ``torch.save`` (an empty member stays empty: torch reads no inputs).

    Raises:
        ValueError: naming the member and what is wrong.
    """
    if not data:
        return data
    fix = "export the program again with sparsecore.torch, or load only files you trust with torch.export.load"
    try:
        members = read_archive(data, max_member_bytes=max_bytes, max_total_bytes=max_bytes, max_members=10_000)
    except ArchiveError as error:
        raise ValueError(f"{where}: the example inputs are not a plain torch.save archive ({error}); {fix}") from None
    try:
        inputs = torch.load(pack_archive(members), weights_only=True)
    except Exception as error:  # noqa: BLE001 - any failure of the restricted load refuses the file
        lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
        reason = next((line for line in lines if line.startswith("WeightsUnpickler error")), lines[0])
        raise ValueError(f"{where}: holds example inputs that torch.load(weights_only=True) refuses ({reason}); "
                         "they are not loaded (torch.export.load would unpickle them without restriction, which "
                         f"can run code); {fix}") from None
    if not isinstance(inputs, tuple):
        raise ValueError(f"{where}: the example inputs are a {type(inputs).__name__}, not the (args, kwargs) "
                         f"tuple torch.export.save writes; {fix}")
    try:
        count_structure(inputs, bounds)
    except ValueError as error:
        raise ValueError(f"{where}: the example inputs {error}; they are not walked. {fix}") from None
    buffer = io.BytesIO()
    torch.save(inputs, buffer)
    try:  # what torch's deserializer will read must load without its fallback too
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as error:  # noqa: BLE001
        raise ValueError(f"{where}: the example inputs, saved again, do not load under weights_only=True "
                         f"({type(error).__name__}); {fix}") from None
    return buffer.getvalue()
