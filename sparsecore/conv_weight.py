"""Checks of a convolution weight: its layout, its kernel axes, channels and dtype.

spconv 2.x lays a weight out ``[out_channels, *kernel_size, in_channels // groups]``;
torch's ``ConvNd`` lays it out ``[out_channels, in_channels // groups, *kernel_size]``.
`check_weight_layout` tells the two apart before anything reads a kernel size
from the weight, and says which permutation fixes a misplaced channel axis;
`check_conv_weight` then checks the weight against a rulebook. Both are
re-exported by `sparsecore.conv`.
"""

from __future__ import annotations

from typing import Any

from ._dispatch import to_core_array
from .rulebook import PairMap, Rulebook

__all__ = ["check_weight_layout", "check_conv_weight"]


def check_weight_layout(weight: Any, in_channels: int, groups: int, ndim: int) -> None:
    """Checks that ``weight`` is laid out ``[out_channels, *kernel_size, in_channels // groups]``.

    Runs before anything reads the kernel size from the weight, so a weight in
    torch's ``[out, in, *k]`` layout is reported as a layout error (with the
    permutation that fixes it), not as a strange kernel size.

    Args:
        weight: a core array.
        in_channels: channels of the input features.
        groups: number of channel groups.
        ndim: spatial axes of the conv.

    Raises:
        ValueError: on a wrong rank, a ``groups`` that does not divide the channels,
            or a last axis that is not ``in_channels // groups``.
    """
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    layout = "[out_channels, *kernel_size, in_channels // groups] (spconv 2.x's layout)"
    shape = tuple(int(size) for size in weight.shape)
    if weight.ndim != ndim + 2:
        raise ValueError(
            f"weight must have shape {layout}: {ndim + 2} axes for a {ndim}-D conv, got shape {shape}"
        )
    if in_channels % groups:
        raise ValueError(f"groups={groups} must divide in_channels ({in_channels})")
    expected = in_channels // groups
    if shape[-1] == expected:
        return
    message = (
        f"weight must be laid out {layout}, so its last axis must be {expected} "
        f"(in_channels {in_channels} // groups {groups}), got shape {shape}"
    )
    if shape[1] == expected:
        axes = ", ".join(str(axis) for axis in range(2, ndim + 2))
        message += (
            f", which is torch's Conv{ndim}d layout [out_channels, in_channels // groups, *kernel_size]. "
            f"Move the channel axis last: weight.permute(0, {axes}, 1) for a torch tensor, "
            "numpy.moveaxis(weight, 1, -1) for an array"
        )
    elif shape[0] == expected:
        message += (
            ", which looks like [in_channels, *kernel_size, out_channels]: swap the first and last "
            "axes (numpy.moveaxis(weight, [0, -1], [-1, 0]))"
        )
    else:
        message += "; check the layer's in_channels and groups"
    raise ValueError(message)


def check_conv_weight(weight: Any, rulebook: Rulebook | PairMap, in_channels: int, groups: int) -> Any:
    """Validates a conv weight against a rulebook and the input channels.

    The layout (`check_weight_layout`) is checked first, then the kernel axes
    against the rulebook's kernel size, the output channels and the dtype.

    Args:
        weight: ``[out_channels, *kernel_size, in_channels // groups]``.
        rulebook: the layer's rulebook.
        in_channels: channels of the input features.
        groups: number of channel groups.

    Returns:
        The weight as a core array.
    """
    weight = to_core_array(weight, "weight")
    kernel_size = tuple(rulebook.kernel_size)
    check_weight_layout(weight, in_channels, groups, len(kernel_size))
    if tuple(weight.shape[1:-1]) != kernel_size:
        raise ValueError(
            f"weight's kernel axes {tuple(weight.shape[1:-1])} do not match the rulebook's "
            f"kernel_size {kernel_size}; weight is [out_channels, *kernel_size, in_channels // groups]"
        )
    out_channels = weight.shape[0]
    if out_channels % groups:
        raise ValueError(
            f"groups={groups} must divide both in_channels ({in_channels}) and out_channels "
            f"({out_channels})"
        )
    if weight.dtype.kind != "f" and weight.dtype.name != "bfloat16":  # bfloat16 runs on the kernel backend
        raise TypeError(f"weight must be a float array, got dtype {weight.dtype}")
    return weight
