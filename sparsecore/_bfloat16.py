"""bfloat16 on the host without a hard dependency: NumPy has no bfloat16, ``ml_dtypes`` (installed with JAX) does.

The core never imports ml_dtypes to compute: a bfloat16 array arrives with its dtype. It is imported
(optionally) only to name the dtype (`bfloat16_dtype`, for the torch frontend's views) and to view a
torch bfloat16 tensor, whose DLPack NumPy cannot read (`bfloat16_view`); results go back to torch or
JAX without DLPack too (`bfloat16_to`).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["bfloat16_dtype", "is_bfloat16", "bfloat16_view", "bfloat16_to"]


def bfloat16_dtype() -> np.dtype | None:
    """NumPy's dtype for bfloat16 (``ml_dtypes.bfloat16``), or None where ml_dtypes is not installed."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


def is_bfloat16(dtype: Any) -> bool:
    """Whether ``dtype`` is bfloat16 (``ml_dtypes.bfloat16``, ``jax.numpy.bfloat16``), importing neither."""
    return getattr(dtype, "name", None) == "bfloat16"


def bfloat16_view(value: Any, library: str, name: str) -> np.ndarray:
    """A host bfloat16 array (torch, JAX, an XLA buffer) as a NumPy ``ml_dtypes.bfloat16`` array, without a copy.

    NumPy's DLPack has no bfloat16: JAX arrays and XLA buffers convert through ``__array__`` (a view of
    their memory), torch tensors through their int16 bits.

    Raises:
        TypeError: a torch bfloat16 tensor where ml_dtypes is not installed (naming ``name``).
    """
    if library == "torch":
        dtype = bfloat16_dtype()
        if dtype is None:
            raise TypeError(f"{name} is a torch bfloat16 tensor; the core reads bfloat16 through ml_dtypes "
                            "(pip install ml_dtypes), or cast it with .float()")
        torch = sys.modules["torch"]
        return value.contiguous().view(torch.int16).numpy().view(dtype)
    return np.asarray(value)


def bfloat16_to(value: np.ndarray, library: str) -> Any:
    """A NumPy ``ml_dtypes.bfloat16`` result as a torch tensor (sharing its memory, through int16 bits) or a JAX
    array (``library``: ``"torch"`` or ``"jax"``)."""
    if library == "torch":
        torch = sys.modules["torch"]
        bits = np.ascontiguousarray(value).view(np.int16)
        if not bits.flags.writeable:
            bits = bits.copy()
        return torch.from_numpy(bits).view(torch.bfloat16)
    return sys.modules["jax"].numpy.asarray(value)
