"""The memory budget: the most bytes one step of the library may allocate, checked before it allocates.

A sparse layer's tables and outputs are known from sizes alone before anything
is allocated: the number of sites, the kernel, the grid, the channels. A file
made elsewhere (an ONNX model, a checkpoint's geometry) decides those sizes, so
an 81^3 kernel or a padding of 300 could ask for tens of GiB. Each public pass
estimates what it is about to allocate (an upper bound, from sizes it knows)
and raises `MemoryBudgetError`, naming the step and the size, when that
exceeds the budget: never a raw NumPy allocation error or an exhausted machine.

The budget in force, first match wins:

1. the innermost `budget` block of the calling thread (a context variable, so
   each thread and each `sparsecore.runtime` session may hold its own);
2. the ``SPARSECORE_MEMORY_BUDGET`` environment variable, read at each check:
   bytes (``"2000000000"``), with a binary suffix (``"512M"``, ``"8G"``), or a
   share of the available memory (``"30%"``);
3. `DEFAULT_FRACTION` of the available memory (`available_memory`: the least
   of the host's available memory, the cgroup's remaining allowance and the
   address space left under ``RLIMIT_AS``), read at each check.

Steps estimated below `NEVER_CHECKED_BYTES` (1 MiB) are never checked, and
under the default budget neither are those below `UNCHECKED_BYTES` (64 MiB):
small layers pay one comparison, no environment or file read. Checks count one step at a time (a rulebook build,
a layout, a pass's outputs), not the sum of a network's live arrays.

Example:
    >>> import sparsecore.memory_budget as memory
    >>> with memory.budget("2G"):
    ...     out = sparsecore.sparse_conv(x, weight, bias)   # refuses any step above 2 GiB
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import re
from typing import Any, Iterator, Optional, Sequence, Union

__all__ = [
    "BUDGET_VARIABLE",
    "DEFAULT_FRACTION",
    "UNCHECKED_BYTES",
    "NEVER_CHECKED_BYTES",
    "MemoryBudgetError",
    "available_memory",
    "parse_budget",
    "current_budget",
    "budget",
    "check_bytes",
    "rulebook_build_bytes",
    "check_rulebook_build",
    "check_layout",
    "check_pass",
    "check_dense",
    "describe_bytes",
]

BUDGET_VARIABLE = "SPARSECORE_MEMORY_BUDGET"
"""The environment variable holding the process-wide budget (bytes, ``"8G"``, or ``"30%"``)."""

DEFAULT_FRACTION = 0.5
"""The default budget: this share of `available_memory`, read when a step is checked."""

UNCHECKED_BYTES = 64 * 2**20
"""Under the default budget, steps estimated below this many bytes are not checked."""

NEVER_CHECKED_BYTES = 2**20
"""Steps estimated below this many bytes are never checked, whatever the budget (the check then costs a
comparison: no environment or file read on small layers)."""

_BUDGET: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar("sparsecore_memory_budget", default=None)
_SUFFIXES = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


class MemoryBudgetError(MemoryError):
    """A step would allocate more than the memory budget: the message names the step, its size and the budget."""


def describe_bytes(size: float) -> str:
    """``size`` bytes in readable units (``"5.3 GiB"``)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{int(size)} bytes"


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path, encoding="ascii") as handle:
            text = handle.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _host_available() -> Optional[int]:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_available() -> Optional[int]:
    limit = _read_int("/sys/fs/cgroup/memory.max")  # cgroup v2 ("max": no limit, not a number)
    if limit is not None:
        used = _read_int("/sys/fs/cgroup/memory.current") or 0
        return max(0, limit - used)
    limit = _read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes")  # cgroup v1
    if limit is not None and limit < 2**60:
        used = _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes") or 0
        return max(0, limit - used)
    return None


