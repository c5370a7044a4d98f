"""Input checks shared by the core: a re-export of the public `sparsecore.interop` checks.

Kept so that existing ``from ._validation import ...`` imports keep working; new
code imports `sparsecore.interop`.
"""

from __future__ import annotations

from .interop import (
    FLOAT_DTYPES,
    as_batch_size,
    as_features,
    as_indices,
    as_spatial_shape,
    check_indices_in_range,
    check_unique_sites,
)

__all__ = [
    "FLOAT_DTYPES",
    "as_features",
    "as_indices",
    "as_spatial_shape",
    "as_batch_size",
    "check_indices_in_range",
    "check_unique_sites",
]
