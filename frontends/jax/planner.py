"""Eager plan building: the core builds rulebooks from concrete indices, this pads them.

- `plan` traces a network with ``jax.eval_shape`` (no arithmetic runs) while a
  `Planner` builds, with the core's NumPy engine, every rulebook the network's
  layers ask for, and returns the complete `Plan`.
- `Recipe` (``plan.recipe``) lists a plan's layers, to rebuild the plan on the
  next cloud without tracing the network again.
- `layer_rulebook` is what a layer calls to find its rulebook: from the plan
  when present; else built on the spot when the plan's arrays are concrete
  (eager use, or inside `plan`); else a `PlanError` that says to build the plan
  outside ``jit``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import numpy as np

import sparsecore as sc

from .buckets import CapacityPolicy
from .plan import (
    PaddedRulebook,
    Plan,
    PlanError,
    Sites,
    SitesInfo,
    active_planner,
    child_sites_name,
    default_policy,
    planning,
    rulebook_key,
)

__all__ = ["Planner", "Recipe", "plan", "layer_rulebook", "inverse_source"]


class Planner:
    """Builds plan entries from concrete NumPy indices.

    Args:
        base: a concrete plan (its site sets are the starting points).
        policy: the capacity policy for new site sets and rulebooks.
    """

    def __init__(self, base: Plan, policy: CapacityPolicy | None = None) -> None:
        self.base = base
        self.policy = policy or base.policy or default_policy()
        self.sites: dict[str, Sites] = dict(base.sites)
        self.rulebooks: dict[str, PaddedRulebook] = dict(base.rulebooks)
        self._numpy: dict[str, np.ndarray] = {}

    def knows(self, sites: str) -> bool:
        return sites in self.sites

    def _indices(self, name: str) -> np.ndarray:
        if name not in self._numpy:
            self._numpy[name] = self.sites[name].numpy_indices()
        return self._numpy[name]

    def build(self, sites: str, geometry: sc.ConvGeometry) -> tuple[str, str]:
        """Ensures the rulebook of ``geometry`` on ``sites`` (and its output sites) exists.

        Returns:
            ``(rulebook key, output sites name)``.
        """
        key = rulebook_key(sites, geometry)
        if key in self.rulebooks:
            return key, self.rulebooks[key].info.output_sites
        info = self.sites[sites].info
        rulebook = sc.build_rulebook(self._indices(sites), info.spatial_shape, info.batch_size, geometry,
                                     assume_unique=True)
        if geometry.kind == "subm":
            out_name, out_info = sites, info
        else:
            out_name = child_sites_name(sites, geometry)
            if out_name in self.sites:
                out_info = self.sites[out_name].info
            else:
                capacity = self.policy.capacity(rulebook.num_output, out_name)
                out_info = SitesInfo(out_name, tuple(rulebook.output_spatial_shape), info.batch_size,
                                     capacity, parent=(sites, geometry))
                self.sites[out_name] = Sites.from_numpy(np.asarray(rulebook.output_indices), out_info)
                self._numpy[out_name] = np.asarray(rulebook.output_indices)
        self.rulebooks[key] = PaddedRulebook.from_core(rulebook, key, info, out_info)
        return key, out_name

    def plan(self) -> Plan:
        """The base plan with every entry built so far (as jax arrays; call outside a trace).

        A policy with a ``finalize`` method (``Buckets(linked=True)``) sets the capacities
        of the whole plan here; the entries are re-padded to them.
        """
        result = Plan(self.sites, self.rulebooks, self.policy)
        finalize = getattr(self.policy, "finalize", None)
        capacities = finalize(result.rows()) if finalize is not None else None
        if capacities is not None:
            result = result.repad(capacities)
        return result.device_put()


def _find_tensors(tree: Any) -> list[Any]:
    from .tensor import SparseTensor

    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda value: isinstance(value, SparseTensor))
    return [leaf for leaf in leaves if isinstance(leaf, SparseTensor)]


def plan(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Plan:
    """Builds the complete plan of ``fn(*args, **kwargs)``, outside ``jit``.

    ``fn`` is traced abstractly (``jax.eval_shape``; no feature arithmetic runs,
    nested ``jax.jit`` calls are inlined) and every sparse layer it calls has its
    rulebook built eagerly by the core from the concrete indices of the
    `SparseTensor` arguments. Capacities come from those tensors' policy.

    Args:
        fn: the network, e.g. ``net(params, x)``.
        *args, **kwargs: its arguments; at least one must be a concrete `SparseTensor`.
            Array leaves are traced; anything else (flags, strings, Python numbers) is
            passed as is, like a static argument.

    Returns:
        The `Plan`; pass it on with ``x.with_plan(plan)``.

    Raises:
        TypeError: when called inside a trace (the tensors' plans are tracers).
        ValueError: when no argument is a `SparseTensor`.
    """
    tensors = _find_tensors((args, kwargs))
    if not tensors:
        raise ValueError("sparsecore.jax.plan(fn, *args): no argument is a sparsecore.jax.SparseTensor")
    base = tensors[0].plan
    for tensor in tensors[1:]:
        base = base.merge(tensor.plan)
    if not base.is_concrete():
        raise TypeError(
            "sparsecore.jax.plan was called inside a jax trace (jit, grad, vmap, ...): the "
            "plan is built from concrete indices, outside jit. Call it before the jitted "
            "step and pass the planned tensor in."
        )
    planner = Planner(base)
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [i for i, leaf in enumerate(leaves) if hasattr(leaf, "shape") and hasattr(leaf, "dtype")]

    def traced(*arrays: Any) -> Any:  # non-array arguments (flags, names, Python numbers) stay static
        filled = list(leaves)
        for i, array in zip(dynamic, arrays):
            filled[i] = array
        call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, filled)
        return fn(*call_args, **call_kwargs)

    with planning(planner), jax.disable_jit():
        jax.eval_shape(traced, *[leaves[i] for i in dynamic])
    return planner.plan()


def layer_rulebook(plan_: Plan, sites: str, geometry: sc.ConvGeometry) -> tuple[Plan, PaddedRulebook]:
    """The padded rulebook of ``geometry`` on ``sites``, and the plan that holds it.

    Raises:
        PlanError: when it is missing and cannot be built (the plan is traced and no
            `plan` call is in progress).
    """
    key = rulebook_key(sites, geometry)
    if key in plan_.rulebooks:
        return plan_, plan_.rulebooks[key]
    planner = active_planner()
    if planner is None or not planner.knows(sites):
        if not plan_.is_concrete():
            raise PlanError(
                f"the plan has no rulebook for this layer ({geometry.describe()} on site set "
                f"{sites!r}; plan key {key!r}) and cannot build one inside jit, where the "
                "indices are abstract. Build the complete plan outside jit: "
                "x = x.with_plan(sparsecore.jax.plan(net, params, x)) (or "
                "plan.recipe.apply(x) for the next cloud), then call the jitted net. Plan "
                f"keys present: {sorted(plan_.rulebooks)}"
            )
        planner = Planner(plan_)
    key, out_name = planner.build(sites, geometry)
    new = plan_.with_entries({out_name: planner.sites[out_name]}, {key: planner.rulebooks[key]})
    return new, new.rulebooks[key]


def inverse_source(plan_: Plan, sites: str, kernel_size: tuple[int, ...]) -> PaddedRulebook:
    """The regular rulebook an inverse conv on ``sites`` reverses.

    Raises:
        ValueError: when ``sites`` were not made by a regular conv / pool, or the kernel differs.
    """
    info = plan_.site(sites).info
    parent = info.parent
    if parent is None or parent[1].kind != "regular":
        made_by = "are input sites" if parent is None else f"were made by a {parent[1].describe()}"
        raise ValueError(
            f"an inverse conv returns to the sites a regular (strided) sparse conv or pool came "
            f"from, but the input's sites {sites!r} {made_by}. Apply the inverse conv to the "
            "output of a regular sparse conv / max pool (after any subm layers)."
        )
    source, geometry = parent
    if tuple(kernel_size) != geometry.kernel_size:
        raise ValueError(
            f"the inverse conv's kernel_size {tuple(kernel_size)} differs from the paired "
            f"layer's {geometry.kernel_size} ({geometry.describe()}); an inverse conv reuses the "
            "paired layer's rulebook, so its weight needs the same kernel size"
        )
    key = rulebook_key(source, geometry)
    if key not in plan_.rulebooks:
        raise PlanError(f"the plan lost the rulebook {key!r} of the layer that made sites {sites!r}")
    return plan_.rulebooks[key]


@dataclass(frozen=True)
class Recipe:
    """The layers of a plan, in an order that can be rebuilt on new input sites.

    Attributes:
        inputs: names of the input site sets.
        layers: ``(input sites, geometry)`` pairs, each buildable from the ones before.
    """

    inputs: tuple[str, ...]
    layers: tuple[tuple[str, sc.ConvGeometry], ...]

    @classmethod
    def from_plan(cls, plan_: Plan) -> "Recipe":
        inputs = tuple(sorted(n for n, s in plan_.sites.items() if s.info.parent is None))
        pending = sorted(plan_.rulebooks.values(), key=lambda rb: rb.info.key)
        known, layers = set(inputs), []
        while pending:
            ready = [rb for rb in pending if rb.info.input_sites in known]
            if not ready:
                raise ValueError(f"plan rulebooks {[rb.info.key for rb in pending]} have no input sites")
            for rb in ready:
                layers.append((rb.info.input_sites, rb.info.geometry))
                known.add(rb.info.output_sites)
            pending = [rb for rb in pending if rb not in ready]
        return cls(inputs, tuple(layers))

    def apply(self, x: Any) -> Any:
        """``x`` (a concrete `SparseTensor` with fresh input sites) with the complete plan."""
        from .tensor import SparseTensor

        if not isinstance(x, SparseTensor):
            raise TypeError(f"Recipe.apply needs a sparsecore.jax.SparseTensor, got {type(x).__name__}")
        missing = [name for name in self.inputs if name not in x.plan.sites]
        if missing:
            raise ValueError(f"the recipe starts from site sets {list(self.inputs)}, but the tensor's "
                             f"plan has {sorted(x.plan.sites)}; create it with name={missing[0]!r}")
        if not x.plan.is_concrete():
            raise TypeError("Recipe.apply builds geometry from concrete indices: call it outside jit")
        planner = Planner(x.plan)
        for sites, geometry in self.layers:
            planner.build(sites, geometry)
        return x.with_plan(planner.plan())
