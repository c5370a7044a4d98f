"""bfloat16 conv passes on the CPU's ``vdpbf16ps`` and AMX tiles: operand packing and the kernel calls.

The kernels (`_bf16_kernel_sources`) read bfloat16 rows as bits and multiply two channels at a time
into float32 sums; this module lays out their operands:

- source rows as 32-bit words of two bfloat16 channels (a view of the features when their channel
  count is even, else a copy with one zero channel);
- each offset's matrix ``[a, b]`` as words ``[ceil(a / 2), c]`` (rows ``2w`` and ``2w + 1`` interleaved,
  columns padded with zeros to ``c``, a multiple of 16: `pack_matrices`);
- the work items of the output-stationary forward sized so a block of float32 sums stays in a core's
  cache (`dot_items`), those of the one-pass backward so the weight gradient's float32 shares stay
  within the float32 backward's budget (`amx_backward_items`).

Two instruction sets run them: ``vdpbf16ps`` (`dot_rows`, `dot_backward`; `_bf16_kernel_sources`,
`_bf16_dot_backward`) and AMX tiles (`amx_rows`, `amx_backward`, where `amx_available`;
`_bf16_amx_sources`, `_bf16_amx_backward`).

Whether this route runs at all is `sparsecore.bf16_cpu_dataflow`'s decision (the CPU's feature and
the switch); elsewhere the bfloat16 passes widen to float32 and run the float32 dataflows. Both
round the float32 sums to bfloat16 once, at the end (nearest even).
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Any, Optional

import numpy as np

from .._compile_notice import numba_for_kernels
from ._cpu_kernels import ROW_BLOCK, TILE_ITEMS, TilePlan, _tile_sources, kernel_threads, tile_items

__all__ = ["LANES", "DOT_BLOCK_BYTES", "padded_columns", "source_words", "pack_matrices",
           "dot_items", "dot_rows", "amx_available", "amx_rows", "amx_backward_items",
           "amx_backward", "dot_backward"]

LANES = 16
"""float32 lanes of one ``vdpbf16ps``: the matrices' columns are padded to a multiple of it."""

DOT_BLOCK_BYTES = 256 * 1024
"""Most bytes of one work item's float32 sums (``rows x padded columns x 4``): the block stays in the
core's L2 cache while the item's offsets add into it."""


def _sources() -> Any:
    numba_for_kernels()
    from . import _bf16_kernel_sources

    return _bf16_kernel_sources


def _amx_sources() -> Any:
    if not amx_available():  # without the granted tile state the first tile instruction faults
        raise RuntimeError("the AMX bfloat16 kernels need a CPU with AMX-BF16 and the tile state granted by Linux "
                           "(amx_available() is False here)")
    numba_for_kernels()
    from . import _bf16_amx_sources

    return _bf16_amx_sources


_ARCH_PRCTL = 158  # x86-64 Linux system call numbers and arguments (asm/prctl.h)
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


