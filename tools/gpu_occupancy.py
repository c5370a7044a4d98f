"""Theoretical occupancy of a kernel on one streaming multiprocessor, from its resources alone.

The arithmetic of NVIDIA's occupancy calculator: resident blocks per SM are the
smallest of four limits,

- registers: each warp takes ``ceil(registers * 32 / 256) * 256`` registers
  (allocated per warp in units of 256); the warps that fit in the SM's 65,536
  are rounded down to a multiple of 4 (the warp allocation granularity), then
  divided by the block's warps;
- shared memory: each block takes its static plus dynamic shared memory plus
  the 1 KiB the runtime reserves per block (sm_80 and later), rounded up to 128
  bytes, out of the SM's 228 KiB;
- threads: 2,048 per SM (64 warps);
- blocks: 32 per SM.

Occupancy is the resident warps over 64. `HOPPER_H100` holds the H100 SXM's
numbers (132 SMs); `SmLimits` takes any other GPU's.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SmLimits", "HOPPER_H100", "Occupancy", "occupancy"]


@dataclass(frozen=True)
class SmLimits:
    """What one SM of a GPU holds.

    Attributes:
        name: the GPU in words.
        multiprocessors: SMs on the GPU.
        registers: 32-bit registers per SM.
        register_unit: registers are allocated per warp in multiples of this.
        warp_granularity: warps that fit by registers are rounded down to a multiple of this.
        max_threads: resident threads per SM.
        max_blocks: resident blocks per SM.
        shared_bytes: shared memory per SM usable by blocks.
        reserved_shared_bytes: shared memory the runtime reserves per block.
        shared_granularity: shared memory is allocated per block in multiples of this.
        max_threads_per_block: the largest block.
        max_registers_per_thread: the most a thread may use.
    """

    name: str = "H100 SXM (sm_90)"
    multiprocessors: int = 132
    registers: int = 65536
    register_unit: int = 256
    warp_granularity: int = 4
    max_threads: int = 2048
    max_blocks: int = 32
    shared_bytes: int = 228 * 1024
    reserved_shared_bytes: int = 1024
    shared_granularity: int = 128
    max_threads_per_block: int = 1024
    max_registers_per_thread: int = 255

    @property
    def max_warps(self) -> int:
        """Resident warps per SM."""
        return self.max_threads // 32


HOPPER_H100 = SmLimits()


@dataclass(frozen=True)
class Occupancy:
    """Resident blocks of one kernel on one SM.

    Attributes:
        blocks_per_sm: resident blocks (0: the kernel cannot launch with these resources).
        by_registers: the register limit on blocks.
        by_shared: the shared-memory limit on blocks.
        by_threads: the thread limit on blocks.
        by_blocks: the SM's block limit.
        limited_by: which limit is the smallest (``"registers"``, ``"shared memory"``, ``"threads"``,
            ``"blocks"``), ties named in that order.
        warps: resident warps (``blocks_per_sm * warps per block``).
        fraction: ``warps / max_warps``.
        resident_blocks: ``blocks_per_sm`` times the GPU's SMs: the blocks of one wave.
    """

    blocks_per_sm: int
    by_registers: int
    by_shared: int
    by_threads: int
    by_blocks: int
    limited_by: str
    warps: int
    fraction: float
    resident_blocks: int


def _ceil_to(value: int, unit: int) -> int:
    return -(-value // unit) * unit


def occupancy(registers: int, threads: int, shared_bytes: int = 0, dynamic_shared_bytes: int = 0,
              limits: SmLimits = HOPPER_H100) -> Occupancy:
    """Resident blocks per SM of a kernel with these resources.

    Args:
        registers: registers per thread (ptxas' "Used N registers"); 0 is taken as 1.
        threads: threads per block.
        shared_bytes: static shared memory per block.
        dynamic_shared_bytes: dynamic shared memory per block (the launch's).
        limits: the GPU.

    Returns:
        The `Occupancy`.

    Raises:
        ValueError: for a block of no threads or more than the GPU allows, negative shared memory,
            or more registers per thread than the GPU allows.
    """
    if not 1 <= threads <= limits.max_threads_per_block:
        raise ValueError(f"threads must be 1..{limits.max_threads_per_block} per block, got {threads}")
    if registers > limits.max_registers_per_thread or registers < 0:
        raise ValueError(f"registers must be 0..{limits.max_registers_per_thread} per thread, got {registers}")
    if shared_bytes < 0 or dynamic_shared_bytes < 0:
        raise ValueError(f"shared memory must be >= 0 bytes, got {shared_bytes} static and "
                         f"{dynamic_shared_bytes} dynamic")
    warps_per_block = -(-threads // 32)
    per_warp = _ceil_to(max(registers, 1) * 32, limits.register_unit)
    warps_by_registers = limits.registers // per_warp // limits.warp_granularity * limits.warp_granularity
    by_registers = warps_by_registers // warps_per_block
    per_block = _ceil_to(shared_bytes + dynamic_shared_bytes + limits.reserved_shared_bytes,
                         limits.shared_granularity)
    by_shared = limits.shared_bytes // per_block
    by_threads = limits.max_warps // warps_per_block
    candidates = (("registers", by_registers), ("shared memory", by_shared), ("threads", by_threads),
                  ("blocks", limits.max_blocks))
    limited_by, blocks = min(candidates, key=lambda item: item[1])
    warps = blocks * warps_per_block
    return Occupancy(blocks, by_registers, by_shared, by_threads, limits.max_blocks, limited_by, warps,
                     warps / limits.max_warps, blocks * limits.multiprocessors)
