"""Data parallelism: one cloud (or batch) per device, gradients averaged.

Devices run one program, so every device's tensor must have the same static
shapes. `stack` pads the tensors of several clouds (planned with the same
network) to their common capacities, largest of each, and stacks every array on
a new leading axis; `shard_map` then hands each device its slice and `local`
removes the axis. `data_parallel_grad` puts it together for a training step.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from .tensor import SparseTensor

__all__ = ["repad", "stack", "local", "data_parallel_grad"]


def repad(x: SparseTensor, site_capacities: dict[str, int]) -> SparseTensor:
    """``x`` with its plan padded to other row capacities (outside jit; same values)."""
    return x.with_plan(x.plan.repad(site_capacities).device_put())


def stack(tensors: Sequence[SparseTensor]) -> SparseTensor:
    """Pads tensors to common capacities and stacks every array on a new leading axis (outside jit).

    The tensors must have plans with the same site sets and rulebooks (the same
    network planned on different clouds) and the same feature channels.
    """
    tensors = list(tensors)
    if not tensors:
        raise ValueError("stack needs at least one SparseTensor")
    first = tensors[0]
    for position, other in enumerate(tensors[1:], start=1):
        if (sorted(other.plan.sites), sorted(other.plan.rulebooks), other.sites_name, other.num_channels) != (
                sorted(first.plan.sites), sorted(first.plan.rulebooks), first.sites_name, first.num_channels):
            raise ValueError(
                f"stack: tensor {position} has a different plan or channels than tensor 0 (site sets "
                f"{sorted(other.plan.sites)} vs {sorted(first.plan.sites)}); plan every cloud with the "
                "same network (plan.recipe.apply(x))"
            )
    site_caps = {name: max(t.plan.sites[name].info.capacity for t in tensors) for name in first.plan.sites}
    padded = [repad(t, site_caps) for t in tensors]
    return jax.tree_util.tree_map(lambda *leaves: jnp.stack(leaves), *padded)


def local(x: Any) -> Any:
    """Inside ``shard_map``: drops the leading (per-device, size 1) axis of every array of ``x``."""
    return jax.tree_util.tree_map(lambda leaf: leaf[0], x)


def data_parallel_grad(loss_fn: Callable[..., Any], mesh: Mesh, axis_name: str = "data") -> Callable[..., Any]:
    """A jitted ``(params, *stacked) -> (mean loss, mean grads)`` over the devices of ``mesh``.

    Args:
        loss_fn: ``loss_fn(params, *per_device_args) -> scalar``; its arguments after
            ``params`` arrive stacked on a leading device axis (`stack` for tensors,
            ``jnp.stack`` for targets), and each device sees its own slice.
        mesh: a 1-D mesh whose axis ``axis_name`` spans the devices.
        axis_name: the mesh axis to shard over and average across.
    """

    def per_device(params: Any, *stacked: Any) -> tuple[Any, Any]:
        mine = local(stacked)

        def mean_loss(p: Any) -> Any:
            return jax.lax.pmean(loss_fn(p, *mine), axis_name)

        # params are replicated: their gradient of the device-mean loss is summed across
        # devices by shard_map's autodiff (the transpose of the replicated-to-varying cast)
        return jax.value_and_grad(mean_loss)(params)

    compiled: dict[int, Callable[..., Any]] = {}

    def step(params: Any, *stacked: Any) -> tuple[Any, Any]:
        if len(stacked) not in compiled:
            specs = (PartitionSpec(),) + (PartitionSpec(axis_name),) * len(stacked)
            compiled[len(stacked)] = jax.jit(jax.shard_map(
                per_device, mesh=mesh, in_specs=specs, out_specs=(PartitionSpec(), PartitionSpec())))
        return compiled[len(stacked)](params, *stacked)

    return step
