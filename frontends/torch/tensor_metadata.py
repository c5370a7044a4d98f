"""Checks of a ``.pt2`` file's weight and constant configs against the bytes it stores, before torch reads them.

``torch.export.load`` views each stored record (``data/weights/weight_3``) as the
tensor its config entry describes (dtype, sizes, strides, storage offset) with
``torch.as_strided``, and builds ``torch.zeros(sizes)`` for a record of 0 bytes.
A config from elsewhere can so ask for any view: float32 bytes read as float16,
strides of 0, a view past the storage's end, or gigabytes of zeros from an
empty record. `check_payload_config` refuses, naming the config and the key:

- a config that is not the JSON torch writes (``{"config": {key: entry}}``), a
  pickled entry (``use_pickle``: torch would unpickle it without restriction), or
  an entry naming a record the archive does not hold;
- a dtype outside the plain numeric ones (`DTYPES`), a layout other than strided,
  a device other than ``cpu`` or ``cuda``;
- sizes, strides or offset that are not plain non-negative ints; a stride below 1
  on an axis of more than one element (an axis of 0 or 1 elements reads no second
  element, so torch writes any stride there);
- records not numbered in the order of the keys, as torch.export.save numbers
  them (``weight_0``, ``weight_1``, ...): two records swapped;
- a view that passes the end of its record, a record whose bytes are not a
  whole number of its dtype's elements, a record that the tensors reading it do
  not reach the end of (bytes of another dtype, or another tensor's record), a
  record read with two dtypes, or an empty record for a tensor with elements.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

__all__ = ["DTYPES", "TensorLayout", "check_payload_config"]

#: torch.export's serialized ScalarType codes a program from elsewhere may store (torch/_export/serde/schema.py).
DTYPES: Mapping[int, torch.dtype] = {
    1: torch.uint8, 2: torch.int8, 3: torch.int16, 4: torch.int32, 5: torch.int64, 6: torch.float16,
    7: torch.float32, 8: torch.float64, 12: torch.bool, 13: torch.bfloat16,
}
_STRIDED = 7
_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class TensorLayout:
    """One config entry, checked: the record it reads and the view."""

    key: str
    record: str
    dtype: torch.dtype
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int

    @property
    def extent(self) -> int:
        """Elements of the record the view reaches (0 for a view of no elements)."""
        if 0 in self.sizes:
            return 0
        return self.offset + 1 + sum((size - 1) * stride for size, stride in zip(self.sizes, self.strides))


def _fail(where: str, what: str) -> ValueError:
    return ValueError(f"{where} {what}; the file was edited or damaged: export the program again with "
                      "sparsecore.torch (torch.export.save)")


def _ints(where: str, field: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise _fail(where, f"has {field} {value!r}; expected a list of {{'as_int': n}}")
    result = []
    for item in value:
        number = item.get("as_int") if isinstance(item, dict) and len(item) == 1 else None
        if not isinstance(number, int) or isinstance(number, bool) or number < 0:
            raise _fail(where, f"has {field} {value!r}; expected non-negative ints ({{'as_int': n}}), "
                        "not symbols or negative numbers")
        result.append(number)
    return tuple(result)


def _layout(where: str, key: str, entry: Any, records: Mapping[str, int]) -> TensorLayout:
    if not isinstance(entry, dict):
        raise _fail(where, f"holds {entry!r} for {key!r}; expected an object")
    if entry.get("use_pickle") is not False:
        raise ValueError(f"{where} holds pickled tensors [{key!r}] (use_pickle); torch.export.load would unpickle it "
                         "without restriction, which can run code. It is not loaded: export the program with "
                         "torch.export.save, which stores plain tensor bytes")
    record, meta = entry.get("path_name"), entry.get("tensor_meta")
    if not isinstance(record, str) or record not in records:
        raise _fail(where, f"names the record {record!r} for {key!r}, which the archive does not hold")
    if not isinstance(meta, dict):
        raise _fail(where, f"has no tensor_meta for {key!r}")
    dtype = DTYPES.get(meta.get("dtype")) if isinstance(meta.get("dtype"), int) else None
    if dtype is None:
        raise _fail(where, f"gives {key!r} the dtype code {meta.get('dtype')!r}; expected one of "
                    f"{sorted(DTYPES)} ({', '.join(str(d).replace('torch.', '') for d in DTYPES.values())})")
    if meta.get("layout") != _STRIDED:
        raise _fail(where, f"gives {key!r} the layout {meta.get('layout')!r}; expected {_STRIDED} (strided)")
    device = meta.get("device")
    if not isinstance(device, dict) or device.get("type") not in _DEVICES:
        raise _fail(where, f"puts {key!r} on the device {device!r}; expected one of {_DEVICES}")
    sizes = _ints(f"{where} ({key!r})", "sizes", meta.get("sizes"))
    strides = _ints(f"{where} ({key!r})", "strides", meta.get("strides"))
    offset = _ints(f"{where} ({key!r})", "storage_offset", [meta.get("storage_offset")])[0]
    if len(sizes) != len(strides):
        raise _fail(where, f"gives {key!r} {len(sizes)} sizes and {len(strides)} strides")
    for axis, (size, stride) in enumerate(zip(sizes, strides)):
        if size > 1 and stride < 1:
            raise _fail(where, f"gives {key!r} the stride {stride} on axis {axis} of {size} elements (sizes "
                        f"{list(sizes)}, strides {list(strides)}); every element of a stored tensor has its own "
                        "bytes, so strides are at least 1")
    return TensorLayout(key, record, dtype, sizes, strides, offset)


def _check_record_order(where: str, layouts: tuple[TensorLayout, ...]) -> None:
    """torch.export.save numbers the records in the order it writes the config (``weight_0``, ``weight_1``, ...;
    keys sharing a storage share its record): a record out of that order was swapped with another."""
    seen: set[str] = set()
    for layout in layouts:
        if layout.record in seen:
            continue
        stem, _, number = layout.record.rpartition("_")
        expected = f"{stem}_{len(seen)}"
        if layout.record != expected:
            raise _fail(where, f"gives {layout.key!r} the record {layout.record!r} where torch.export.save writes "
                        f"{expected!r} (it numbers the records in the order of the keys): records were swapped")
        seen.add(layout.record)


def check_payload_config(where: str, data: bytes, records: Mapping[str, int]) -> tuple[TensorLayout, ...]:
    """Checks one weights or constants config against the records the archive stores.

    Args:
        where: how messages name the config (the file and the member).
        data: the config's bytes (JSON).
        records: per record name the config may use (``weight_3``), its size in bytes.

    Returns:
        The checked entries.

    Raises:
        ValueError: naming the config, the key and what is wrong (see the module docstring).
    """
    try:
        entries = json.loads(data)["config"]
    except (ValueError, KeyError, TypeError, RecursionError) as error:
        raise _fail(where, f"is not the JSON torch.export.save writes ({type(error).__name__}: "
                    f"{str(error)[:200]})") from None
    if not isinstance(entries, dict):
        raise _fail(where, "holds no config object")
    layouts = tuple(_layout(where, str(key), entry, records) for key, entry in entries.items())
    _check_record_order(where, layouts)
    by_record: dict[str, list[TensorLayout]] = {}
    for layout in layouts:
        by_record.setdefault(layout.record, []).append(layout)
    for record, readers in by_record.items():
        nbytes = records[record]
        dtypes = {layout.dtype for layout in readers}
        keys = [layout.key for layout in readers]
        if len(dtypes) > 1:
            raise _fail(where, f"reads the record {record!r} with several dtypes ({sorted(map(str, dtypes))}, "
                        f"keys {keys})")
        itemsize = torch.empty((), dtype=readers[0].dtype).element_size()
        if nbytes % itemsize:
            raise _fail(where, f"reads the record {record!r} ({nbytes} bytes) as {readers[0].dtype}, which takes "
                        f"{itemsize} bytes an element; the bytes are not a whole number of elements")
        numel = nbytes // itemsize
        reach = max(layout.extent for layout in readers)
        for layout in readers:
            if layout.extent > numel:
                raise _fail(where, f"views {layout.key!r} as sizes {list(layout.sizes)}, strides "
                            f"{list(layout.strides)}, offset {layout.offset}: up to element {layout.extent}, past "
                            f"the end of its record {record!r} ({numel} elements of {layout.dtype})")
            if nbytes == 0 and math.prod(layout.sizes) > 0:
                raise _fail(where, f"gives {layout.key!r} sizes {list(layout.sizes)} but its record {record!r} "
                            "is empty (torch would allocate it as zeros)")
        if reach != numel:
            raise _fail(where, f"reads {reach} of the {numel} {readers[0].dtype} elements of the record "
                        f"{record!r} (keys {keys}); a stored record holds exactly its tensors' elements, so the "
                        "dtype, sizes or record name was changed")
    return layouts
