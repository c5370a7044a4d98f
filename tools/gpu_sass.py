"""Machine code of a cubin without a GPU: the ELF's padding, ``cuobjdump -sass``, and what the SASS issues.

`gpu_kernel_report.py --sass sm_XX` compiles each kernel file through NVRTC to
a cubin and reads it here:

- `pad_cubin`: CuPy's ``getCUBIN`` (NVRTC's cubin as CuPy hands it back) can
  lose the ELF's trailing zero bytes; ``cuobjdump`` then calls the file "not
  device code" or "an invalid ELF". The cubin is padded with zeros to the end
  of its section header table and of its program header table (whichever
  ends later; seen on NVRTC 13.5: the program headers are last and lose a byte).
- `find_cuobjdump`: ``cuobjdump`` (and the ``nvdisasm`` it runs) from the
  PATH, a CUDA toolkit, or the ``nvidia-cuda-cuobjdump`` and
  ``nvidia-cuda-nvdisasm`` wheels (``pip install "nvidia-cuda-cuobjdump==13.*"
  "nvidia-cuda-nvdisasm==13.*"``, or ``-cu12`` for CUDA 12); None when absent.
- `parse_sass`: per function, the instructions that decide a feature kernel's
  speed: global loads by width (``LDG.E.U16`` ... ``LDG.E.128``), asynchronous
  copies to shared memory (``LDGSTS``, cp.async), tensor-core MMAs (``HMMA``,
  Hopper's ``HGMMA``), ``FFMA`` / ``DFMA``, shared-memory loads (``LDS``,
  ``LDSM`` = ldmatrix) and stores, local memory (``LDL`` / ``STL``: spills or
  local arrays) and barriers. Counts are static (instructions in the code, not
  executed ones): a load in a loop counts once.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["INSTALL_HINT", "DisassemblerMissing", "cubin_end", "pad_cubin", "find_cuobjdump", "disassemble",
           "SassCounts", "parse_sass"]

INSTALL_HINT = ("cuobjdump was not found (PATH, CUDA_HOME/CUDA_PATH, /usr/local/cuda, or the pip wheels). "
                "Install it with: pip install \"nvidia-cuda-cuobjdump==13.*\" \"nvidia-cuda-nvdisasm==13.*\" "
                "(the dev extra has them; for CUDA 12: nvidia-cuda-cuobjdump-cu12 nvidia-cuda-nvdisasm-cu12), "
                "or put a CUDA toolkit's bin/ on the PATH")

_FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$")
# "/*0a30*/  @!P0 LDG.E.U16.CONSTANT R4, desc[UR4][R2.64] ;" -> opcode LDG, modifiers .E.U16.CONSTANT
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)((?:\.[A-Z0-9_]+)*)[\s;]")
_WIDTHS = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128}


class DisassemblerMissing(RuntimeError):
    """cuobjdump is not installed (the message says how to install it)."""


def cubin_end(data: bytes) -> int:
    """Where a 64-bit little-endian ELF's section and program header tables end (bytes from its start).

    Raises:
        ValueError: when ``data`` is not a 64-bit little-endian ELF header.
    """
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"not a 64-bit little-endian ELF (a cubin): {len(data)} bytes starting {data[:6]!r}")
    program_offset, section_offset = struct.unpack_from("<QQ", data, 0x20)
    program_size, program_count, section_size, section_count = struct.unpack_from("<HHHH", data, 0x36)
    return max(section_offset + section_size * section_count, program_offset + program_size * program_count)


def pad_cubin(data: bytes) -> bytes:
    """``data`` with zero bytes appended up to `cubin_end` (unchanged when it is long enough)."""
    missing = cubin_end(data) - len(data)
    return data + b"\0" * missing if missing > 0 else data


def _wheel_binaries(name: str) -> list[Path]:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    found = []
    for location in spec.submodule_search_locations:  # nvidia/cu13/bin (13.x), nvidia/cuda_*/bin (12.x)
        found += sorted(Path(location).glob(f"*/bin/{name}"))
    return found


def find_cuobjdump() -> Path | None:
    """The ``cuobjdump`` to run: the PATH's, a toolkit's, else the pip wheel's; None when there is none."""
    on_path = shutil.which("cuobjdump")
    if on_path:
        return Path(on_path)
    for toolkit in filter(None, (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda")):
        candidate = Path(toolkit) / "bin" / "cuobjdump"
        if candidate.is_file():
            return candidate
    wheels = [path for path in _wheel_binaries("cuobjdump") if os.access(path, os.X_OK)]
    return wheels[0] if wheels else None


def disassemble(cubin: bytes, cuobjdump: Path | None = None, timeout: float = 300.0) -> str:
    """``cuobjdump -sass`` of a cubin (padded first), as text.

    Raises:
        DisassemblerMissing: when there is no cuobjdump (`INSTALL_HINT`).
        RuntimeError: when cuobjdump fails (its message).
    """
    tool = cuobjdump or find_cuobjdump()
    if tool is None:
        raise DisassemblerMissing(INSTALL_HINT)
    environment = dict(os.environ)
    extra = [str(path.parent) for path in _wheel_binaries("nvdisasm")]  # cuobjdump runs nvdisasm
    environment["PATH"] = os.pathsep.join([str(tool.parent), *extra, environment.get("PATH", "")])
    with tempfile.TemporaryDirectory(prefix="sparsecore-sass-") as folder:
        path = Path(folder) / "kernels.cubin"
        path.write_bytes(pad_cubin(cubin))
        completed = subprocess.run([str(tool), "-sass", str(path)], capture_output=True, text=True,
                                   env=environment, timeout=timeout, check=False)
    if completed.returncode != 0 or "Function :" not in completed.stdout:
        message = (completed.stderr or completed.stdout).strip()[-1000:]
        if "nvdisasm" in message and "not found" in message.lower():
            raise DisassemblerMissing(f"{INSTALL_HINT} ({message})")
        raise RuntimeError(f"{tool} -sass failed (exit {completed.returncode}): {message}")
    return completed.stdout


@dataclass(frozen=True)
class SassCounts:
    """Static instruction counts of one function's SASS.

    Attributes:
        instructions: every instruction.
        global_loads_8, global_loads_16, global_loads_32, global_loads_64, global_loads_128: ``LDG`` by
            width in bits (``LDG.E.U8`` / ``.U16`` / none / ``.64`` / ``.128``).
        async_copies: ``LDGSTS`` (cp.async, global to shared memory), any width.
        async_copies_128: those of them that copy 16 bytes.
        generic_loads: ``LD`` (a generic address, global or shared).
        global_stores: ``STG``.
        shared_loads: ``LDS``.
        ldmatrix: ``LDSM``.
        shared_stores: ``STS``.
        local_accesses: ``LDL`` + ``STL`` (spills or local arrays).
        mma: ``HMMA`` (tensor cores through mma.sync / wmma).
        warpgroup_mma: ``HGMMA`` (Hopper's wgmma).
        ffma: float32 fused multiply-adds.
        dfma: float64 fused multiply-adds.
        barriers: ``BAR``.
    """

    instructions: int = 0
    global_loads_8: int = 0
    global_loads_16: int = 0
    global_loads_32: int = 0
    global_loads_64: int = 0
    global_loads_128: int = 0
    async_copies: int = 0
    async_copies_128: int = 0
    generic_loads: int = 0
    global_stores: int = 0
    shared_loads: int = 0
    ldmatrix: int = 0
    shared_stores: int = 0
    local_accesses: int = 0
    mma: int = 0
    warpgroup_mma: int = 0
    ffma: int = 0
    dfma: int = 0
    barriers: int = 0

    @property
    def global_loads(self) -> int:
        """Every ``LDG``."""
        return (self.global_loads_8 + self.global_loads_16 + self.global_loads_32 + self.global_loads_64
                + self.global_loads_128)


_PLAIN = {"LD": "generic_loads", "STG": "global_stores", "LDS": "shared_loads", "LDSM": "ldmatrix",
          "STS": "shared_stores", "LDL": "local_accesses", "STL": "local_accesses", "HMMA": "mma",
          "HGMMA": "warpgroup_mma", "FFMA": "ffma", "DFMA": "dfma", "BAR": "barriers"}


def _count(lines: list[str]) -> SassCounts:
    counts = dict.fromkeys(SassCounts.__dataclass_fields__, 0)
    for line in lines:
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        opcode, modifiers = match.group(1), set(match.group(2).split(".")[1:])
        counts["instructions"] += 1
        width = next((bits for name, bits in _WIDTHS.items() if name in modifiers), 32)
        if opcode == "LDG":
            counts[f"global_loads_{width}"] += 1
        elif opcode == "LDGSTS":
            counts["async_copies"] += 1
            counts["async_copies_128"] += width == 128
        elif opcode in _PLAIN:
            counts[_PLAIN[opcode]] += 1
    return SassCounts(**counts)


def parse_sass(text: str) -> dict[str, SassCounts]:
    """``mangled function name -> SassCounts`` of ``cuobjdump -sass`` output (every function in it)."""
    functions: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        function = _FUNCTION.match(line)
        if function:
            current = functions.setdefault(function.group(1), [])
        elif current is not None:
            current.append(line)
    return {name: _count(lines) for name, lines in functions.items()}
