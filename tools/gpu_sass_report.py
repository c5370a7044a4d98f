"""The ``--sass`` part of `gpu_kernel_report`: per instantiation its SASS counts, threads and H100 occupancy.

`sass_report` disassembles one file's cubin (`gpu_sass.disassemble`), reads each
function's ``__launch_bounds__`` from ``cuobjdump -elf`` (`parse_elf_threads`),
and sets on every instantiation of the report its `gpu_sass.SassCounts`, the
threads per block the occupancy assumes (`threads_of`) and its
`gpu_occupancy.Occupancy` from ptxas' registers and static shared memory.
`format_sass` prints them as one table.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from gpu_occupancy import HOPPER_H100, occupancy
from gpu_sass import disassemble, find_cuobjdump, pad_cubin, parse_sass

__all__ = ["parse_elf_threads", "threads_of", "sass_report", "format_sass"]

_ELF_SECTION = re.compile(r"^\.nv\.info\.(\S+)\s*$")
_ELF_THREADS = re.compile(r"Attribute:\s+EIATTR_(?:MAX_THREADS|REQNTID)\s*$")
_ELF_VALUE = re.compile(r"Value:\s+((?:0x[0-9a-f]+\s*)+)$")


def parse_elf_threads(text: str) -> dict[str, int]:
    """``function -> threads per block`` of its ``__launch_bounds__`` (``EIATTR_MAX_THREADS``, or
    ``EIATTR_REQNTID``) in ``cuobjdump -elf`` output; functions without one are absent."""
    threads: dict[str, int] = {}
    function, wanted = None, False
    for line in text.splitlines():
        section = _ELF_SECTION.match(line.strip())
        if section:
            function, wanted = section.group(1), False
            continue
        if function is None:
            continue
        if _ELF_THREADS.search(line):
            wanted = True
            continue
        value = _ELF_VALUE.search(line.strip())
        if wanted and value:
            product = 1
            for number in value.group(1).split():
                product *= int(number, 16)
            threads[function] = product
            wanted = False
    return threads


def threads_of(expression: str, launch_bounds: dict[str, int], lowered: str | None,
               default: int | None = None) -> tuple[int, str]:
    """``(threads per block, where that came from)`` of one instantiation for the occupancy.

    In order: ``default`` (``--threads``), the kernel's ``__launch_bounds__``, the backend's engine sizes
    (``sc::Simt`` / ``sc::Wmma`` in the expression: `_kernel_fused.SIMT_THREADS` / ``WMMA_THREADS``), the
    kernel backend's default block of 256.
    """
    if default:
        return default, "--threads"
    if lowered and lowered in launch_bounds:
        return launch_bounds[lowered], "__launch_bounds__"
    try:
        from sparsecore.backends import _kernel_fused as fused
    except ImportError:  # pragma: no cover - an older tree
        fused = None
    for tag, name in (("Simt", "SIMT_THREADS"), ("Wmma", "WMMA_THREADS"), ("Mma", "WMMA_THREADS")):
        if f"sc::{tag}" in expression and getattr(fused, name, None):
            return int(getattr(fused, name)), f"the backend's {name}"
    return 256, "the kernel backend's default block"


def sass_report(report: Any, cubin: bytes, threads: int | None = None) -> None:
    """Adds each instantiation's SASS counts, threads and H100 occupancy to ``report`` (``cuobjdump``).

    Raises:
        DisassemblerMissing: when there is no cuobjdump (its message says how to install it).
    """
    counts = parse_sass(disassemble(cubin))
    tool = find_cuobjdump()
    with tempfile.TemporaryDirectory(prefix="sparsecore-elf-") as folder:
        path = Path(folder) / "kernels.cubin"
        path.write_bytes(pad_cubin(cubin))
        elf = subprocess.run([str(tool), "-elf", str(path)], capture_output=True, text=True, check=False).stdout
    launch_bounds = parse_elf_threads(elf)
    for item in report.instantiations:
        item.sass = counts.get(item.lowered or "")
        item.threads, item.threads_source = threads_of(item.expression, launch_bounds, item.lowered, threads)
        if item.registers is not None:
            try:
                item.occupancy = occupancy(item.registers, item.threads, item.shared_bytes or 0)
            except ValueError as error:
                report.error = f"{report.error + '; ' if report.error else ''}{item.expression}: {error}"


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def format_sass(reports: list[Any], arch: str, match: str = "") -> str:
    """One line per instantiation (those whose expression holds ``match``): resources, occupancy on an
    H100, and its SASS counts."""
    lines = [f"SASS for {arch} (static instruction counts: a load in a loop counts once); occupancy on an "
             f"{HOPPER_H100.name} with {HOPPER_H100.multiprocessors} SMs",
             f"{'instantiation':<44} {'thr':>4} {'regs':>4} {'smem B':>6} {'spill':>5} {'blk/SM':>6} "
             f"{'occ':>4} {'limit':<9} | {'LDG 16/32/64/128':>16} {'LDGSTS':>6} {'(128)':>5} {'LDS':>4} "
             f"{'LDSM':>4} {'STS':>4} {'HMMA':>4} {'HGMMA':>5} {'FFMA':>4} {'DFMA':>4} {'LDL+STL':>7}"]
    for report in reports:
        for item in report.instantiations:
            if match not in item.expression:
                continue
            sass, held = item.sass, item.occupancy
            spill = "-" if item.spill_store_bytes is None else str(item.spill_store_bytes)
            resident = "-" if held is None else str(held.blocks_per_sm)
            share = "-" if held is None else f"{held.fraction:.0%}"
            limit = "-" if held is None else held.limited_by.split()[0]
            line = (f"{item.expression[:44]:<44} {_cell(item.threads):>4} {_cell(item.registers):>4} "
                    f"{_cell(item.shared_bytes):>6} {spill:>5} {resident:>6} {share:>4} {limit:<9} | ")
            if sass is None:
                line += "no SASS"
            else:
                widths = (f"{sass.global_loads_16}/{sass.global_loads_32}/{sass.global_loads_64}/"
                          f"{sass.global_loads_128}" + (f" +{sass.global_loads_8} U8" if sass.global_loads_8 else ""))
                line += (f"{widths:>16} {sass.async_copies:>6} {sass.async_copies_128:>5} {sass.shared_loads:>4} "
                         f"{sass.ldmatrix:>4} {sass.shared_stores:>4} {sass.mma:>4} {sass.warpgroup_mma:>5} "
                         f"{sass.ffma:>4} {sass.dfma:>4} {sass.local_accesses:>7}")
            lines.append(line)
    sources = sorted({f"{item.threads_source}" for report in reports for item in report.instantiations
                      if item.threads_source and match in item.expression})
    lines.append(f"threads per block from: {', '.join(sources) if sources else '-'}")
    return "\n".join(lines)
