"""Every registered kernel compiles through NVRTC, and the registry matches the sources.

No GPU is needed: NVRTC compiles to PTX, and with its built-in ptxas to
machine code, on any machine that has the ``nvidia-cuda-nvrtc`` wheel (a dev
dependency). Each kernel file is compiled exactly as
`kernel_registry.load_module` hands it to CuPy (same source text, same
options, same name expressions) to PTX for compute_80 and compute_90, and to
machine code (``-arch=sm_XX``, ptxas' ``-v`` report) for every GPU that
CUDA 12 and 13 both support: sm_75, sm_80, sm_86, sm_89 and sm_90; a compile
error or warning fails the suite, and so does an instantiation that spills
registers to local memory. Each (file, architecture) compiles once per process.
"""

from __future__ import annotations

import functools
import re

import pytest

from sparsecore.backends import kernel_registry

try:
    from cupy_backends.cuda.libs import nvrtc
except ImportError:  # pragma: no cover - depends on the environment
    nvrtc = None

ARCHITECTURES = ("compute_80", "compute_90")
MACHINE_ARCHITECTURES = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
KERNEL_FILES = tuple(entry.file for entry in kernel_registry.KERNEL_FILES)
_GLOBAL_FUNCTION = re.compile(r"__global__\s+void\s+(\w+)\s*\(")


def _source_dir():
    directory = kernel_registry._source_dir()
    assert directory is not None, "kernels_cu/ not found"
    return directory


def _compile(file: str, options: list[str]) -> tuple[int, str]:
    """Compiles a registered file; returns ``(program handle, log)``; raises with the log on failure."""
    entry = kernel_registry.kernel_file(file)
    program = nvrtc.createProgram(kernel_registry.kernel_source(file), file, [], [])
    for expression in entry.name_expressions:
        nvrtc.addNameExpression(program, expression)
    try:
        nvrtc.compileProgram(program, options)
    except nvrtc.NVRTCError as error:
        log = nvrtc.getProgramLog(program)
        nvrtc.destroyProgram(program)
        pytest.fail(f"NVRTC could not compile {file} ({' '.join(options)}): {error}\n{log}")
    return program, nvrtc.getProgramLog(program)


@pytest.mark.skipif(nvrtc is None, reason="cupy (with NVRTC bindings) is not installed")
@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("file", KERNEL_FILES)
def test_kernel_file_compiles(file: str, architecture: str) -> None:
    if kernel_registry.cuda_include_dir() is None:
        pytest.skip("no CUDA headers (install cupy-cuda13x[ctk] / nvidia-cuda-runtime)")
    tensor_cores = kernel_registry.kernel_file(file).tensor_cores
    if tensor_cores and kernel_registry.tensor_core_include_dir() is None:
        pytest.fail(f"{file} includes <mma.h>, but {kernel_registry.TENSOR_CORE_HEADER} was not found: install the "
                    "dev extra (nvidia-cuda-crt), as the README says")
    options = list(kernel_registry.nvrtc_options((f"-arch={architecture}",), tensor_cores=tensor_cores))
    program, log = _compile(file, options)
    try:
        assert "warning" not in log.lower(), f"NVRTC warnings for {file}:\n{log}"
        ptx = nvrtc.getPTX(program)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        for expression in kernel_registry.kernel_file(file).name_expressions:
            lowered = nvrtc.getLoweredName(program, expression)
            assert lowered, f"no lowered name for {expression}"
            assert f".entry {lowered}" in ptx, f"{expression} ({lowered}) is missing from the PTX of {file}"
    finally:
        nvrtc.destroyProgram(program)


@functools.lru_cache(maxsize=None)
def _machine_code(file: str, architecture: str) -> tuple[str, tuple[tuple[str, str], ...], int]:
    """``(ptxas log, (expression, lowered name) pairs, cubin bytes)`` of a file for an ``sm_XX``, compiled once."""
    entry = kernel_registry.kernel_file(file)
    options = list(kernel_registry.nvrtc_options((f"-arch={architecture}", "--ptxas-options=-v"),
                                                 tensor_cores=entry.tensor_cores))
    program, log = _compile(file, options)
    try:
        names = tuple((expression, nvrtc.getLoweredName(program, expression)) for expression in entry.name_expressions)
        return log, names, len(nvrtc.getCUBIN(program))
    finally:
        nvrtc.destroyProgram(program)


def spilled_entries(log: str) -> dict[str, tuple[int, int]]:
    """``{lowered name: (spill store bytes, spill load bytes)}`` of every entry of a ptxas ``-v`` log that spills."""
    spills: dict[str, tuple[int, int]] = {}
    current = None
    for line in log.splitlines():
        entry = _ENTRY.search(line)
        if entry:
            current = entry.group(1)
            continue
        counts = _SPILLS.search(line)
        if counts and current is not None and (int(counts.group(1)) or int(counts.group(2))):
            spills[current] = (int(counts.group(1)), int(counts.group(2)))
    return spills


