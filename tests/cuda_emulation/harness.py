"""Compiles the CUDA kernels for the CPU with g++ and runs them on NumPy arrays.

Each registered ``kernels_cu/*.cu`` file (its text exactly as NVRTC gets it,
from `kernel_registry.kernel_source`) is compiled with ``cuda_shim.h``
force-included, plus a generated wrapper with two ``extern "C"`` entry points
per registered name expression: one launches it with a grid, a block and a
``void**`` argument array (as ``cudaLaunchKernel`` takes), the other returns
its parameter list as text, so every launch is checked against the kernel's
real C++ signature. A launch that would hang fails instead: a barrier that a
thread of its block has left (a ``__syncthreads()`` in a branch not every
thread takes) raises `BarrierDeadlock`, and every barrier wait gives up at the
launch's deadline (`LaunchTimeout`, `LAUNCH_TIMEOUT_SECONDS`). Every launch is bounds-checked
(``guarded_launch.h``): each array argument runs from a copy with guard pages
around it, and an access outside an array (a row -1, an index past the end)
raises `OutOfBoundsAccess` naming the kernel, the argument and the element.
The shared library is cached in the temp directory under a hash of everything
that went into it.

`EmulatedModule` mimics ``cupy.RawModule``: ``module.get_function(expression)``
returns a kernel called as ``kernel((grid,), (block,), args)``, with arrays as
C-contiguous NumPy arrays and scalars as NumPy scalars of the parameter's type.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from sparsecore.backends import kernel_registry

__all__ = ["compiler_path", "build_libraries", "load_module", "load_module_from_source", "EmulatedModule",
           "EmulatedKernel", "OutOfBoundsAccess", "LaunchFailure", "BarrierDeadlock", "LaunchTimeout", "KernelTrap",
           "LAUNCH_TIMEOUT_SECONDS"]

SHIM_DIR = Path(__file__).resolve().parent
SHIM_HEADER = SHIM_DIR / "cuda_shim.h"
GUARD_HEADER = SHIM_DIR / "guarded_launch.h"
COMPILE_FLAGS = ("-O1", "-std=c++20", "-pthread", "-shared", "-fPIC", "-Wall", "-Wextra")
MAX_BLOCK_THREADS = 1024


def compiler_path() -> str | None:
    """The g++ to use (``$CXX`` if set), or None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _cache_dir() -> Path:
    directory = Path(tempfile.gettempdir()) / f"sparsecore-cuda-emulation-{os.getuid()}"
    directory.mkdir(parents=True, exist_ok=True)
    return directory


class OutOfBoundsAccess(RuntimeError):
    """An emulated kernel touched memory outside one of its array arguments."""


class LaunchFailure(RuntimeError):
    """An emulated launch stopped before its end (the message says why)."""


class BarrierDeadlock(LaunchFailure):
    """A thread waited at a barrier (``__syncthreads``, ``__syncwarp``, a wmma store) that some thread of its
    block or warp had left by returning from the kernel: a barrier in a branch not every thread takes."""


class LaunchTimeout(LaunchFailure):
    """Threads still waited at a barrier when the launch's time (`EmulatedModule.set_timeout`) ran out."""


class KernelTrap(LaunchFailure):
    """The kernel called ``__trap()``."""


# How long one emulated launch may wait at its barriers before it fails (seconds); a module's
# set_timeout changes it. $SPARSECORE_EMULATION_TIMEOUT overrides the default.
LAUNCH_TIMEOUT_SECONDS = float(os.environ.get("SPARSECORE_EMULATION_TIMEOUT", "600"))
_FAILURES = {4: BarrierDeadlock, 5: LaunchTimeout, 6: KernelTrap}


