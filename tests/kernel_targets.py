"""Where the kernel-backend tests run, and their shared helpers.

`target` is a module-scoped fixture with two parameters: ``emulated`` runs
`KernelBackend` on NumPy arrays through the CPU emulation of CUDA (the very
``kernels_cu`` sources, compiled by g++), with 32-thread blocks and at most
2 blocks per launch so every grid-stride loop goes round several times;
``cupy`` (marked ``gpu``) runs `CUPY_BACKEND` with the same small launches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from sparsecore.backends import kernel_registry
from sparsecore.backends.kernel_backend import KernelBackend

try:
    from cuda_emulation import harness
    from cuda_emulation.emulated_launcher import EmulatedLauncher, RecordingLauncher
except ImportError:  # tests/ imported as a package
    from tests.cuda_emulation import harness
    from tests.cuda_emulation.emulated_launcher import EmulatedLauncher, RecordingLauncher

__all__ = ["Target", "target", "emulated_backend", "FLOAT_DTYPES", "rng_for", "random_sites", "random_floats",
           "assert_equal"]

try:
    import ml_dtypes

    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes comes with the test dependencies
    BFLOAT16 = None

FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")


@dataclass(frozen=True)
class Target:
    """Where a test runs: a kernel backend, its array module and host/device transfers.

    Attributes:
        name: ``"emulated"`` or ``"cupy"``.
        xp: ``numpy`` or ``cupy``.
        backend: small blocks and a capped grid (grid-stride loops in every launch).
        base_launcher: the target's plain launcher (emulated, or ``CupyLauncher``).
    """

    name: str
    xp: Any
    backend: KernelBackend
    base_launcher: Any

    def put(self, array: Any) -> Any:
        return self.xp.asarray(array)

    def get(self, array: Any) -> Any:
        return array if self.xp is np else self.xp.asnumpy(array)

    def with_launcher(self, launcher: Any, **config: Any) -> KernelBackend:
        """This target's backend with another launcher and launch configuration."""
        return dataclasses.replace(self.backend, launcher=launcher, **config)

    def recording(self, **config: Any) -> tuple[KernelBackend, RecordingLauncher]:
        launcher = RecordingLauncher(self.base_launcher)
        return self.with_launcher(launcher, **config), launcher

    def dtype(self, dtype_name: str) -> np.dtype:
        if dtype_name == "bfloat16":
            if BFLOAT16 is None or self.xp is not np:
                pytest.skip("bfloat16 arrays need ml_dtypes on NumPy (CuPy has no bfloat16 dtype)")
            return BFLOAT16
        return np.dtype(dtype_name)


def emulated_backend() -> KernelBackend:
    """`KernelBackend` on NumPy arrays through the emulated kernels (small launches); skips without g++."""
    if harness.compiler_path() is None:
        pytest.skip("g++ is not installed")
    harness.build_libraries([entry.file for entry in kernel_registry.KERNEL_FILES])
    return KernelBackend(np, EmulatedLauncher(), name="emulated", block_threads=32, max_blocks=2)


@pytest.fixture(scope="module", params=["emulated", pytest.param("cupy", marks=pytest.mark.gpu)])
def target(request) -> Target:
    if request.param == "emulated":
        backend = emulated_backend()
        return Target("emulated", np, backend, backend.launcher)
    import cupy

    from sparsecore.backends.cupy_backend import CUPY_BACKEND

    backend = dataclasses.replace(CUPY_BACKEND, block_threads=32, max_blocks=2)
    return Target("cupy", cupy, backend, CUPY_BACKEND.launcher)


def rng_for(*seed: int) -> np.random.Generator:
    return np.random.default_rng([20261215, *seed])


def random_sites(rng: np.random.Generator, count: int, shape: tuple[int, ...], batch_size: int) -> np.ndarray:
    """``count`` distinct int32 sites ``[count, 1 + D]`` of a ``batch_size x shape`` grid, in random order."""
    cells = rng.choice(batch_size * int(np.prod(shape)), size=count, replace=False)
    columns = np.unravel_index(cells, (batch_size, *shape))
    return np.stack(columns, axis=1).astype(np.int32).reshape(count, 1 + len(shape))


def random_floats(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return rng.uniform(-2.0, 2.0, size=shape).astype(dtype)


def assert_equal(actual: Any, expected: Any, what: str) -> None:
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.tobytes() == expected.tobytes(), f"{what}: values differ"
