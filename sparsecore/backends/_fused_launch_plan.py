"""Launch plans of the fused conv kernels: the GPU's traits, the engine per dtype, and the scratch sizes.

What `sparsecore.backends._kernel_fused` decides before a launch, as pure functions of sizes (and one
per-map cache): which engine and block size a dtype runs (`engine_of`), whether the GPU can run it
(`check_device`), how big the weight gradient's zeroed scratch is (`weight_gradient_scratch_words`), and the
offset splits' per-map scratch (`split_scratch`, `SplitPlan`). The constants mirror
``kernels_cu/implicit_gemm.cu``'s (``sc::kSimtThreads``...).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from . import tile_shapes

__all__ = ["SIMT_THREADS", "WMMA_THREADS", "TILE_ROWS", "TILE_COLUMNS", "TILE_ELEMENTS", "MAX_KERNEL_VOLUME",
           "MIN_COMPUTE_CAPABILITY", "DeviceTraits", "device_traits", "check_device", "engine_of",
           "weight_gradient_tiles", "weight_gradient_scratch_words", "split_scratch_words", "SplitScratch",
           "SPLIT_SCRATCH", "split_scratch", "SplitPlan"]

SIMT_THREADS = 256  # sc::kSimtThreads
WMMA_THREADS = 128  # sc::kWmmaThreads
TILE_ROWS = 64  # sc::kTileRows: rows of a block's tile
TILE_COLUMNS = 64  # sc::kTileCols
TILE_ELEMENTS = TILE_ROWS * TILE_COLUMNS
MAX_KERNEL_VOLUME = 64 * 32  # sc::kMaxMaskWords mask words of 32 offsets
# The oldest GPU the feature kernels are built for: sm_75 (Turing), the oldest CUDA 13 supports.
MIN_COMPUTE_CAPABILITY = 75



@dataclass(frozen=True)
class DeviceTraits:
    """What the launch wrappers need of the GPU: its multiprocessors and compute capability (75 for sm_75)."""

    sm_count: int
    compute_capability: int


@functools.lru_cache(maxsize=None)
def _cupy_traits(device_id: int) -> DeviceTraits:
    import cupy

    device = cupy.cuda.Device(device_id)
    return DeviceTraits(int(device.attributes["MultiProcessorCount"]), int(device.compute_capability))


def device_traits(xp: Any) -> DeviceTraits:
    """The current CuPy device's traits (memoized per device), or an sm_90 with `tile_shapes.DEFAULT_SM_COUNT`
    multiprocessors for any other array module (the emulation)."""
    if getattr(xp, "__name__", "") == "cupy":
        return _cupy_traits(int(xp.cuda.runtime.getDevice()))
    return DeviceTraits(tile_shapes.DEFAULT_SM_COUNT, 90)


def check_device(dtype_name: str, traits: DeviceTraits, volume: int, caller: str) -> None:
    """Raises a clear error where the fused kernels cannot run a pass (checked before any launch).

    Raises:
        RuntimeError: a GPU older than sm_75 (the kernels' oldest target), naming the dtype and the GPU.
        ValueError: a kernel of more than `MAX_KERNEL_VOLUME` offsets.
    """
    if traits.compute_capability < MIN_COMPUTE_CAPABILITY:
        major, minor = divmod(traits.compute_capability, 10)
        raise RuntimeError(
            f"{caller}: the fused convolution kernels need a GPU of compute capability 7.5 (sm_75) or newer; "
            f"this GPU is {major}.{minor}, so a {dtype_name} convolution cannot run on it: run on the CPU "
            "(NumPy arrays) or on a newer GPU")
    if volume > MAX_KERNEL_VOLUME:
        raise ValueError(f"{caller}: a kernel of {volume} offsets exceeds the fused kernels' "
                         f"{MAX_KERNEL_VOLUME}; use a smaller kernel_size")


def engine_of(dtype_name: str, tf32: bool, reduce: int | None = None) -> tuple[str, int]:
    """``(Math tag, threads per block)`` of the conv kernels for a storage dtype name.

    Args:
        dtype_name: the storage dtype's name.
        tf32: float32 on TF32 tensor cores.
        reduce: channels an ``sc_implicit_gemm`` pass reduces over; at most
            `tile_shapes.NARROW_REDUCTION` of them run on SIMT for every dtype (not padded to the
            tensor cores' k). None for ``sc_weight_gradient``.

    The Wmma instantiations run 128 threads on every GPU (on sm_75, bfloat16 and TF32 compile to the
    SIMT engine at 128 threads: `tile_shapes.engine_of`).
    """
    tensor = dtype_name in ("float16", "bfloat16") or (dtype_name == "float32" and tf32)
    if tensor and not (reduce is not None and reduce <= tile_shapes.NARROW_REDUCTION):
        return "sc::Wmma", WMMA_THREADS
    return "sc::Simt", SIMT_THREADS


def weight_gradient_tiles(volume: int, groups: int, in_per_group: int, out_per_group: int) -> int:
    """64 x 64 tiles of the weight gradient: ``K * groups * ceil(a / 64) * ceil(b / 64)``."""
    return volume * groups * -(-in_per_group // TILE_ROWS) * -(-out_per_group // TILE_COLUMNS)


def weight_gradient_scratch_words(tiles: int, splits: int, partial_itemsize: int) -> int:
    """Elements (of the ``partial_itemsize``-byte accumulator) of ``sc_weight_gradient``'s zeroed scratch:
    the partials (``splits > 1``), then a 32-bit counter per tile."""
    partials = tiles * splits * TILE_ELEMENTS if splits > 1 else 0
    return partials + -(-tiles * 4 // partial_itemsize)


def split_scratch_words(counters: int, partial_bytes: int) -> int:
    """32-bit words of ``sc_implicit_gemm``'s split scratch: ``counters`` counter words (rounded up to 32, so
    the partials start 128-byte aligned), then ``partial_bytes`` of partial tiles."""
    return -(-counters // 32) * 32 + -(-partial_bytes // 4)


@dataclass(frozen=True)
class SplitScratch:
    """A map's scratch for ``sc_implicit_gemm``'s offset splits (kept in ``NeighbourMap.derived``).

    Attributes:
        buffer: uint32 device array of `split_scratch_words` words: the counters (zero between launches),
            then the partial tiles.
        counter_words: words reserved for counters (a multiple of 32).
        partial_bytes: bytes for partial tiles after them.
    """

    buffer: Any
    counter_words: int
    partial_bytes: int


SPLIT_SCRATCH = "fused split scratch"


def split_scratch(xp: Any, neighbour_map: Any, counters: int, partial_bytes: int) -> SplitScratch:
    """The map's split scratch, allocated (zeroed) at first use or when a pass needs more than it holds."""
    scratch = neighbour_map.derived.get(SPLIT_SCRATCH)
    if scratch is None or scratch.counter_words < counters or scratch.partial_bytes < partial_bytes:
        if scratch is not None:
            counters, partial_bytes = max(counters, scratch.counter_words), max(partial_bytes, scratch.partial_bytes)
        counter_words = -(-counters // 32) * 32
        scratch = SplitScratch(xp.zeros(split_scratch_words(counter_words, partial_bytes), dtype=xp.uint32),
                               counter_words, -(-partial_bytes // 4) * 4)
        neighbour_map.derived[SPLIT_SCRATCH] = scratch
    return scratch


@dataclass(frozen=True)
class SplitPlan:
    """How one ``sc_implicit_gemm`` launch is cut: ``tiles`` output tiles, ``splits`` blocks each."""

    tiles: int
    splits: int
    partial_bytes: int
