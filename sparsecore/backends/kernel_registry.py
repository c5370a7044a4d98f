"""The one registry of sparsecore's CUDA kernels, and their lazy, per-device loading.

Every kernel source file in ``kernels_cu/`` (installed as the package
``sparsecore.kernels_cu``) is listed here with its kernels and every template
instantiation (NVRTC name expression) the GPU backend uses. The NVRTC test
compiles exactly this list; the CPU emulation tests run exactly this list; the
CuPy backend loads exactly this list. A kernel missing here cannot be launched.

Sources are handed to NVRTC with their local ``#include "*.cuh"`` lines
replaced by the header's text, so CuPy's on-disk cache (keyed on the source
text and options) sees every edit of a header, and no include path into the
installed package is needed.

CuPy is imported only inside `load_module`, so importing this module is free.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._cuda_headers import TENSOR_CORE_HEADER, cuda_include_dir, nvrtc_options, tensor_core_include_dir

__all__ = [
    "KernelSpec",
    "KernelFile",
    "KERNEL_FILES",
    "kernel_file",
    "kernel_spec",
    "file_of_kernel",
    "name_expression",
    "cuda_type_name",
    "kernel_source",
    "cuda_include_dir",
    "tensor_core_include_dir",
    "TENSOR_CORE_HEADER",
    "nvrtc_options",
    "load_module",
    "get_kernel",
]

KERNEL_PACKAGE = "sparsecore.kernels_cu"

# Storage element types of the feature kernels, with the accumulator each sums in.
FLOAT_TYPES: tuple[tuple[str, str], ...] = (
    ("float", "float"),
    ("double", "double"),
    ("__half", "float"),
    ("__nv_bfloat16", "float"),
)
# Value types of hash tables: int32 (row indices) and int64 (general values).
HASH_VALUE_TYPES: tuple[str, ...] = ("int", "long long")

# NumPy dtype names (``numpy.dtype(x).name``; ml_dtypes' bfloat16 included) to C++ types.
_CUDA_TYPE_OF_DTYPE: tuple[tuple[str, str], ...] = (
    ("float32", "float"),
    ("float64", "double"),
    ("float16", "__half"),
    ("bfloat16", "__nv_bfloat16"),
    ("int32", "int"),
    ("int64", "long long"),
)

_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.MULTILINE)


@dataclass(frozen=True)
class KernelSpec:
    """One ``__global__`` function and the instantiations the backend launches.

    Attributes:
        name: the kernel's name in the source, prefixed ``sc_``.
        template_arguments: one tuple of C++ type names per instantiation; an
            empty tuple of tuples for a non-template kernel.
    """

    name: str
    template_arguments: tuple[tuple[str, ...], ...] = ()

    @property
    def name_expressions(self) -> tuple[str, ...]:
        """NVRTC name expressions, e.g. ``("sc_max_pool_map<float>", ...)``."""
        if not self.template_arguments:
            return (self.name,)
        return tuple(f"{self.name}<{', '.join(arguments)}>" for arguments in self.template_arguments)


@dataclass(frozen=True)
class KernelFile:
    """One source file of ``kernels_cu/`` and the kernels it defines.

    Attributes:
        file: the file name, e.g. ``"hash_table.cu"``.
        kernels: its kernels.
        tensor_cores: it includes ``<mma.h>`` (wmma), so NVRTC needs ``crt/mma.h``
            (`tensor_core_include_dir`).
    """

    file: str
    kernels: tuple[KernelSpec, ...]
    tensor_cores: bool = False

    @property
    def name_expressions(self) -> tuple[str, ...]:
        """Every name expression of every kernel of the file, in order."""
        return tuple(expression for kernel in self.kernels for expression in kernel.name_expressions)


def _per_type(name: str, types: tuple[Any, ...]) -> KernelSpec:
    arguments = tuple(entry if isinstance(entry, tuple) else (entry,) for entry in types)
    return KernelSpec(name, arguments)


_STORAGE_ONLY = tuple(storage for storage, _ in FLOAT_TYPES)
# The fused feature kernels' (storage type, arithmetic engine) pairs: SIMT for float32 and float64,
# tensor cores (wmma) for float16, bfloat16 and, TF32, float32 (implicit_gemm.cu).
_FEATURE_ENGINES = (("float", "sc::Simt"), ("double", "sc::Simt"), ("float", "sc::Wmma"), ("__half", "sc::Wmma"),
                    ("__nv_bfloat16", "sc::Wmma"))
# ...and for sc_implicit_gemm, SIMT for the 16-bit types too: a pass reducing over a few channels (a first
# layer's 3 inputs) runs there instead of padding them to the tensor cores' k (`_fused_launch_plan.engine_of`).
_CONV_ENGINES = _FEATURE_ENGINES + (("__half", "sc::Simt"), ("__nv_bfloat16", "sc::Simt"))

KERNEL_FILES: tuple[KernelFile, ...] = (
    KernelFile(
        "hash_table.cu",
        (
            _per_type("sc_hash_insert", HASH_VALUE_TYPES),
            _per_type("sc_hash_lookup", HASH_VALUE_TYPES),
            _per_type("sc_hash_lookup_offsets", HASH_VALUE_TYPES),
            KernelSpec("sc_pack_keys"),
            KernelSpec("sc_unpack_keys"),
        ),
    ),
    KernelFile("segment_sums.cu", (_per_type("sc_segment_sum_rows", (("double", "double"),)),)),
    KernelFile(
        "rulebook.cu",
        (
            KernelSpec("sc_compact_count"),
            KernelSpec("sc_compact_write"),
            KernelSpec("sc_regular_conv_candidates"),
            KernelSpec("sc_transposed_conv_candidates"),
        ),
    ),
    KernelFile("int8.cu", (_per_type("sc_int8_conv", ("signed char", "float")), KernelSpec("sc_int8_max_pool"))),
    KernelFile(
        "implicit_gemm.cu",
        (
            _per_type("sc_implicit_gemm", _CONV_ENGINES),
            _per_type("sc_weight_gradient", _FEATURE_ENGINES),
        ),
        tensor_cores=True,
    ),
    KernelFile(
        "pool_maps.cu",
        (
            _per_type("sc_max_pool_map", _STORAGE_ONLY),
            _per_type("sc_max_pool_map_backward", _STORAGE_ONLY),
            _per_type("sc_avg_pool_map", _STORAGE_ONLY),
            _per_type("sc_avg_pool_map_backward", _STORAGE_ONLY),
        ),
    ),
    KernelFile(
        "neighbour_map.cu",
        (
            KernelSpec("sc_map_insert_sites"),
            KernelSpec("sc_map_check_sites"),
            KernelSpec("sc_map_submanifold"),
            KernelSpec("sc_map_candidates"),
            KernelSpec("sc_map_mark_outputs"),
            KernelSpec("sc_map_strided"),
            KernelSpec("sc_map_strided_capacity"),
            KernelSpec("sc_map_row_masks"),
            KernelSpec("sc_map_row_plan"),
        ),
    ),
)


def kernel_file(file: str) -> KernelFile:
    """The registry entry of a source file.

    Raises:
        KeyError: for a file that is not registered.
    """
    for entry in KERNEL_FILES:
        if entry.file == file:
            return entry
    known = ", ".join(entry.file for entry in KERNEL_FILES)
    raise KeyError(f"no kernel file {file!r} in the registry; registered files: {known}")


def file_of_kernel(name: str) -> str:
    """The source file that defines kernel ``name``."""
    for entry in KERNEL_FILES:
        if any(kernel.name == name for kernel in entry.kernels):
            return entry.file
    raise KeyError(f"no kernel named {name!r} in the registry")


def kernel_spec(name: str) -> KernelSpec:
    """The registry entry of kernel ``name``."""
    for kernel in kernel_file(file_of_kernel(name)).kernels:
        if kernel.name == name:
            return kernel
    raise AssertionError("unreachable")  # pragma: no cover


def cuda_type_name(dtype: Any) -> str:
    """The C++ type of a NumPy / CuPy dtype (or dtype name), e.g. ``float32 -> "float"``.

    Raises:
        TypeError: for a dtype no kernel takes.
    """
    dtype_name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None)
    if dtype_name is None:
        import numpy

        dtype_name = numpy.dtype(dtype).name
    for candidate, cuda_name in _CUDA_TYPE_OF_DTYPE:
        if candidate == dtype_name:
            return cuda_name
    known = ", ".join(candidate for candidate, _ in _CUDA_TYPE_OF_DTYPE)
    raise TypeError(f"no CUDA kernel takes dtype {dtype_name!r}; supported: {known}")


def name_expression(name: str, *types: Any) -> str:
    """The registered name expression of kernel ``name`` for the given types.

    Args:
        name: a kernel name, e.g. ``"sc_segment_sum_rows"``.
        *types: dtypes, dtype names or C++ type names of its leading template
            parameters; omitted trailing ones (an accumulator) take the
            registered default. None for a non-template kernel.

    Returns:
        e.g. ``name_expression("sc_segment_sum_rows", numpy.float16)`` gives
        ``"sc_segment_sum_rows<__half, float>"``.

    Raises:
        KeyError: when that instantiation is not registered.
    """
    spec = kernel_spec(name)
    wanted = tuple(
        entry if isinstance(entry, str) and not _is_dtype_name(entry) else cuda_type_name(entry)
        for entry in types
    )
    if not spec.template_arguments:
        if wanted:
            raise KeyError(f"kernel {name!r} is not a template; got types {wanted}")
        return name
    for arguments, expression in zip(spec.template_arguments, spec.name_expressions):
        if arguments[: len(wanted)] == wanted:
            return expression
    raise KeyError(
        f"kernel {name!r} has no instantiation for {wanted}; registered: {spec.name_expressions}"
    )


def _is_dtype_name(text: str) -> bool:
    return any(candidate == text for candidate, _ in _CUDA_TYPE_OF_DTYPE)


def _source_dir() -> Path | None:
    """The directory of the kernel sources: the installed package, else the repository's."""
    try:
        package_dir = importlib.resources.files(KERNEL_PACKAGE)
        if isinstance(package_dir, Path) and (package_dir / KERNEL_FILES[0].file).is_file():
            return package_dir
    except (ModuleNotFoundError, TypeError):
        pass
    repository_dir = Path(__file__).resolve().parents[2] / "kernels_cu"
    return repository_dir if repository_dir.is_dir() else None


