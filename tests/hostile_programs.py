"""Hostile ``.pt2`` files for sparsecore.torch.load_program: each a file on disk and what a safe loader does.

Every case starts from one valid program exported from a small sparsecore model
(subm conv + BatchNorm + ReLU, a strided conv, ``.dense()``) and changes one thing,
by the classes of issue 39: code execution (a second archive whose example inputs
would run a command; a pickle in the example inputs; Python in a symbolic size,
a guard or an argument name, which torch evaluates), file access by the graph
(``aten.from_file``, in-place ``fill_``), hangs and memory (a DAG of shared tuples,
a deflated member of 3.5 GiB, a ``new_zeros`` of 11.8 GB), silent edits (a flipped
weight byte, strides of 0, float32 bytes read as float16, swapped weight records (BatchNorm weight and bias too),
a conv reading another rulebook's pairs, a grid the file declares) and obscure
failures (a truncated file, broken JSON, a dangling node name). A case expects an
error (its type and a pattern naming the member, node or tensor) or, for the valid
file, the eager model's answer. `CHILD` loads them all in one process under an
address-space cap; nothing a case holds may run, so one process is safe to share:
an escape would show as the marker file appearing. Last, it loads twins of the
two-archive file and of the symbolic-size injection (other markers) with
``torch.export.load``, whose markers must appear: the oracle that the cases are
exploits.
"""

from __future__ import annotations

import io
import json
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = ["CHILD", "write_program_cases", "two_archives", "sympy_injection"]

CHILD = r'''
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]), int(sys.argv[2])))
import numpy as np
import torch
import sparsecore.torch as spconv
from sparsecore.memory_budget import MemoryBudgetError
cases = json.load(open(sys.argv[1]))
data = np.load(cases["input"])
x = spconv.SparseConvTensor(torch.from_numpy(data["features"]), torch.from_numpy(data["indices"]),
                            data["shape"].tolist(), int(data["batch"]))
for case in cases["cases"]:
    record = {"name": case["name"]}
    start = time.perf_counter()
    try:
        program = spconv.load_program(case["file"])
        with torch.no_grad():
            out = program.module()(x)
        np.save(case["output"], out.numpy())
        record["outcome"] = "ran"
    except BaseException as error:
        raw_memory = isinstance(error, MemoryError) and not isinstance(error, MemoryBudgetError)
        record.update(outcome="error", type=type(error).__name__, message=str(error), raw_memory=raw_memory)
    record["seconds"] = time.perf_counter() - start
    record["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps(record), flush=True)
# the oracle that the two-archive case is real: torch.export.load on a twin file (another marker) runs its code
import logging, os
logging.disable(logging.CRITICAL)
for oracle in cases["torch_oracles"]:
    try:
        torch.export.load(oracle["file"])
    except Exception:
        pass
    print(json.dumps({"name": oracle["name"], "marker": os.path.exists(oracle["marker"])}), flush=True)
'''


def _members(path: Path) -> list[tuple[zipfile.ZipInfo, bytes]]:
    with zipfile.ZipFile(path) as source:
        return [(info, source.read(info)) for info in source.infolist()]


def _write(target: Path, members: list[tuple[str, bytes]]) -> Path:
    with zipfile.ZipFile(target, "w") as out:
        for name, data in members:
            out.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)
    return target


def _edit(source: Path, target: Path, suffix: str, change: Callable[[bytes], bytes]) -> Path:
    """A copy of the archive with the member ending in ``suffix`` changed (its CRC recomputed: a consistent edit)."""
    return _write(target, [(info.filename, change(data) if info.filename.endswith(suffix) else data)
                           for info, data in _members(source)])


def _json_edit(change: Callable[[Any], None]) -> Callable[[bytes], bytes]:
    def edit(data: bytes) -> bytes:
        value = json.loads(data)
        change(value)
        return json.dumps(value).encode()
    return edit


def _nodes(graph: Any) -> list:
    return graph["graph_module"]["graph"]["nodes"]


def _first(graph: Any, target: str) -> dict:
    return next(node for node in _nodes(graph) if node["target"] == target)


def _argument(node: dict, name: str) -> dict:
    return next(entry for entry in node["inputs"] if entry["name"] == name)


def _pickled_inputs(marker: Path) -> bytes:
    """Example inputs whose unpickling would create ``marker`` (what a crafted file could run instead)."""
    import pathlib

    import torch

    class RunsCode:
        def __reduce__(self):
            return (pathlib.Path.touch, (marker,))

    buffer = io.BytesIO()
    torch.save(((RunsCode(),), {}), buffer)
    return buffer.getvalue()


