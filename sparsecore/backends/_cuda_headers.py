"""Where the CUDA headers NVRTC needs are, and the NVRTC options that name them.

The runtime headers (``cuda_fp16.h``...) come with CuPy's ``[ctk]`` extra or a
toolkit; the tensor-core header ``crt/mma.h``, which ``#include <mma.h>`` (wmma)
needs, does not: the ``nvidia-cuda-crt`` wheel (CUDA 13, sparsecore's ``cuda13``
extra) or ``nvidia-cuda-nvcc-cu12`` (CUDA 12, the ``cuda12`` extra) or a toolkit
brings it. `kernel_registry` re-exports these for the backend, the NVRTC tests
and the device tools.
"""

from __future__ import annotations

import os
from pathlib import Path

# The header of the tensor-core API (``<mma.h>`` includes it), which the CUDA runtime wheels lack.
TENSOR_CORE_HEADER = "crt/mma.h"

__all__ = ["TENSOR_CORE_HEADER", "cuda_include_dir", "tensor_core_include_dir", "nvrtc_options"]


def _include_candidates() -> list[Path]:
    """Directories that may hold the CUDA headers, in the order `cuda_include_dir` searches them."""
    candidates: list[Path] = []
    try:
        import nvidia  # namespace package of the CUDA wheels

        for root in getattr(nvidia, "__path__", ()):
            root_path = Path(root)
            candidates += [root_path / "cu13" / "include", root_path / "cuda_runtime" / "include",
                           root_path / "cuda_nvcc" / "include"]
            candidates += sorted(root_path.glob("cu*/include"), reverse=True)
    except ImportError:
        pass
    for variable in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(variable):
            candidates.append(Path(os.environ[variable]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    return candidates


def cuda_include_dir() -> str | None:
    """The CUDA toolkit header directory (with ``cuda_fp16.h``) NVRTC needs, or None.

    Searched in order: the ``nvidia`` wheels' include directories (CUDA 13's
    ``nvidia/cu13/include``, CUDA 12's ``nvidia/cuda_runtime/include``), then
    ``$CUDA_PATH/include``, ``$CUDA_HOME/include`` and ``/usr/local/cuda/include``.
    """
    for candidate in _include_candidates():
        if (candidate / "cuda_fp16.h").is_file():
            return str(candidate)
    return None


def tensor_core_include_dir() -> str | None:
    """The directory holding ``crt/mma.h`` (what ``#include <mma.h>``, wmma, needs), or None.

    The ``nvidia-cuda-crt`` wheel (CUDA 13) puts it in ``nvidia/cu13/include``,
    possibly in another site-packages than the runtime headers (a virtual
    environment over the system's); CUDA 12's ``nvidia-cuda-nvcc-cu12`` in
    ``nvidia/cuda_nvcc/include``; a toolkit in its ``include``. The directory of
    `cuda_include_dir` is preferred, then one of the same name (the same CUDA
    release), then the rest in `cuda_include_dir`'s order.
    """
    base = cuda_include_dir()
    candidates = _include_candidates()
    if base is not None:
        base_path = Path(base)
        candidates = ([base_path] + [path for path in candidates if path.name == base_path.name
                                     and path.parent.name == base_path.parent.name] + candidates)
    for candidate in candidates:
        if (candidate / TENSOR_CORE_HEADER).is_file():
            return str(candidate)
    return None


def nvrtc_options(extra: tuple[str, ...] = (), tensor_cores: bool = False) -> tuple[str, ...]:
    """NVRTC options for every kernel file (no ``-arch``: CuPy adds the device's).

    Args:
        extra: options appended as given (e.g. ``("-arch=compute_90",)``).
        tensor_cores: the file includes ``<mma.h>`` (`KernelFile.tensor_cores`):
            ``crt/mma.h`` must be found.

    Raises:
        RuntimeError: when no CUDA headers are found, or ``crt/mma.h`` when asked for.
    """
    include_dir = cuda_include_dir()
    if include_dir is None:
        raise RuntimeError(
            "the CUDA headers (cuda_fp16.h) that NVRTC needs were not found: install "
            "'cupy-cuda13x[ctk]' (or 'cupy-cuda12x[ctk]'), or set CUDA_PATH to a CUDA toolkit"
        )
    tensor_dir = tensor_core_include_dir()
    if tensor_cores and tensor_dir is None:
        raise RuntimeError(
            f"the tensor-core header {TENSOR_CORE_HEADER} (included by <mma.h>) that the feature kernels need was "
            "not found: install sparsecore's 'cuda13' extra (the nvidia-cuda-crt wheel) or 'cuda12' extra "
            "(nvidia-cuda-nvcc-cu12), or set CUDA_PATH to a CUDA toolkit"
        )
    extra_dirs = (f"-I{tensor_dir}",) if tensor_dir is not None and tensor_dir != include_dir else ()
    return ("-std=c++17", f"-I{include_dir}") + extra_dirs + tuple(extra)