def _read_raw(file: str) -> str:
    try:
        resource = importlib.resources.files(KERNEL_PACKAGE).joinpath(file)
        if resource.is_file():
            return resource.read_text(encoding="utf-8")
    except (ModuleNotFoundError, TypeError):
        pass
    source_dir = _source_dir()
    if source_dir is None or not (source_dir / file).is_file():
        raise FileNotFoundError(
            f"kernel source {file!r} not found in the package {KERNEL_PACKAGE!r} or in the "
            "repository's kernels_cu/ directory; is sparsecore installed with its package data?"
        )
    return (source_dir / file).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=None)
def kernel_source(file: str) -> str:
    """The source text of a kernel file, its local ``#include "x.cuh"`` lines inlined.

    Each header is inlined once (later includes of it are dropped), between
    ``#line`` directives so compiler messages name the right file and line.
    """
    return _expand(file, set())


def _expand(file: str, seen: set[str]) -> str:
    seen.add(file)
    text = _read_raw(file)
    pieces: list[str] = []
    position = 0
    for match in _LOCAL_INCLUDE.finditer(text):
        header = match.group(1)
        pieces.append(text[position : match.start()])
        if header not in seen:
            line_after = text.count("\n", 0, match.end()) + 2
            pieces.append(f'#line 1 "{header}"\n{_expand(header, seen)}\n#line {line_after} "{file}"')
        position = match.end()
    pieces.append(text[position:])
    return "".join(pieces)


@functools.lru_cache(maxsize=None)
def load_module(file: str, device_id: int) -> Any:
    """The compiled ``cupy.RawModule`` of a kernel file on one device (memoized).

    Compiles (or loads from CuPy's disk cache, ``CUPY_CACHE_DIR``) on first use
    per ``(file, device_id)``; later calls return the same module.

    Args:
        file: a registered file name, e.g. ``"hash_table.cu"``.
        device_id: the CUDA device ordinal.
    """
    import cupy

    entry = kernel_file(file)
    with cupy.cuda.Device(device_id):
        module = cupy.RawModule(
            code=kernel_source(file),
            options=nvrtc_options(tensor_cores=entry.tensor_cores),
            name_expressions=entry.name_expressions,
        )
        module.compile()
    return module


@functools.lru_cache(maxsize=None)
def get_kernel(expression: str, device_id: int) -> Any:
    """The ``cupy.RawKernel`` of a registered name expression on one device (memoized).

    Args:
        expression: e.g. ``name_expression("sc_max_pool_map", features.dtype)``.
        device_id: the CUDA device ordinal.
    """
    base_name = expression.split("<", 1)[0].strip()
    return load_module(file_of_kernel(base_name), device_id).get_function(expression)
