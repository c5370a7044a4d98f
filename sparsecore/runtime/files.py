"""Reading an ONNX file made elsewhere: the file itself, then its external data, each path checked.

An ONNX model may keep initializers in other files ("external data": a
``location`` relative to the model's folder, an ``offset`` and a ``length``).
A file from elsewhere could point that location anywhere: ``../../etc/passwd``,
an absolute path, a symbolic link, a FIFO that blocks the reader, ``/proc``.
`read_model` reads the model without its external data, checks every
location itself (a relative path naming a regular file inside the model's
folder, reached through no symbolic link, offset and length plain ASCII
digits inside that file, no two initializers sharing a byte, their sum within
the memory budget), and only then has ``onnx`` read the data, which checks the paths again (onnx
1.23 refuses the same cases; setup.cfg pins the tested versions). Every
refusal is a `GraphError` naming the initializer and its location.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, Union

from ..memory_budget import check_bytes
from .nodes import GraphError

__all__ = ["read_model", "check_external_data"]


def _onnx() -> Any:
    try:
        import onnx
    except ImportError:
        raise ImportError(
            "sparsecore.runtime reads ONNX files with the 'onnx' package; install it with "
            "pip install 'sparsecore-conv[onnx]' (or pip install onnx)"
        ) from None
    return onnx


def _external_fields(tensor: Any) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def _integer_field(tensor: Any, fields: dict[str, str], key: str, default: int = 0) -> int:
    """A plain non-negative decimal (ASCII digits only: ``str.isdigit`` also takes "²", which ``int`` refuses)."""
    text = fields.get(key)
    if text is None:
        return default
    if not (text.isascii() and text.isdigit() and len(text) <= 20):
        raise GraphError(f"initializer {tensor.name!r}: its external data {key} {text[:40]!r} must be a non-negative "
                         "integer of bytes written in ASCII digits 0-9 (at most 20 of them)")
    return int(text)


def _all_tensors(graph: Any) -> list:
    """The graph's initializers and every tensor held in a node attribute, subgraphs included."""
    tensors = list(graph.initializer)
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                tensors.append(attribute.t)
            tensors.extend(attribute.tensors)
            for subgraph in ([attribute.g] if attribute.HasField("g") else []) + list(attribute.graphs):
                tensors.extend(_all_tensors(subgraph))
    return tensors


def check_external_data(model: Any, folder: Union[str, Path]) -> None:
    """Checks every external-data location of ``model`` before anything is read from it.

    Args:
        model: an ``onnx.ModelProto`` read without its external data.
        folder: the model file's folder, the only place its data may live.

    Raises:
        GraphError: naming the initializer, for a location that is empty, absolute, leaves the
            folder (``..``, or a symbolic link anywhere on the way), is not a regular file, an
            offset / length that is not plain ASCII digits or passes the file's end, or a range that
            overlaps another initializer's (or is the same).
        MemoryBudgetError: the ranges together beyond the memory budget.
    """
    root = os.path.realpath(folder)
    ranges: dict[tuple[int, int], list[tuple[int, int, str, str]]] = {}  # per data file, (offset, length, name)
    for tensor in _all_tensors(model.graph):
        if tensor.data_location != 1:  # TensorProto.EXTERNAL
            continue
        fields = _external_fields(tensor)
        location = fields.get("location", "")
        where = f"initializer {tensor.name!r} keeps its data in {location!r}"
        if not location:
            raise GraphError(f"initializer {tensor.name!r} is marked as external data but names no location")
        if os.path.isabs(location) or location.startswith("\\"):
            raise GraphError(f"{where}: an absolute path; external data must be a file beside the model "
                             "(a relative path inside the model's folder)")
        parts = Path(location).parts
        if ".." in parts:
            raise GraphError(f"{where}: the path leaves the model's folder ('..'); external data must be a file "
                             "inside the model's folder")
        path = os.path.join(root, location)
        walked = root
        for part in parts:
            walked = os.path.join(walked, part)
            if os.path.islink(walked):
                raise GraphError(f"{where}: {walked!r} is a symbolic link; external data is read only from "
                                 "regular files inside the model's folder, never through links")
        if os.path.commonpath([root, os.path.realpath(path)]) != root:
            raise GraphError(f"{where}: the path leaves the model's folder")
        try:
            status = os.stat(path)
        except OSError as error:
            raise GraphError(f"{where}: the file cannot be read ({error.strerror}); copy the data file beside "
                             "the model") from None
        if not stat.S_ISREG(status.st_mode):
            raise GraphError(f"{where}: not a regular file (a FIFO, device or folder); external data must be a "
                             "regular file")
        offset = _integer_field(tensor, fields, "offset")
        if offset > status.st_size:
            raise GraphError(f"{where}: offset {offset} passes the file's end ({status.st_size} bytes); the data "
                             "file is truncated or the model edited")
        length = _integer_field(tensor, fields, "length", status.st_size - offset)  # none: to the file's end
        if offset + length > status.st_size:
            raise GraphError(f"{where}: offset {offset} + length {length} passes the file's end "
                             f"({status.st_size} bytes); the data file is truncated or the model edited")
        ranges.setdefault((status.st_dev, status.st_ino), []).append((offset, length, tensor.name, location))
    _check_ranges(ranges)


def _check_ranges(ranges: dict[tuple[int, int], list[tuple[int, int, str, str]]]) -> None:
    """Each byte of external data belongs to one initializer, and all of them together fit the memory budget."""
    total = 0
    for spans in ranges.values():
        previous = None
        for offset, length, name, location in sorted(spans):
            if previous is not None and offset < previous[0] + previous[1]:
                raise GraphError(f"initializer {name!r} keeps its data in {location!r} at offset {offset} (length "
                                 f"{length}), inside the bytes of initializer {previous[2]!r} (offset {previous[0]}, "
                                 f"length {previous[1]}); external-data ranges may not overlap or be reused (a file "
                                 "could otherwise make the reader load one range many times)")
            previous = (offset, length, name)
            total += length
    check_bytes(total, f"reading the external data of {sum(len(s) for s in ranges.values())} initializers",
                "The model's data files declare this size.")


def read_model(path: Union[str, Path]) -> Any:
    """Reads an ONNX file and its external data, turning a missing, corrupt, foreign or unsafe file into a
    clear error.

    Raises:
        FileNotFoundError: no file at ``path``.
        GraphError: an unreadable file, or an external-data location refused by `check_external_data`
            or by ``onnx``.
        ImportError: the ``onnx`` package is missing.
    """
    onnx = _onnx()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no ONNX file at {str(path)!r}")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as error:
        raise GraphError(
            f"{str(path)!r} is not a readable ONNX model ({type(error).__name__}: {error}); export one "
            "with sparsecore.torch.export_onnx or NVIDIA's exptool"
        ) from None
    check_external_data(model, path.parent)
    try:
        onnx.external_data_helper.load_external_data_for_model(model, str(path.parent))
    except Exception as error:  # onnx's own refusal of a path, or a read that failed
        raise GraphError(f"{str(path)!r}: its external data cannot be read ({type(error).__name__}: "
                         f"{error})") from None
    return model
