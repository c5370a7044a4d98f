"""Loading a ``torch.export`` program (a ``.pt2`` file) made elsewhere without running code from it.

``torch.export.load`` is not a safe loader: it reads the archive with a zip
reader that trusts the end record's offsets (a file can hold two archives, one
for a checker, one for torch), falls back to an unrestricted pickle load of the
example inputs when ``torch.load(weights_only=True)`` refuses them, unpickles
pickled weights, constants and opaque objects, runs whatever operators the graph
names (``aten.from_file`` reads and writes files), and allocates what sizes the
file states. `load_program` reads the file's bytes once and builds, from them,
the only archive torch sees:

1. the zip is read strictly (`strict_zip.read_archive`): one end record, one
   central directory, every byte accounted for, no overlaps, unique names,
   sizes bounded before inflating, CRC-32 verified for every member;
2. every member is of a kind a sparsecore program has (the archive's marks,
   one graph ``models/model.json``, the weights and constants configs and their
   raw tensor records, the example inputs, extra files); anything else
   (compiled AOTInductor code, custom or opaque objects, older layouts, a second
   model) is refused;
3. the configs' tensor metadata agree with the stored bytes
   (`tensor_metadata.check_payload_config`; no pickled tensors);
4. the graph calls only sparsecore's ops and pure aten ops
   (`op_allowlist.check_targets`), and the strings torch evaluates as Python
   (symbolic sizes, guards, argument names) keep to grammars that cannot run
   anything (`program_strings.check_program_strings`), before torch
   deserializes it;
5. the example inputs load under ``weights_only=True`` from a strictly read
   inner archive, are bounded in depth, leaves and bytes before anything walks
   them, and are written again by this process (`example_inputs`);
6. torch's archive loader (``load_pt2``, without ``torch.export.load``'s
   fallback to an older layout) reads a new in-memory archive of exactly the
   checked members; then the graph's sparsecore ops are checked against each
   other and the weights (`program_checks.check_program`) and its fixed-size
   allocations against the memory budget (`op_allowlist.check_allocations`).

Every refusal is a ``ValueError`` (a `MemoryBudgetError` for a size beyond the
budget) naming the file and the member, node or tensor, and the fix.
"""

from __future__ import annotations

import json
import os
from typing import Union

import torch

from sparsecore.memory_budget import check_bytes

from .example_inputs import InputBounds, load_example_inputs
from .op_allowlist import check_allocations, check_targets
from .program_checks import check_program
from .program_strings import check_program_strings
from .strict_zip import ArchiveError, ArchiveMember, pack_archive, read_archive
from .tensor_metadata import check_payload_config

__all__ = ["load_program", "InputBounds"]

_MARKS = ("archive_format", "archive_version", "byteorder", ".data/version", ".data/serialization_id")
_GRAPH = "models/model.json"
_WEIGHTS_CONFIG, _CONSTANTS_CONFIG = "data/weights/model_weights_config.json", "data/constants/model_constants_config.json"
_INPUTS = "data/sample_inputs/model.pt"
_REQUIRED = (_GRAPH, _WEIGHTS_CONFIG, _CONSTANTS_CONFIG, _INPUTS, "archive_version", "archive_format")
_JSON_EXPANSION = 16  # bytes of Python objects per byte of JSON text: about 12 measured on graph-like JSON
_FIX = ("export the program again with sparsecore.torch (torch.export.save); load only files you trust with "
        "torch.export.load")


def _refuse(path: str, what: str) -> ValueError:
    return ValueError(f"load_program: {path} {what}; it is not loaded (torch.export.load would unpickle it "
                      "without restriction, which can run code). Load only files you trust with "
                      "torch.export.load, or export the program again with sparsecore.torch")


def _member_kind(name: str) -> str:
    """'mark', 'graph', 'config', 'weight', 'constant', 'inputs', 'extra', or '' for a member no sparsecore
    program has."""
    if name in _MARKS:
        return "mark"
    if name == _GRAPH:
        return "graph"
    if name in (_WEIGHTS_CONFIG, _CONSTANTS_CONFIG):
        return "config"
    if name == _INPUTS:
        return "inputs"
    if name.startswith("extra/") and name.count("/") == 1:
        return "extra"
    if name.startswith("data/weights/weight_") and name.count("/") == 2:
        return "weight"
    if name.startswith("data/constants/tensor_") and name.count("/") == 2:
        return "constant"
    return ""


def _layout(shown: str, members: tuple[ArchiveMember, ...]) -> tuple[str, dict[str, bytes]]:
    """The archive's root folder and its members by name below it, each of a kind a program has."""
    roots = {member.name.split("/", 1)[0] for member in members}
    if len(roots) != 1 or any("/" not in member.name for member in members):
        raise _refuse(shown, f"is not laid out as one .pt2 archive folder (top-level entries {sorted(roots)[:5]})")
    root = roots.pop() + "/"
    named = {member.name[len(root):]: member.data for member in members}
    for name in named:
        if not _member_kind(name):
            raise _refuse(shown, f"holds {name!r}, a member no sparsecore program has")
    missing = [name for name in _REQUIRED if name not in named]
    if missing:
        raise ValueError(f"load_program: {shown} lacks the members {missing} every torch.export.save archive "
                         f"holds (a truncated or hand-made archive); {_FIX}")
    return root, named


