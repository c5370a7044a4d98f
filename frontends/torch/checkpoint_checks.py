"""Checks of a checkpoint's values and layouts as a sparsecore conv layer loads them (``load_state_dict``).

torch copies whatever a checkpoint holds into a parameter of matching shape: NaN
and infinity load silently, and so do integer and bool tensors (cast to the
parameter's float dtype), which no trained float layer holds. Before the copy,
`check_saved_values` refuses, naming the key:

- a non-floating tensor (int, bool, complex) for a float parameter (``weight``, ``bias``);
- a tensor holding NaN or infinity (the count and the first position named).

``SPARSECORE_CHECKPOINT_CHECKS=off`` in the environment (read at each load) skips
these two checks, for those who want torch's behaviour.

`check_saved_layout` turns the two layouts a conv weight is commonly mistaken for
into an error saying which it is and how to convert it, where torch would report
a size mismatch: torch's dense layout ``[out, in, *kernel]`` (a checkpoint of
``nn.Conv3d`` or of another library), and a 1x1 weight saved transposed
(``[in, 1, ..., 1, out]``). Where those layouts have this layer's own shape (as
many input channels as the kernel is wide, or as many input as output channels),
the file cannot say which it is, and the weight is read as spconv reads it: as
``[out, *kernel, in]``, a 1x1 weight through ``weight.view(in, out)``.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["CHECKS_VARIABLE", "check_saved_values", "check_saved_layout"]

CHECKS_VARIABLE = "SPARSECORE_CHECKPOINT_CHECKS"
_OFF = ("off", "0", "false", "no")


def _switch() -> str:
    return f"set {CHECKS_VARIABLE}=off in the environment to load it as torch would"


def check_saved_values(module: Any, state_dict: dict, prefix: str) -> None:
    """Refuses non-float or non-finite values for the layer's float parameters (see the module docstring).

    Raises:
        TypeError: an int or bool tensor for a float parameter, naming the key.
        ValueError: a tensor holding NaN or infinity, naming the key, the count and the first position.
    """
    if os.environ.get(CHECKS_VARIABLE, "").strip().lower() in _OFF:
        return
    for name, parameter in module.named_parameters(recurse=False):
        key = prefix + name
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor) or not parameter.is_floating_point():
            continue
        if not value.is_floating_point():
            raise TypeError(f"state_dict[{key!r}] has dtype {value.dtype}, but {type(module).__name__}.{name} is a "
                            f"{parameter.dtype} parameter: a trained layer stores floats, so the checkpoint was "
                            f"written by something else or edited; {_switch()}")
        finite = torch.isfinite(value)
        if not bool(finite.all()):
            bad = (~finite).nonzero()[0].tolist()
            count = int((~finite).sum())
            raise ValueError(f"state_dict[{key!r}] holds {count} non-finite value(s) of {value.numel()} (first: "
                             f"{value[tuple(bad)].item()} at {bad}): the layer would compute NaN or infinity; the "
                             f"checkpoint was saved after training diverged, or edited; {_switch()}")


def check_saved_layout(module: Any, state_dict: dict, prefix: str) -> None:
    """Refuses a weight in torch's dense layout or a transposed 1x1 weight, saying which (see the module
    docstring); shapes equal to the layer's own load as spconv reads them.

    Raises:
        ValueError: naming the key, the layout recognised and how to convert it.
    """
    key = prefix + "weight"
    value = state_dict.get(key)
    if not isinstance(value, torch.Tensor):
        return
    expected = tuple(module.weight.shape)  # [out, *kernel, in // groups]
    shape = tuple(value.shape)
    if shape == expected or len(shape) != len(expected):
        return
    out, kernel, inputs = expected[0], expected[1:-1], expected[-1]
    ndim = len(kernel)
    if shape == (out, inputs, *kernel):
        order = ", ".join(["0", *(str(axis) for axis in range(2, 2 + ndim)), "1"])
        raise ValueError(f"state_dict[{key!r}] has shape {list(shape)}: torch's dense layout [out, in, *kernel] "
                         f"(nn.Conv{ndim}d's), not spconv's [out, *kernel, in] = {list(expected)}; convert it with "
                         f"state_dict[{key!r}] = weight.permute({order}).contiguous() before loading")
    if all(size == 1 for size in kernel) and shape == (inputs, *kernel, out):
        raise ValueError(f"state_dict[{key!r}] has shape {list(shape)}: a 1x1 weight saved transposed [in, 1, ..., "
                         f"out]; spconv stores it as [out, 1, ..., in] = {list(expected)} and computes with "
                         f"weight.view(in, out). If its values are that [in, out] matrix, load "
                         f"weight.reshape({list(expected)}) (the same memory, as spconv keeps it)")
