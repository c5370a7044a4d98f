"""Sparse layers on `SparseTensor`s: find the geometry in the plan, run the feature pass.

Every function works inside ``jit`` and ``grad`` once the tensor's plan holds
its layer's rulebook (``x.with_plan(sparsecore.jax.plan(net, params, x))``);
outside ``jit`` a missing rulebook is built on the spot. Weights are
``[out_channels, *kernel_size, in_channels // groups]`` (spconv 2.x layout) and
the kernel size is read from the weight. ``impl`` picks the feature-pass
implementation (``"jnp"`` or ``"callback"``; ``None``: the plan's ``impl``
(`Plan.with_impl`), else `default_impl`).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import sparsecore as sc
from sparsecore.conv_weight import check_weight_layout

from . import ops, pooling
from .buckets import Buckets
from .plan import PaddedRulebook, Plan, Sites, SitesInfo
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
UNION_SITES = "union"  # the site set of an eager sparse_add of tensors on different sites


def _check_tensor(x: Any, layer: str) -> SparseTensor:
    if not isinstance(x, SparseTensor):
        raise TypeError(f"{layer}: x must be a sparsecore.jax.SparseTensor, got {type(x).__name__}")
    return x


def _check_weight(x: SparseTensor, weight: Any, bias: Any, groups: int, layer: str) -> tuple[int, ...]:
    """The kernel size of a valid weight; the layout checks and their messages are the core's."""
    if not hasattr(weight, "shape") or not hasattr(weight, "ndim"):
        raise ValueError(f"{layer}: weight must be an array [out_channels, *kernel_size, in_channels // groups], "
                         f"got {type(weight).__name__}")
    try:
        check_weight_layout(weight, x.num_channels, groups, x.ndim)
    except ValueError as error:
        raise ValueError(f"{layer}: {error}") from None
    shape = tuple(int(size) for size in weight.shape)
    if shape[0] % groups:
        raise ValueError(f"{layer}: groups={groups} must divide in_channels ({x.num_channels}) and "
                         f"out_channels ({shape[0]})")
    if not jnp.issubdtype(weight.dtype, jnp.floating):
        raise TypeError(f"{layer}: weight must be a float array, got dtype {weight.dtype}")
    if bias is not None and tuple(getattr(bias, "shape", ())) != (shape[0],):
        raise ValueError(f"{layer}: bias must have shape [{shape[0]}] (out_channels), got "
                         f"{tuple(getattr(bias, 'shape', ()))}")
    if x.features.shape[0] != x.capacity:
        raise ValueError(f"{layer}: x.features has {x.features.shape[0]} rows, its sites' capacity is {x.capacity}")
    return shape[1:-1]


def _run_conv(x: SparseTensor, weight: Any, bias: Any, plan: Plan, rulebook: PaddedRulebook, swap: bool,
              groups: int, impl: str | None) -> SparseTensor:
    pair_input, pair_output = rulebook.pair_input, rulebook.pair_output
    out_name = rulebook.info.output_sites
    identity = rulebook.info.identity_offset
    if swap:
        pair_input, pair_output, out_name, identity = pair_output, pair_input, rulebook.info.input_sites, -1
    out_sites = plan.site(out_name)
    if plan.planner is not None:  # sj.plan traces the network for its geometry only: skip the feature pass
        features = jnp.zeros((out_sites.info.capacity, weight.shape[0]), x.features.dtype)
        if bias is not None:
            features = features + bias.astype(features.dtype)
        return SparseTensor(features, plan, out_name)
    features = ops.conv(x.features, weight, pair_input, pair_output, rulebook.counts, plan.site(x.sites_name).count,
                        out_sites.count, capacity_out=out_sites.info.capacity, identity_offset=identity,
                        groups=groups, chunk=rulebook.info.chunk, impl=ops.resolve_impl(impl, plan.impl))
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
    if plan.planner is not None:  # planning: geometry only (see _run_conv)
        return SparseTensor(jnp.zeros((out_sites.info.capacity, x.num_channels), x.features.dtype), plan,
                            rulebook.info.output_sites)
    run = pooling.max_pool if which == "max" else pooling.avg_pool
    features = run(x.features, rulebook.pair_input, rulebook.pair_output, rulebook.counts,
                   plan.site(x.sites_name).count, out_sites.count, capacity_out=out_sites.info.capacity,
                   identity_offset=rulebook.info.identity_offset, kernel_size=geometry.kernel_size,
                   chunk=rulebook.info.chunk, impl=ops.resolve_impl(impl, plan.impl))
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


def _same_sites_at_run_time(first: SparseTensor, other: SparseTensor, position: int) -> None:
    """Inside jit, where site sets are abstract: raises at run time when ``other``'s sites differ."""
    a, b = first.sites, other.sites
    if a.indices is b.indices and a.count is b.count:
        return  # the same arrays: nothing to check

    def check(same: Any) -> None:
        if not bool(same):
            raise ValueError(
                f"sparse_add: input {position} is on site set {other.sites_name!r} like input 0, but its sites "
                "differ (another cloud or different indices under the same name). Inside jit only tensors on "
                "the very same sites can be added; add tensors with different sites outside jit, where "
                "sparse_add returns their union"
            )

    jax.debug.callback(check, jnp.logical_and(a.count == b.count, jnp.all(a.indices == b.indices)))


