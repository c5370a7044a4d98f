"""Array backends: the primitives the core's algorithms run on.

`backend_for` picks the backend of an array without importing any framework:
NumPy arrays get `NumpyBackend`; CuPy arrays get the CuPy backend.

`require_cuda` and `CudaUnavailableError` (defined in
`sparsecore.backends.cuda_device`, re-exported here) are the one check every
GPU request passes: without CuPy or a usable CUDA device, one message saying
so and how to run on the CPU.
"""

from __future__ import annotations

from typing import Any

from .._dispatch import is_cupy_array
from .base import ArrayBackend
from .cuda_device import CPU_ADVICE, CudaUnavailableError, require_cuda
from .numpy_backend import NumpyBackend

__all__ = ["ArrayBackend", "NumpyBackend", "backend_for", "NUMPY_BACKEND", "CudaUnavailableError", "require_cuda",
           "CPU_ADVICE"]

NUMPY_BACKEND = NumpyBackend()


def backend_for(array: Any) -> ArrayBackend:
    """The backend that computes on ``array`` (a core NumPy or CuPy array).

    Raises:
        CudaUnavailableError: for a CuPy array when no CUDA device is visible.
        RuntimeError: for a CuPy array when the GPU backend cannot be loaded.
    """
    if is_cupy_array(array):
        require_cuda("a CuPy array")
        try:
            from .cupy_backend import CUPY_BACKEND
        except ImportError as error:
            raise RuntimeError(
                "the input arrays live on a CUDA GPU, but the sparsecore GPU backend "
                f"could not be loaded ({error}). Install the CUDA extra "
                "(pip install 'sparsecore-conv[cuda13]' or 'sparsecore-conv[cuda12]'), or pass NumPy arrays "
                "to run on the CPU."
            ) from error
        return CUPY_BACKEND
    return NUMPY_BACKEND
