"""Seeded conv case sets and their expected output sites, shared by the conv oracle tests.

The core's (``test_conv.py``) and the torch layers' (``test_torch_conv.py``)
oracle tests draw the same kinds of cases from `dense_oracle.sample_cases`
and expect the same output sites: the input sites (submanifold), the dense
op's active sites on the occupancy mask (regular), or the transposed op's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import sparsecore as sc

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

#: Seeds of kind ``i`` (regular, subm, transposed, inverse) start at ``base_seed + SEED_STRIDE * i``.
SEED_STRIDE = 1000


@dataclass(frozen=True)
class CaseSets:
    """One test module's sampled cases per layer kind (an inverse case is the regular conv it inverts)."""

    regular: list
    subm: list
    transposed: list
    inverse: list


def sample_case_sets(regular: int, subm: int, transposed: int, inverse: int, base_seed: int) -> CaseSets:
    """``regular`` / ``subm`` / ``transposed`` / ``inverse`` cases, seeded from ``base_seed`` (see `SEED_STRIDE`)."""
    counts = {"regular": regular, "subm": subm, "transposed": transposed, "inverse": inverse}
    drawn = {kind: do.sample_cases("regular" if kind == "inverse" else kind, count,
                                   base_seed=base_seed + SEED_STRIDE * position)
             for position, (kind, count) in enumerate(counts.items())}
    return CaseSets(**drawn)


def expected_sites(case: do.ConvCase, indices: np.ndarray) -> np.ndarray:
    """The output sites of ``case``'s layer on ``indices``, from dense ops on the occupancy mask."""
    if case.kind == "subm":
        return indices
    if case.kind == "regular":
        return do.regular_sites(indices, case.spatial_shape, case.batch_size, case.kernel_size, case.stride,
                                case.padding, case.dilation)
    return do.transposed_sites(indices, case.spatial_shape, case.batch_size, case.kernel_size, case.stride,
                               case.padding, case.dilation, case.output_padding)


def case_geometry(case: do.ConvCase, kind: str | None = None) -> sc.ConvGeometry:
    """The `ConvGeometry` of ``case`` (its own kind, or ``kind``: e.g. "inverse" on a regular case's sizes)."""
    kind = kind or case.kind
    if kind == "subm":
        return sc.ConvGeometry.create(case.ndim, case.kernel_size, dilation=case.dilation, kind="subm")
    return sc.ConvGeometry.create(case.ndim, case.kernel_size, stride=case.stride, padding=case.padding,
                                  dilation=case.dilation, output_padding=case.output_padding, kind=kind)


def case_dense_fn(case: do.ConvCase, indices, spatial_shape, transposed: bool = False, output_padding=None):
    """The dense (float64 torch) computation of ``case`` on ``indices`` as a function of (features, weight[, bias])."""
    padding = do.subm_padding(case.kernel_size, case.dilation, case.ndim) if case.kind == "subm" else case.padding

    def fn(feats, weight, bias=None):
        x = do.densify(feats, indices, spatial_shape, case.batch_size)
        if transposed:
            extra = case.output_padding if output_padding is None else output_padding
            return do.dense_conv_transpose(x, weight, case.stride, padding, case.dilation, extra, case.groups, bias)
        return do.dense_conv(x, weight, case.stride, padding, case.dilation, case.groups, bias)

    return fn
