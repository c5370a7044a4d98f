"""Emulated device arrays that refuse every read back to the host, for "no host synchronisation" tests.

On a GPU, code that turns device data into a host value (``int(x)``,
``float(x)``, ``bool(x)``, ``x.item()``, ``x.tolist()``, ``x.get()``,
``cupy.asnumpy``, iterating, boolean-mask indexing) blocks until the stream
has run, and so do CuPy functions whose output size depends on the data
(``bincount`` reads ``max`` back, ``nonzero``, ``unique``, ``compress``,
``repeat`` by an array...). On the CPU emulation the arrays are NumPy's, so
none of that is visible. Here:

- `DeviceArray` is an ``ndarray`` subclass whose host conversions raise
  `HostReadError` while `forbid_host_reads` is active; NumPy functions called
  on it (``np.bincount(device)``, through ``__array_function__``) are held to
  the same rule, and their array results stay `DeviceArray`;
- `DEVICE_NUMPY` is the array library of those arrays: NumPy's functions with
  `DeviceArray` results (creation functions included), the data-sized ones
  refused while reads are forbidden;
- `device_backend` is the emulated kernel backend on that library, and
  `use_device_arrays` makes the core's `array_module` answer `DEVICE_NUMPY`
  for them, as it answers ``cupy`` for CuPy arrays.

Shapes, dtypes and pointers stay readable (they are host metadata on a GPU
too), and kernels launch on the arrays' memory as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from typing import Any, Iterator

import numpy as np

__all__ = ["HostReadError", "DeviceArray", "DEVICE_NUMPY", "forbid_host_reads", "to_device", "device_backend",
           "use_device_arrays"]


class HostReadError(AssertionError):
    """Device data was read back to the host while reads were forbidden."""


# Whether host reads are forbidden now (any thread: JAX runs callbacks on its own threads).
_FORBIDDEN = {"depth": 0}
_LOCK = threading.Lock()

# NumPy functions whose CuPy counterparts read device data to size their result.
_DATA_SIZED = frozenset({"bincount", "nonzero", "flatnonzero", "argwhere", "unique", "unique_values",
                         "unique_counts", "unique_inverse", "unique_all", "compress", "extract", "histogram",
                         "asnumpy", "array_equal", "allclose", "array_equiv", "setdiff1d", "union1d",
                         "intersect1d", "in1d", "isin", "trim_zeros"})


def _forbidden() -> bool:
    return _FORBIDDEN["depth"] > 0


def _refuse(what: str) -> None:
    if _forbidden():
        raise HostReadError(f"{what} reads device data back to the host (a GPU synchronisation)")


@contextlib.contextmanager
def forbid_host_reads() -> Iterator[None]:
    """Within the block, any read of a `DeviceArray` back to the host raises `HostReadError`."""
    with _LOCK:
        _FORBIDDEN["depth"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _FORBIDDEN["depth"] -= 1


def _to_device(value: Any) -> Any:
    if type(value) is np.ndarray:
        return value.view(DeviceArray)
    if isinstance(value, tuple):
        return tuple(_to_device(item) for item in value)
    if isinstance(value, list):
        return [_to_device(item) for item in value]
    return value


def _has_boolean_array(key: Any) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(item, np.ndarray) and item.dtype == bool and item.ndim > 0 for item in keys)


def _check_repeat(args: tuple, kwargs: dict) -> None:
    repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
    if isinstance(repeats, np.ndarray) and repeats.ndim > 0:
        _refuse("repeat by an array of counts")


def _scalar_conversion(what: str, convert: Any) -> Any:
    """A ``__int__``-like method: refused while reads are forbidden, else ``convert`` of the one element."""

    def conversion(self: np.ndarray) -> Any:
        _refuse(what)
        return convert(np.asarray(self).item())

    return conversion


class DeviceArray(np.ndarray):
    """An ndarray that stands for GPU memory: host conversions raise while reads are forbidden."""

    __int__ = _scalar_conversion("int(array)", int)
    __float__ = _scalar_conversion("float(array)", float)
    __index__ = _scalar_conversion("array used as an index", int)
    __complex__ = _scalar_conversion("complex(array)", complex)

    def __bool__(self) -> bool:
        _refuse("bool(array)")
        return bool(np.asarray(self).item()) if self.ndim == 0 else bool(np.asarray(self))

    def __iter__(self):
        _refuse("iterating over an array")
        return (_to_device(item) for item in np.asarray(self))

    def item(self, *args: Any) -> Any:
        _refuse("array.item()")
        return np.asarray(self).item(*args)

    def tolist(self) -> Any:
        _refuse("array.tolist()")
        return np.asarray(self).tolist()

    def get(self) -> np.ndarray:
        """CuPy's device-to-host copy."""
        _refuse("array.get()")
        return np.array(self, copy=True).view(np.ndarray)

    def nonzero(self) -> tuple:
        _refuse("array.nonzero()")
        return _to_device(np.asarray(self).nonzero())

    def repeat(self, repeats: Any, axis: Any = None) -> Any:
        _check_repeat((self, repeats), {})
        return _to_device(np.asarray(self).repeat(repeats, axis))

    def __getitem__(self, key: Any) -> Any:
        if _has_boolean_array(key):
            _refuse("boolean-mask indexing")
        result = super().__getitem__(key)
        return result.view(DeviceArray) if isinstance(result, np.ndarray) else DeviceArray._scalar(result)

    @staticmethod
    def _scalar(value: Any) -> Any:
        # CuPy gives 0-d arrays where NumPy gives scalars: keep them on the "device"
        return np.asarray(value).view(DeviceArray) if isinstance(value, np.generic) else value

    def __array_wrap__(self, array: Any, context: Any = None, return_scalar: bool = False) -> Any:
        return np.asarray(array).view(DeviceArray)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func.__name__ in _DATA_SIZED:
            _refuse(f"numpy.{func.__name__}")
        if func.__name__ == "repeat":
            _check_repeat(args, kwargs)
        result = super().__array_function__(func, tuple(np.ndarray if t is DeviceArray else t for t in types),
                                            args, kwargs)
        return _to_device(result)


