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


def test_torch_tensor_requiring_grad_is_refused_with_a_pointer_to_the_torch_frontend() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.ones(4, requires_grad=True)
    with pytest.raises(TypeError) as caught:
        _dispatch.to_core_array(tensor, "features")
    message = str(caught.value)
    assert "features is a torch tensor that requires grad" in message
    assert "sparsecore.torch" in message and "features.detach()" in message and "no_grad" in message
    with torch.no_grad():  # grad mode off: the caller asked for no gradient, so the tensor is viewed
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


def test_hands_back_to_torch_without_copy_and_through_tuples() -> None:
    torch = pytest.importorskip("torch")
    first, second = np.arange(6.0), np.arange(3, dtype=np.int32)
    result = _dispatch.hands_back((first, [second, "label"], None), like=torch.zeros(1))
    assert isinstance(result, tuple) and isinstance(result[0], torch.Tensor) and result[0].data_ptr() == _address(first)
    assert isinstance(result[1][0], torch.Tensor) and result[1][0].dtype == torch.int32
    assert result[1][1] == "label" and result[2] is None
    frozen = np.arange(4.0)
    frozen.flags.writeable = False
    copied = _dispatch.from_core_array(frozen, like=torch.zeros(1))  # torch has no read-only tensors
    assert copied.data_ptr() != _address(frozen) and torch.equal(copied, torch.arange(4.0, dtype=torch.float64))


def test_caller_array_is_the_first_array_argument() -> None:
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(2)
    assert _dispatch.caller_array([None, 3, tensor, np.zeros(2)]) is tensor
    assert _dispatch.caller_array([np.zeros(2), tensor]) is None
    assert _dispatch.caller_array([(1, 2), [tensor]]) is tensor
    assert _dispatch.caller_array(["key", 1.5]) is None


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


def test_jax_without_x64_narrows_64_bit_results_and_refuses_integers_that_would_wrap() -> None:
    jax = pytest.importorskip("jax")
    if jax.config.jax_enable_x64:
        pytest.skip("64-bit JAX types are enabled in this process")
    like = jax.numpy.zeros(1)
    keys = _dispatch.from_core_array(np.array([5, -7, 2**31 - 1], dtype=np.int64), like=like)
    assert keys.dtype == jax.numpy.int32 and np.asarray(keys).tolist() == [5, -7, 2**31 - 1]
    values = _dispatch.from_core_array(np.array([0.5, 1.25]), like=like)
    assert values.dtype == jax.numpy.float32 and np.asarray(values).tolist() == [0.5, 1.25]
    with pytest.raises(ValueError) as caught:
        _dispatch.from_core_array(np.array([1, 2**40], dtype=np.int64), like=like)
    message = str(caught.value)
    assert "int64 result" in message and "outside the int32 range" in message and "1099511627776" in message
    assert "jax_enable_x64" in message


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


# --- the public API hands results back in the caller's library --------------------------------------


def _oracle_module():
    pytest.importorskip("torch")
    try:
        from . import dense_oracle
    except ImportError:
        import dense_oracle
    return dense_oracle


def _subm_problem(seed: int):
    """Sites, float64 features, a 3x3x3 weight and the dense-conv oracle's output at the sites."""
    do = _oracle_module()
    import torch

    rng = do.make_rng(96000, seed)
    shape, batch = (6, 5, 7), 2
    indices = do.random_indices(rng, shape, batch, 0.3)
    features = do.random_features(rng, indices.shape[0], 3)
    weight = do.random_weight(rng, 4, (3, 3, 3), 3)
    dense = do.dense_conv(do.densify(features, indices, shape, batch), torch.from_numpy(weight), 1, 1, 1)
    return indices, features, weight, shape, batch, do.read_sites(dense, indices).numpy()


