"""Which library an array belongs to, and zero-copy conversion to the core's arrays.

Nothing here imports torch, jax or cupy: a library is only consulted when it is
already in ``sys.modules`` (an array of that library can only exist if it was
imported), in the style of array-api-compat. The core computes on NumPy arrays
(CPU) and CuPy arrays (GPU); any other array that speaks DLPack is viewed as
one of those without a copy, and results can be handed back the same way.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = [
    "array_library",
    "is_numpy_array",
    "is_cupy_array",
    "is_torch_tensor",
    "is_jax_array",
    "is_jax_tracer",
    "array_module",
    "to_core_array",
    "from_core_array",
    "device_of",
    "check_same_device",
]

CPU_DEVICE = "cpu"


def _module_root(value: Any) -> str:
    return type(value).__module__.split(".", 1)[0]


def is_numpy_array(value: Any) -> bool:
    """True for a NumPy ndarray (or subclass)."""
    return isinstance(value, np.ndarray)


def is_cupy_array(value: Any) -> bool:
    """True for a CuPy ndarray; never imports CuPy."""
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(value, cupy.ndarray)


def is_torch_tensor(value: Any) -> bool:
    """True for a torch.Tensor; never imports torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_jax_tracer(value: Any) -> bool:
    """True for an abstract JAX value seen under ``jit``/``grad``/``vmap`` tracing."""
    jax_core = sys.modules.get("jax.core")
    if jax_core is None:
        return False
    tracer = getattr(jax_core, "Tracer", None)
    return tracer is not None and isinstance(value, tracer)


def is_jax_array(value: Any) -> bool:
    """True for a concrete ``jax.Array``; never imports jax."""
    jax = sys.modules.get("jax")
    if jax is None or is_jax_tracer(value):
        return False
    array_type = getattr(jax, "Array", None)
    return array_type is not None and isinstance(value, array_type)


def array_library(value: Any) -> str:
    """Names the library an array comes from.

    Returns:
        One of ``"numpy"``, ``"cupy"``, ``"torch"``, ``"jax"``, ``"jax_tracer"``,
        ``"dlpack"`` (another object with ``__dlpack__``) or ``"unknown"``.
    """
    if is_numpy_array(value):
        return "numpy"
    if is_cupy_array(value):
        return "cupy"
    if is_torch_tensor(value):
        return "torch"
    if is_jax_tracer(value):
        return "jax_tracer"
    if is_jax_array(value):
        return "jax"
    if hasattr(value, "__dlpack__"):
        return "dlpack"
    return "unknown"


def _tracer_error(name: str) -> TypeError:
    return TypeError(
        f"{name} is a JAX tracer (an abstract value inside jax.jit, grad or vmap), but the "
        "sparsecore core needs concrete arrays: rulebooks and output sites depend on the "
        "values of the indices. Build the geometry (sparsecore.jax plan / rulebooks) "
        "outside jit, from concrete indices, and pass only features and weights into the "
        "jitted function."
    )


def _dlpack_device_type(value: Any) -> int | None:
    getter = getattr(value, "__dlpack_device__", None)
    if getter is None:
        return None
    return int(getter()[0])


# DLPack device types (dlpack.h): kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13.
_DLPACK_CPU_TYPES = (1, 3)
_DLPACK_CUDA_TYPES = (2, 13)


def to_core_array(value: Any, name: str = "array") -> Any:
    """Views an array as a NumPy (CPU) or CuPy (GPU) array, without copying.

    Args:
        value: a NumPy or CuPy array, a torch tensor, a JAX array, any object with
            ``__dlpack__``, or a Python sequence / scalar (converted with ``np.asarray``).
        name: the argument's name, used in error messages.

    Returns:
        ``numpy.ndarray`` for host data, ``cupy.ndarray`` for CUDA data.

    Raises:
        TypeError: for a JAX tracer, or an object that is not array-like.
    """
    library = array_library(value)
    if library in ("numpy", "cupy"):
        return value
    if library == "jax_tracer":
        raise _tracer_error(name)
    if library == "torch" and value.requires_grad:
        value = value.detach()
    if library in ("torch", "jax", "dlpack"):
        device_type = _dlpack_device_type(value)
        if device_type in _DLPACK_CUDA_TYPES:
            import cupy  # a CUDA array exists, so CuPy is the engine for it

            return cupy.from_dlpack(value)
        if device_type is None or device_type in _DLPACK_CPU_TYPES:
            return np.from_dlpack(value)
        raise TypeError(
            f"{name} lives on DLPack device type {device_type}; sparsecore computes on "
            "the CPU (NumPy) or on CUDA GPUs (CuPy). Move it to one of those first."
        )
    if isinstance(value, (list, tuple, int, float, bool, np.generic)):
        return np.asarray(value)
    raise TypeError(
        f"{name} must be an array (NumPy, CuPy, torch, JAX or any __dlpack__ object), "
        f"got {type(value).__module__}.{type(value).__qualname__}."
    )


def from_core_array(value: Any, like: Any) -> Any:
    """Hands a core array back in the library of ``like``, without copying.

    Args:
        value: a NumPy or CuPy array produced by the core.
        like: an array of the library wanted (torch tensor, JAX array, NumPy, CuPy).

    Returns:
        ``value`` as an array of ``like``'s library (same memory where the library allows).
    """
    library = array_library(like)
    if library in ("numpy", "cupy", "unknown", "dlpack"):
        return value
    if library == "torch":
        return sys.modules["torch"].from_dlpack(value)
    if library == "jax":
        return sys.modules["jax"].dlpack.from_dlpack(value)
    raise _tracer_error("like")


def array_module(value: Any) -> Any:
    """The array module (``numpy`` or ``cupy``) for a core array."""
    if is_cupy_array(value):
        return sys.modules["cupy"]
    return np


def device_of(value: Any) -> str:
    """A short device name: ``"cpu"`` or ``"cuda:N"``."""
    if is_cupy_array(value):
        return f"cuda:{value.device.id}"
    return CPU_DEVICE


def check_same_device(**arrays: Any) -> str:
    """Checks that every array given (None is skipped) lives on one device.

    Args:
        **arrays: core arrays by argument name.

    Returns:
        The common device name (``"cpu"`` when no array is given).

    Raises:
        ValueError: naming each argument and its device when they differ.
    """
    devices = {name: device_of(array) for name, array in arrays.items() if array is not None}
    distinct = sorted(set(devices.values()))
    if len(distinct) > 1:
        listing = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(
            f"arrays are on different devices ({listing}); sparsecore does not move data "
            "between devices implicitly. Move them to one device first (for example "
            "cupy.asarray(x) / x.get(), or tensor.to(device) in torch)."
        )
    return distinct[0] if distinct else CPU_DEVICE
