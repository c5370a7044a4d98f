"""A `KernelLauncher` that runs the kernels compiled by g++ (harness.py) on NumPy arrays.

``KernelBackend(numpy, EmulatedLauncher())`` runs the core's algorithms
through the very kernels the GPU runs. The harness checks every launch
against the kernel's C++ signature (array dtypes, scalar types, contiguity)
and rejects grids of zero blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sparsecore.backends import kernel_registry

try:
    from cuda_emulation import harness
except ImportError:  # tests/ imported as a package
    from tests.cuda_emulation import harness

__all__ = ["EmulatedLauncher", "RecordingLauncher", "LaunchRecord"]


@dataclass(frozen=True)
class EmulatedLauncher:
    """Launches a registered name expression on the CPU emulation of CUDA.

    Attributes:
        arch: compute capability whose code path the kernels take (e.g. 75), None for the default (sm_90).
    """

    arch: int | None = None

    def launch(self, expression: str, grid: int, block: int, args: tuple[Any, ...]) -> None:
        """Runs ``expression<<<grid, block>>>(*args)`` on C-contiguous NumPy arrays."""
        file = kernel_registry.file_of_kernel(expression.split("<", 1)[0].strip())
        harness.load_module(file, self.arch).get_function(expression)((grid,), (block,), args)


@dataclass(frozen=True)
class LaunchRecord:
    """One launch: the name expression and its configuration."""

    expression: str
    grid: int
    block: int


@dataclass(frozen=True)
class RecordingLauncher:
    """Forwards launches to ``inner`` and records each one (for tests that count launches)."""

    inner: Any
    records: list[LaunchRecord] = field(default_factory=list)

    def launch(self, expression: str, grid: int, block: int, args: tuple[Any, ...]) -> None:
        """Records the launch, then runs it."""
        self.records.append(LaunchRecord(expression, grid, block))
        self.inner.launch(expression, grid, block, args)

    def kernel_names(self) -> set[str]:
        """The kernels (without template arguments) launched so far."""
        return {record.expression.split("<", 1)[0] for record in self.records}
