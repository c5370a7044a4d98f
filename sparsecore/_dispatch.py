"""Which library an array belongs to, and zero-copy conversion to the core's arrays.

Nothing here imports torch, jax or cupy: a library is only consulted when it is
already in ``sys.modules`` (an array of that library can only exist if it was
imported), in the style of array-api-compat. The core computes on NumPy arrays
(CPU) and CuPy arrays (GPU); any other array that speaks DLPack is viewed as
one of those without a copy, and results can be handed back the same way.

`hands_back_caller_arrays` is the one place where the public core API meets
the caller's arrays: ``sparsecore/__init__.py`` wraps every public function
with it, so a result comes back in the library of the first array argument
(torch in, torch out; JAX in, JAX out; NumPy and CuPy as they are), zero-copy
through DLPack. The core cannot carry autograd or run under a JAX trace:
`to_core_array` refuses a torch tensor that requires grad (pointing to
``sparsecore.torch``) and a JAX tracer (pointing to ``sparsecore.jax``).
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable, Iterable, MutableMapping, TypeVar

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
    "caller_array",
    "hands_back",
    "hands_back_caller_arrays",
    "wrap_public_functions",
]

Function = TypeVar("Function", bound=Callable[..., Any])

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
        "values of the indices, and the core does not differentiate. Use the sparsecore.jax "
        "frontend, whose feature passes run under jit and grad: build the geometry "
        "(sparsecore.jax plan / rulebooks) outside jit, from concrete indices, and pass only "
        "features and weights into the jitted function."
    )


def _requires_grad_error(name: str) -> TypeError:
    return TypeError(
        f"{name} is a torch tensor that requires grad, but the sparsecore core computes on NumPy / "
        "CuPy arrays and cannot carry autograd: the result would silently lose its gradient. Use "
        "the differentiable layers of sparsecore.torch (import sparsecore.torch as spconv; "
        "spconv.SubMConv3d, ...) for training, or pass "
        f"{name}.detach() (or call under torch.no_grad()) to compute without gradients."
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
        TypeError: for a JAX tracer, a torch tensor that requires grad while grad mode is
            on (under ``torch.no_grad()`` it is viewed detached), or an object that is
            not array-like.
        RuntimeError: (`sparsecore.backends.CudaUnavailableError`) for a CUDA array when
            CuPy cannot run on it.
    """
    library = array_library(value)
    if library in ("numpy", "cupy"):
        return value
    if library == "jax_tracer":
        raise _tracer_error(name)
    if library == "torch" and value.requires_grad:
        if sys.modules["torch"].is_grad_enabled():
            raise _requires_grad_error(name)
        value = value.detach()
    if library in ("torch", "jax", "dlpack"):
        device_type = _dlpack_device_type(value)
        if device_type in _DLPACK_CUDA_TYPES:
            from .backends.cuda_device import require_cuda  # a CUDA array exists: CuPy is its engine

            return require_cuda(f"{name} (a CUDA array)").from_dlpack(value)
        if device_type is None or device_type in _DLPACK_CPU_TYPES:
            if str(getattr(value, "dtype", "")).endswith("bfloat16"):
                from ._bfloat16 import bfloat16_view  # NumPy's DLPack has no bfloat16

                return bfloat16_view(value, library, name)
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


def _jax_without_x64(jax: Any, value: Any) -> Any:
    """``value`` narrowed to the 32-bit dtype JAX uses when ``jax_enable_x64`` is off.

    JAX would narrow a 64-bit buffer itself, wrapping integers that do not fit
    (``2**40`` becomes 0): refused here instead, with the fix.
    """
    if value.dtype.itemsize != 8 or value.dtype.kind not in "iuf" or jax.config.jax_enable_x64:
        return value
    xp = array_module(value)
    if value.dtype.kind == "f":
        return value.astype(xp.float32)
    narrow = xp.int32 if value.dtype.kind == "i" else xp.uint32
    limits = np.iinfo(narrow)
    if value.size and (int(value.min()) < limits.min or int(value.max()) > limits.max):
        raise ValueError(
            f"a {value.dtype} result holds values outside the {np.dtype(narrow).name} range "
            f"([{int(value.min())}, {int(value.max())}]), and JAX has 64-bit types disabled, so it "
            "would wrap them. Enable them with jax.config.update('jax_enable_x64', True), or pass "
            "NumPy arrays to get NumPy results."
        )
    return value.astype(narrow)