def test_spilled_entries_reads_a_ptxas_report() -> None:
    log = ("ptxas info    : Compiling entry function '_Z1av' for 'sm_90'\n"
           "ptxas info    : Function properties for _Z1av\n"
           "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Compiling entry function '_Z1bv' for 'sm_90'\n"
           "    24 bytes stack frame, 24 bytes spill stores, 16 bytes spill loads\n")
    assert spilled_entries(log) == {"_Z1bv": (24, 16)}


@pytest.mark.skipif(nvrtc is None, reason="cupy (with NVRTC bindings) is not installed")
@pytest.mark.parametrize("architecture", MACHINE_ARCHITECTURES)
def test_every_kernel_file_compiles_to_machine_code_without_spills(architecture: str) -> None:
    """Every registered instantiation, for every GPU CUDA 12 and 13 support (sm_75 included: no tensor-core
    type of sm_80+ may be named there), with ptxas' report: a machine-code entry per instantiation, no spills."""
    if kernel_registry.cuda_include_dir() is None:
        pytest.skip("no CUDA headers (install cupy-cuda13x[ctk] / nvidia-cuda-runtime)")
    if kernel_registry.tensor_core_include_dir() is None:
        pytest.fail(f"{kernel_registry.TENSOR_CORE_HEADER} was not found: install the dev extra (nvidia-cuda-crt)")
    for file in KERNEL_FILES:
        log, names, cubin_bytes = _machine_code(file, architecture)
        assert "warning" not in log.lower().replace("ptxas info", ""), f"warnings for {file} ({architecture}):\n{log}"
        assert cubin_bytes > 0, f"no machine code for {file} ({architecture})"
        for expression, lowered in names:
            assert f"Compiling entry function '{lowered}' for '{architecture}'" in log, (
                f"{expression} has no {architecture} entry in ptxas' report of {file}")
        spills = spilled_entries(log)
        named = {lowered: expression for expression, lowered in names}
        assert not spills, f"{file} ({architecture}) spills: " + ", ".join(
            f"{named.get(entry, entry)} stores {stores} B, loads {loads} B" for entry, (stores, loads) in spills.items())


def test_every_kernel_file_is_registered() -> None:
    on_disk = sorted(path.name for path in _source_dir().glob("*.cu"))
    assert on_disk == sorted(KERNEL_FILES)


@pytest.mark.parametrize("file", KERNEL_FILES)
def test_every_global_function_is_registered(file: str) -> None:
    defined = set(_GLOBAL_FUNCTION.findall((_source_dir() / file).read_text()))
    registered = {kernel.name for kernel in kernel_registry.kernel_file(file).kernels}
    assert defined == registered, f"{file}: defined {sorted(defined)}, registered {sorted(registered)}"


def test_kernel_names_are_prefixed_and_unique() -> None:
    names = [kernel.name for entry in kernel_registry.KERNEL_FILES for kernel in entry.kernels]
    assert all(name.startswith("sc_") for name in names), names
    assert len(names) == len(set(names))
    for entry in kernel_registry.KERNEL_FILES:
        expressions = entry.name_expressions
        assert len(expressions) == len(set(expressions))
        assert all(expression.startswith("sc_") for expression in expressions)


def test_sources_inline_local_headers_only() -> None:
    for file in KERNEL_FILES:
        source = kernel_registry.kernel_source(file)
        assert not re.search(r'^\s*#\s*include\s*"', source, re.MULTILINE), file
        assert "namespace sc" in source
        assert "#ifndef SPARSECORE_CPU_EMULATION" in source


def test_name_expression_lookup() -> None:
    import numpy as np

    assert kernel_registry.name_expression("sc_max_pool_map", np.float16) == "sc_max_pool_map<__half>"
    assert kernel_registry.name_expression("sc_implicit_gemm", "float32") == "sc_implicit_gemm<float, sc::Simt>"
    assert kernel_registry.name_expression("sc_implicit_gemm", "float32", "sc::Wmma") == (
        "sc_implicit_gemm<float, sc::Wmma>")
    assert kernel_registry.name_expression("sc_segment_sum_rows", np.dtype("float64")) == (
        "sc_segment_sum_rows<double, double>")
    assert kernel_registry.name_expression("sc_hash_insert", np.int32) == "sc_hash_insert<int>"
    assert kernel_registry.name_expression("sc_compact_count") == "sc_compact_count"
    assert kernel_registry.file_of_kernel("sc_int8_max_pool") == "int8.cu"
    with pytest.raises(KeyError):
        kernel_registry.name_expression("sc_max_pool_map", np.int32)
    with pytest.raises(KeyError):
        kernel_registry.name_expression("sc_implicit_gemm", "float64", "sc::Wmma")  # float64 has no tensor cores
    with pytest.raises(TypeError):
        kernel_registry.cuda_type_name(np.complex64)
