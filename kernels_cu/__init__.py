"""CUDA C++ sources of sparsecore's GPU kernels, installed as ``sparsecore.kernels_cu``.

The ``.cu``, ``.cuh`` and ``.h`` files beside this module are package data: the
CuPy backend reads them and compiles them with NVRTC at run time. This module
imports nothing beyond the standard library; it only tells where the sources are.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["KERNEL_SOURCE_SUFFIXES", "kernel_directory", "kernel_source_names", "source_path"]

KERNEL_SOURCE_SUFFIXES: tuple[str, ...] = (".cu", ".cuh", ".h")


def kernel_directory() -> Path:
    """The directory that holds the installed kernel sources.

    Returns:
        The absolute path of the ``sparsecore/kernels_cu`` package directory.
    """
    return Path(__file__).resolve().parent


def kernel_source_names() -> tuple[str, ...]:
    """Names of every kernel source file shipped, sorted.

    Returns:
        File names (not paths) ending in one of ``KERNEL_SOURCE_SUFFIXES``.
    """
    return tuple(
        sorted(
            path.name
            for path in kernel_directory().iterdir()
            if path.is_file() and path.suffix in KERNEL_SOURCE_SUFFIXES
        )
    )


def source_path(name: str) -> Path:
    """The path of one kernel source file.

    Args:
        name: a file name such as ``"hash_table.cu"``.

    Returns:
        The absolute path of that file.

    Raises:
        FileNotFoundError: when no shipped kernel source has that name; the
            message lists the names that exist.
    """
    path = kernel_directory() / name
    if path.suffix not in KERNEL_SOURCE_SUFFIXES or not path.is_file():
        available = ", ".join(kernel_source_names()) or "none"
        raise FileNotFoundError(
            f"no kernel source named {name!r} in {kernel_directory()}; available: {available}."
        )
    return path