def _dag_inputs(levels: int) -> bytes:
    import torch

    value: Any = torch.ones(2)
    for _ in range(levels):
        value = (value, value)
    buffer = io.BytesIO()
    torch.save(((value,), {}), buffer)
    return buffer.getvalue()


def _bomb(target: Path, source: Path, gib: float) -> Path:
    """The archive with an extra deflated member declaring ``gib`` GiB of zeros (about a MiB on disk). Its CRC is
    not computed (2 s more): the loader must refuse it on the declared size, before inflating or checking it."""
    chunk = bytes(2**20)
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = compressor.compress(chunk) + compressor.flush(zlib.Z_FULL_FLUSH)  # same bytes for every chunk
    count = int(gib * 1024)
    stream = block * count + compressor.flush()
    root = _members(source)[0][0].filename.split("/")[0]
    target.write_bytes(source.read_bytes())
    return _append_raw_member(target, f"{root}/extra/bomb", stream, count * 2**20)


def _append_raw_member(path: Path, name: str, raw: bytes, size: int) -> Path:
    """Rewrites ``path`` with one more member ``name`` holding the deflated bytes ``raw`` that declare ``size``."""
    entries = [entry for entry in _members_raw(path) if entry[0].filename != name]
    path.write_bytes(_raw_archive(entries + [(zipfile.ZipInfo(name), raw, 8, 0x12345678, size)]))
    return path


def _raw_archive(entries: list) -> bytes:
    """A zip64 archive, as torch writes them (zip64 end record and locator), of ``(info, bytes, method, crc,
    size)`` entries, written by hand (zipfile would compute what a hostile file declares)."""
    out = io.BytesIO()
    central = []
    for info, data, method, crc, usize in entries:
        encoded = info.filename.encode()
        extra = struct.pack("<HHQQ", 1, 16, usize, len(data))
        offset = out.tell()
        out.write(struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 45, 0, method, 0, 0x21, crc, 0xFFFFFFFF,
                              0xFFFFFFFF, len(encoded), len(extra)) + encoded + extra + data)
        central.append(struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 45, 45, 0, method, 0, 0x21, crc,
                                   0xFFFFFFFF, 0xFFFFFFFF, len(encoded), len(extra) + 8, 0, 0, 0, 0, 0xFFFFFFFF)
                       + encoded + struct.pack("<HHQQQ", 1, 24, usize, len(data), offset))
    start = out.tell()
    out.write(b"".join(central))
    size_central = out.tell() - start
    zip64_at = out.tell()
    count = len(central)
    out.write(struct.pack("<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count, size_central, start))
    out.write(struct.pack("<4sIQI", b"PK\x06\x07", 0, zip64_at, 1))
    out.write(struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0))
    return out.getvalue()


def _members_raw(path: Path) -> list:
    with zipfile.ZipFile(path) as source:
        return [(info, source.read(info), 0, zlib.crc32(source.read(info)), info.file_size)
                for info in source.infolist()]


def _flip_weight_byte(source: Path, target: Path) -> Path:
    """One byte of a stored weight flipped in place: the member's CRC-32 no longer matches."""
    data = bytearray(source.read_bytes())
    with zipfile.ZipFile(source) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("data/weights/weight_0"))
    name_length, extra_length = struct.unpack_from("<HH", data, info.header_offset + 26)
    data[info.header_offset + 30 + name_length + extra_length + 5] ^= 0x40
    target.write_bytes(bytes(data))
    return target


def two_archives(source: Path, target: Path, marker: Path) -> Path:
    """A malicious archive E (example inputs that would create ``marker``), then the benign archive B whose zip64
    locator points at E's zip64 end record. Python's zipfile reads B (it takes the zip64 record just before the
    locator), torch's reader follows the locator's offset and reads E, whose example inputs torch.export.load
    unpickles without restriction once weights_only=True refuses them."""
    entries = []
    for info, data in _members(source):
        data = _pickled_inputs(marker) if info.filename.endswith("sample_inputs/model.pt") else data
        entries.append((info, data, 0, zlib.crc32(data), len(data)))
    evil = _raw_archive(entries)
    benign = bytearray(source.read_bytes())
    locator = len(benign) - 22 - 20
    struct.pack_into("<Q", benign, locator + 8, len(evil) - 22 - 20 - 56)
    target.write_bytes(evil + bytes(benign))
    return target