def test_public_functions_hand_torch_tensors_back() -> None:
    torch = pytest.importorskip("torch")
    import sparsecore as sc

    indices, features, weight, shape, batch, expected = _subm_problem(1)
    geometry = sc.ConvGeometry.create(3, 3, kind="subm")
    rulebook = sc.build_rulebook(torch.from_numpy(indices), shape, batch, geometry)
    out = sc.conv_forward(torch.from_numpy(features), torch.from_numpy(weight), rulebook)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64 and out.shape == expected.shape
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-10, atol=1e-10)
    grads = sc.conv_backward(torch.ones_like(out), torch.from_numpy(features), torch.from_numpy(weight), rulebook)
    assert isinstance(grads, tuple) and all(isinstance(grad, torch.Tensor) for grad in grads)
    dense = sc.to_dense(torch.from_numpy(features), torch.from_numpy(indices), shape, batch)
    assert isinstance(dense, torch.Tensor) and dense.shape == (batch, 3, *shape)
    np.testing.assert_array_equal(dense.numpy()[tuple(indices[:, 0]), :, tuple(indices[:, 1]), tuple(indices[:, 2]),
                                                tuple(indices[:, 3])], features)
    back_features, back_indices = sc.from_dense(dense, channels_first=True)
    assert isinstance(back_features, torch.Tensor) and isinstance(back_indices, torch.Tensor)
    assert back_features.shape == (indices.shape[0], 3)
    keys = sc.pack_keys(torch.from_numpy(indices), shape, batch)
    assert isinstance(keys, torch.Tensor) and keys.shape == (indices.shape[0],)
    assert isinstance(sc.conv_forward(features, weight, rulebook), np.ndarray), "NumPy in, NumPy out"


def test_public_functions_refuse_tensors_that_require_grad_naming_the_argument() -> None:
    torch = pytest.importorskip("torch")
    import sparsecore as sc

    indices, features, weight, shape, batch, _ = _subm_problem(2)
    rulebook = sc.build_rulebook(indices, shape, batch, sc.ConvGeometry.create(3, 3, kind="subm"))
    trained = torch.from_numpy(weight).requires_grad_()
    with pytest.raises(TypeError) as caught:
        sc.conv_forward(torch.from_numpy(features), trained, rulebook)
    message = str(caught.value)
    assert message.startswith("weight is a torch tensor that requires grad")
    assert "sparsecore.torch" in message and "silently lose its gradient" in message
    with pytest.raises(TypeError, match="features is a torch tensor that requires grad"):
        sc.SparseTensor(torch.from_numpy(features).requires_grad_(), indices, shape, batch)
    clouds = [np.random.default_rng(5).random((20, 4)), torch.rand(20, 4, dtype=torch.float64, requires_grad=True)]
    with pytest.raises(TypeError, match="point_clouds is a torch tensor that requires grad"):
        sc.voxelize_batch(clouds, (0.1, 0.1, 0.1), (0, 0, 0, 1, 1, 1), 4, 100)
    with torch.no_grad():
        out = sc.conv_forward(torch.from_numpy(features), trained, rulebook)
    assert isinstance(out, torch.Tensor) and not out.requires_grad


def test_public_functions_hand_jax_arrays_back_and_refuse_tracers() -> None:
    jax = pytest.importorskip("jax")
    import sparsecore as sc

    indices, features, weight, shape, batch, expected = _subm_problem(3)
    rulebook = sc.build_rulebook(jax.numpy.asarray(indices), shape, batch, sc.ConvGeometry.create(3, 3, kind="subm"))
    out = sc.conv_forward(jax.numpy.asarray(features, jax.numpy.float32),
                          jax.numpy.asarray(weight, jax.numpy.float32), rulebook)
    assert _dispatch.array_library(out) == "jax" and out.dtype == jax.numpy.float32
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5)
    dense = sc.to_dense(jax.numpy.asarray(features, jax.numpy.float32), jax.numpy.asarray(indices), shape, batch)
    assert _dispatch.array_library(dense) == "jax" and dense.shape == (batch, 3, *shape)

    @jax.jit
    def inside_jit(values: object) -> object:
        return sc.to_dense(values, indices, shape, batch)

    with pytest.raises(TypeError) as caught:
        inside_jit(jax.numpy.asarray(features, jax.numpy.float32))
    message = str(caught.value)
    assert message.startswith("features is a JAX tracer") and "sparsecore.jax" in message
