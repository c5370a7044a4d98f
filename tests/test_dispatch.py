"""sparsecore._dispatch: telling array libraries apart, zero-copy views, device checks."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from sparsecore import _dispatch

DLPACK_ALIGNMENT = 64  # JAX's CPU client imports host buffers without a copy only when so aligned


def _aligned_float32(count: int) -> np.ndarray:
    raw = np.empty(count * 4 + DLPACK_ALIGNMENT, dtype=np.uint8)
    offset = (-raw.ctypes.data) % DLPACK_ALIGNMENT
    array = raw[offset : offset + count * 4].view(np.float32)
    array[:] = np.arange(count, dtype=np.float32)
    return array


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


class _DLPackOnly:
    """An object that speaks DLPack and is no known library's array."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array

    def __dlpack__(self, **kwargs: object) -> object:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._array.__dlpack_device__()


# --- NumPy and plain Python values -------------------------------------------------------------


def test_numpy_arrays_pass_through_unchanged() -> None:
    array = np.arange(6, dtype=np.float32)
    assert _dispatch.array_library(array) == "numpy"
    assert _dispatch.is_numpy_array(array)
    assert not _dispatch.is_torch_tensor(array) and not _dispatch.is_jax_array(array)
    assert _dispatch.to_core_array(array) is array
    assert _dispatch.array_module(array) is np
    assert _dispatch.device_of(array) == "cpu"


def test_sequences_become_numpy_and_other_objects_are_rejected_by_name() -> None:
    converted = _dispatch.to_core_array([[1, 2], [3, 4]], "indices")
    assert isinstance(converted, np.ndarray) and converted.shape == (2, 2)
    assert _dispatch.array_library(object()) == "unknown"
    with pytest.raises(TypeError, match="indices must be an array"):
        _dispatch.to_core_array(object(), "indices")


def test_other_dlpack_objects_are_viewed_without_copy() -> None:
    array = np.arange(8, dtype=np.float64)
    wrapped = _DLPackOnly(array)
    assert _dispatch.array_library(wrapped) == "dlpack"
    view = _dispatch.to_core_array(wrapped, "features")
    assert isinstance(view, np.ndarray)
    assert _address(view) == _address(array)


# --- torch ---------------------------------------------------------------------------------------


def test_torch_tensors_are_recognised() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(3)
    assert _dispatch.array_library(tensor) == "torch"
    assert _dispatch.is_torch_tensor(tensor)
    assert not _dispatch.is_numpy_array(tensor) and not _dispatch.is_jax_array(tensor)


def test_torch_cpu_tensor_to_numpy_shares_memory() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    view = _dispatch.to_core_array(tensor, "features")
    assert isinstance(view, np.ndarray) and view.shape == (3, 4) and view.dtype == np.float32
    assert _address(view) == tensor.data_ptr()
    view[1, 2] = -5.0
    assert float(tensor[1, 2]) == -5.0


def test_torch_tensor_requiring_grad_is_viewed_detached() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.ones(4, requires_grad=True)
    view = _dispatch.to_core_array(tensor, "features")
    assert isinstance(view, np.ndarray)
    assert _address(view) == tensor.data_ptr()


def test_numpy_back_to_torch_shares_memory() -> None:
    torch = pytest.importorskip("torch")
    array = np.arange(10, dtype=np.float32)
    tensor = _dispatch.from_core_array(array, like=torch.zeros(1))
    assert isinstance(tensor, torch.Tensor)
    assert tensor.data_ptr() == _address(array)
    array[3] = 42.0
    assert float(tensor[3]) == 42.0


# --- JAX -----------------------------------------------------------------------------------------


def test_jax_arrays_and_tracers_are_told_apart() -> None:
    jax = pytest.importorskip("jax")
    concrete = jax.numpy.zeros(3)
    assert _dispatch.array_library(concrete) == "jax"
    assert _dispatch.is_jax_array(concrete) and not _dispatch.is_jax_tracer(concrete)
    seen: list[str] = []

    @jax.jit
    def traced(value: object) -> object:
        seen.append(_dispatch.array_library(value))
        assert _dispatch.is_jax_tracer(value) and not _dispatch.is_jax_array(value)
        return value

    traced(concrete)
    assert seen == ["jax_tracer"]


def test_jax_cpu_array_to_numpy_shares_memory() -> None:
    jax = pytest.importorskip("jax")
    array = jax.numpy.arange(12, dtype=jax.numpy.float32).reshape(3, 4)
    view = _dispatch.to_core_array(array, "features")
    assert isinstance(view, np.ndarray) and view.shape == (3, 4)
    assert _address(view) == array.unsafe_buffer_pointer()
    np.testing.assert_array_equal(view, np.arange(12, dtype=np.float32).reshape(3, 4))


def test_numpy_back_to_jax_shares_memory() -> None:
    jax = pytest.importorskip("jax")
    array = _aligned_float32(1024)
    result = _dispatch.from_core_array(array, like=jax.numpy.zeros(1))
    assert _dispatch.array_library(result) == "jax"
    assert result.unsafe_buffer_pointer() == _address(array)
    np.testing.assert_array_equal(np.asarray(result), array)


def test_jax_tracer_inside_jit_is_rejected_with_advice() -> None:
    jax = pytest.importorskip("jax")

    @jax.jit
    def convert(features: object) -> object:
        return _dispatch.to_core_array(features, "features")

    with pytest.raises(TypeError) as caught:
        convert(jax.numpy.ones((2, 3)))
    message = str(caught.value)
    assert "features is a JAX tracer" in message
    assert "outside jit" in message and "geometry" in message


def test_jax_tracer_as_like_is_rejected() -> None:
    jax = pytest.importorskip("jax")

    @jax.jit
    def convert_back(like: object) -> object:
        return _dispatch.from_core_array(np.zeros(2), like=like)

    with pytest.raises(TypeError, match="outside jit"):
        convert_back(jax.numpy.ones(2))


# --- devices -------------------------------------------------------------------------------------


def _fake_cupy(device_id: int) -> tuple[types.ModuleType, object]:
    """A stand-in ``cupy`` module with one array on ``cuda:device_id`` (no GPU needed)."""
    module = types.ModuleType("cupy")

    class ndarray:  # noqa: N801 - mirrors cupy.ndarray
        device = types.SimpleNamespace(id=device_id)

    module.ndarray = ndarray  # type: ignore[attr-defined]
    return module, ndarray()


def test_check_same_device_accepts_one_device_and_skips_none() -> None:
    assert _dispatch.check_same_device() == "cpu"
    assert _dispatch.check_same_device(features=np.zeros(2), bias=None, weight=np.zeros(3)) == "cpu"


def test_check_same_device_names_each_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_module, gpu_array = _fake_cupy(1)
    monkeypatch.setitem(sys.modules, "cupy", fake_module)
    assert _dispatch.array_library(gpu_array) == "cupy"
    assert _dispatch.device_of(gpu_array) == "cuda:1"
    with pytest.raises(ValueError) as caught:
        _dispatch.check_same_device(features=np.zeros(2), weight=gpu_array)
    message = str(caught.value)
    assert "features on cpu" in message and "weight on cuda:1" in message
    assert "different devices" in message