def _wrapper_source(file: str) -> str:
    lines = ['#include "guarded_launch.h"', f'#include "{file}"', "", 'extern "C" {',
             "int sc_emu_fault_argument() { return sc_emu::fault_argument.load(); }",
             "long long sc_emu_fault_offset() { return sc_emu::fault_offset.load(); }",
             "int sc_emu_fault_kind() { return sc_emu::fault_kind.load(); }",
             "unsigned long long sc_emu_fault_address() { return sc_emu::fault_address.load(); }",
             "const char* sc_emu_failure_message() { return sc_emu::failure_message().c_str(); }",
             "void sc_emu_set_timeout(double seconds) { sc_emu::set_timeout_seconds(seconds); }"]
    for index, expression in enumerate(kernel_registry.kernel_file(file).name_expressions):
        lines += [
            f"int sc_emu_launch_{index}(unsigned int grid, unsigned int block, void** args, "
            "const long long* extents) {",
            f"  return sc_emu::guarded_launch(&{expression}, grid, block, args, extents);",
            "}",
            f"const char* sc_emu_signature_{index}() {{ return sc_emu::signature(&{expression}); }}",
        ]
    lines.append("}")
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=None)
def _compiler_version(compiler: str) -> str:
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout


@dataclass(frozen=True)
class _BuildPlan:
    file: str
    library: Path
    source: str
    wrapper: str
    flags: tuple[str, ...] = COMPILE_FLAGS


def _plan(file: str, compiler: str, source: str | None = None, arch: int | None = None) -> _BuildPlan:
    source = kernel_registry.kernel_source(file) if source is None else source
    flags = _flags(arch)
    wrapper = _wrapper_source(file)
    digest = hashlib.sha256()
    for part in (source, wrapper, SHIM_HEADER.read_text(), GUARD_HEADER.read_text(), " ".join(flags),
                 _compiler_version(compiler)):
        digest.update(part.encode())
        digest.update(b"\0")
    suffix = "" if arch is None else f"-sm{arch}"
    library = _cache_dir() / f"{Path(file).stem}{suffix}-{digest.hexdigest()[:20]}.so"
    return _BuildPlan(file, library, source, wrapper, flags)


def _flags(arch: int | None) -> tuple[str, ...]:
    """g++ flags; ``arch`` (e.g. 75) compiles the kernels' code path for that compute capability
    (``SC_EMULATED_ARCH``, as ``__CUDA_ARCH__`` would be), None the default (sm_90)."""
    return COMPILE_FLAGS if arch is None else (*COMPILE_FLAGS, f"-DSC_EMULATED_ARCH={int(arch) * 10}")


def build_libraries(files: Sequence[str]) -> dict[str, Path]:
    """Builds (in parallel) or finds in the cache the libraries of kernel files.

    Returns:
        ``{file: path of its shared library}``.

    Raises:
        RuntimeError: when g++ is missing or a build fails (with g++'s output).
    """
    compiler = compiler_path()
    if compiler is None:
        raise RuntimeError("g++ not found: the CUDA emulation tests need a C++20 compiler")
    plans = [_plan(file, compiler) for file in files]
    if all(plan.library.is_file() for plan in plans):
        return {plan.file: plan.library for plan in plans}
    with _build_lock():  # pytest-xdist workers: one builds, the others wait and reuse
        _build_missing(compiler, plans)
    return {plan.file: plan.library for plan in plans}


