"""A session's conv weights in its dtype and on each device, converted once and held to the memory budget.

A weight shared by several nodes is one initializer, so one array: it is
converted once and the converted array shared by every node that reads it.
The bytes the cache keeps (the converted copies and the int8 parameters)
are counted together against the session's memory budget, and the first
conversion that would pass it raises a `MemoryBudgetError` naming the node.
Threads sharing a session convert and count each array once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Optional

import numpy as np

from .._dispatch import array_module, device_of
from ..memory_budget import budget, check_bytes
from .nodes import ConvNode
from .quantized import computes_int8, int8_parameters

__all__ = ["WeightCache"]


class WeightCache:
    """Per (node, device), a conv node's parameters as its passes take them.

    Args:
        dtype: the session's float dtype (float32 or float16).
        memory_budget: the session's budget in bytes; None: the process-wide one.
    """

    def __init__(self, dtype: np.dtype, memory_budget: Optional[int]) -> None:
        self.dtype = dtype
        self.memory_budget = memory_budget
        self._parameters: dict[tuple[int, str], Any] = {}  # (node id, device) -> (weight, bias) or int8 parameters
        self._arrays: dict[tuple[int, str], Any] = {}  # (initializer array id, device) -> converted array
        self.cached_bytes = 0
        self._lock = threading.Lock()

    def parameters(self, node: ConvNode, like: Any) -> Any:
        """``node``'s ``(weight, bias)`` (or int8 parameters) on ``like``'s device, converted at the first call."""
        device = device_of(like)
        key = (id(node), device)  # by the node itself: names need not be set
        cached = self._parameters.get(key)
        if cached is None:
            with self._lock:
                cached = self._parameters.get(key)
                if cached is None:
                    cached = self._convert(node, like, device)
                    self._parameters[key] = cached
        return cached

    def _convert(self, node: ConvNode, like: Any, device: str) -> Any:
        xp = array_module(like)
        if computes_int8(node):  # quantized with the node's own ranges: one per node
            parameters = int8_parameters(node, xp)
            arrays = [getattr(parameters, field.name) for field in dataclasses.fields(parameters)]
            self._count(node, sum(int(getattr(array, "nbytes", 0)) for array in arrays), like)
            return parameters
        return (self._converted(node, node.weight, xp, device, like),
                self._converted(node, node.bias, xp, device, like))

    def _converted(self, node: ConvNode, array: np.ndarray, xp: Any, device: str, like: Any) -> Any:
        """``array`` in the session's dtype on ``device``, once for every node that reads it, its bytes counted."""
        key = (id(array), device)
        converted = self._arrays.get(key)
        if converted is None:
            converted = xp.asarray(array.astype(self.dtype, copy=False))
            if converted is not array:  # a copy (another dtype, another device): the session holds its bytes
                self._count(node, int(converted.nbytes), like)
            self._arrays[key] = converted
        return converted

    def _count(self, node: ConvNode, nbytes: int, like: Any) -> None:
        """Holds the converted weights, all of them together, to the memory budget."""
        total = self.cached_bytes + nbytes
        chosen = budget(self.memory_budget) if self.memory_budget is not None else contextlib.nullcontext()
        with chosen:
            check_bytes(total, f"node {node.name!r} (SparseConvolution): keeping the session's converted weights "
                        f"({total} bytes, {len(self._arrays) + 1} arrays)", "Run the model in its stored dtype "
                        "(dtype='float16' for an FP16 file), or give the session a larger memory_budget.",
                        like=like)
        self.cached_bytes = total
