"""Whether a CUDA device is usable: the one check every GPU request passes.

`require_cuda` is called for a CuPy array reaching `sparsecore.backends.backend_for`,
a CUDA DLPack array reaching the core (`sparsecore._dispatch`), ``--device cuda``
in the demo, the examples and the benchmark. Without CuPy or a usable CUDA device
it raises `CudaUnavailableError`: one message saying so and how to run on the
CPU, instead of CuPy's ``cudaErrorInsufficientDriver`` from deep inside. This
module imports nothing of sparsecore (both the backends and the array dispatch
use it), and imports CuPy only when called.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CPU_ADVICE", "CudaUnavailableError", "require_cuda"]

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
            f"(pip install 'sparsecore-conv[cuda13]' or 'sparsecore-conv[cuda12]') on a machine with an NVIDIA GPU. {cpu_advice}"
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