@contextlib.contextmanager
def _build_lock():
    with open(_cache_dir() / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_missing(compiler: str, plans: Sequence[_BuildPlan]) -> None:
    running = []
    for plan in plans:
        if plan.library.is_file():
            continue
        work_dir = Path(tempfile.mkdtemp(prefix="build-", dir=_cache_dir()))
        (work_dir / plan.file).write_text(plan.source)
        (work_dir / "wrapper.cpp").write_text(plan.wrapper)
        output = work_dir / "library.so"
        command = [compiler, *plan.flags, "-include", str(SHIM_HEADER), f"-I{work_dir}", f"-I{SHIM_DIR}",
                   str(work_dir / "wrapper.cpp"), "-o", str(output)]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        running.append((plan, work_dir, output, process))
    failures = []
    for plan, work_dir, output, process in running:
        log = process.communicate()[0]
        if process.returncode != 0:
            failures.append(f"{plan.file}:\n{log}")
        else:
            if log.strip():
                plan.library.with_suffix(".log").write_text(log)
            os.replace(output, plan.library)
        shutil.rmtree(work_dir, ignore_errors=True)
    if failures:
        raise RuntimeError("g++ could not build the emulated kernels:\n" + "\n".join(failures))


def build_warnings(file: str) -> str:
    """g++'s warnings from building a kernel file ('' when it built silently)."""
    compiler = compiler_path()
    if compiler is None:
        return ""
    log = _plan(file, compiler).library.with_suffix(".log")
    return log.read_text() if log.is_file() else ""


def _dtype_code(dtype: np.dtype) -> str:
    if dtype.name == "bfloat16":
        return "b2"
    if dtype == np.float16:
        return "h2"
    if dtype.kind in "fiu":
        return f"{dtype.kind}{dtype.itemsize}"
    return f"?{dtype.itemsize}"


def _accepts(expected: str, dtype: np.dtype) -> bool:
    code = _dtype_code(dtype)
    # bfloat16 data may travel as its uint16 bit pattern.
    return code == expected or (expected == "b2" and code == "u2")


class EmulatedKernel:
    """One kernel instantiation, called like a ``cupy.RawKernel``."""

    def __init__(self, expression: str, launch: Any, signature: str, library: Any) -> None:
        self.expression = expression
        self._launch = launch
        self._library = library
        self.parameters = tuple(signature.split(",")) if signature else ()

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: Sequence[Any]) -> None:
        grid_x, block_x = self._check_configuration(grid, block)
        if len(args) != len(self.parameters):
            raise TypeError(f"{self.expression} takes {len(self.parameters)} arguments, got {len(args)}")
        keep_alive = []
        pointers = (ctypes.c_void_p * max(len(args), 1))()
        extents = (ctypes.c_longlong * max(len(args), 1))()
        for position, (parameter, value) in enumerate(zip(self.parameters, args)):
            kind, code = parameter.split(":")
            where = f"{self.expression} argument {position} ({parameter})"
            if kind == "p":
                if not isinstance(value, np.ndarray) or not value.flags.c_contiguous:
                    raise TypeError(f"{where}: expected a C-contiguous array, got {type(value).__name__}")
                if not _accepts(code, value.dtype):
                    raise TypeError(f"{where}: array of dtype {value.dtype} does not match")
                holder = ctypes.c_void_p(value.ctypes.data)
                extents[position] = value.nbytes
            else:
                if not isinstance(value, np.generic) or not _accepts(code, value.dtype):
                    raise TypeError(f"{where}: expected a NumPy scalar of code {code}, got {value!r}")
                holder = np.array(value)
                extents[position] = -1
            keep_alive.append((value, holder))
            address = ctypes.addressof(holder) if kind == "p" else holder.ctypes.data
            pointers[position] = address
        status = self._launch(grid_x, block_x, pointers, extents)
        if status == 2:
            raise self._out_of_bounds(args)
        if status in _FAILURES:
            message = self._library.sc_emu_failure_message().decode()
            raise _FAILURES[status](f"{self.expression} <<<{grid_x}, {block_x}>>>: {message}")
        if status != 0:
            raise RuntimeError(f"{self.expression}: launch failed with status {status}")

    def _out_of_bounds(self, args: Sequence[Any]) -> OutOfBoundsAccess:
        position = int(self._library.sc_emu_fault_argument())
        if int(self._library.sc_emu_fault_kind()) == 3:
            return OutOfBoundsAccess(
                f"{self.expression}: accessed address {int(self._library.sc_emu_fault_address()):#x}, outside "
                "every array argument (a wild index: an out-of-range row, or one read past the end of an array)"
            )
        offset = int(self._library.sc_emu_fault_offset())
        array = args[position]
        element = offset // array.itemsize if array.itemsize else offset
        how = ("accessed" if int(self._library.sc_emu_fault_kind()) == 1
               else "wrote past its end at")
        return OutOfBoundsAccess(
            f"{self.expression}: argument {position} ({self.parameters[position]}, {array.dtype} "
            f"{tuple(array.shape)}, {array.size} elements) {how} element {element} (byte {offset}), "
            f"outside [0, {array.size}): an out-of-range or negative index"
        )

    def _check_configuration(self, grid: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, int]:
        grid, block = tuple(grid), tuple(block)
        if any(extent != 1 for extent in grid[1:] + block[1:]):
            raise ValueError(f"{self.expression}: only 1-D launches are emulated, got {grid}, {block}")
        if grid[0] < 1:
            raise ValueError(f"{self.expression}: a launch needs at least one block, got grid {grid}")
        if not 1 <= block[0] <= MAX_BLOCK_THREADS:
            raise ValueError(f"{self.expression}: block must have 1..1024 threads, got {block}")
        return int(grid[0]), int(block[0])