def _sympy_injection(graph: Any, code: str) -> None:
    """The first symbolic size's expression made to run ``code`` (torch parses it with sympy.sympify: eval)."""
    values = graph["graph_module"]["graph"]["sym_int_values"]
    entry = values[next(iter(values))]["as_expr"]
    entry["expr_str"] = f"{code} or {entry['expr_str']}"


def sympy_injection(source: Path, target: Path, marker: Path) -> Path:
    """The program with a symbolic size that creates ``marker`` when torch deserializes it."""
    touch = f"__import__('pathlib').Path('{marker}').touch()"
    return _edit(source, target, "models/model.json", _json_edit(lambda g: _sympy_injection(g, touch)))


def write_program_cases(source: Path, folder: Path, marker: Path) -> list[tuple[str, str, Optional[tuple[str, str]]]]:
    """Writes every hostile variant of the valid program ``source``; returns ``(name, file, (type, pattern))``,
    the pattern None for the valid file."""
    cases: list[tuple[str, str, Optional[tuple[str, str]]]] = []
    loaded = "load_program: .*{}"

    def add(name: str, path: Path, error: Optional[tuple[str, str]]) -> None:
        cases.append((name, str(path), error))

    def graph(name: str, change: Callable[[Any], None], error: tuple[str, str]) -> None:
        add(name, _edit(source, folder / f"{name}.pt2", "models/model.json", _json_edit(change)), error)

    def weights(name: str, change: Callable[[Any], None], error: tuple[str, str]) -> None:
        add(name, _edit(source, folder / f"{name}.pt2", "model_weights_config.json", _json_edit(change)), error)

    add("valid", source, None)
    add("two_archives", two_archives(source, folder / "two_archives.pt2", marker),
        ("ValueError", "not a .pt2 archive that reads one way only .*second archive"))
    add("pickled_inputs", _edit(source, folder / "pickled_inputs.pt2", "data/sample_inputs/model.pt",
                                lambda _: _pickled_inputs(marker)),
        ("ValueError", "data/sample_inputs/model.pt: holds example inputs that torch.load\\(weights_only=True\\) "
                       "refuses"))
    add("shared_tuple_dag_100", _edit(source, folder / "dag100.pt2", "data/sample_inputs/model.pt",
                                      lambda _: _dag_inputs(100)),
        ("ValueError", "data/sample_inputs/model.pt: the example inputs nest deeper than 32 levels"))
    add("shared_tuple_dag_30", _edit(source, folder / "dag30.pt2", "data/sample_inputs/model.pt",
                                     lambda _: _dag_inputs(28)),
        ("ValueError", "data/sample_inputs/model.pt: the example inputs hold more than 10000 leaves"))
    add("zip_bomb_member", _bomb(folder / "bomb.pt2", source, 3.5),
        ("MemoryBudgetError", "unpacking .*bomb.pt2 \\(37[0-9]{8} bytes declared.*more than the memory budget"))
    add("flipped_weight_byte", _flip_weight_byte(source, folder / "flipped.pt2"),
        ("ValueError", "member '[^']*data/weights/weight_0' fails its CRC-32 check"))
    raw = source.read_bytes()
    (folder / "truncated.pt2").write_bytes(raw[:len(raw) * 2 // 3])
    add("truncated", folder / "truncated.pt2", ("ValueError", "no zip end record ends at the file's end"))
    (folder / "prefixed.pt2").write_bytes(b"#!/bin/sh\n" + raw)
    add("bytes_before_members", folder / "prefixed.pt2", ("ValueError", "nothing accounts for"))
    graph("from_file", lambda g: _first(g, "torch.ops.aten.relu.default").update(
        target="torch.ops.aten.from_file.default"),
        ("ValueError", "node 'relu' calls 'torch.ops.aten.from_file.default'.*reads or writes files"))
    graph("fill_in_place", lambda g: _first(g, "torch.ops.aten.relu.default").update(
        target="torch.ops.aten.fill_.Scalar"), ("ValueError", "node 'relu' calls 'torch.ops.aten.fill_.Scalar'.*in place"))
    graph("new_zeros_11_8_gb", lambda g: _argument(_first(g, "torch.ops.aten.new_zeros.default"), "size").update(
        arg={"as_ints": [1, 8, 1100, 1100, 305]}),
        ("MemoryBudgetError", "node 'new_zeros' \\(aten.new_zeros.default\\) allocating its size argument "
                              "\\[1, 8, 1100, 1100, 305\\].*more than the memory budget"))

    def other_pairs(g: Any) -> None:
        convs = [n for n in _nodes(g) if n["target"] == "torch.ops.sparsecore.export_conv.default"]
        _argument(convs[1], "pair_output")["arg"] = _argument(convs[0], "pair_output")["arg"]
    graph("pairs_of_another_rulebook", other_pairs,
          ("ValueError", "node 'export_conv_1' \\(export_conv\\) reads pair tensors of several rulebooks"))
    graph("grid_declared_by_the_file", lambda g: _argument(
        _first(g, "torch.ops.sparsecore.export_rulebook.default"), "spatial_shape").update(
        arg={"as_ints": [8, 8, 8]}),
        ("ValueError", "node 'export_rulebook' \\(export_rulebook\\) declares spatial_shape \\[8, 8, 8\\] for the "
                       "sites 'x_indices', whose grid is \\[24, 24, 24\\].*the grid is the file's"))
    graph("dangling_name", lambda g: _argument(_first(g, "torch.ops.aten.relu.default"), "self").update(
        arg={"as_tensor": {"name": "nowhere"}}),
        ("ValueError", "torch cannot deserialize the checked archive \\(.*\\): the graph \\(models/model.json\\)"))
    touch = f"__import__('pathlib').Path('{marker}').touch()"
    graph("sympy_expression_runs_code", lambda g: _sympy_injection(g, touch),
          ("ValueError", "sym_int_values.sym_size_int_[0-9]+.as_expr.expr_str holds .*torch would run it as Python"))
    graph("guard_runs_code", lambda g: g["guards_code"].append(f"{touch} is None"),
          ("ValueError", "guards_code\\[[0-9]+\\] .* calls .*a guard calls only"))
    graph("forward_argument_name_runs_code", lambda g: g["graph_module"]["module_call_graph"][0]["signature"].update(
        forward_arg_names=[f"x={touch}"]), ("ValueError", "has the forward argument name .*not an identifier"))
    add("broken_json", _edit(source, folder / "broken_json.pt2", "models/model.json", lambda data: data[:-40]),
        ("ValueError", "models/model.json is not the graph JSON torch.export.save writes \\(JSONDecodeError"))

    def meta(key: str) -> Callable[[Any], dict]:
        return lambda config: config["config"][key]["tensor_meta"]
    first_weight = "0.weight"
    weights("zero_strides", lambda c: meta(first_weight)(c).update(strides=[{"as_int": 0}] * 5),
            ("ValueError", "model_weights_config.json gives '0.weight' the stride 0 on axis 0"))
    weights("float32_as_float16", lambda c: meta(first_weight)(c).update(dtype=6),
            ("ValueError", "model_weights_config.json reads [0-9]+ of the [0-9]+ torch.float16 elements of the "
                           "record 'weight_0'"))

    def swap(config: Any) -> None:
        entries = config["config"]
        entries["0.weight"]["path_name"], entries["0.bias"]["path_name"] = \
            entries["0.bias"]["path_name"], entries["0.weight"]["path_name"]
    weights("swapped_weight_records", swap, ("ValueError", "model_weights_config.json gives '0.weight' the record "
                                                           "'weight_1' where torch.export.save writes 'weight_0'"))

    def swap_batch_norm(config: Any) -> None:  # same shape and dtype: only the records' numbering tells
        entries = config["config"]
        entries["1.weight"]["path_name"], entries["1.bias"]["path_name"] = \
            entries["1.bias"]["path_name"], entries["1.weight"]["path_name"]
    weights("swapped_batch_norm_weight_and_bias", swap_batch_norm,
            ("ValueError", "gives '1.weight' the record 'weight_[0-9]+' where torch.export.save writes"))
    weights("empty_record_zeros", lambda c: c["config"].update(
        ghost={**c["config"]["0.bias"], "path_name": "weight_0", "tensor_meta": {
            **meta("0.bias")(c), "sizes": [{"as_int": 3 * 10**9}]}}),
        ("ValueError", "views 'ghost' as sizes \\[3000000000\\].*past the end of its record 'weight_0'"))
    for index, (name, file, error) in enumerate(cases):
        if error is not None:
            cases[index] = (name, file, (error[0], loaded.format("") + error[1]))
    return cases
