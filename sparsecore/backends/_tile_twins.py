"""NumPy twins of the tiled CPU kernels (`sparsecore.backends._cpu_kernels`), for layers too small to be
worth a compile (`_cpu_kernels.NUMPY_MAX_WORK`).

`fill_plan` gives the same plan as the compiled ``count_plan`` / ``fill_plan``. The passes add each
row's offsets in the compiled kernels' order, one GEMM per offset on NumPy's BLAS, so they agree with
the kernels to rounding (not bitwise: another BLAS and other GEMM shapes); which of the two runs a
layer depends on its sizes alone, so every result is the same at every thread count.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["fill_plan", "tiled_forward", "tiled_backward"]


def fill_plan(keys: np.ndarray, values: np.ndarray, offset_starts: tuple[int, ...], shift: int, starts: np.ndarray,
              sources: np.ndarray, local_rows: np.ndarray) -> np.ndarray:
    """Fills a tile plan's ``starts``, ``sources`` and ``local_rows`` (see `_cpu_kernels.tile_plan`) and returns
    its int64 ``[K, W]`` counts: the pairs grouped by work item (``key >> shift``), then offset, in order."""
    volume = len(offset_starts) - 1
    works = (starts.shape[0] - 1) // volume
    offsets = np.repeat(np.arange(volume, dtype=np.int64), np.diff(np.asarray(offset_starts, dtype=np.int64)))
    groups = (keys.astype(np.int64) >> shift) * volume + offsets  # (work item, offset), item-major
    order = np.argsort(groups, kind="stable")  # pairs keep their order within a range
    np.take(values, order, out=sources)
    np.bitwise_and(np.take(keys, order), (1 << shift) - 1, out=local_rows)
    counts = np.bincount(groups, minlength=works * volume)
    np.cumsum(counts, out=starts[1:])
    return counts.reshape(works, volume).T


def _plan_pairs(plan: Any, volume: int) -> tuple[np.ndarray, np.ndarray]:
    """Each plan entry's offset and key row (the item's first row plus its local row), int64 ``[P]``."""
    groups = np.repeat(np.arange(plan.starts.shape[0] - 1, dtype=np.int64), np.diff(plan.starts))
    return groups % volume, (groups // volume) * plan.capacity + plan.local_rows


def _offset_runs(offsets: np.ndarray, volume: int) -> tuple[np.ndarray, np.ndarray]:
    """The plan entries ordered by offset (stable: item order within one), and where each offset's run starts."""
    order = np.argsort(offsets, kind="stable")
    return order, np.concatenate([[0], np.cumsum(np.bincount(offsets, minlength=volume))])


def _add_rows(target: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
    """``target[rows] += values``, every pair summed where a hand-made pair map repeats a row within one offset
    (as the kernels do; rulebooks never repeat one, and then the plain indexed add runs)."""
    if int(np.bincount(rows, minlength=1).max()) > 1:
        np.add.at(target, rows, values)
    else:
        target[rows] += values


def tiled_forward(source: np.ndarray, plan: Any, matrices: np.ndarray, out: np.ndarray) -> None:
    """`tiled_forward` in NumPy: per offset in order, one GEMM of its pairs added into their rows (a row
    adds its offsets in the kernel's order; the products are NumPy's BLAS's)."""
    volume = matrices.shape[0]
    offsets, rows = _plan_pairs(plan, volume)
    order, runs = _offset_runs(offsets, volume)
    for offset in range(volume):
        run = order[runs[offset]:runs[offset + 1]]
        if run.shape[0]:
            _add_rows(out, rows[run], np.take(source, plan.sources[run], axis=0) @ matrices[offset])


def tiled_backward(source: np.ndarray, grad: np.ndarray, plan: Any,
                   matrices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`tiled_backward` in NumPy: per offset in order, the d-features GEMM added into the source rows
    and the offset's d-weights as one GEMM over all its pairs."""
    volume = matrices.shape[0]
    offsets, rows = _plan_pairs(plan, volume)  # key rows: the source rows
    order, runs = _offset_runs(offsets, volume)
    grad_source = np.zeros(source.shape, dtype=source.dtype)
    grad_matrices = np.zeros(matrices.shape, dtype=source.dtype)
    for offset in range(volume):
        run = order[runs[offset]:runs[offset + 1]]
        if run.shape[0]:
            gathered = np.take(grad, plan.sources[run], axis=0)
            _add_rows(grad_source, rows[run], gathered @ matrices[offset].T)
            grad_matrices[offset] = np.take(source, rows[run], axis=0).T @ gathered
    return grad_source, grad_matrices