def from_core_array(value: Any, like: Any) -> Any:
    """Hands a core array back in the library of ``like``, without copying.

    Args:
        value: a NumPy or CuPy array produced by the core.
        like: an array of the library wanted (torch tensor, JAX array, NumPy, CuPy).

    Returns:
        ``value`` as an array of ``like``'s library (same memory where the library
        allows; a read-only NumPy array is copied for torch, which cannot mark a
        tensor read-only; with JAX's 64-bit types off, 64-bit results are narrowed
        to 32 bits, as JAX does, and integers that do not fit are refused).

    Raises:
        TypeError: for a JAX tracer as ``like``.
        ValueError: for 64-bit integers beyond 32 bits when JAX has 64-bit types off.
    """
    library = array_library(like)
    if library in ("numpy", "cupy", "unknown", "dlpack"):
        return value
    if is_numpy_array(value) and value.dtype.name == "bfloat16":  # NumPy's DLPack has no bfloat16
        from ._bfloat16 import bfloat16_to

        return bfloat16_to(value, library)
    if library == "torch":
        if is_numpy_array(value) and not value.flags.writeable:
            value = value.copy()
        return sys.modules["torch"].from_dlpack(value)
    if library == "jax":
        jax = sys.modules["jax"]
        return jax.dlpack.from_dlpack(_jax_without_x64(jax, value))
    raise _tracer_error("like")


def caller_array(arguments: Iterable[Any]) -> Any | None:
    """The first torch tensor or JAX array among ``arguments`` (and in list / tuple arguments).

    Returns None when the first array found is a NumPy, CuPy or other DLPack array
    (its results are core arrays already), or when there is no array at all.
    """
    for argument in arguments:
        candidates = argument if isinstance(argument, (list, tuple)) else (argument,)
        for candidate in candidates:
            library = array_library(candidate)
            if library in ("torch", "jax"):
                return candidate
            if library != "unknown":  # numpy, cupy, dlpack, or a tracer (refused on conversion)
                return None
    return None


def hands_back(result: Any, like: Any) -> Any:
    """``result`` with each core array in it (top level, tuples, lists) handed back like ``like``.

    Other values, including the core's objects (`SparseTensor`, `Rulebook`,
    `Voxels`, ...), which hold core arrays, are returned as they are.
    """
    if is_numpy_array(result) or is_cupy_array(result):
        return from_core_array(result, like)
    if isinstance(result, tuple):
        items = [hands_back(item, like) for item in result]
        return type(result)(*items) if hasattr(result, "_fields") else tuple(items)
    if isinstance(result, list):
        return [hands_back(item, like) for item in result]
    return result


def hands_back_caller_arrays(function: Function) -> Function:
    """Wraps a public core function so its array results come back in the caller's library.

    The library is that of the first array argument (`caller_array`): a torch
    tensor in gives torch tensors out (on its device, zero-copy), a JAX array
    gives JAX arrays, NumPy / CuPy give NumPy / CuPy as before. Arguments are
    converted by the function itself (`to_core_array`), which refuses torch
    tensors that require grad and JAX tracers.
    """

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _refuse_untraceable(function, args, kwargs)
        result = function(*args, **kwargs)
        like = caller_array(args + tuple(kwargs.values()))
        return result if like is None else hands_back(result, like)

    wrapper.hands_back_caller_arrays = True  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]


def _refuse_untraceable(function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raises, naming the argument, for a torch tensor that requires grad (grad mode on) or a JAX tracer."""
    torch = sys.modules.get("torch")
    grad_enabled = torch is not None and torch.is_grad_enabled()
    for position, argument in enumerate(args + tuple(kwargs.values())):
        candidates = argument if isinstance(argument, (list, tuple)) else (argument,)
        for candidate in candidates:
            traced = is_jax_tracer(candidate)
            needs_grad = grad_enabled and is_torch_tensor(candidate) and candidate.requires_grad
            if traced or needs_grad:
                name = _argument_name(function, position, args, kwargs)
                raise _tracer_error(name) if traced else _requires_grad_error(name)


def _argument_name(function: Callable[..., Any], position: int, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> str:
    """The parameter name of the ``position``-th argument (positional first, then keywords)."""
    if position >= len(args):
        return list(kwargs)[position - len(args)]
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return f"argument {position}"
    if position < len(parameters) and parameters[position].kind in (
            inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return parameters[position].name
    for index, parameter in enumerate(parameters):
        if parameter.kind == inspect.Parameter.VAR_POSITIONAL and position >= index:
            return f"{parameter.name}[{position - index}]"
    return f"argument {position}"


def wrap_public_functions(namespace: MutableMapping[str, Any], names: Iterable[str]) -> None:
    """Replaces each plain function among ``names`` in ``namespace`` by `hands_back_caller_arrays` of it.

    Called once, by ``sparsecore/__init__.py``, on its ``__all__``: classes are left alone.
    """
    for name in names:
        value = namespace[name]
        if callable(value) and not isinstance(value, type) and not getattr(value, "hands_back_caller_arrays", False):
            namespace[name] = hands_back_caller_arrays(value)


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
