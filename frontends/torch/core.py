"""spconv's algorithm enums (accepted; sparsecore picks its own dataflow), and the names of ``spconv.pytorch.core``."""

from __future__ import annotations

import enum

from .tensor import IndiceData, SparseConvTensor, expand_nd

__all__ = ["ConvAlgo", "AlgoHint", "SparseConvTensor", "IndiceData", "expand_nd"]


class ConvAlgo(enum.Enum):
    """spconv ``ConvAlgo``; layers record it and ignore it."""

    Native = 0
    MaskImplicitGemm = 1
    MaskSplitImplicitGemm = 2


class AlgoHint(enum.Enum):
    """spconv ``AlgoHint`` (its spelling of ``Fowrard`` kept)."""

    NoHint = 0b000
    Fowrard = 0b001
    BackwardInput = 0b010
    BackwardWeight = 0b100