def _check_json_size(shown: str, name: str, data: bytes) -> None:
    """Parsed JSON takes several times its text in Python objects (here and again in torch): held to the budget."""
    check_bytes(_JSON_EXPANSION * len(data), f"load_program: parsing {shown}: {name} ({len(data)} bytes of JSON, "
                f"about {_JSON_EXPANSION} bytes of objects a byte)", "The file declares this size: check where it "
                "came from.")


def _check_graph(shown: str, data: bytes) -> None:
    where = f"load_program: {shown}: {_GRAPH}"
    _check_json_size(shown, _GRAPH, data)
    try:
        graph = json.loads(data)
        nodes = graph["graph_module"]["graph"]["nodes"]
    except (ValueError, KeyError, TypeError, RecursionError) as error:
        raise ValueError(f"{where} is not the graph JSON torch.export.save writes ({type(error).__name__}: "
                         f"{str(error)[:200]}); {_FIX}") from None
    if not isinstance(nodes, list) or not isinstance(graph, dict):
        raise ValueError(f"{where} holds no list of nodes; {_FIX}")
    check_targets(where, nodes)
    check_program_strings(where, graph)


def _first_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0][:300]}" if lines else type(error).__name__


def _deserialize(shown: str, members: list[ArchiveMember]) -> torch.export.ExportedProgram:
    from torch.export.pt2_archive._package import load_pt2

    try:
        contents = load_pt2(pack_archive(members))
        return contents.exported_programs["model"]
    except Exception as error:  # noqa: BLE001 - every failure of the deserializer is the file's
        raise ValueError(f"load_program: {shown}: torch cannot deserialize the checked archive "
                         f"({_first_line(error)}): the graph ({_GRAPH}) or a config was edited, or the file was "
                         f"written by another torch version; {_FIX}") from None


def load_program(path: Union[str, os.PathLike], *, max_bytes: int = 2**32,
                 input_bounds: InputBounds = InputBounds()) -> torch.export.ExportedProgram:
    """A ``torch.export`` program from ``path``, a file made elsewhere, loaded without running code from it.

    Args:
        path: a ``.pt2`` file written by ``torch.export.save``.
        max_bytes: the most bytes the file, and its members once uncompressed (together), may hold; the
            members are also held to the memory budget (`sparsecore.memory_budget`).
        input_bounds: the most the example inputs may hold (nesting depth, leaves, tensor bytes).

    Returns:
        The ``torch.export.ExportedProgram``, as ``torch.export.load(path)`` gives it for a valid file.

    Raises:
        ValueError: naming the member, node or tensor and the fix: a file larger than ``max_bytes``, not a
            strict zip archive, a member no sparsecore program has or that would be unpickled without
            restriction, tensor metadata that disagree with the stored bytes, an operator outside
            `op_allowlist.ALLOWED`, a string torch would evaluate that is not a plain size expression, guard
            or name (`program_strings`), example inputs beyond ``input_bounds``, or sparsecore ops that
            disagree with each other or with the stored weights.
        MemoryBudgetError: the members, or a size the graph fixes, beyond the memory budget.
    """
    shown = os.fspath(path)
    size = os.path.getsize(path)
    if size > max_bytes:
        raise ValueError(f"load_program: {shown} has {size} bytes, more than max_bytes={max_bytes}; "
                         "pass a larger max_bytes for a program you expect to be that large")
    with open(path, "rb") as file:
        data = file.read(size + 1)  # read(n) allocates n bytes first: the file's size, not max_bytes
    if len(data) != size:
        raise ValueError(f"load_program: {shown} changed size while being read ({size} bytes, then {len(data)}); "
                         "load it again once it is written")

    def check_total(total: int) -> None:
        check_bytes(total, f"load_program: unpacking {shown} ({total} bytes declared by its members)",
                    "The file declares this size: check where it came from.")

    try:
        members = read_archive(data, max_member_bytes=max_bytes, max_total_bytes=max_bytes, check_total=check_total)
    except ArchiveError as error:
        raise ValueError(f"load_program: {shown} is not a .pt2 archive that reads one way only ({error}); "
                         f"{_FIX}") from None
    del data
    root, named = _layout(shown, members)
    for config, folder, prefix in ((_WEIGHTS_CONFIG, "data/weights/", "weight_"),
                                   (_CONSTANTS_CONFIG, "data/constants/", "tensor_")):
        records = {name[len(folder):]: len(value) for name, value in named.items()
                   if name.startswith(folder + prefix)}
        _check_json_size(shown, config, named[config])
        check_payload_config(f"load_program: {shown}: {config}", named[config], records)
    _check_graph(shown, named[_GRAPH])
    named[_INPUTS] = load_example_inputs(f"load_program: {shown}: {_INPUTS}", named[_INPUTS], input_bounds,
                                         max_bytes)
    checked = [ArchiveMember(root + name, value) for name, value in named.items()]
    del members, named
    program = _deserialize(shown, checked)
    check_program(program, shown)
    check_allocations(f"load_program: {shown}", program)
    return program