def _address_space_available() -> Optional[int]:
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            used = int(statm.read().split()[0]) * int(os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        used = 0
    return max(0, soft - used)


def _on_gpu(like: Any) -> bool:
    return like is not None and type(like).__module__.split(".")[0] == "cupy"


def available_memory(like: Any = None) -> int:
    """Bytes this process may still allocate.

    On the host (``like`` None or a NumPy array): the least of the available memory
    (``MemAvailable``), the cgroup's remaining allowance and the address space left under
    ``RLIMIT_AS``, each where the system states it (none known: 2**62). For a CuPy array: the
    current GPU's free memory plus what CuPy's memory pool holds unused.
    """
    if _on_gpu(like):
        import cupy

        free, _ = cupy.cuda.Device().mem_info
        return int(free) + int(cupy.get_default_memory_pool().free_bytes())
    known = [value for value in (_host_available(), _cgroup_available(), _address_space_available())
             if value is not None]
    return min(known) if known else 2**62


def parse_budget(value: Union[int, float, str], name: str = BUDGET_VARIABLE) -> int:
    """A budget in bytes from an int (bytes), a string of bytes with an optional binary suffix
    (``"512M"``, ``"8G"``, ``"1.5GiB"``) or a share of `available_memory` (``"30%"``).

    Raises:
        ValueError: naming ``name``, for anything else or a budget that is not positive.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name} must be a number of bytes (e.g. 2000000000, '8G') or a share ('30%'), got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
        return int(value)
    text = str(value).strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            share = -1.0
        if not 0 < share <= 100:
            raise ValueError(f"{name}={value!r}: a share of the available memory must be in (0%, 100%]")
        return max(1, int(available_memory() * share / 100))
    match = _PATTERN.match(text)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f"{name}={value!r} must be a positive number of bytes, optionally with a suffix K, M, G "
                         "or T (binary: 8G = 8 * 2**30), or a share of the available memory such as '30%'")
    return int(float(match.group(1)) * _SUFFIXES[match.group(2).upper()])


def _explicit_budget() -> Optional[int]:
    chosen = _BUDGET.get()
    if chosen is not None:
        return chosen
    text = os.environ.get(BUDGET_VARIABLE, "").strip()
    return parse_budget(text) if text else None


def current_budget() -> int:
    """The budget in force for the calling thread, in bytes (see the module docstring)."""
    chosen = _explicit_budget()
    return chosen if chosen is not None else int(DEFAULT_FRACTION * available_memory())


@contextlib.contextmanager
def budget(limit: Union[int, float, str, None]) -> Iterator[int]:
    """Sets the calling thread's budget inside the block (``None``: the process-wide one).

    Args:
        limit: bytes, a string such as ``"8G"`` or ``"30%"`` (`parse_budget`), or None.

    Yields:
        The budget in force inside the block, in bytes.
    """
    token = _BUDGET.set(None if limit is None else parse_budget(limit, "budget"))
    try:
        yield current_budget()
    finally:
        _BUDGET.reset(token)


def _exceeded(size: int, like: Any) -> Optional[tuple[int, str]]:
    """``(budget, where it comes from)`` when ``size`` passes the budget, else None (cheap below the floors)."""
    if size < NEVER_CHECKED_BYTES:
        return None
    chosen = _explicit_budget()
    if chosen is None:
        if size < UNCHECKED_BYTES:
            return None
        available = available_memory(like)
        limit = int(DEFAULT_FRACTION * available)
        source = f"the default, {DEFAULT_FRACTION:.0%} of the {describe_bytes(available)} available"
    else:
        limit = chosen
        source = "the budget set" if _BUDGET.get() is not None else BUDGET_VARIABLE
    return None if size <= limit else (limit, source)


def _refuse(size: int, what: str, fix: str, limit: int, source: str) -> MemoryBudgetError:
    return MemoryBudgetError(
        f"{what} would allocate about {describe_bytes(size)}, more than the memory budget of "
        f"{describe_bytes(limit)} ({source}). {fix + ' ' if fix else ''}A larger budget: "
        f"{BUDGET_VARIABLE}=16G (or '50%') in the environment, or sparsecore.memory_budget.budget('16G') "
        "around the call (docs/deployment.md, 'Memory budget')"
    )


def check_bytes(size: int, what: str, fix: str = "", like: Any = None) -> None:
    """Refuses a step that would allocate ``size`` bytes beyond the budget.

    Args:
        size: the step's estimated bytes (an upper bound).
        what: the step, as a phrase (``"building the rulebook of a regular conv k[81, 81, 81] on 600 sites"``).
        fix: how to make the step smaller, appended to the message.
        like: an array on the device the step allocates on (None or NumPy: the host; CuPy: the GPU), for
            the default budget.

    Raises:
        MemoryBudgetError: naming ``what``, the size and the budget.
    """
    exceeded = _exceeded(size, like)
    if exceeded is not None:
        raise _refuse(size, what, fix, *exceeded)


def _candidates_per_site(geometry: Any, output_shape: Sequence[int]) -> int:
    """The most (kernel offset, output site) candidates one input site can have in a strided layer."""
    count = 1
    for axis in range(geometry.ndim):
        size, step, spacing = geometry.kernel_size[axis], geometry.stride[axis], geometry.dilation[axis]
        if geometry.kind == "regular":  # only kernel indices k with (x + pad - k * dilation) % stride == 0
            size = -(-size // (step // math.gcd(step, spacing)))
        count *= max(1, min(size, int(output_shape[axis])))
    return count


def rulebook_build_bytes(geometry: Any, num_sites: int, spatial_shape: Sequence[int], batch_size: int) -> int:
    """An upper bound of the bytes `sparsecore.build_rulebook` allocates for ``num_sites`` sites.

    Submanifold: a table of ``4 * N * (K // 2)`` bytes and 8 bytes a pair (at most ``N * min(N, K)``
    pairs). Regular and transposed: 64 bytes per (input site, kernel offset) candidate (the
    candidates' rows and keys, their sort and the inverse, the output sites: 39-52 bytes a pair
    measured on 2026-12-05, numpy 2.4.6, on the 2-core test VM), at most the reachable offsets
    per site times the sites.
    """
    sites = max(0, int(num_sites))
    volume = geometry.kernel_volume
    if geometry.kind == "subm":
        return 4 * sites * (volume // 2) + 8 * sites * min(sites, volume) + 64 * sites
    try:
        output_shape = geometry.output_spatial_shape(spatial_shape)
    except ValueError:  # an empty output grid: the builder raises its own error
        return 64 * sites
    candidates = sites * _candidates_per_site(geometry, output_shape)
    cells = batch_size * math.prod(output_shape)
    return 40 * candidates + 24 * min(candidates, cells) + 64 * sites


def check_rulebook_build(geometry: Any, indices: Any, spatial_shape: Sequence[int], batch_size: int) -> None:
    """`check_bytes` of `rulebook_build_bytes` for the sites ``indices`` (``[N, 1 + D]``, NumPy or CuPy),
    naming the layer's geometry and the number of sites."""
    if geometry.kind == "inverse":
        return
    num_sites = int(indices.shape[0])
    size = rulebook_build_bytes(geometry, num_sites, spatial_shape, batch_size)
    exceeded = _exceeded(size, indices)
    if exceeded is not None:
        raise _refuse(size, f"building the rulebook of a {geometry.describe()} on {num_sites} sites of grid "
                            f"{tuple(spatial_shape)}",
                      "A smaller kernel, stride or padding, or fewer sites, needs less.", *exceeded)


def check_pass(what: str, output_rows: int, output_channels: int, input_rows: int, input_channels: int,
               like: Any = None) -> None:
    """Refuses a feature pass whose outputs and working copies (``2 * rows_out * C_out + rows_in * C_in``
    values of at least 4 bytes: the result, its float32 working copy, the input's) pass the budget."""
    itemsize = max(4, int(getattr(getattr(like, "dtype", None), "itemsize", 4)))
    size = (2 * output_rows * output_channels + input_rows * input_channels) * itemsize
    exceeded = _exceeded(size, like)
    if exceeded is not None:
        raise _refuse(size, f"{what} ({output_rows} output rows x {output_channels} channels)",
                      "Fewer sites or channels need less.", *exceeded)


def check_dense(batch_size: int, spatial_shape: Sequence[int], channels: int, itemsize: int,
                like: Any = None) -> None:
    """Refuses a dense ``[B, C, *spatial]`` grid beyond the budget, naming its shape."""
    size = batch_size * math.prod(spatial_shape) * channels * itemsize
    exceeded = _exceeded(size, like)
    if exceeded is not None:
        raise _refuse(size, f"a dense grid of batch_size {batch_size} x {channels} channels x spatial_shape "
                            f"{tuple(spatial_shape)}", "Densify a cropped region or a coarser grid, or stay sparse.",
                      *exceeded)


def check_layout(layout: str, rows: int, volume: int, pairs: int, rows_per_item: int = 0) -> None:
    """Refuses a CPU layout of a rulebook (`sparsecore.cpu_dataflow`) beyond the budget.

    Args:
        layout: ``"neighbour table"`` (int32, a slot per row and offset: ``4 * K * rows`` bytes, rows rounded
            up to 64) or ``"tile plan"`` (two int64 entries per work item and offset, 8 bytes a pair).
        rows: destination rows.
        volume: kernel offsets ``K``.
        pairs: the rulebook's pairs.
        rows_per_item: destination rows per work item of a tile plan.
    """
    if layout == "tile plan":
        size = 16 * volume * -(-rows // max(1, rows_per_item)) + 8 * pairs
    else:
        size = 4 * volume * 64 * -(-rows // 64) + 8 * volume
    exceeded = _exceeded(size, None)
    if exceeded is not None:
        raise _refuse(size, f"the {layout} of a rulebook of {volume} kernel offsets, {rows} rows and {pairs} pairs",
                      "The layer's kernel or its number of sites is too large for this machine.", *exceeded)
