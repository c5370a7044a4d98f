"""torch's deprecation notices that sparsecore's own int8 calls trigger, silenced around those calls only.

torch (2.13) warns, once per process, that ``torch.quantize_per_tensor``,
``torch.quantize_per_channel`` and the other quantized-tensor constructors are
deprecated. sparsecore's int8 layers hold their features and weights in such
tensors (``torch.qint8``, spconv's API), so that notice would otherwise be
printed by every run of an int8 model, naming a call the user never made.
`torch_notices_silenced` wraps exactly those calls of ours, with a
``warnings.catch_warnings`` block that ignores that message alone: the user's
own calls (``prepare_fx``, ``convert_fx``, their own ``torch.quantize_per_tensor``)
warn as torch decides, and no filter outlives the call.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator

__all__ = ["QUANTIZED_TENSOR_NOTICE", "torch_notices_silenced"]

QUANTIZED_TENSOR_NOTICE = (r"torch\.quantize_per_tensor, torch\.quantize_per_channel and other quantized tensor "
                           r"creation functions")
"""The start of torch's UserWarning about quantized-tensor constructors (a regular expression)."""


@contextlib.contextmanager
def torch_notices_silenced() -> Iterator[None]:
    """Ignores torch's quantized-tensor deprecation notice inside the block (and nothing else)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=QUANTIZED_TENSOR_NOTICE, category=UserWarning)
        yield
