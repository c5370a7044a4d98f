"""The mechanics every kernel launch wrapper shares: argument checks, grid sizing, launching.

A wrapper in `kernel_backend` (or in `_kernel_pairs` / `_kernel_int8`, which
receive the backend's `KernelDevice`: its array module and launch settings,
nothing else) makes its inputs contiguous (a RawKernel ignores
strides), checks their dtypes and shapes with the helpers here, sizes the
grid with `grid_blocks`, and launches through `launch`, which does nothing
at all when there is no work: a launch never has zero blocks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

from . import kernel_registry

__all__ = [
    "KernelLauncher",
    "KernelDevice",
    "INT32_MAX",
    "INT64_MAX",
    "FLOAT_DTYPE_NAMES",
    "hash_capacity",
    "grid_blocks",
    "expression_of",
    "launch",
    "check_float",
    "check_integer_vector",
    "check_row_count",
]

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

# Storage dtypes (``dtype.name``) the feature kernels are instantiated for.
FLOAT_DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16")


@runtime_checkable
class KernelLauncher(Protocol):
    """Launches one registered kernel instantiation.

    Implementations: ``CupyLauncher`` (a real GPU, on CuPy's current stream) and
    the tests' emulated launcher (the same sources compiled by g++, on NumPy arrays).
    """

    def launch(self, expression: str, grid: int, block: int, args: tuple[Any, ...]) -> None:
        """Runs ``expression<<<grid, block>>>(*args)``.

        Args:
            expression: a name expression of `kernel_registry`, e.g. ``"sc_max_pool_map<float>"``.
            grid: blocks, at least 1.
            block: threads per block, 1 to 1024.
            args: C-contiguous arrays of the backend's ``xp`` and NumPy scalars of
                the exact parameter types (``numpy.int64`` for ``long long``...).
        """


@dataclass(frozen=True)
class KernelDevice:
    """What a launch wrapper needs of a kernel backend: its array module and how it launches.

    `sparsecore.backends.kernel_backend.KernelBackend.device` hands this to the
    pair and int8 wrappers (`_kernel_pairs`, `_kernel_int8`), which therefore
    depend on this module only, not on the backend class.

    Attributes:
        xp: the array module of the arrays the kernels run on (``cupy``, or ``numpy``
            under the CPU emulation).
        launcher: the `KernelLauncher`.
        block_threads: threads per block of every launch, 1 to 1024.
        max_blocks: most blocks of a launch (grid-stride loops cover the rest).
    """

    xp: Any
    launcher: KernelLauncher
    block_threads: int
    max_blocks: int

    def run(self, name: str, type_names: Sequence[str], work: int, args: Sequence[Any]) -> None:
        """Launches kernel ``name`` over ``work`` items with this device's grid settings (`launch`)."""
        launch(self.launcher, name, type_names, work, args, self.block_threads, self.max_blocks)


def hash_capacity(num_keys: int) -> int:
    """Slots of a hash table for ``num_keys`` keys: the smallest power of two >= 2 * num_keys, and >= 2."""
    return max(2, 1 << max(2 * num_keys - 1, 0).bit_length())


def grid_blocks(work: int, block: int, max_blocks: int) -> int:
    """Blocks for ``work`` items at one item per thread, capped (grid-stride loops do the rest).

    Args:
        work: items to process, > 0.
        block: threads per block.
        max_blocks: the cap.
    """
    return max(1, min(-(-work // block), max_blocks))


@functools.lru_cache(maxsize=None)
def expression_of(name: str, *type_names: str) -> str:
    """The registered name expression of kernel ``name`` for dtype / C++ type names (memoized)."""
    return kernel_registry.name_expression(name, *type_names)


def launch(launcher: KernelLauncher, name: str, type_names: Sequence[str], work: int,
           args: Sequence[Any], block: int, max_blocks: int) -> None:
    """Launches kernel ``name`` over ``work`` items; nothing at all when ``work <= 0``.

    Args:
        launcher: the `KernelLauncher`.
        name: a kernel name, e.g. ``"sc_hash_insert"``.
        type_names: its template arguments as dtype names (``"int64"``, ``"float16"``...).
        work: number of items (threads wanted).
        args: the kernel's arguments.
        block: threads per block.
        max_blocks: grid cap.
    """
    if work <= 0:
        return
    launcher.launch(expression_of(name, *type_names), grid_blocks(work, block, max_blocks), block,
                    tuple(args))


def check_float(array: Any, argument: str, function: str, ndim: int = 2) -> str:
    """Checks a feature array's rank and dtype; returns its dtype name.

    Raises:
        ValueError: when ``array`` does not have ``ndim`` axes.
        TypeError: for a dtype no feature kernel is instantiated for.
    """
    if array.ndim != ndim:
        raise ValueError(f"{function}: {argument} must have {ndim} axes, got shape {tuple(array.shape)}")
    dtype_name = array.dtype.name
    if dtype_name not in FLOAT_DTYPE_NAMES:
        raise TypeError(
            f"{function}: {argument} must have dtype float32, float64, float16 or bfloat16 "
            f"(the dtypes the kernels are built for), got {array.dtype}"
        )
    return dtype_name


def check_integer_vector(array: Any, argument: str, function: str, length: int | None = None) -> None:
    """Checks that ``array`` is a 1-D integer array (of ``length`` entries when given).

    Raises:
        ValueError: on a wrong rank or length.
        TypeError: on a non-integer dtype.
    """
    if array.ndim != 1:
        raise ValueError(f"{function}: {argument} must be 1-D, got shape {tuple(array.shape)}")
    if array.dtype.kind not in "iu":
        raise TypeError(f"{function}: {argument} must be an integer array, got dtype {array.dtype}")
    if length is not None and array.shape[0] != length:
        raise ValueError(f"{function}: {argument} has {array.shape[0]} entries, expected {length}")


def check_row_count(count: int, argument: str, function: str) -> None:
    """Raises when ``count`` rows cannot be addressed by the kernels' int32 row numbers."""
    if count > INT32_MAX:
        raise ValueError(
            f"{function}: {argument} has {count} rows, more than the kernels' int32 row numbers "
            f"address ({INT32_MAX}); split the input into smaller pieces"
        )
