"""Loading a ``torch.export`` program (a ``.pt2`` file) made elsewhere without running code from it.

``torch.export.load`` is not a safe loader: when the example inputs do not load
under ``torch.load(weights_only=True)`` it retries with ``weights_only=False`` (an
unrestricted pickle: the file can run any code) after logging a warning, and it
reads pickled weights, pickled constants and opaque objects with unrestricted
pickle loads too. `load_program` reads the file once, checks the whole archive
first, and hands torch only an archive where none of those paths can run:

- every member is of a kind a sparsecore program has (the archive's version
  and format marks, the graph as JSON, the weight and constant configs as JSON,
  raw tensor bytes, the example inputs, extra files); anything else (compiled
  AOTInductor or ExecuTorch code, custom or opaque objects, older layouts) is
  refused;
- no weight or constant is pickled (``use_pickle`` in the configs);
- the example inputs load under ``torch.load(weights_only=True)``, so torch's
  fallback never runs (a `SparseConvTensor` is an allowed global once
  ``sparsecore.torch`` is imported);
- the members add up to at most ``max_bytes`` once uncompressed;
- once loaded, the graph's sparsecore ops agree with each other and with the
  weights the file stores (`program_checks.check_program`): an edited kernel
  size is refused here, not after a rulebook of its size was built.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from typing import Union

import torch

from .program_checks import check_program

__all__ = ["load_program"]

_MARKS = ("archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id")
_WEIGHTS, _CONSTANTS, _INPUTS = "data/weights/", "data/constants/", "data/sample_inputs/"


def _refuse(path: str, what: str) -> ValueError:
    return ValueError(f"load_program: {path} {what}; it is not loaded (torch.export.load would unpickle it "
                      "without restriction, which can run code). Load only files you trust with "
                      "torch.export.load, or export the program again with sparsecore.torch")


def _member_kind(name: str) -> str:
    """'mark', 'graph', 'config', 'tensor', 'inputs', 'extra', or '' for a member no sparsecore program has."""
    if name in _MARKS:
        return "mark"
    if name.startswith("models/") and name.endswith(".json") and name.count("/") == 1:
        return "graph"
    if name.startswith("extra/"):
        return "extra"
    for folder, config, tensor in ((_WEIGHTS, "_weights_config.json", "weight_"),
                                   (_CONSTANTS, "_constants_config.json", "tensor_")):
        if name.startswith(folder) and name.count("/") == 2:
            leaf = name[len(folder):]
            return "config" if leaf.endswith(config) else "tensor" if leaf.startswith(tensor) else ""
    if name.startswith(_INPUTS) and name.endswith(".pt") and name.count("/") == 2:
        return "inputs"
    return ""


def _reason(error: Exception) -> str:
    """The line of torch's weights-only message that names what was refused (its first line otherwise)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    return next((line for line in lines if line.startswith("WeightsUnpickler error")), lines[0])


def _check_config(path: str, name: str, data: bytes) -> None:
    try:
        entries = json.loads(data)["config"]
        pickled = [key for key, entry in entries.items() if entry["use_pickle"]]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise _refuse(path, f"has a malformed {name} ({type(error).__name__}: {error})") from None
    if pickled:
        raise _refuse(path, f"holds pickled tensors {pickled[:5]} ({name})")


def load_program(path: Union[str, os.PathLike], *, max_bytes: int = 2**32) -> torch.export.ExportedProgram:
    """A ``torch.export`` program from ``path``, loaded once the whole file is checked to unpickle nothing unsafely.

    The checks are the module's: only the members a sparsecore program has, no pickled weights or
    constants, example inputs that load under ``weights_only=True``, at most ``max_bytes``.

    Args:
        path: a ``.pt2`` file written by ``torch.export.save``.
        max_bytes: the most bytes the file and its members (uncompressed, together) may hold.

    Returns:
        The ``torch.export.ExportedProgram``, as ``torch.export.load(path)`` gives it.

    Raises:
        ValueError: the file is larger than ``max_bytes``, not a ``.pt2`` archive, or holds a member
            that would be unpickled without restriction (the message names it), or its graph's
            sparsecore ops disagree with each other or with the stored weights (naming the node).
    """
    shown = os.fspath(path)
    size = os.path.getsize(path)
    if size > max_bytes:
        raise ValueError(f"load_program: {shown} has {size} bytes, more than max_bytes={max_bytes}; "
                         "pass a larger max_bytes for a program you expect to be that large")
    with open(path, "rb") as file:
        data = file.read(max_bytes + 1)
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except zipfile.BadZipFile:
        raise ValueError(f"load_program: {shown} is not a .pt2 archive (not a zip file); "
                         "torch.export.save writes one") from None
    members = archive.infolist()
    total = sum(member.file_size for member in members)
    if total > max_bytes:
        raise ValueError(f"load_program: {shown} unpacks to {total} bytes, more than max_bytes={max_bytes}")
    roots = {member.filename.split("/", 1)[0] for member in members}
    if len(roots) != 1 or any("/" not in member.filename for member in members):
        raise _refuse(shown, f"is not laid out as one .pt2 archive folder (top-level entries {sorted(roots)[:5]})")
    root = roots.pop() + "/"
    for member in members:
        name = member.filename[len(root):]
        kind = _member_kind(name)
        if not kind:
            raise _refuse(shown, f"holds {name!r}, a member no sparsecore program has")
        if kind == "config":
            _check_config(shown, name, archive.read(member))
        elif kind == "inputs":
            try:
                torch.load(io.BytesIO(archive.read(member)), weights_only=True)
            except Exception as error:  # noqa: BLE001 - any failure of the restricted load refuses the file
                raise _refuse(shown, f"holds example inputs ({name}) that torch.load(weights_only=True) refuses "
                              f"({_reason(error)})") from None
    program = torch.export.load(io.BytesIO(data))
    check_program(program, shown)
    return program
