"""Sparse layers on `SparseTensor`s: find the geometry in the plan, run the feature pass.

Every function works inside ``jit`` and ``grad`` once the tensor's plan holds
its layer's rulebook (``x.with_plan(sparsecore.jax.plan(net, params, x))``);
outside ``jit`` a missing rulebook is built on the spot. Weights are
``[out_channels, *kernel_size, in_channels // groups]`` (spconv 2.x layout) and
the kernel size is read from the weight. ``impl`` picks the feature-pass
implementation (``"jnp"`` or ``"callback"``; ``None``: `default_impl`).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp

import sparsecore as sc

from . import ops, pooling
from .plan import PaddedRulebook, Plan
from .planner import inverse_source, layer_rulebook
from .tensor import SparseTensor

__all__ = [
    "sparse_conv",
    "subm_conv",
    "conv_transpose",
    "inverse_conv",
    "sparse_max_pool",
    "sparse_avg_pool",
    "global_max_pool",
    "global_avg_pool",
    "to_dense",
    "sparse_add",
]

PerAxis = int | Sequence[int]


def _check_tensor(x: Any, layer: str) -> SparseTensor:
    if not isinstance(x, SparseTensor):
        raise TypeError(f"{layer}: x must be a sparsecore.jax.SparseTensor, got {type(x).__name__}")
    return x


def _check_weight(x: SparseTensor, weight: Any, bias: Any, groups: int, layer: str) -> tuple[int, ...]:
    shape = tuple(getattr(weight, "shape", ()))
    if len(shape) != x.ndim + 2:
        raise ValueError(
            f"{layer}: weight must be [out_channels, *kernel_size, in_channels // groups] with "
            f"{x.ndim + 2} axes for this {x.ndim}-D tensor, got shape {shape}"
        )
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"{layer}: groups must be a positive int, got {groups!r}")
    channels = x.num_channels
    if channels % groups or shape[0] % groups:
        raise ValueError(f"{layer}: groups={groups} must divide in_channels ({channels}) and "
                         f"out_channels ({shape[0]})")
    if shape[-1] * groups != channels:
        raise ValueError(
            f"{layer}: weight's last axis is {shape[-1]} but the input has {channels} channels and "
            f"groups={groups}, so it must be {channels // groups}; weight is "
            "[out_channels, *kernel_size, in_channels // groups]"
        )
    if not jnp.issubdtype(weight.dtype, jnp.floating):
        raise TypeError(f"{layer}: weight must be a float array, got dtype {weight.dtype}")
    if bias is not None and tuple(getattr(bias, "shape", ())) != (shape[0],):
        raise ValueError(f"{layer}: bias must have shape [{shape[0]}] (out_channels), got "
                         f"{tuple(getattr(bias, 'shape', ()))}")
    if x.features.shape[0] != x.capacity:
        raise ValueError(f"{layer}: x.features has {x.features.shape[0]} rows, its sites' capacity is {x.capacity}")
    return tuple(int(size) for size in shape[1:-1])


def _run_conv(x: SparseTensor, weight: Any, bias: Any, plan: Plan, rulebook: PaddedRulebook, swap: bool,
              groups: int, impl: str | None) -> SparseTensor:
    pair_input, pair_output = rulebook.pair_input, rulebook.pair_output
    out_name = rulebook.info.output_sites
    identity = rulebook.info.identity_offset
    if swap:
        pair_input, pair_output, out_name, identity = pair_output, pair_input, rulebook.info.input_sites, -1
    out_sites = plan.site(out_name)
    features = ops.conv(x.features, weight, pair_input, pair_output, rulebook.counts, plan.site(x.sites_name).count,
                        out_sites.count, capacity_out=out_sites.info.capacity, identity_offset=identity,
                        groups=groups, chunk=rulebook.info.chunk, impl=impl)
    if bias is not None:
        features = features + jnp.where(out_sites.mask()[:, None], bias.astype(features.dtype), 0)
    return SparseTensor(features, plan, out_name)


def sparse_conv(x: SparseTensor, weight: Any, bias: Any | None = None, *, kind: str = "regular",
                stride: PerAxis = 1, padding: PerAxis = 0, dilation: PerAxis = 1, output_padding: PerAxis = 0,
                groups: int = 1, impl: str | None = None) -> SparseTensor:
    """A sparse convolution of any kind.

    Args:
        x: the input tensor.
        weight: ``[C_out, *kernel_size, C_in // groups]``.
        bias: optional ``[C_out]``.
        kind: ``"regular"`` (strided: outputs wherever an input is in reach), ``"subm"``
            (outputs = input sites; stride and padding ignored), ``"transposed"``, or
            ``"inverse"`` (back to the sites the regular conv / pool that made ``x``'s sites
            came from; stride, padding and dilation come from that layer).
        stride, padding, dilation, output_padding: ints or per-axis sequences.
        groups: channel groups.
        impl: ``"jnp"``, ``"callback"`` or None.

    Returns:
        The output `SparseTensor` (its plan includes the layer's geometry).
    """
    layer = f"sparse_conv(kind={kind!r})"
    x = _check_tensor(x, layer)
    kernel_size = _check_weight(x, weight, bias, groups, layer)
    if kind == "inverse":
        rulebook = inverse_source(x.plan, x.sites_name, kernel_size)
        return _run_conv(x, weight, bias, x.plan, rulebook, True, groups, impl)
    if kind not in ("regular", "subm", "transposed"):
        raise ValueError(f"kind must be one of {sc.CONV_KINDS}, got {kind!r}")
    geometry = sc.ConvGeometry.create(x.ndim, kernel_size, stride, padding, dilation, output_padding, kind=kind)
    plan, rulebook = layer_rulebook(x.plan, x.sites_name, geometry)
    return _run_conv(x, weight, bias, plan, rulebook, False, groups, impl)


def subm_conv(x: SparseTensor, weight: Any, bias: Any | None = None, *, dilation: PerAxis = 1, groups: int = 1,
              impl: str | None = None) -> SparseTensor:
    """Submanifold conv (``SubMConv``): outputs on the input sites; odd kernels."""
    return sparse_conv(x, weight, bias, kind="subm", dilation=dilation, groups=groups, impl=impl)


def conv_transpose(x: SparseTensor, weight: Any, bias: Any | None = None, *, stride: PerAxis = 1,
                   padding: PerAxis = 0, dilation: PerAxis = 1, output_padding: PerAxis = 0, groups: int = 1,
                   impl: str | None = None) -> SparseTensor:
    """Transposed sparse conv (``SparseConvTranspose``), like a dense transposed conv."""
    return sparse_conv(x, weight, bias, kind="transposed", stride=stride, padding=padding, dilation=dilation,
                       output_padding=output_padding, groups=groups, impl=impl)


def inverse_conv(x: SparseTensor, weight: Any, bias: Any | None = None, *, groups: int = 1,
                 impl: str | None = None) -> SparseTensor:
    """Inverse conv (``SparseInverseConv``): undoes the regular conv / pool that made ``x``'s sites."""
    return sparse_conv(x, weight, bias, kind="inverse", groups=groups, impl=impl)


def _pool(x: SparseTensor, kernel_size: PerAxis, stride: PerAxis | None, padding: PerAxis, dilation: PerAxis,
          subm: bool, impl: str | None, which: str) -> SparseTensor:
    x = _check_tensor(x, f"sparse_{which}_pool")
    geometry = sc.ConvGeometry.create(x.ndim, kernel_size, kernel_size if stride is None else stride, padding,
                                      dilation, kind="subm" if subm else "regular")
    plan, rulebook = layer_rulebook(x.plan, x.sites_name, geometry)
    out_sites = plan.site(rulebook.info.output_sites)
    run = pooling.max_pool if which == "max" else pooling.avg_pool
    features = run(x.features, rulebook.pair_input, rulebook.pair_output, rulebook.counts,
                   plan.site(x.sites_name).count, out_sites.count, capacity_out=out_sites.info.capacity,
                   identity_offset=rulebook.info.identity_offset, kernel_size=geometry.kernel_size,
                   chunk=rulebook.info.chunk, impl=impl)
    return SparseTensor(features, plan, rulebook.info.output_sites)


def sparse_max_pool(x: SparseTensor, kernel_size: PerAxis, stride: PerAxis | None = None, padding: PerAxis = 0,
                    dilation: PerAxis = 1, *, subm: bool = False, impl: str | None = None) -> SparseTensor:
    """Max over the active sites of each window (stride defaults to the kernel size)."""
    return _pool(x, kernel_size, stride, padding, dilation, subm, impl, "max")


def sparse_avg_pool(x: SparseTensor, kernel_size: PerAxis, stride: PerAxis | None = None, padding: PerAxis = 0,
                    dilation: PerAxis = 1, *, subm: bool = False, impl: str | None = None) -> SparseTensor:
    """Mean over the active sites of each window (stride defaults to the kernel size)."""
    return _pool(x, kernel_size, stride, padding, dilation, subm, impl, "avg")


def global_max_pool(x: SparseTensor) -> Any:
    """``[B, C]`` channel-wise max per batch element (0 for an empty element)."""
    x = _check_tensor(x, "global_max_pool")
    return pooling.global_max_pool(x.features, x.indices[:, 0], x.batch_size)


def global_avg_pool(x: SparseTensor) -> Any:
    """``[B, C]`` channel-wise mean per batch element (0 for an empty element)."""
    x = _check_tensor(x, "global_avg_pool")
    return pooling.global_avg_pool(x.features, x.indices[:, 0], x.batch_size)


def to_dense(x: SparseTensor, channels_first: bool = True) -> Any:
    """The dense grid ``[B, C, *spatial]`` (or ``[B, *spatial, C]``)."""
    return _check_tensor(x, "to_dense").dense(channels_first)


def sparse_add(*tensors: SparseTensor) -> SparseTensor:
    """Sum of tensors on the same site set (residual connections).

    Raises:
        ValueError: for tensors on different site sets (a union of sites changes
            shapes with the data; do it outside jit with the core's ``sparse_add``).
    """
    if not tensors:
        raise ValueError("sparse_add needs at least one SparseTensor")
    first = _check_tensor(tensors[0], "sparse_add")
    total, plan = first.features, first.plan
    for position, other in enumerate(tensors[1:], start=1):
        other = _check_tensor(other, "sparse_add")
        if other.sites_name != first.sites_name:
            raise ValueError(
                f"sparse_add inputs must live on the same site set: input 0 is on "
                f"{first.sites_name!r}, input {position} on {other.sites_name!r}"
            )
        if other.features.shape != first.features.shape:
            raise ValueError(f"sparse_add: input {position} has features {other.features.shape}, "
                             f"input 0 {first.features.shape}")
        total = total + other.features
        if other.plan is not plan:
            plan = plan.merge(other.plan)
    return SparseTensor(total, plan, first.sites_name)
