"""libspconv's int8 quantities of a converted layer: dynamic ranges that give back its scales, FP16 weights.

libspconv (and `sparsecore.runtime`) compute a scale as ``float32(range) / 127``
in float32 and quantize the FP16 weight per output channel with it; these
helpers choose the ranges and check that the FP16 weight quantizes back to the
layer's int8 weight.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._export_trace import ExportError

__all__ = ["dynamic_ranges", "dynamic_range", "check_fp16_weight"]


def dynamic_ranges(scales: Any) -> np.ndarray:
    """float32 ranges ``r`` with ``float32(r) / 127 == float32(scale)`` in float32 where a float32 ``r`` does
    (the one nearest to ``127 * scale``), else the float32 nearest to ``127 * scale``."""
    targets = np.asarray(scales, dtype=np.float64).astype(np.float32).reshape(-1)
    ranges = (127.0 * targets.astype(np.float64)).astype(np.float32)
    for index, (target, start) in enumerate(zip(targets, ranges)):
        candidates = [start]
        up = down = start
        for _ in range(4):
            up, down = np.nextafter(up, np.float32(np.inf)), np.nextafter(down, np.float32(0))
            candidates += [up, down]
        for candidate in candidates:
            if candidate / np.float32(127) == target:
                ranges[index] = candidate
                break
    return ranges


def dynamic_range(scale: float) -> float:
    """`dynamic_ranges` of one scale, as a Python float."""
    return float(dynamic_ranges([scale])[0])


def check_fp16_weight(where: str, weight: np.ndarray, ranges: np.ndarray, weight_int8: np.ndarray) -> None:
    """Refuses a weight whose FP16 values would not quantize back (with ``range / 127``) to the int8 weight."""
    scales = (ranges / np.float32(127)).astype(np.float32).reshape((-1,) + (1,) * (weight.ndim - 1))
    with np.errstate(divide="ignore", invalid="ignore"):
        back = np.clip(np.rint(weight.astype(np.float16).astype(np.float32) / scales), -128, 127)
    wrong = back != weight_int8
    if wrong.any():
        channel = int(np.argwhere(wrong)[0][0])
        raise ExportError(
            f"{where}: the FP16 weights (libspconv's only initializer type) cannot hold output channel {channel}'s "
            f"int8 weights exactly (its scale {float(scales.reshape(-1)[channel]):.3g} is too small for FP16 "
            "subnormals); the file would not run the converted model. Rescale the layer (e.g. a larger weight "
            "norm before conversion) or exclude it from quantization")
