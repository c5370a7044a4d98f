"""Array backends: the primitives the core's algorithms run on.

`backend_for` picks the backend of an array without importing any framework:
NumPy arrays get `NumpyBackend`; CuPy arrays get the CuPy backend.

`require_cuda` is the one check every GPU request passes (a CuPy array reaching
`backend_for`, a CUDA DLPack array reaching the core, ``--device cuda`` in the
demo, the examples and the benchmark): without CuPy or a usable CUDA device it
raises `CudaUnavailableError`, one message saying so and how to run on the CPU,
instead of CuPy's ``cudaErrorInsufficientDriver`` from deep inside.
"""

from __future__ import annotations

from typing import Any

from .._dispatch import is_cupy_array
from .base import ArrayBackend
from .numpy_backend import NumpyBackend

__all__ = ["ArrayBackend", "NumpyBackend", "backend_for", "NUMPY_BACKEND", "CudaUnavailableError", "require_cuda"]

NUMPY_BACKEND = NumpyBackend()

CPU_ADVICE = (
    "To run on the CPU, pass NumPy arrays (cupy.asnumpy(x), tensor.cpu()), or use --device cpu "
    "with the sparsecore demo, examples and benchmark."
)


class CudaUnavailableError(RuntimeError):
    """A GPU computation was requested, but no CUDA device is visible (or CuPy is missing)."""


def require_cuda(request: str = "a GPU computation", cpu_advice: str = CPU_ADVICE) -> Any:
    """The ``cupy`` module, once it is known to see a usable CUDA device.

    Args:
        request: what asked for the GPU, for the message (``"--device cuda"``, ...).
        cpu_advice: how to run the same thing on the CPU, ending the message.

    Returns:
        The imported ``cupy`` module.

    Raises:
        CudaUnavailableError: CuPy does not import, or its CUDA runtime finds no device
            (no GPU, no driver, or a driver older than CuPy's runtime).
    """
    try:
        import cupy
    except ImportError as error:
        raise CudaUnavailableError(
            f"{request} needs CuPy, which does not import here ({error}). Install the CUDA extra "
            f"(pip install 'sparsecore[cuda13]' or '[cuda12]') on a machine with an NVIDIA GPU. {cpu_advice}"
        ) from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # noqa: BLE001 - CUDARuntimeError and driver load failures alike
        reason = str(error).split(":", 1)[0] or type(error).__name__
        raise CudaUnavailableError(
            f"{request} needs a CUDA GPU, but no CUDA device is visible ({reason}: no GPU, no NVIDIA "
            f"driver, or a driver too old for CuPy's CUDA runtime). {cpu_advice}"
        ) from None
    if count < 1:
        raise CudaUnavailableError(
            f"{request} needs a CUDA GPU, but no CUDA device is visible (CuPy counts 0 devices; check "
            f"CUDA_VISIBLE_DEVICES). {cpu_advice}"
        )
    return cupy


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
                "(pip install 'sparsecore[cuda13]' or '[cuda12]'), or pass NumPy arrays "
                "to run on the CPU."
            ) from error
        return CUPY_BACKEND
    return NUMPY_BACKEND
