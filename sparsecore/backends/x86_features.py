"""Which x86 dot-product instructions the CPU kernels use: detection and the one switch that overrides it.

sparsecore's CPU kernels have fast routes on two AVX-512 extensions, and
today's portable routes elsewhere:

- ``avx512_vnni`` (``vpdpbusd``: int8 dot products into int32): the int8 conv
  (`sparsecore.int8_cpu_dataflow`);
- ``avx512_bf16`` (``vdpbf16ps``: bfloat16 dot products into float32): the
  bfloat16 CPU passes.

A feature is *available* when the CPU reports it (``/proc/cpuinfo``'s flags,
or LLVM's view of the host where there is no such file) and numba can target
it: numba compiles for the host CPU unless ``NUMBA_CPU_NAME`` names another
(then only a ``NUMBA_CPU_FEATURES`` that lists it, e.g. ``+avx512vnni``, lets it
through: code cached for a generic CPU must not hold these instructions). Intel
has both since Cooper Lake (VNNI since Cascade Lake), AMD since Zen 4.
AVX-VNNI-only (256-bit) CPUs take the portable routes.

The switch, ``SPARSECORE_CPU_ISA`` (read on every call, so it can change
within a process; `cpu_isa` sets it for a block):

- ``auto`` (the default, also when unset or empty): every available feature;
- ``generic``: none; every kernel takes its portable route, as on a CPU
  without the features (the results of the int8 routes are bitwise the same
  either way; see docs/quantization.md);
- a comma-separated list of features (``avx512_vnni``, ``avx512_bf16``, or the
  short ``vnni``, ``bf16``): exactly those; one that is not available is an
  error (a `ValueError` at the first pass that asks), never a silent fallback.

Example:
    >>> from sparsecore.backends import x86_features
    >>> x86_features.available_features()        # doctest: +SKIP
    CpuFeatures(avx512_vnni=True, avx512_bf16=True)
    >>> with x86_features.cpu_isa("generic"):    # the portable routes only, inside the block
    ...     x86_features.uses("avx512_vnni")
    False
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Iterator

__all__ = ["ISA_VARIABLE", "FEATURES", "CpuFeatures", "cpu_reported_features", "numba_can_target",
           "available_features", "selected_features", "uses", "cpu_isa"]

ISA_VARIABLE = "SPARSECORE_CPU_ISA"
"""The environment variable of the switch (``auto``, ``generic`` or a list of features)."""

FEATURES = ("avx512_vnni", "avx512_bf16")
"""The features the switch knows, as ``/proc/cpuinfo`` spells them."""

_ALIASES = {"vnni": "avx512_vnni", "bf16": "avx512_bf16"}
_LLVM_NAMES = {"avx512_vnni": "avx512vnni", "avx512_bf16": "avx512bf16"}


@dataclasses.dataclass(frozen=True)
class CpuFeatures:
    """One answer per feature of `FEATURES`.

    Attributes:
        avx512_vnni: int8 dot products (``vpdpbusd``).
        avx512_bf16: bfloat16 dot products (``vdpbf16ps``).
    """

    avx512_vnni: bool = False
    avx512_bf16: bool = False


def _cpuinfo_flags(path: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The first ``flags`` line of a cpuinfo file, as a set; None without the file or the line."""
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        return None
    return None


def _llvm_host_features() -> dict[str, bool]:
    try:
        import llvmlite.binding as llvm
    except ImportError:
        return {}
    try:
        return {name: bool(value) for name, value in llvm.get_host_cpu_features().items()}
    except RuntimeError:  # LLVM cannot tell on this host
        return {}


@functools.lru_cache(maxsize=1)
def cpu_reported_features() -> CpuFeatures:
    """What the CPU reports: ``/proc/cpuinfo``'s flags, else LLVM's host features (no llvmlite: none)."""
    flags = _cpuinfo_flags()
    if flags is not None:
        return CpuFeatures(**{name: name in flags for name in FEATURES})
    host = _llvm_host_features()
    return CpuFeatures(**{name: host.get(_LLVM_NAMES[name], False) for name in FEATURES})


