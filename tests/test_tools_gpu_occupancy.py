"""tools/gpu_occupancy.py: resident blocks per SM against cases computed by hand (H100: 65,536 registers
in 256-register warp units, warps rounded down to 4, 228 KiB of shared memory with 1 KiB reserved per
block in 128-byte units, 2,048 threads, 32 blocks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tool_modules import load_tool

ROOT = Path(__file__).resolve().parents[1]


tool = load_tool("gpu_occupancy")


@pytest.mark.parametrize(("registers", "threads", "shared", "blocks", "limit", "fraction"), [
    # 96 regs: 3,072 a warp, 21 warps -> 20, 8 warps a block: 2 (the issue-28 SIMT forward)
    (96, 256, 9472, 2, "registers", 0.25),
    # 120 regs: 3,840 a warp, 17 warps -> 16, 4 a block: 4 (the float16 wmma forward)
    (120, 128, 27392, 4, "registers", 0.25),
    # 92 regs round up to 96: 20 warps, 5 blocks of 4 warps (the float16 weight gradient)
    (92, 128, 27168, 5, "registers", 0.3125),
    # 132 regs round up to 136: 4,352 a warp, 15 warps -> 12: 3 blocks
    (132, 128, 27168, 3, "registers", 0.1875),
    # 32 regs: 64 warps -> 16 blocks; threads allow 16 too: registers named first
    (32, 128, 0, 16, "registers", 1.0),
    # shared memory: 100,000 + 1,024 -> 101,120 bytes a block, 233,472 / 101,120 = 2
    (32, 128, 100_000, 2, "shared memory", 0.125),
    # 16 regs, one warp a block: 32 blocks (the SM's block limit), 32 of 64 warps
    (16, 32, 0, 32, "blocks", 0.5),
    # threads: 1,024-thread blocks of 32 regs: 2 by threads, 2 by registers -> registers first
    (32, 1024, 0, 2, "registers", 1.0),
    # 40 regs (1,280 a warp, 51 warps -> 48), 512-thread blocks: 3 by registers, 4 by threads
    (40, 512, 0, 3, "registers", 0.75),
    # 255 regs: 8,192 a warp, 8 warps; a 1,024-thread block does not fit
    (255, 1024, 0, 0, "registers", 0.0),
])
def test_resident_blocks_match_the_hand_computation(registers: int, threads: int, shared: int, blocks: int,
                                                     limit: str, fraction: float) -> None:
    result = tool.occupancy(registers, threads, shared)
    assert (result.blocks_per_sm, result.limited_by, result.fraction) == (blocks, limit, fraction)
    assert result.resident_blocks == blocks * 132 and result.warps == blocks * -(-threads // 32)


def test_dynamic_shared_memory_counts_and_other_gpus_take_their_limits() -> None:
    assert tool.occupancy(32, 128, 50_000, dynamic_shared_bytes=50_000).by_shared == 2  # 101,120 a block
    small = tool.SmLimits(name="a smaller SM", multiprocessors=10, shared_bytes=64 * 1024, max_threads=1024)
    result = tool.occupancy(32, 256, 20_000, limits=small)
    assert (result.by_shared, result.by_threads, result.blocks_per_sm, result.resident_blocks) == (3, 4, 3, 30)


@pytest.mark.parametrize(("registers", "threads", "shared", "message"), [
    (32, 0, 0, "threads must be 1..1024"), (32, 2048, 0, "threads must be 1..1024"),
    (300, 128, 0, "registers must be 0..255"), (32, 128, -1, "shared memory must be >= 0"),
])
def test_impossible_resources_are_refused(registers: int, threads: int, shared: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tool.occupancy(registers, threads, shared)
