"""Test configuration: `gpu`-marked tests run only where CuPy sees a CUDA device."""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    """True when CuPy imports and reports at least one CUDA device."""
    try:
        import cupy
    except Exception:  # noqa: BLE001 - any import failure means no usable GPU
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001 - no driver / no device
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (CuPy found none)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
