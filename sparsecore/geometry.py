"""Convolution geometry: frozen, hashable descriptions of a sparse conv or pool layer.

A `ConvGeometry` holds what a rulebook depends on besides the coordinates: the
kind of layer and its per-axis kernel size, stride, padding, dilation and
output padding. It computes output spatial shapes with the dense PyTorch
formulas and the table of kernel offsets in the row-major order of a weight's
flattened kernel axes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

__all__ = ["ConvGeometry", "CONV_KINDS", "normalize_per_axis"]

CONV_KINDS = ("subm", "regular", "transposed", "inverse")
MAX_NDIM = 4

PerAxis = Union[int, Sequence[int]]


def normalize_per_axis(value: PerAxis, ndim: int, name: str, minimum: int) -> tuple[int, ...]:
    """Turns an int or a sequence into a tuple of ``ndim`` ints, each >= ``minimum``.

    Args:
        value: an int (used for every axis) or a sequence of ``ndim`` ints.
        ndim: the number of spatial axes.
        name: the argument's name, for error messages.
        minimum: the smallest allowed value.

    Returns:
        A tuple of ``ndim`` Python ints.

    Raises:
        ValueError: on a wrong length, a non-integer or a value below ``minimum``.
    """
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        values = (int(value),) * ndim
    else:
        try:
            values = tuple(value)  # type: ignore[arg-type]
        except TypeError:
            raise ValueError(
                f"{name} must be an int or a sequence of {ndim} ints, got {value!r}"
            ) from None
        if len(values) != ndim:
            raise ValueError(
                f"{name} must have {ndim} entries (one per spatial axis), got {len(values)} "
                f"entries: {value!r}"
            )
        for entry in values:
            if isinstance(entry, bool) or not isinstance(entry, (int, np.integer)):
                raise ValueError(f"{name} must contain ints, got {value!r}")
        values = tuple(int(entry) for entry in values)
    for axis, entry in enumerate(values):
        if entry < minimum:
            raise ValueError(
                f"{name} must be >= {minimum} on every axis, got {values} (axis {axis} is {entry})"
            )
    return values


@dataclass(frozen=True)
class ConvGeometry:
    """The shape-determining parameters of a sparse convolution or pooling layer.

    Attributes:
        kind: ``"subm"`` (output sites = input sites), ``"regular"`` (strided
            sparse conv, like a dense conv evaluated where any input is active),
            ``"transposed"`` (like a dense transposed conv) or ``"inverse"`` (the
            reverse of a saved regular rulebook).
        kernel_size: per-axis kernel extent.
        stride: per-axis stride (1 for subm).
        padding: per-axis zero padding.
        dilation: per-axis kernel dilation.
        output_padding: per-axis extra size of a transposed conv's output.
    """

    kind: str
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    output_padding: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.kind not in CONV_KINDS:
            raise ValueError(f"kind must be one of {CONV_KINDS}, got {self.kind!r}")
        ndim = len(self.kernel_size)
        if not 1 <= ndim <= MAX_NDIM:
            raise ValueError(f"sparse convolutions have 1 to {MAX_NDIM} spatial axes, got {ndim}")
        for name in ("stride", "padding", "dilation", "output_padding"):
            if len(getattr(self, name)) != ndim:
                raise ValueError(
                    f"{name} has {len(getattr(self, name))} axes but kernel_size has {ndim}"
                )
        if self.kind == "subm":
            even = [axis for axis, size in enumerate(self.kernel_size) if size % 2 == 0]
            if even:
                raise ValueError(
                    f"a submanifold conv needs an odd kernel size on every axis so that the "
                    f"kernel has a centre, got kernel_size={self.kernel_size} (even on axes "
                    f"{even}); use an odd size such as 3, or a regular sparse conv"
                )
        if self.kind == "transposed":
            for axis in range(ndim):
                limit = max(self.stride[axis], self.dilation[axis])
                if self.output_padding[axis] >= limit:
                    raise ValueError(
                        f"output_padding must be smaller than stride or dilation on every "
                        f"axis, got output_padding={self.output_padding} with "
                        f"stride={self.stride}, dilation={self.dilation} (axis {axis})"
                    )
        elif any(self.output_padding):
            raise ValueError(
                f"output_padding applies to transposed convs only, got "
                f"output_padding={self.output_padding} for kind={self.kind!r}"
            )

    @classmethod
    def create(
        cls,
        ndim: int,
        kernel_size: PerAxis,
        stride: PerAxis = 1,
        padding: PerAxis = 0,
        dilation: PerAxis = 1,
        output_padding: PerAxis = 0,
        kind: str = "regular",
    ) -> "ConvGeometry":
        """Builds a geometry, expanding ints to per-axis tuples and validating them.

        For ``kind="subm"`` the stride is forced to 1 and the padding to the
        kernel's half extent (spconv ignores both for submanifold layers).

        Args:
            ndim: number of spatial axes, 1 to 4.
            kernel_size: int or ``ndim`` ints, each >= 1.
            stride: int or ``ndim`` ints, each >= 1.
            padding: int or ``ndim`` ints, each >= 0.
            dilation: int or ``ndim`` ints, each >= 1.
            output_padding: int or ``ndim`` ints, each >= 0 (transposed only).
            kind: one of ``CONV_KINDS``.

        Returns:
            The frozen geometry.
        """
        if isinstance(ndim, bool) or not isinstance(ndim, (int, np.integer)) or not 1 <= ndim <= MAX_NDIM:
            raise ValueError(f"ndim must be an int from 1 to {MAX_NDIM}, got {ndim!r}")
        ndim = int(ndim)
        kernel = normalize_per_axis(kernel_size, ndim, "kernel_size", 1)
        strides = normalize_per_axis(stride, ndim, "stride", 1)
        pads = normalize_per_axis(padding, ndim, "padding", 0)
        dilations = normalize_per_axis(dilation, ndim, "dilation", 1)
        out_pads = normalize_per_axis(output_padding, ndim, "output_padding", 0)
        if kind == "subm":
            strides = (1,) * ndim
            pads = tuple(d * (k - 1) // 2 for k, d in zip(kernel, dilations))
        return cls(kind, kernel, strides, pads, dilations, out_pads)

    @property
    def ndim(self) -> int:
        """Number of spatial axes."""
        return len(self.kernel_size)

    @property
    def kernel_volume(self) -> int:
        """Number of kernel offsets, ``prod(kernel_size)``."""
        return math.prod(self.kernel_size)

    def output_spatial_shape(self, input_spatial_shape: Sequence[int]) -> tuple[int, ...]:
        """The output grid's shape, by the dense PyTorch formula for this kind.

        Args:
            input_spatial_shape: ``ndim`` positive ints.

        Returns:
            ``ndim`` ints.

        Raises:
            ValueError: for the inverse kind (its shape is the paired layer's input
                shape), a wrong number of axes, or an output that would be empty.
        """
        shape = normalize_per_axis(tuple(input_spatial_shape), self.ndim, "spatial_shape", 1)
        if self.kind == "subm":
            return shape
        if self.kind == "inverse":
            raise ValueError(
                "an inverse conv's output shape is the input shape of the paired regular "
                "conv; take it from that layer's rulebook (inverse_rulebook)"
            )
        out = []
        for axis, size in enumerate(shape):
            k, s, p, d = (
                self.kernel_size[axis],
                self.stride[axis],
                self.padding[axis],
                self.dilation[axis],
            )
            if self.kind == "regular":
                extent = size + 2 * p - d * (k - 1) - 1
                value = extent // s + 1 if extent >= 0 else 0
            else:
                value = (size - 1) * s - 2 * p + d * (k - 1) + self.output_padding[axis] + 1
            out.append(value)
        if any(value <= 0 for value in out):
            raise ValueError(
                f"the output spatial shape would be {tuple(out)} (empty) for input spatial "
                f"shape {shape} with {self.describe()}; enlarge the input or padding, or "
                f"shrink the kernel, stride or dilation"
            )
        return tuple(out)

    def kernel_offsets(self) -> np.ndarray:
        """Kernel positions, row-major over the kernel axes.

        Returns:
            int32 array ``[kernel_volume, ndim]``: row ``k`` holds the per-axis kernel
            index (0..kernel_size-1) of the ``k``-th flattened kernel offset.
        """
        grids = np.meshgrid(*[np.arange(size) for size in self.kernel_size], indexing="ij")
        return np.stack([grid.reshape(-1) for grid in grids], axis=1).astype(np.int32)

    def describe(self) -> str:
        """A one-line description naming every parameter, for error messages."""
        text = (
            f"{self.kind} geometry kernel_size={self.kernel_size}, stride={self.stride}, "
            f"padding={self.padding}, dilation={self.dilation}"
        )
        if any(self.output_padding):
            text += f", output_padding={self.output_padding}"
        return text
