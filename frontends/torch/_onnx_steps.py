"""The planned nodes of an ONNX export: a conv with its folded parameters, or an op, plus extra attributes.

`export_onnx` plans them from a recorded float model (`onnx_export`) or from a
converted int8 model (`_onnx_int8`), then writes each as one libspconv node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np

from ._export_trace import ConvRecord, OpRecord

__all__ = ["PlannedConv", "PlannedStep"]


@dataclass(frozen=True)
class PlannedConv:
    """A conv to write: its record, (folded) float64 parameters, activation and output value."""

    record: ConvRecord
    weight: np.ndarray
    bias: np.ndarray
    activation: Optional[str]
    output: str


@dataclass(frozen=True)
class PlannedStep:
    """One graph node in planning: a `PlannedConv` or an `OpRecord` (add, relu, dense, reshape, transpose).

    ``attributes``: ``(name, value)`` pairs written on the node over the defaults (the int8 ones).
    """

    item: Union[PlannedConv, OpRecord]
    attributes: tuple[tuple[str, Any], ...] = ()

    @property
    def inputs(self) -> tuple[str, ...]:
        if isinstance(self.item, PlannedConv):
            return (self.item.record.input,)
        return self.item.inputs

    @property
    def output(self) -> str:
        return self.item.output