@functools.lru_cache(maxsize=1)
def amx_available() -> bool:
    """Whether this process may run AMX-BF16 tiles: the CPU reports ``amx_bf16`` and ``amx_tile``, numba's
    LLVM targets them, and Linux grants the tile state (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, once a process).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            flags = next((line.partition(":")[2].split() for line in handle if line.startswith("flags")), [])
        import llvmlite.binding as llvm

        host = llvm.get_host_cpu_features()
        if not ({"amx_bf16", "amx_tile"} <= set(flags) and host.get("amx-bf16") and host.get("amx-tile")):
            return False
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, ImportError, RuntimeError, AttributeError):
        return False


def padded_columns(columns: int) -> int:
    """``columns`` rounded up to a multiple of `LANES` (at least `LANES`)."""
    return max(LANES, -(-columns // LANES) * LANES)


def source_words(rows: np.ndarray) -> np.ndarray:
    """bfloat16 ``rows [N, a]`` as uint32 words ``[N, ceil(a / 2)]`` (two channels each, the lower first).

    A view for C-contiguous rows with an even ``a``; else a copy with a zero channel appended.
    """
    bits = np.ascontiguousarray(rows).view(np.uint16)
    if bits.shape[1] % 2:
        padded = np.zeros((bits.shape[0], bits.shape[1] + 1), dtype=np.uint16)
        padded[:, :-1] = bits
        bits = padded
    return bits.view(np.uint32)


def pack_matrices(matrices: np.ndarray, rows_multiple: int = 2) -> np.ndarray:
    """bfloat16 ``matrices [K, a, b]`` as uint32 ``[K, a' / 2, padded_columns(b)]`` (``a'``: ``a`` rounded up to
    ``rows_multiple``, even): word ``[k, w, j]`` holds ``matrices[k, 2w, j]`` (lower half) and
    ``matrices[k, 2w + 1, j]`` (upper), zeros where padded (the layout ``vdpbf16ps`` and AMX tiles read)."""
    volume, rows, columns = matrices.shape
    bits = np.zeros((volume, -(-rows // rows_multiple) * rows_multiple, padded_columns(columns)), dtype=np.uint16)
    bits[:, :rows, :columns] = matrices.view(np.uint16) if matrices.flags.c_contiguous else (
        np.ascontiguousarray(matrices).view(np.uint16))
    pairs = bits.reshape(volume, bits.shape[1] // 2, 2, bits.shape[2]).transpose(0, 1, 3, 2)
    return np.ascontiguousarray(pairs).view(np.uint32).reshape(volume, bits.shape[1] // 2, bits.shape[2])


def dot_items(rows: int, columns: int) -> int:
    """`ROW_BLOCK` blocks per work item of `dot_rows`: `tile_items`' choice, halved while a block of float32
    sums (``items x ROW_BLOCK x padded_columns(columns) x 4`` bytes) passes `DOT_BLOCK_BYTES` (a power of
    two, from the sizes alone)."""
    items = tile_items(-(-rows // ROW_BLOCK))
    while items > 1 and items * ROW_BLOCK * padded_columns(columns) * 4 > DOT_BLOCK_BYTES:
        items //= 2
    return min(items, TILE_ITEMS)


def dot_rows(source: np.ndarray, matrices: np.ndarray, plan: TilePlan, num_rows: int, pairs: int,
             initial: Optional[np.ndarray] = None) -> np.ndarray:
    """``bfloat16(initial + sum_k source[s] @ matrices[k])`` for each destination row over the plan's pairs.

    Args:
        source: bfloat16 ``[N_src, a]``.
        matrices: bfloat16 ``[K, a, b]``.
        plan: the pairs' `TilePlan` with `dot_items` blocks per item (keys: destination rows).
        num_rows: destination rows ``N_dst``.
        pairs: the number of pairs (small passes run on the calling thread).
        initial: float32 ``[b]`` the sums start from (the bias), or None for zeros.

    Returns:
        bfloat16 ``[N_dst, b]`` (``source``'s dtype), every row written (rounded to nearest even once).
    """
    columns = matrices.shape[2]
    start = np.zeros(padded_columns(columns), dtype=np.float32)
    if initial is not None:
        start[:columns] = initial
    out = np.empty((num_rows, columns), dtype=np.uint16)
    words = source_words(source)
    packed = pack_matrices(matrices)
    with kernel_threads(pairs * (source.shape[1] + columns)) as lanes:
        _sources().dot_rows_kernel(words, plan.starts, plan.sources, plan.local_rows, packed, start, out,
                                   plan.capacity, lanes)
    return out.view(source.dtype)


def amx_rows(source: np.ndarray, matrices: np.ndarray, plan: TilePlan, num_rows: int, pairs: int,
             initial: Optional[np.ndarray] = None) -> np.ndarray:
    """`dot_rows` on AMX tiles (where `amx_available`): the same arguments and result, other summation order."""
    columns = matrices.shape[2]
    start = np.zeros(padded_columns(columns), dtype=np.float32)
    if initial is not None:
        start[:columns] = initial
    out = np.empty((num_rows, columns), dtype=np.uint16)
    packed = pack_matrices(matrices, 32)
    kernels = _amx_sources()
    with kernel_threads(pairs * (source.shape[1] + columns)) as lanes:
        kernels.amx_rows_kernel(np.ascontiguousarray(source).view(np.uint16), plan.starts, plan.sources,
                                plan.local_rows, packed, start, out, plan.capacity, max(1, plan.most),
                                kernels.TILE_CONFIG, lanes)
    return out.view(source.dtype)


def amx_backward_items(rows: int, volume: int, in_channels: int, out_channels: int, pairs: int) -> int:
    """`ROW_BLOCK` blocks per work item of `amx_backward`: `tile_items` of the padded sizes (the float32 shares
    of the weight gradient kept within `_cpu_kernels.TILE_PARTIAL_MAX_BYTES`)."""
    return tile_items(-(-rows // ROW_BLOCK), volume, padded_columns(in_channels), padded_columns(out_channels), 4,
                      pairs)


def _backward_buffers(source: np.ndarray, matrices: np.ndarray, plan: TilePlan, pairs: int,
                      rows_multiple: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
    """What `amx_backward` and `dot_backward` allocate: the padded float32 weight gradient ``[K, a16, b16]``
    (zeros), and, unless the pass has no work, ``(grad_source uint16 [N_in, a], the transposed matrices packed
    with ``rows_multiple`` [K, b' / 2, a16], the per-work-item shares [items, K, a16, b16])``."""
    volume, in_channels, out_channels = matrices.shape
    padded_in, padded_out = padded_columns(in_channels), padded_columns(out_channels)
    grad_matrices = np.zeros((volume, padded_in, padded_out), dtype=np.float32)
    if pairs == 0 or source.shape[0] == 0 or in_channels == 0 or out_channels == 0:
        return grad_matrices, None
    grad_source = np.empty(source.shape, dtype=np.uint16)
    packed = pack_matrices(np.ascontiguousarray(matrices.transpose(0, 2, 1)), rows_multiple)  # [K, b / 2, a16]
    partial = np.empty(((plan.starts.shape[0] - 1) // max(1, volume), volume, padded_in, padded_out), np.float32)
    return grad_matrices, (grad_source, packed, partial)


def amx_backward(grad: np.ndarray, source: np.ndarray, matrices: np.ndarray, plan: TilePlan,
                 pairs: int) -> tuple[np.ndarray, np.ndarray]:
    """Both gradients in one pass on AMX tiles (where `amx_available`; `_bf16_amx_backward`).

    Args:
        grad: bfloat16 ``[N_out, b]``.
        source: bfloat16 ``[N_in, a]`` the forward's input.
        matrices: bfloat16 ``[K, a, b]``.
        plan: the reversed pairs' `TilePlan` (keys: input rows) with `amx_backward_items` blocks a work item.
        pairs: the number of pairs.

    Returns:
        ``(grad_source bfloat16 [N_in, a], grad_matrices float32 [K, a, b])``, the weight gradient's shares
        added in work-item order (bitwise the same at every thread count).
    """
    _, in_channels, out_channels = matrices.shape
    grad_matrices, buffers = _backward_buffers(source, matrices, plan, pairs, 32)
    if buffers is None:
        return np.zeros(source.shape, dtype=source.dtype), grad_matrices[:, :in_channels, :out_channels]
    grad_source, packed, partial = buffers
    kernels = _amx_sources()
    from . import _bf16_amx_backward

    with kernel_threads(pairs * (in_channels + out_channels)) as lanes:
        _bf16_amx_backward.amx_backward_kernel(
            np.ascontiguousarray(source).view(np.uint16), np.ascontiguousarray(grad).view(np.uint16), plan.starts,
            plan.sources, plan.local_rows, packed, grad_source, partial, plan.capacity, max(1, plan.most),
            kernels.TILE_CONFIG, lanes)
        _tile_sources().sum_partials(partial, grad_matrices, lanes)
    return grad_source.view(source.dtype), grad_matrices[:, :in_channels, :out_channels]


def dot_backward(grad: np.ndarray, source: np.ndarray, matrices: np.ndarray, plan: TilePlan,
                 pairs: int) -> tuple[np.ndarray, np.ndarray]:
    """`amx_backward` on ``vdpbf16ps`` (`_bf16_dot_backward`): the same arguments (a plan with
    `amx_backward_items` blocks a work item) and results."""
    _, in_channels, out_channels = matrices.shape
    grad_matrices, buffers = _backward_buffers(source, matrices, plan, pairs, 2)
    if buffers is None:
        return np.zeros(source.shape, dtype=source.dtype), grad_matrices[:, :in_channels, :out_channels]
    grad_source, packed, partial = buffers
    numba_for_kernels()
    from . import _bf16_dot_backward

    with kernel_threads(pairs * (in_channels + out_channels)) as lanes:
        _bf16_dot_backward.dot_backward_kernel(
            np.ascontiguousarray(source).view(np.uint16), np.ascontiguousarray(grad).view(np.uint16),
            source_words(grad), plan.starts, plan.sources, plan.local_rows, packed, grad_source, partial,
            plan.capacity, max(1, plan.most), lanes)
        _tile_sources().sum_partials(partial, grad_matrices, lanes)
    return grad_source.view(source.dtype), grad_matrices[:, :in_channels, :out_channels]