class _DeviceNumpy:
    """NumPy as the library of `DeviceArray`: array results are device arrays; data-sized functions refused."""

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(np, name)
        if isinstance(attribute, type) or not callable(attribute) or isinstance(attribute, np.ufunc):
            return attribute  # dtypes, constants; ufuncs keep DeviceArray inputs as they are

        def call(*args: Any, **kwargs: Any) -> Any:
            if name in _DATA_SIZED:
                _refuse(f"xp.{name}")
            if name == "repeat":
                _check_repeat(args, kwargs)
            return _to_device(attribute(*args, **kwargs))

        call.__name__ = name
        return call

    def asnumpy(self, array: Any) -> np.ndarray:
        """``cupy.asnumpy``: a host copy (refused while reads are forbidden)."""
        _refuse("xp.asnumpy")
        return np.array(array, copy=True).view(np.ndarray)


DEVICE_NUMPY = _DeviceNumpy()


def to_device(array: Any) -> DeviceArray:
    """A `DeviceArray` view of a NumPy array (a contiguous copy of anything else array-like)."""
    return np.ascontiguousarray(array).view(DeviceArray)


def device_backend(backend: Any) -> Any:
    """The emulated kernel backend ``backend`` on `DEVICE_NUMPY`."""
    return dataclasses.replace(backend, xp=DEVICE_NUMPY)


def use_device_arrays(monkeypatch: Any) -> None:
    """Makes ``array_module`` answer `DEVICE_NUMPY` for device arrays in every sparsecore module that imported it."""
    from sparsecore import _dispatch

    original = _dispatch.array_module

    def array_module(value: Any) -> Any:
        return DEVICE_NUMPY if isinstance(value, DeviceArray) else original(value)

    for name, module in list(sys.modules.items()):
        if name.startswith("sparsecore") and getattr(module, "array_module", None) is original:
            monkeypatch.setattr(module, "array_module", array_module)


def route_to_emulated_backend(monkeypatch: Any, backend: Any) -> list[str]:
    """Routes device arrays to ``backend`` (the emulated kernel backend on `DEVICE_NUMPY`) as the core routes
    CuPy arrays, in every sparsecore module that imported ``array_module`` or ``backend_for``.

    Returns:
        The reads back attempted from then on (each still refused while `forbid_host_reads` is active).
    """
    from sparsecore import _dispatch, backends

    array_module, backend_for = _dispatch.array_module, backends.backend_for
    for name, module in list(sys.modules.items()):
        if name.startswith("sparsecore") and module is not None:
            if getattr(module, "array_module", None) is array_module:
                monkeypatch.setattr(module, "array_module", lambda value: DEVICE_NUMPY if isinstance(
                    value, DeviceArray) else array_module(value))
            if getattr(module, "backend_for", None) is backend_for:
                monkeypatch.setattr(module, "backend_for", lambda array: backend if isinstance(
                    array, DeviceArray) else backend_for(array))
    reads: list[str] = []
    refuse = sys.modules[__name__]._refuse

    def counted_refuse(what: str) -> None:
        reads.append(what)
        refuse(what)

    monkeypatch.setattr(sys.modules[__name__], "_refuse", counted_refuse)
    return reads
