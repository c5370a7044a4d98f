"""sparsecore.backends: the backend of an array, and the one no-GPU check every GPU request passes.

No GPU is needed: CuPy is replaced by stand-in modules whose CUDA runtime
reports what a machine without a GPU (or without a driver) reports.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from sparsecore import _dispatch, backends


def _fake_cupy(device_count=None, error=None):
    """A stand-in ``cupy``: ``getDeviceCount`` returns ``device_count`` or raises ``error``."""
    module = types.ModuleType("cupy")

    def get_device_count():
        if error is not None:
            raise error
        return device_count

    module.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=get_device_count))

    class ndarray:  # noqa: N801 - mirrors cupy.ndarray
        device = types.SimpleNamespace(id=0)

    module.ndarray = ndarray
    return module


class _CUDARuntimeError(RuntimeError):
    """What CuPy raises without a driver (cupy_backends.cuda.api.runtime.CUDARuntimeError)."""


def test_numpy_arrays_get_the_numpy_backend():
    assert backends.backend_for(np.zeros(3)) is backends.NUMPY_BACKEND


def test_no_driver_is_one_clear_message_with_the_cpu_way(monkeypatch):
    error = _CUDARuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime "
                              "version")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(error=error))
    with pytest.raises(backends.CudaUnavailableError) as caught:
        backends.require_cuda("--device cuda")
    message = str(caught.value)
    assert message.startswith("--device cuda needs a CUDA GPU, but no CUDA device is visible")
    assert "cudaErrorInsufficientDriver" in message and "To run on the CPU" in message
    assert isinstance(caught.value, RuntimeError)
    with pytest.raises(backends.CudaUnavailableError, match="Use --device cpu.$"):
        backends.require_cuda("the demo", "Use --device cpu.")


def test_zero_devices_and_missing_cupy_are_clear_too(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(device_count=0))
    with pytest.raises(backends.CudaUnavailableError, match="no CUDA device is visible.*CUDA_VISIBLE_DEVICES"):
        backends.require_cuda()
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    missing = "needs CuPy, which does not import here.*sparsecore-conv\\[cuda13\\]"
    with pytest.raises(backends.CudaUnavailableError, match=missing):
        backends.require_cuda("a CuPy array")


def test_gpu_arrays_reaching_the_core_pass_the_check(monkeypatch):
    fake = _fake_cupy(error=_CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected"))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    with pytest.raises(backends.CudaUnavailableError, match="^a CuPy array needs a CUDA GPU.*cudaErrorNoDevice"):
        backends.backend_for(fake.ndarray())

    class CudaDLPack:  # a CUDA array of some library, seen through DLPack
        def __dlpack__(self, **kwargs):
            raise AssertionError("not reached without a GPU")

        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA

    with pytest.raises(backends.CudaUnavailableError, match="^features \\(a CUDA array\\) needs a CUDA GPU"):
        _dispatch.to_core_array(CudaDLPack(), "features")


def test_this_machine_reports_its_gpu_state_without_a_raw_cupy_error():
    try:
        cupy = backends.require_cuda()
    except backends.CudaUnavailableError as error:
        assert "no CUDA device is visible" in str(error) or "needs CuPy" in str(error)
    else:
        assert cupy.cuda.runtime.getDeviceCount() >= 1


# ------------------------------------------------ compiled rulebook primitives (issue 14)


@pytest.mark.parametrize("count", [0, 3, 5000])
def test_numpy_backend_hash_build_reports_a_duplicate_among_many_keys(count):
    rng = np.random.default_rng(14_400 + count)
    keys = rng.choice(10 * count + 10, size=count, replace=False).astype(np.int64)
    table, duplicate = backends.NUMPY_BACKEND.hash_build(keys, np.arange(count, dtype=np.int64))
    assert duplicate is None
    np.testing.assert_array_equal(backends.NUMPY_BACKEND.hash_lookup(table, keys), np.arange(count))
    if count:
        repeated = np.concatenate([keys, keys[count // 2:count // 2 + 1]])
        _, duplicate = backends.NUMPY_BACKEND.hash_build(repeated, np.arange(count + 1, dtype=np.int64))
        assert sorted(duplicate) == [count // 2, count]
