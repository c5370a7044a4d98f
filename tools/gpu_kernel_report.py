"""Compile time and resources of every registered CUDA kernel: per file, per instantiation.

    python tools/gpu_kernel_report.py [--arch sm_90] [--files a.cu,b.cu] [--json PATH] [--output PATH]
    python tools/gpu_kernel_report.py --sass sm_90 [--files implicit_gemm.cu] [--match __half]

Two sources, each used where it can run:

- **NVRTC** (no GPU needed: the ``nvidia-cuda-nvrtc`` wheel through
  ``cupy_backends``): each file of `kernel_registry.KERNEL_FILES` is compiled
  exactly as the backend hands it to CuPy (same text, options and name
  expressions) for ``--arch`` (default ``sm_90``, the H100/H200) with
  ``--ptxas-options=-v``, timed from an empty start; NVRTC's own ptxas then
  reports, per instantiation, registers, barriers, static shared memory,
  stack frame and spill stores/loads, and the cubin's size. With a
  ``compute_XX`` architecture NVRTC stops at PTX: seconds and PTX size only.
- **The GPU** (when CuPy sees one, or ``--device cuda``): the cold compile
  of each file through `kernel_registry.load_module` (CuPy's NVRTC and module
  load) with ``CUPY_CACHE_DIR`` pointing at an empty folder (``--cache-dir``;
  later processes that set the same folder reuse the compiled kernels), then
  per instantiation ``RawKernel.attributes``: ``num_regs``,
  ``shared_size_bytes``, ``local_size_bytes`` (spills and local arrays),
  ``max_threads_per_block``. On a GPU the NVRTC pass is skipped unless
  ``--nvrtc`` asks for it (the attributes say the same, and the device's
  minutes are few).

- **The SASS** (``--sass sm_XX``, sm_75 to sm_90; no GPU needed): the
  NVRTC pass for that architecture keeps its cubin, ``cuobjdump -sass`` reads
  it (`gpu_sass`: the ``nvidia-cuda-cuobjdump`` and ``nvidia-cuda-nvdisasm``
  wheels or a toolkit; when absent the report says how to install them), and
  per instantiation it prints the global loads by width, ``LDGSTS``, shared
  loads and ``LDSM``, ``HMMA``, ``FFMA`` / ``DFMA``, local accesses, and the
  theoretical occupancy on an H100 (`gpu_occupancy`: blocks per SM from
  registers, static shared memory and threads per block; the threads from the
  kernel's ``__launch_bounds__`` when it has them, else the backend's engine
  sizes, else ``--threads``). ``--kernels-dir`` compiles another copy of
  ``kernels_cu/`` (e.g. an older commit's, ``git archive``) with the
  registry's name expressions: before and after of a kernel edit.

The JSON (``--json``) and the text (``--output``) are rewritten after every
file, so a run stopped by its time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_occupancy import Occupancy  # noqa: E402
from gpu_sass import INSTALL_HINT, DisassemblerMissing, SassCounts, find_cuobjdump  # noqa: E402
from gpu_sass_report import format_sass, sass_report  # noqa: E402

__all__ = ["InstantiationReport", "FileReport", "parse_ptxas_log", "nvrtc_report", "compile_file",
           "kernel_source", "device_report", "format_reports", "main"]

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_USED = re.compile(r"Used (\d+) registers")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SMEM = re.compile(r"(\d+) bytes smem")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)
_SASS_ARCH = re.compile(r"sm_(\d+)a?")
_ATTRIBUTES = ("num_regs", "shared_size_bytes", "local_size_bytes", "max_threads_per_block", "const_size_bytes")


@dataclass
class InstantiationReport:
    """What is known of one name expression (None: not measured).

    Attributes:
        expression: the NVRTC name expression, e.g. ``"sc_gather_rows<float>"``.
        lowered: its mangled name.
        registers: registers per thread (ptxas).
        barriers: named barriers used (ptxas).
        shared_bytes: static shared memory per block (ptxas).
        stack_bytes: stack frame per thread (ptxas).
        spill_store_bytes: bytes spilled (stores) per thread (ptxas).
        spill_load_bytes: bytes reloaded from spills per thread (ptxas).
        device: ``RawKernel.attributes`` on the GPU (the keys of `_ATTRIBUTES`).
        threads: threads per block the occupancy assumes (``--sass``).
        threads_source: where that number came from.
        sass: static instruction counts of its SASS (``--sass``).
        occupancy: on an H100 (``--sass``), from registers, static shared memory and ``threads``.
    """

    expression: str
    lowered: str | None = None
    registers: int | None = None
    barriers: int | None = None
    shared_bytes: int | None = None
    stack_bytes: int | None = None
    spill_store_bytes: int | None = None
    spill_load_bytes: int | None = None
    device: dict[str, int] = field(default_factory=dict)
    threads: int | None = None
    threads_source: str | None = None
    sass: SassCounts | None = None
    occupancy: Occupancy | None = None


@dataclass
class FileReport:
    """One kernel file.

    Attributes:
        file: its name.
        arch: the NVRTC architecture of the offline compile.
        nvrtc_seconds: NVRTC compile time (with ptxas for an ``sm_XX`` arch), None when not run.
        binary_bytes: size of the cubin (``sm_XX``) or PTX (``compute_XX``).
        device_cold_seconds: CuPy's compile and load on the GPU from an empty cache, None when not run.
        instantiations: per name expression.
        error: what failed, if anything.
    """

    file: str
    arch: str
    nvrtc_seconds: float | None = None
    binary_bytes: int | None = None
    device_cold_seconds: float | None = None
    instantiations: list[InstantiationReport] = field(default_factory=list)
    error: str | None = None


def parse_ptxas_log(log: str) -> dict[str, dict[str, int]]:
    """``lowered entry name -> {registers, barriers, shared_bytes, stack_bytes, spill_store_bytes,
    spill_load_bytes}`` from the log of ``ptxas -v`` (or NVRTC's ``--ptxas-options=-v``)."""
    entries: dict[str, dict[str, int]] = {}
    current: dict[str, int] | None = None
    name = described = None  # the entry being compiled; the function the last "Function properties for"
    # line named (a callee's properties come too)
    for line in log.splitlines():
        entry = _ENTRY.search(line)
        if entry:
            current, name = entries.setdefault(entry.group(1), {}), entry.group(1)
            continue
        properties = _PROPERTIES.search(line)
        if properties:
            described = properties.group(1)
            continue
        if current is None:
            continue
        frame = _FRAME.search(line)
        if frame and described == name:
            current.update(stack_bytes=int(frame.group(1)), spill_store_bytes=int(frame.group(2)),
                           spill_load_bytes=int(frame.group(3)))
        used = _USED.search(line)
        if used:
            current["registers"] = int(used.group(1))
            barriers, smem = _BARRIERS.search(line), _SMEM.search(line)
            current["barriers"] = int(barriers.group(1)) if barriers else 0
            current["shared_bytes"] = int(smem.group(1)) if smem else 0
    return entries


def kernel_source(file: str, kernels_dir: Path | None = None) -> str:
    """A kernel file's text as NVRTC gets it: the registry's, or read from ``kernels_dir`` with its local
    ``#include "x.cuh"`` lines inlined (each header once) the way the registry inlines them."""
    from sparsecore.backends import kernel_registry

    if kernels_dir is None:
        return kernel_registry.kernel_source(file)
    seen: set[str] = set()

    def expand(name: str) -> str:
        seen.add(name)
        path = Path(kernels_dir) / name
        if not path.is_file():
            raise FileNotFoundError(f"--kernels-dir {kernels_dir} has no {name}")
        text = path.read_text(encoding="utf-8")
        return _LOCAL_INCLUDE.sub(lambda match: "" if match.group(1) in seen else expand(match.group(1)), text)

    return expand(file)


def compile_file(file: str, arch: str, kernels_dir: Path | None = None) -> tuple[FileReport, bytes | None]:
    """Compiles one registered file through NVRTC for ``arch`` (``sm_XX``: with ptxas' report).

    Returns:
        The report and the cubin (``sm_XX``; None for ``compute_XX`` or a failed compile).
    """
    from cupy_backends.cuda.libs import nvrtc

    from sparsecore.backends import kernel_registry

    entry = kernel_registry.kernel_file(file)
    report = FileReport(file, arch, instantiations=[InstantiationReport(e) for e in entry.name_expressions])
    machine_code = arch.startswith("sm_")
    options = list(kernel_registry.nvrtc_options(
        (f"-arch={arch}",) + (("--ptxas-options=-v",) if machine_code else ()), tensor_cores=entry.tensor_cores))
    started = time.perf_counter()
    program = nvrtc.createProgram(kernel_source(file, kernels_dir), file, [], [])
    try:
        for expression in entry.name_expressions:
            nvrtc.addNameExpression(program, expression)
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as error:
            report.error = f"NVRTC: {error}: {nvrtc.getProgramLog(program)[-2000:]}"
            return report, None
        binary = nvrtc.getCUBIN(program) if machine_code else nvrtc.getPTX(program)
        report.nvrtc_seconds = time.perf_counter() - started
        report.binary_bytes = len(binary)
        resources = parse_ptxas_log(nvrtc.getProgramLog(program)) if machine_code else {}
        for item in report.instantiations:
            item.lowered = nvrtc.getLoweredName(program, item.expression)
            for name, value in resources.get(item.lowered, {}).items():
                setattr(item, name, value)
    finally:
        nvrtc.destroyProgram(program)
    return report, (bytes(binary) if machine_code else None)


def nvrtc_report(file: str, arch: str, kernels_dir: Path | None = None) -> FileReport:
    """Compiles one registered file through NVRTC for ``arch`` (``sm_90``: with ptxas' report)."""
    return compile_file(file, arch, kernels_dir)[0]


def device_report(report: FileReport, device_id: int = 0) -> None:
    """Adds the GPU's cold compile time and ``RawKernel.attributes`` to ``report`` (CuPy, a visible GPU)."""
    from sparsecore.backends import kernel_registry

    started = time.perf_counter()
    try:
        module = kernel_registry.load_module(report.file, device_id)
    except Exception as error:  # keep the other files going
        report.error = f"{report.error + '; ' if report.error else ''}GPU compile: {type(error).__name__}: {error}"
        return
    report.device_cold_seconds = time.perf_counter() - started
    for item in report.instantiations:
        try:
            attributes = module.get_function(item.expression).attributes
        except Exception as error:
            report.error = f"{report.error + '; ' if report.error else ''}{item.expression}: {error}"
            continue
        item.device = {name: int(attributes[name]) for name in _ATTRIBUTES if name in attributes}


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _rounded(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_reports(reports: list[FileReport], header: str) -> str:
    """The text table: per file its times and size, then one line per instantiation."""
    lines = [header, "",
             f"{'file':<22} {'NVRTC s':>8} {'binary KiB':>10} {'GPU cold s':>10}  instantiations",
             f"{'-' * 22} {'-' * 8} {'-' * 10} {'-' * 10}  {'-' * 14}"]
    for report in reports:
        lines.append(f"{report.file:<22} {_rounded(report.nvrtc_seconds):>8} "
                     f"{_rounded(None if report.binary_bytes is None else report.binary_bytes / 1024, 1):>10} "
                     f"{_rounded(report.device_cold_seconds):>10}  "
                     f"{len(report.instantiations)}" + (f"  ERROR {report.error}" if report.error else ""))
    nvrtc_times = [report.nvrtc_seconds for report in reports if report.nvrtc_seconds is not None]
    device_times = [report.device_cold_seconds for report in reports if report.device_cold_seconds is not None]
    lines.append(f"{'total':<22} {_rounded(sum(nvrtc_times) if nvrtc_times else None):>8} {'':>10} "
                 f"{_rounded(sum(device_times) if device_times else None):>10}")
    lines += ["", f"{'instantiation':<52} {'regs':>4} {'smem B':>7} {'stack B':>7} {'spill st/ld B':>13} "
              f"{'bar':>3} | GPU: {'regs':>4} {'smem B':>7} {'local B':>7} {'max thr':>7}"]
    for report in reports:
        for item in report.instantiations:
            spill = ("-" if item.spill_store_bytes is None
                     else f"{item.spill_store_bytes}/{item.spill_load_bytes}")
            device = item.device
            lines.append(
                f"{item.expression[:52]:<52} {_cell(item.registers):>4} {_cell(item.shared_bytes):>7} "
                f"{_cell(item.stack_bytes):>7} {spill:>13} {_cell(item.barriers):>3} | "
                f"     {_cell(device.get('num_regs')):>4} {_cell(device.get('shared_size_bytes')):>7} "
                f"{_cell(device.get('local_size_bytes')):>7} {_cell(device.get('max_threads_per_block')):>7}")
    spilled = [item.expression for report in reports for item in report.instantiations
               if (item.spill_store_bytes or 0) > 0 or item.device.get("local_size_bytes", 0) > 0]
    lines.append("")
    lines.append(f"instantiations with spills or local memory: {', '.join(spilled) if spilled else 'none'}")
    return "\n".join(lines)


def gpu_visible() -> bool:
    """Whether CuPy imports and sees a CUDA device (False on any failure: no CuPy, no driver, no device)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90", help="NVRTC architecture of the offline compile: sm_90 "
                        "(with ptxas' resource report), sm_80, compute_90 (PTX only)...")
    parser.add_argument("--files", default="", help="comma-separated kernel files (default: every registered one)")
    parser.add_argument("--device", choices=("auto", "cuda", "none"), default="auto",
                        help="measure on the GPU too: auto (when CuPy sees one), cuda, none")
    parser.add_argument("--nvrtc", action="store_true", help="on a GPU, run the offline NVRTC pass as well")
    parser.add_argument("--cache-dir", help="CUPY_CACHE_DIR for the GPU's cold compile (default: a new "
                        "empty temporary folder); it must be empty for cold times")
    parser.add_argument("--json", metavar="PATH", help="write the reports as JSON (after every file)")
    parser.add_argument("--output", metavar="PATH", help="write the text report (after every file)")
    parser.add_argument("--sass", metavar="sm_XX", help="compile for this architecture (sm_75 .. sm_90) and "
                        "summarise each instantiation's SASS and H100 occupancy (needs cuobjdump: "
                        "pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")
    parser.add_argument("--match", default="", help="with --sass: only instantiations whose expression holds "
                        "this text in the SASS table, e.g. '__half, sc::Wmma'")
    parser.add_argument("--threads", type=int, help="with --sass: threads per block for the occupancy "
                        "(default: the kernel's __launch_bounds__, else the backend's engine sizes)")
    parser.add_argument("--kernels-dir", type=Path, help="compile the kernel files of this folder instead of "
                        "the installed ones (the registry's name expressions), e.g. an older commit's "
                        "kernels_cu/ from git archive")
    args = parser.parse_args(argv)
    if args.sass:
        match = _SASS_ARCH.fullmatch(args.sass)
        if match is None or not 75 <= int(match.group(1)) <= 120:
            parser.error(f"--sass takes an architecture sm_75 .. sm_90 (e.g. sm_90), got {args.sass!r}")
        args.arch = args.sass
        disassembler = find_cuobjdump()
        if disassembler is None:
            print(f"gpu_kernel_report --sass: {INSTALL_HINT}", file=sys.stderr)
            return 2
    if args.kernels_dir is not None and not args.kernels_dir.is_dir():
        parser.error(f"--kernels-dir must be a folder of kernel files, got {args.kernels_dir}")

    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="sparsecore-cold-cache-")
    os.environ["CUPY_CACHE_DIR"] = cache_dir  # before CuPy compiles anything
    from sparsecore.backends import kernel_registry

    files = [name for name in args.files.split(",") if name] or [entry.file for entry in kernel_registry.KERNEL_FILES]
    on_gpu = args.device == "cuda" or (args.device == "auto" and gpu_visible())
    run_nvrtc = not on_gpu or args.nvrtc or bool(args.sass)
    cached = [path for path in Path(cache_dir).rglob("*") if path.is_file()]
    gpu_pass = (f"on (CUPY_CACHE_DIR={cache_dir}, {'NOT EMPTY: not cold' if cached else 'empty'})" if on_gpu
                else "off (no GPU)")
    header = (f"kernel report: {len(files)} files; NVRTC pass {'for ' + args.arch if run_nvrtc else 'skipped'}; "
              f"GPU pass {gpu_pass}; CUDA headers: {kernel_registry.cuda_include_dir()}"
              + (f"; sources from {args.kernels_dir}" if args.kernels_dir else ""))
    reports: list[FileReport] = []
    for file in files:
        cubin = None
        try:
            if run_nvrtc:
                report, cubin = compile_file(file, args.arch, args.kernels_dir)
            else:
                expressions = kernel_registry.kernel_file(file).name_expressions
                report = FileReport(file, args.arch, instantiations=[InstantiationReport(e) for e in expressions])
        except Exception as error:  # a missing file or NVRTC: report it, go on
            report = FileReport(file, args.arch, error=f"{type(error).__name__}: {error}")
        if args.sass and cubin is not None:
            try:
                sass_report(report, cubin, args.threads)
            except (DisassemblerMissing, RuntimeError, OSError) as error:
                report.error = f"{report.error + '; ' if report.error else ''}SASS: {error}"
        if on_gpu:
            device_report(report)
        reports.append(report)
        text = format_reports(reports, header)
        if args.sass:
            text += "\n\n" + format_sass(reports, args.arch, args.match)
        if args.output:
            Path(args.output).write_text(text + "\n", encoding="utf-8")
        if args.json:
            Path(args.json).write_text(json.dumps({"header": header, "files": [asdict(item) for item in reports]},
                                                  indent=1) + "\n", encoding="utf-8")
        print(f"[kernel report] {file}: NVRTC {_rounded(report.nvrtc_seconds)} s, "
              f"GPU {_rounded(report.device_cold_seconds)} s"
              + (f", ERROR {report.error}" if report.error else ""), file=sys.stderr, flush=True)
    print(format_reports(reports, header))
    if args.sass:
        print()
        print(format_sass(reports, args.arch, args.match))
    return 1 if any(report.error for report in reports) else 0


if __name__ == "__main__":
    raise SystemExit(main())
