"""Every registered kernel compiles through NVRTC, and the registry matches the sources.

No GPU is needed: NVRTC compiles to PTX on any machine that has the
``nvidia-cuda-nvrtc`` wheel (a dev dependency). Each kernel file is compiled
exactly as `kernel_registry.load_module` hands it to CuPy (same source text,
same options, same name expressions), for the two architectures the project
targets (Ampere and Hopper); a compile error or warning fails the suite.
"""

from __future__ import annotations

import re

import pytest

from sparsecore.backends import kernel_registry

try:
    from cupy_backends.cuda.libs import nvrtc
except ImportError:  # pragma: no cover - depends on the environment
    nvrtc = None

ARCHITECTURES = ("compute_80", "compute_90")
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