class EmulatedModule:
    """The emulated counterpart of a ``cupy.RawModule`` of one kernel file."""

    def __init__(self, file: str, library: Path) -> None:
        self.file = file
        self._library = ctypes.CDLL(str(library))
        self._library.sc_emu_fault_offset.restype = ctypes.c_longlong
        self._library.sc_emu_fault_address.restype = ctypes.c_ulonglong
        self._library.sc_emu_failure_message.restype = ctypes.c_char_p
        self._library.sc_emu_set_timeout.argtypes = [ctypes.c_double]
        self.set_timeout(LAUNCH_TIMEOUT_SECONDS)
        self._kernels: dict[str, EmulatedKernel] = {}
        for index, expression in enumerate(kernel_registry.kernel_file(file).name_expressions):
            launch = getattr(self._library, f"sc_emu_launch_{index}")
            launch.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p),
                               ctypes.POINTER(ctypes.c_longlong)]
            launch.restype = ctypes.c_int
            signature = getattr(self._library, f"sc_emu_signature_{index}")
            signature.restype = ctypes.c_char_p
            self._kernels[expression] = EmulatedKernel(expression, launch, signature().decode(), self._library)

    def set_timeout(self, seconds: float) -> None:
        """How long each launch of this module may wait at its barriers before it fails with `LaunchTimeout`."""
        self._library.sc_emu_set_timeout(float(seconds))

    def get_function(self, expression: str) -> EmulatedKernel:
        """The kernel of a registered name expression."""
        try:
            return self._kernels[expression]
        except KeyError:
            raise KeyError(f"{expression!r} is not registered for {self.file}") from None


@functools.lru_cache(maxsize=None)
def load_module(file: str, arch: int | None = None) -> EmulatedModule:
    """The emulated module of a kernel file, built on first use; ``arch`` (e.g. 75) builds the code path of
    that compute capability (`_flags`), None the default."""
    if arch is None:
        library = build_libraries([file])[file]
        return EmulatedModule(file, library)
    compiler = compiler_path()
    if compiler is None:
        raise RuntimeError("g++ not found: the CUDA emulation tests need a C++20 compiler")
    plan = _plan(file, compiler, arch=arch)
    if not plan.library.is_file():
        with _build_lock():
            _build_missing(compiler, [plan])
    return EmulatedModule(file, plan.library)


def load_module_from_source(file: str, source: str) -> EmulatedModule:
    """An emulated module of ``file``'s registered kernels built from another ``source`` text.

    For tests that show what the bounds checks catch (a kernel with a guard
    removed); cached like the registered sources, under the text's hash.
    """
    compiler = compiler_path()
    if compiler is None:
        raise RuntimeError("g++ not found: the CUDA emulation tests need a C++20 compiler")
    plan = _plan(file, compiler, source)
    if not plan.library.is_file():
        with _build_lock():
            _build_missing(compiler, [plan])
    return EmulatedModule(file, plan.library)
