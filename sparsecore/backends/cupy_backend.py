"""The CuPy (GPU) backend: `KernelBackend` on CuPy arrays, kernels launched as RawKernels.

Imported only by `sparsecore.backends.backend_for` when an input is a CuPy
array, so importing sparsecore never imports CuPy. Kernels are compiled by
NVRTC on first use, per device, and cached on disk by CuPy
(`kernel_registry.get_kernel`). Every launch goes to CuPy's *current* stream,
the stream CuPy's own operations (sorts, scans) in the backend use
too; a frontend makes the caller's stream current with
``with cupy.cuda.Stream.from_external(stream):`` around a call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cupy

from . import kernel_registry
from .kernel_backend import KernelBackend, tf32_from_environment

__all__ = ["CupyLauncher", "CUPY_BACKEND"]


@dataclass(frozen=True)
class CupyLauncher:
    """Launches registered kernels on the current CUDA device and CuPy's current stream."""

    def launch(self, expression: str, grid: int, block: int, args: tuple[Any, ...]) -> None:
        """Runs ``expression<<<grid, block>>>(*args)`` (see `KernelLauncher.launch`)."""
        kernel = kernel_registry.get_kernel(expression, cupy.cuda.runtime.getDevice())
        kernel((grid,), (block,), args)  # a RawKernel launches on the current stream


# float32 convolutions on TF32 tensor cores when CUPY_TF32 > 0 at import (CuPy's own switch and reading).
CUPY_BACKEND = KernelBackend(cupy, CupyLauncher(), name="cupy", tf32=tf32_from_environment())
