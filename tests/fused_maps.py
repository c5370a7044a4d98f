"""Neighbour maps and array transfers shared by the fused-kernel tests (test_implicit_gemm, test_pool_maps...).

Maps are made from random pairs (unique rows on both sides within each offset,
as in every rulebook) with `sparsecore.neighbour_map.neighbour_map_from_pairs`;
storage arrays are the twins' (``cuda_emulation/numpy_twins``: bfloat16 as its
uint16 bits), moved to a test target's array library.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sparsecore.neighbour_map import neighbour_map_from_pairs

try:
    from kernel_targets import BFLOAT16
except ImportError:  # tests/ imported as a package
    from tests.kernel_targets import BFLOAT16

__all__ = ["storage", "bits", "random_map", "symmetric_map", "on_target"]


def storage(target, bits: np.ndarray, dtype_name: str):
    """A twin's storage array (bfloat16 as uint16 bits) as the target's array."""
    if dtype_name == "bfloat16":
        if BFLOAT16 is None or target.xp is not np:
            pytest.skip("bfloat16 arrays need ml_dtypes on NumPy")
        return target.put(bits.view(BFLOAT16))
    return target.put(bits)


def bits(target, array, dtype_name: str) -> np.ndarray:
    host = np.asarray(target.get(array))
    return host.view(np.uint16) if dtype_name == "bfloat16" else host


def random_map(rng: np.random.Generator, num_input: int, num_output: int, kernel_size: tuple[int, ...],
               density: float = 0.5, empty_rows: int = 3):
    """A `NeighbourMap` of random pairs (unique rows on both sides within each offset, as in a rulebook);
    the last ``empty_rows`` outputs get no pair at all."""
    volume = int(np.prod(kernel_size))
    inputs, outputs, starts = [], [], [0]
    reachable = max(num_output - empty_rows, 0)
    for _ in range(volume):
        count = int(rng.integers(0, int(min(num_input, reachable) * density) + 1))
        inputs.append(rng.choice(num_input, count, replace=False))
        outputs.append(rng.choice(reachable, count, replace=False))
        starts.append(starts[-1] + count)
    pair_input = np.concatenate(inputs).astype(np.int32)
    pair_output = np.concatenate(outputs).astype(np.int32)
    return neighbour_map_from_pairs(np, pair_input, pair_output, tuple(starts), num_input, num_output, kernel_size)


def symmetric_map(rng: np.random.Generator, num_rows: int, kernel_size: tuple[int, ...]):
    """A submanifold-like map: offset ``k`` pairs ``(i, o)`` mirrored by offset ``K - 1 - k`` as ``(o, i)``;
    stored as one side (``symmetric=True``)."""
    volume = int(np.prod(kernel_size))
    table = np.full((num_rows, volume), -1, np.int32)
    for k in range(volume // 2):
        count = int(rng.integers(0, num_rows // 2 + 1))
        outputs = rng.choice(num_rows, count, replace=False)
        inputs = rng.choice(num_rows, count, replace=False)
        table[outputs, k] = inputs
        table[inputs, volume - 1 - k] = outputs
    if volume % 2:
        table[:, volume // 2] = np.arange(num_rows)
    offsets, outputs = np.nonzero(table.T >= 0)  # grouped by offset
    starts = np.concatenate([[0], np.cumsum(np.bincount(offsets, minlength=volume))])
    return neighbour_map_from_pairs(np, table.T[offsets, outputs].astype(np.int32), outputs.astype(np.int32),
                                    tuple(int(s) for s in starts), num_rows, num_rows, kernel_size,
                                    identity_offset=volume // 2 if volume % 2 else -1, symmetric=True)


def on_target(target, neighbour_map):
    """The map's arrays on the target (CuPy on a GPU)."""
    if target.xp is np:
        return neighbour_map
    fields = {name: None if getattr(neighbour_map, name) is None else target.put(getattr(neighbour_map, name))
              for name in ("output_neighbours", "output_masks", "output_order", "input_neighbours", "input_masks",
                           "input_order")}
    return dataclasses.replace(neighbour_map, **fields)
