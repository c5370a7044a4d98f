"""torch tensors <-> core arrays, without copies, on the right device and stream.

CPU tensors become NumPy views (``numpy.from_dlpack``); CUDA tensors become
CuPy views through DLPack, inside `core_context`, which makes torch's current
stream CuPy's current stream and routes CuPy's allocations to torch's caching
allocator, so the core's kernels are ordered with torch's work and a training
loop keeps one memory pool. CuPy is imported only when a CUDA tensor arrives:
on CPU this module never touches it.

bfloat16 has no NumPy dtype of its own: a CPU bfloat16 tensor reaches the core
as an ``ml_dtypes.bfloat16`` view of its memory when ml_dtypes is installed (it
comes with JAX; `sparsecore.interop.bfloat16_dtype`), so the core's bfloat16
passes run it (``vdpbf16ps`` where the CPU has it, `sparsecore.bf16_cpu_dataflow`);
otherwise, and on CUDA, it is upcast to float32 for the core (which accumulates
in float32 anyway) and results are cast back.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import numpy as np
import torch

from sparsecore.backends import require_cuda
from sparsecore.interop import FLOAT_DTYPES as CORE_FLOAT_DTYPES
from sparsecore.interop import INT32_MAX, INT32_MIN, bfloat16_dtype, is_cupy_array, to_core_array

__all__ = [
    "core_context",
    "core_view",
    "core_float_view",
    "to_torch",
    "check_same_device",
    "as_int32_indices",
    "FLOAT_DTYPES",
]

#: Feature dtypes the frontend accepts: the core's, and bfloat16 (the core's bfloat16 passes on the CPU, else
#: computed in float32).
FLOAT_DTYPES = (torch.bfloat16, *(getattr(torch, dtype.name) for dtype in CORE_FLOAT_DTYPES))

_local = threading.local()


def _torch_backed_allocator(cupy: Any) -> Any:
    """A CuPy allocator that takes memory from torch's caching allocator on torch's current stream."""
    allocator = getattr(_local, "allocator", None)
    if allocator is None:

        def malloc(size: int, device_id: int) -> int:
            stream = torch.cuda.current_stream(device_id)
            return torch.cuda.caching_allocator_alloc(size, device_id, stream)

        def free(pointer: int, device_id: int) -> None:
            torch.cuda.caching_allocator_delete(pointer)

        allocator = cupy.cuda.memory.PythonFunctionAllocator(malloc, free)
        _local.allocator = allocator
    return allocator


@contextlib.contextmanager
def core_context(device: torch.device) -> Iterator[None]:
    """Runs the core on ``device``: for CUDA, on torch's current stream and memory pool.

    On CPU this does nothing (and imports nothing). Inside a context of the same
    CUDA device on the same thread (a layer's forward holds one around its
    rulebook and its feature pass; the ops it calls open theirs) it does nothing
    either: one device and stream context per layer.
    """
    if device.type != "cuda":
        yield
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    outer = getattr(_local, "device_index", None)
    if outer == index:
        yield
        return
    # a CUDA tensor exists, so the CuPy engine is wanted: one clear error when CuPy cannot run
    cupy = require_cuda(f"a CUDA tensor (on {device}) in sparsecore.torch",
                        "Install CuPy for this CUDA version, or move the model and inputs to the CPU "
                        "(model.cpu(), features.cpu(), indices.cpu()).")

    stream = torch.cuda.current_stream(index)
    with torch.cuda.device(index), cupy.cuda.Device(index):
        external = cupy.cuda.Stream.from_external(stream)
        with external, cupy.cuda.using_allocator(_torch_backed_allocator(cupy).malloc):
            _local.device_index = index
            try:
                yield
            finally:
                _local.device_index = outer


#: torch dtypes ``Tensor.numpy`` views directly (bfloat16 has no NumPy twin; complex tensors may carry a
#: conjugate bit that only DLPack resolves).
_NUMPY_DTYPES = frozenset((torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
                           torch.int32, torch.int64, torch.bool))


def core_view(tensor: torch.Tensor, name: str) -> Any:
    """A NumPy (CPU) or CuPy (CUDA) view of ``tensor``; contiguous, detached, no copy when possible.

    Call inside `core_context` for CUDA tensors.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.device.type not in ("cpu", "cuda"):
        raise TypeError(
            f"{name} is on device {tensor.device}; sparsecore computes on the CPU or on CUDA GPUs. "
            f"Move it first, e.g. {name}.to('cuda') or {name}.cpu()."
        )
    if tensor.device.type == "cpu" and type(tensor) is torch.Tensor and tensor.dtype in _NUMPY_DTYPES:
        return tensor.numpy()  # the same memory as through DLPack, without its Python layers (~5 us a view)
    return to_core_array(tensor, name)


def core_float_view(tensor: torch.Tensor, name: str) -> Any:
    """Like `core_view` for float tensors; a CPU bfloat16 tensor becomes an ``ml_dtypes.bfloat16`` view (no copy)
    where ml_dtypes is installed, else (and on CUDA) a float32 copy."""
    if tensor.dtype == torch.bfloat16:
        plain = tensor.detach()
        dtype = bfloat16_dtype() if plain.device.type == "cpu" and type(plain) is torch.Tensor else None
        if dtype is None:
            return core_view(tensor.float(), name)
        return core_view(plain.contiguous().view(torch.int16), name).view(dtype)
    return core_view(tensor, name)


def to_torch(array: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A torch tensor sharing the memory of a core (NumPy / CuPy) array; cast to ``dtype`` if given."""
    if is_cupy_array(array):
        tensor = torch.from_dlpack(array)
    else:
        array = np.asarray(array)
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.ascontiguousarray(array).copy()
        if array.dtype.name == "bfloat16":  # ml_dtypes: torch reads the bits
            tensor = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        else:
            tensor = torch.from_numpy(array)
    if dtype is not None and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    return tensor


def check_same_device(layer: str, **tensors: torch.Tensor | None) -> torch.device:
    """Raises a ValueError naming every tensor and its device when they are not on one device."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise ValueError(
            f"{layer}: tensors are on different devices ({listing}). sparsecore does not move "
            "data between devices implicitly; move the module and the input to one device "
            "(module.to(device), features.to(device), indices.to(device))."
        )
    return next(iter(devices.values()))


def as_int32_indices(indices: Any, name: str = "indices") -> Any:
    """``indices`` as int32, converted once from another integer dtype when its values fit int32.

    The core's rule (`sparsecore.interop.as_indices`), applied to torch tensors:
    int32 passes through unchanged (the same tensor); int64 (what ``torch.nonzero``,
    ``torch.floor(...).long()`` and most loaders give), int16, int8 and uint8 are
    range-checked and converted; anything else (floats, bools, non-tensors) is left
    for the caller's validation to refuse by name.

    Raises:
        ValueError: for integer values outside the int32 range.
    """
    if not isinstance(indices, torch.Tensor) or indices.dtype == torch.int32:
        return indices
    if indices.dtype.is_floating_point or indices.dtype.is_complex or indices.dtype == torch.bool:
        return indices
    if indices.numel():
        low, high = int(indices.min()), int(indices.max())
        if low < INT32_MIN or high > INT32_MAX:
            raise ValueError(
                f"{name} ({indices.dtype}) has values in [{low}, {high}], outside the int32 range "
                f"[{INT32_MIN}, {INT32_MAX}]: coordinates must fit the grid (spatial_shape) and batch "
                "indices the batch; check how the coordinates were computed"
            )
    return indices.to(torch.int32)
