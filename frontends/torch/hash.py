"""`HashTable` with spconv 2.x's interface, on top of `sparsecore.HashTable`.

Keys live in a core hash table (NumPy on the CPU, CuPy on CUDA) that maps each
key to a slot; the values live in a torch tensor indexed by slot, so any of
spconv's value dtypes works. Unlike spconv 2.3.8's CPU wheel (whose ``insert``
raises), this works on the CPU; ``max_size`` is accepted and not needed (the
table grows). Slots are in insertion order: ``items`` and ``assign_arange_``
use it.
"""

from __future__ import annotations

from typing import Optional

import torch

import sparsecore as sc
from sparsecore.interop import INT32_MIN

from ._convert import core_context, core_view, to_torch

__all__ = ["HashTable"]

_KEY_DTYPES = (torch.int32, torch.int64)
_VALUE_DTYPES = (torch.int32, torch.int64, torch.float32, torch.float64)


class HashTable:
    """A key -> value table (spconv ``HashTable``).

    Args:
        device: where keys and values live.
        key_dtype: ``torch.int32`` or ``torch.int64``.
        value_dtype: ``torch.int32``, ``int64``, ``float32`` or ``float64``.
        max_size: spconv's fixed CUDA capacity; accepted, not required.
    """

    def __init__(self, device: torch.device, key_dtype: torch.dtype, value_dtype: torch.dtype,
                 max_size: int = -1) -> None:
        if key_dtype not in _KEY_DTYPES:
            raise ValueError(f"key_dtype must be torch.int32 or torch.int64, got {key_dtype}")
        if value_dtype not in _VALUE_DTYPES:
            raise ValueError(f"value_dtype must be one of {_VALUE_DTYPES}, got {value_dtype}")
        self._keys = torch.empty(0, dtype=key_dtype, device=torch.device(device))
        # the device as torch resolves it: "cuda" is the current GPU, "cuda:0" say, which is what
        # the keys' and values' .device will read (a bare "cuda" compared unequal: seen on an H200)
        self.device = self._keys.device
        self.is_cpu = self.device.type == "cpu"
        self.key_dtype = key_dtype
        self.value_dtype = value_dtype
        self.max_size = max_size
        self._values = torch.zeros(0, dtype=value_dtype, device=self.device)
        self._table: Optional[sc.HashTable] = None

    # -------------------------------------------------------------- internals

    def _check_keys(self, keys: torch.Tensor, name: str = "keys") -> torch.Tensor:
        if not isinstance(keys, torch.Tensor) or keys.ndim != 1 or keys.dtype != self.key_dtype:
            got = f"{tuple(keys.shape)} {keys.dtype}" if isinstance(keys, torch.Tensor) else type(keys).__name__
            raise ValueError(f"{name} must be a 1-D {self.key_dtype} tensor, got {got}")
        if keys.device != self.device:
            raise ValueError(f"{name} is on {keys.device} but the table is on {self.device}")
        return keys

    def _check_values(self, values: torch.Tensor, count: int) -> torch.Tensor:
        if not isinstance(values, torch.Tensor) or values.shape != (count,) or values.dtype != self.value_dtype:
            got = f"{tuple(values.shape)} {values.dtype}" if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(f"values must be a [{count}] {self.value_dtype} tensor, got {got}")
        if values.device != self.device:
            raise ValueError(f"values is on {values.device} but the table is on {self.device}")
        return values

    def _packed(self, keys: torch.Tensor) -> torch.Tensor:
        """int64, non-negative: int32 keys shifted by 2^31; negative int64 keys rejected."""
        if self.key_dtype == torch.int32:
            return keys.to(torch.int64) - INT32_MIN
        if keys.numel() and int(keys.min()) < 0:
            raise ValueError("int64 keys must be non-negative")
        return keys

    def _slots(self, keys: torch.Tensor) -> torch.Tensor:
        if self._table is None or keys.numel() == 0:
            return torch.full(keys.shape, -1, dtype=torch.int64, device=self.device)
        with core_context(self.device):
            return to_torch(self._table.lookup(core_view(self._packed(keys), "keys")))

    def _rebuild(self) -> None:
        with core_context(self.device):
            self._table = sc.HashTable(core_view(self._packed(self._keys), "keys"))

    # -------------------------------------------------------------- spconv API

    def insert(self, keys: torch.Tensor, values: Optional[torch.Tensor] = None) -> None:
        """Inserts keys (a repeated key keeps its last value); existing keys get the new values.

        Without ``values`` the values of new keys are 0 (spconv: undefined).
        """
        keys = self._check_keys(keys)
        if values is None:
            values = torch.zeros(keys.shape[0], dtype=self.value_dtype, device=self.device)
        values = self._check_values(values, keys.shape[0])
        if keys.numel() == 0:
            return
        unique, inverse = torch.unique(keys, return_inverse=True)
        last = torch.full(unique.shape, -1, dtype=torch.int64, device=self.device)
        last = last.scatter_reduce(0, inverse, torch.arange(keys.shape[0], device=self.device), reduce="amax")
        last = last.sort().values  # keep the call's order (of each key's last occurrence)
        keys, values = keys[last], values[last]
        slots = self._slots(keys)
        found = slots >= 0
        self._values[slots[found]] = values[found]
        fresh = ~found
        if bool(fresh.any()):
            self._keys = torch.cat([self._keys, keys[fresh]])
            self._values = torch.cat([self._values, values[fresh]])
            self._rebuild()

    def query(self, keys: torch.Tensor, values: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(values, is_empty)``: the values of ``keys`` (0 where absent) and a bool mask of absent keys.

        With ``values`` given, the results are written into it.
        """
        keys = self._check_keys(keys)
        slots = self._slots(keys)
        is_empty = slots < 0
        found = self._values[slots.clamp(min=0)] if self._values.numel() else torch.zeros(
            keys.shape[0], dtype=self.value_dtype, device=self.device)
        result = torch.where(is_empty, torch.zeros_like(found), found)
        if values is not None:
            self._check_values(values, keys.shape[0]).copy_(result)
            result = values
        return result, is_empty

    def insert_exist_keys(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Sets the values of keys already in the table; returns a uint8 mask of the keys that were not."""
        keys = self._check_keys(keys)
        values = self._check_values(values, keys.shape[0])
        slots = self._slots(keys)
        found = slots >= 0
        self._values[slots[found]] = values[found]
        return (~found).to(torch.uint8)

    def assign_arange_(self) -> torch.Tensor:
        """Sets the values to ``0, 1, ...`` in slot (insertion) order; returns the count ``[1]`` int64."""
        if self.value_dtype not in (torch.int32, torch.int64):
            raise ValueError(f"assign_arange_ needs integer values, the table has {self.value_dtype}")
        count = self._keys.shape[0]
        self._values = torch.arange(count, dtype=self.value_dtype, device=self.device)
        return torch.tensor([count], dtype=torch.int64)

    def items(self, max_size: int = -1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(keys, values, count)`` in slot order; padded with zeros to ``max_size`` when it is larger."""
        count = self._keys.shape[0]
        keys, values = self._keys.clone(), self._values.clone()
        if max_size > count:
            pad = max_size - count
            keys = torch.cat([keys, keys.new_zeros(pad)])
            values = torch.cat([values, values.new_zeros(pad)])
        return keys, values, torch.tensor([count], dtype=torch.int64)

    def __len__(self) -> int:
        return int(self._keys.shape[0])
