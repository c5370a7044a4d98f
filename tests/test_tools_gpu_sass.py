"""tools/gpu_sass.py: the cubin's padding, and the SASS counts of a kernel compiled here by NVRTC.

The padding is checked on synthetic ELF headers (the tables' ends computed by
hand); the counts on a small kernel whose loads have known widths (a float4,
a __half, a double, scalar floats, one 16-byte cp.async) compiled for sm_80
and disassembled by cuobjdump (skipped where it is not installed: the dev
extra installs it).
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from sparsecore.backends import kernel_registry

from tests.tool_modules import load_tool

ROOT = Path(__file__).resolve().parents[1]

try:
    from cupy_backends.cuda.libs import nvrtc
except ImportError:  # pragma: no cover - depends on the environment
    nvrtc = None


sass = load_tool("gpu_sass")
needs_tools = pytest.mark.skipif(nvrtc is None or kernel_registry.cuda_include_dir() is None
                                 or sass.find_cuobjdump() is None,
                                 reason="needs NVRTC (cupy), the CUDA headers and cuobjdump "
                                        "(pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)")


def _header(program_offset: int, program_size: int, program_count: int, section_offset: int, section_size: int,
            section_count: int) -> bytes:
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<QQ", header, 0x20, program_offset, section_offset)
    struct.pack_into("<HHHH", header, 0x36, program_size, program_count, section_size, section_count)
    return bytes(header)


@pytest.mark.parametrize(("tables", "end"), [
    ((1000, 56, 6, 500, 64, 5), 1000 + 56 * 6),  # program headers last (NVRTC 13.5's layout)
    ((100, 56, 2, 900, 64, 10), 900 + 64 * 10),  # section headers last
])
def test_a_cubin_is_padded_to_the_end_of_its_header_tables(tables: tuple[int, ...], end: int) -> None:
    header = _header(*tables)
    truncated = header + b"\x11" * (end - 64 - 3)  # three trailing bytes lost
    assert sass.cubin_end(truncated) == end
    padded = sass.pad_cubin(truncated)
    assert len(padded) == end and padded[: len(truncated)] == truncated and padded[len(truncated):] == b"\0" * 3
    whole = truncated + b"\0" * 3 + b"\x22" * 7  # as long or longer: unchanged
    assert sass.pad_cubin(whole) == whole


def test_something_else_than_a_64_bit_elf_is_refused() -> None:
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        sass.pad_cubin(b"\x7fELF\x01\x01" + bytes(58))
    with pytest.raises(ValueError, match="not a 64-bit"):
        sass.cubin_end(b"PK\x03\x04")


_LISTING = """\
\tcode for sm_90
\t\tFunction : _Z3onePf
\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                   /* 0x00000a00ff017b82 */
        /*0010*/              @!P0 LDG.E.U16.CONSTANT R4, desc[UR4][R2.64] ;  /* 0x0000000402048981 */
        /*0020*/                   LDG.E.128 R8, desc[UR4][R2.64] ;         /* 0x0000000402087981 */
        /*0030*/                   LDGSTS.E.BYPASS.LTC128B.128 [R9], desc[UR4][R2.64] ; /* 0x0 */
        /*0040*/                   LDGSTS.E [R9+0x4], desc[UR4][R2.64] ;   /* 0x0 */
        /*0050*/                   LDGDEPBAR ;                               /* 0x0 */
        /*0060*/                   HMMA.16816.F32 R12, R4, R8, R12 ;        /* 0x0 */
        /*0070*/                   LDSM.16.MT88.4 R4, [R2] ;                /* 0x0 */
        /*0080*/               @P1 STL [R1], R4 ;                           /* 0x0 */
        /*0090*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;            /* 0x0 */
\t\t..........

\t\tFunction : _Z3twov
        /*0000*/                   FFMA R0, R1, R2, R0 ;                    /* 0x0 */
        /*0010*/                   DFMA R4, R6, R8, R4 ;                    /* 0x0 */
        /*0020*/                   LDG.E.64 R4, desc[UR4][R2.64] ;          /* 0x0 */
        /*0030*/                   LDG.E R4, desc[UR4][R2.64] ;             /* 0x0 */
"""


def test_a_listing_is_counted_per_function() -> None:
    counts = sass.parse_sass(_LISTING)
    assert set(counts) == {"_Z3onePf", "_Z3twov"}
    one, two = counts["_Z3onePf"], counts["_Z3twov"]
    assert (one.instructions, one.global_loads_16, one.global_loads_128, one.global_loads) == (10, 1, 1, 2)
    assert (one.async_copies, one.async_copies_128, one.mma, one.ldmatrix, one.local_accesses, one.barriers) == (
        2, 1, 1, 1, 1, 1)
    assert (two.ffma, two.dfma, two.global_loads_64, two.global_loads_32, two.async_copies) == (1, 1, 1, 1, 0)


_KERNEL = r"""
#include <cuda_fp16.h>
extern "C" __global__ void widths(const float4* a, const __half* h, const double* d, const float* f, float* out) {
  __shared__ float4 stage[32];
  int i = threadIdx.x;
  unsigned int address = static_cast<unsigned int>(__cvta_generic_to_shared(stage + i));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(address), "l"(a + i + 64));
  asm volatile("cp.async.wait_all;\n" ::);
  __syncthreads();
  float4 v = a[i];
  out[i] = v.x + v.y + v.z + v.w + __half2float(h[i]) + static_cast<float>(d[i]) + stage[i].y + f[i] * f[i + 1];
}
"""


@needs_tools
def test_a_compiled_kernel_shows_its_loads_by_width() -> None:
    program = nvrtc.createProgram(_KERNEL, "widths.cu", [], [])
    try:
        nvrtc.compileProgram(program, list(kernel_registry.nvrtc_options(("-arch=sm_80",))))
        cubin = nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)
    counts = sass.parse_sass(sass.disassemble(cubin))["widths"]
    assert counts.global_loads_128 == 1 and counts.global_loads_16 == 1 and counts.global_loads_64 == 1
    assert counts.global_loads_32 >= 1 and counts.global_loads_8 == 0
    assert counts.async_copies == 1 and counts.async_copies_128 == 1
    assert counts.ffma >= 1 and counts.mma == 0 and counts.local_accesses == 0
    assert counts.global_stores == 1 and counts.shared_loads >= 1


def test_a_missing_cuobjdump_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sass, "find_cuobjdump", lambda: None)
    with pytest.raises(sass.DisassemblerMissing, match="pip install .*nvidia-cuda-cuobjdump"):
        sass.disassemble(_header(64, 56, 0, 64, 64, 0))
