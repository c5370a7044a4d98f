"""Validation of rulebook reuse: a cached rulebook must fit the layer that reuses it.

Layers that share an ``indice_key`` reuse one rulebook (spconv's semantics:
submanifold layers with the same kernel and sites; an inverse conv reversing a
regular conv or pool). Reusing one that does not fit would give silently wrong
results, so each check raises a `ValueError` naming both geometries.
"""

from __future__ import annotations

from typing import Any, Sequence

from ._dispatch import array_module
from .geometry import ConvGeometry
from .rulebook import Rulebook

__all__ = ["check_rulebook_fits", "check_inverse_fits"]


def _same_sites(first: Any, second: Any) -> bool:
    if first is second:
        return True
    if first.shape != second.shape:
        return False
    return bool(array_module(first).array_equal(first, second))


def check_rulebook_fits(rulebook: Rulebook, geometry: ConvGeometry, indices: Any,
                        spatial_shape: Sequence[int], key: str) -> None:
    """Raises when a cached rulebook cannot serve a layer with ``geometry`` on these sites.

    Args:
        rulebook: the cached rulebook.
        geometry: the reusing layer's geometry.
        indices: the reusing layer's input sites.
        spatial_shape: the reusing layer's input grid.
        key: the ``indice_key`` shared, for the message.
    """
    problems = []
    if rulebook.geometry != geometry:
        problems.append("the geometries differ")
    if tuple(spatial_shape) != rulebook.input_spatial_shape:
        problems.append(
            f"the input spatial shape is {tuple(spatial_shape)}, the rulebook's is "
            f"{rulebook.input_spatial_shape}"
        )
    if indices.shape[0] != rulebook.num_input:
        problems.append(f"the input has {indices.shape[0]} sites, the rulebook {rulebook.num_input}")
    elif not _same_sites(indices, rulebook.input_indices):
        problems.append("the input sites are not the ones the rulebook was built from")
    if problems:
        raise ValueError(
            f"indice_key {key!r} holds a rulebook that does not fit this layer: "
            + "; ".join(problems)
            + f". Cached: {rulebook.geometry.describe()}. This layer: {geometry.describe()}. "
            "Layers may share an indice_key only when they have the same kernel size, "
            "dilation and input sites; give this layer its own indice_key."
        )


def check_inverse_fits(rulebook: Rulebook, kernel_size: tuple[int, ...], indices: Any,
                       spatial_shape: Sequence[int], key: str) -> None:
    """Raises when an inverse conv's input is not the output of the paired layer under ``key``."""
    problems = []
    if rulebook.geometry.kind != "regular":
        problems.append(f"the paired layer is a {rulebook.geometry.kind} layer, not a regular conv or pool")
    if tuple(kernel_size) != rulebook.geometry.kernel_size:
        problems.append(
            f"the inverse conv has kernel_size {tuple(kernel_size)}, the paired layer "
            f"{rulebook.geometry.kernel_size}"
        )
    if tuple(spatial_shape) != rulebook.output_spatial_shape:
        problems.append(
            f"the input spatial shape is {tuple(spatial_shape)}, the paired layer's output "
            f"shape is {rulebook.output_spatial_shape}"
        )
    if indices.shape[0] != rulebook.num_output or not _same_sites(indices, rulebook.output_indices):
        problems.append(
            f"the input's {indices.shape[0]} sites are not the paired layer's "
            f"{rulebook.num_output} output sites"
        )
    if problems:
        raise ValueError(
            f"the inverse conv cannot reverse the rulebook under indice_key {key!r}: "
            + "; ".join(problems)
            + f". Paired layer: {rulebook.geometry.describe()}. Feed the inverse conv the "
            "(feature-transformed) output of the paired layer, with the same kernel_size."
        )