@functools.lru_cache(maxsize=1)
def numba_can_target() -> CpuFeatures:
    """Which features numba's code generation may use: LLVM knows them for its target CPU.

    numba compiles for the host (LLVM's host features) unless ``NUMBA_CPU_NAME`` names a CPU;
    then only the features ``NUMBA_CPU_FEATURES`` lists (``+avx512vnni``) count. Without numba
    or llvmlite: none.
    """
    try:
        import numba  # noqa: F401 (the kernels need it)
    except ImportError:
        return CpuFeatures()
    cpu_name = os.environ.get("NUMBA_CPU_NAME", "")
    if cpu_name and cpu_name != "host":
        listed = os.environ.get("NUMBA_CPU_FEATURES", "").split(",")
        return CpuFeatures(**{name: f"+{_LLVM_NAMES[name]}" in listed for name in FEATURES})
    host = _llvm_host_features()
    return CpuFeatures(**{name: host.get(_LLVM_NAMES[name], False) for name in FEATURES})


def available_features() -> CpuFeatures:
    """The features the CPU reports and numba can target (the ``auto`` selection)."""
    reported, targeted = cpu_reported_features(), numba_can_target()
    return CpuFeatures(**{name: getattr(reported, name) and getattr(targeted, name) for name in FEATURES})


def _parse(value: str) -> tuple[str, ...] | None:
    """The features a switch value names (None: ``auto``); raises `ValueError` for a bad value."""
    text = value.strip().lower()
    if text in ("", "auto"):
        return None
    if text == "generic":
        return ()
    names = []
    for part in (piece.strip() for piece in text.split(",")):
        name = _ALIASES.get(part, part)
        if name not in FEATURES:
            raise ValueError(
                f"{ISA_VARIABLE}={value!r} is not a CPU instruction-set choice: expected 'auto', 'generic' or a "
                f"comma-separated list of {', '.join(FEATURES)} (or {', '.join(_ALIASES)}); unset it for 'auto'")
        names.append(name)
    return tuple(names)


def selected_features() -> CpuFeatures:
    """The features the kernels use now: ``SPARSECORE_CPU_ISA`` applied to `available_features`.

    Raises:
        ValueError: the variable holds an unknown value, or lists a feature that is not available
            here (the message says which, and why).
    """
    value = os.environ.get(ISA_VARIABLE, "")
    names = _parse(value)
    available = available_features()
    if names is None:
        return available
    for name in names:
        if not getattr(available, name):
            reason = ("this CPU does not report it" if not getattr(cpu_reported_features(), name)
                      else "numba cannot target it here (numba or llvmlite missing, or NUMBA_CPU_NAME names a "
                           "CPU without it)")
            raise ValueError(f"{ISA_VARIABLE}={value!r} asks for {name}, but {reason}; use "
                             f"{ISA_VARIABLE}=auto (every available feature) or generic")
    return CpuFeatures(**{name: name in names for name in FEATURES})


def uses(feature: str) -> bool:
    """Whether the CPU kernels use ``feature`` (one of `FEATURES`, or an alias) now (`selected_features`)."""
    name = _ALIASES.get(feature, feature)
    if name not in FEATURES:
        raise ValueError(f"feature must be one of {FEATURES}, got {feature!r}")
    return bool(getattr(selected_features(), name))


@contextlib.contextmanager
def cpu_isa(value: str) -> Iterator[CpuFeatures]:
    """Sets ``SPARSECORE_CPU_ISA`` to ``value`` for the block (process-wide), then restores it.

    Args:
        value: ``"auto"``, ``"generic"`` or a comma-separated list of features (see the module docstring).

    Yields:
        The features selected inside the block.

    Raises:
        ValueError: ``value`` is unknown, or names a feature that is not available here.
    """
    _parse(value)  # a bad value is refused before anything changes
    previous = os.environ.get(ISA_VARIABLE)
    os.environ[ISA_VARIABLE] = value
    try:
        selected = selected_features()
        yield selected
    finally:
        if previous is None:
            os.environ.pop(ISA_VARIABLE, None)
        else:
            os.environ[ISA_VARIABLE] = previous