def _union(tensors: Sequence[SparseTensor]) -> SparseTensor:
    """Eager sum over the union of the sites (differentiable in the features)."""
    first = tensors[0]
    union, rows = sc.union_sites([t.valid_indices() for t in tensors], first.spatial_shape, first.batch_size,
                                 assume_unique=True)
    union = np.asarray(union, np.int32)
    policy = first.plan.policy or Buckets()
    info = SitesInfo(UNION_SITES, first.spatial_shape, first.batch_size,
                     policy.capacity(int(union.shape[0]), UNION_SITES))
    total = jnp.zeros((info.capacity, first.num_channels), jnp.result_type(*[t.features for t in tensors]))
    for tensor, union_rows in zip(tensors, rows):
        # each tensor's rows -> their union rows, padded (to its capacity, so nothing compiles per cloud)
        # with an out-of-range row that the scatter drops
        target = np.full(tensor.capacity, info.capacity, np.int32)
        target[: union_rows.shape[0]] = union_rows
        total = total.at[jax.device_put(target)].add(tensor.features.astype(total.dtype), mode="drop",
                                                     unique_indices=True)
    plan = Plan({UNION_SITES: Sites.from_numpy(union, info)}, {}, policy).device_put()
    return SparseTensor(total, plan, UNION_SITES)


def sparse_add(*tensors: SparseTensor) -> SparseTensor:
    """Sum of sparse tensors (residual connections); a site present in several inputs adds up.

    - Inputs on the same sites (the usual case: a residual branch and its input) add row by row,
      inside or outside ``jit``, and the result stays on that site set and plan.
    - Outside ``jit``, inputs on different sites (two clouds, or a strided layer's output and
      its input on the same grid) give their **union**, like the core's ``sparsecore.sparse_add``:
      a new tensor on a site set named ``"union"`` with the sorted union sites (padded by the
      first input's capacity policy) and a fresh plan; differentiable in the features.
    - Inside ``jit`` site sets are abstract and a union would have data-dependent shape, so
      inputs must be on the same site set (same name); when their site arrays are not the same
      arrays, equality is checked at run time and a difference raises (a ``JaxRuntimeError``
      carrying the message). Compute unions outside ``jit``.

    Raises:
        TypeError: an input is not a `SparseTensor`.
        ValueError: no input; inputs with different grids, batch sizes or channels; inside ``jit``,
            inputs on different site sets.
    """
    if not tensors:
        raise ValueError("sparse_add needs at least one SparseTensor")
    first = _check_tensor(tensors[0], "sparse_add")
    for position, other in enumerate(tensors[1:], start=1):
        other = _check_tensor(other, "sparse_add")
        if (other.spatial_shape, other.batch_size) != (first.spatial_shape, first.batch_size):
            raise ValueError(
                f"sparse_add inputs must live on the same grid: input 0 (site set {first.sites_name!r}) has "
                f"spatial_shape {first.spatial_shape} and batch_size {first.batch_size}, input {position} (site "
                f"set {other.sites_name!r}) has {other.spatial_shape} and {other.batch_size}; a strided layer "
                "changes the grid (add after an inverse conv, which returns to the input's sites)"
            )
        if other.num_channels != first.num_channels:
            raise ValueError(f"sparse_add: input {position} has {other.num_channels} channels, input 0 has "
                             f"{first.num_channels}; inputs must have the same channels")
    if len(tensors) == 1:
        return first
    concrete = all(t.plan.is_concrete() for t in tensors)
    if concrete:
        reference = first.valid_indices()
        if not all(t.sites_name == first.sites_name and t.capacity == first.capacity
                   and np.array_equal(t.valid_indices(), reference) for t in tensors[1:]):
            return _union(tensors)
    total, plan = first.features, first.plan
    for position, other in enumerate(tensors[1:], start=1):
        if not concrete:
            if other.sites_name != first.sites_name:
                raise ValueError(
                    f"sparse_add inside jit: input 0 is on site set {first.sites_name!r}, input {position} on "
                    f"{other.sites_name!r}; inside jit inputs must be on the same site set (the union of "
                    "different sites has a data-dependent size: compute it outside jit, where sparse_add "
                    "returns the union)"
                )
            _same_sites_at_run_time(first, other, position)
        if other.features.shape != first.features.shape:
            raise ValueError(f"sparse_add: input {position} has features {other.features.shape}, "
                             f"input 0 {first.features.shape}")
        total = total + other.features
        if other.plan is not plan:
            plan = plan.merge(other.plan)
    return SparseTensor(total, plan, first.sites_name)
