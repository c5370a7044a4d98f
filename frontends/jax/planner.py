"""Planning a network: trace it once, build every layer's geometry eagerly with the core.

- `plan` traces a network with ``jax.eval_shape`` (no arithmetic runs) on
  tensors whose plans carry a `Planner` (``Plan.planner``, static: the planner
  travels with the data, no context variable); each layer on such a plan
  builds its rulebook with the core's NumPy engine into the planner and skips
  its feature pass; `plan` returns the complete `Plan`.
- `Recipe` (``plan.recipe``, in `plan`) lists a plan's layers, to rebuild the
  plan on the next cloud without tracing the network again.
- `layer_rulebook` is what a layer calls to find its rulebook: from the plan
  when present; else built on the spot when the plan's arrays are concrete
  (eager use) or its planner knows the sites (inside `plan`); else a
  `PlanError` that says to build the plan outside ``jit``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

import sparsecore as sc

from .buckets import Buckets, CapacityPolicy
from .plan import PaddedRulebook, Plan, PlanError, Recipe, rulebook_key
from .tensor import SparseTensor

__all__ = ["Planner", "Recipe", "plan", "layer_rulebook", "inverse_source"]


class Planner:
    """Collects the entries a network's layers build while `plan` traces it.

    Args:
        base: a concrete plan (its site sets are the starting points).
        policy: the capacity policy for new site sets and rulebooks.
    """

    def __init__(self, base: Plan, policy: CapacityPolicy | None = None) -> None:
        self.built = base.configured(policy=policy or base.policy or Buckets(), planner=None)

    def knows(self, sites: str) -> bool:
        return sites in self.built.sites

    def build(self, sites: str, geometry: sc.ConvGeometry) -> tuple[str, str]:
        """Ensures the rulebook of ``geometry`` on ``sites`` (and its output sites) exists.

        Returns:
            ``(rulebook key, output sites name)``.
        """
        self.built, key, out_name = self.built.with_layer(sites, geometry)
        return key, out_name

    def plan(self) -> Plan:
        """The base plan with every entry built so far (`Plan.finalized`; call outside a trace)."""
        return self.built.finalized()


def _find_tensors(tree: Any) -> list[SparseTensor]:
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda value: isinstance(value, SparseTensor))
    return [leaf for leaf in leaves if isinstance(leaf, SparseTensor)]


def _with_planner(tree: Any, planner: Planner) -> Any:
    """``tree`` with the plan of every `SparseTensor` carrying ``planner``."""
    def attach(leaf: Any) -> Any:
        if isinstance(leaf, SparseTensor):
            return SparseTensor(leaf.features, leaf.plan.configured(planner=planner), leaf.sites_name)
        return leaf

    return jax.tree_util.tree_map(attach, tree, is_leaf=lambda value: isinstance(value, SparseTensor))


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
        The `Plan` (with the tensors' ``impl`` configuration); pass it on with ``x.with_plan(plan)``.

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
    leaves, treedef = jax.tree_util.tree_flatten(_with_planner((args, kwargs), planner))
    dynamic = [i for i, leaf in enumerate(leaves) if hasattr(leaf, "shape") and hasattr(leaf, "dtype")]

    def traced(*arrays: Any) -> Any:  # non-array arguments (flags, names, Python numbers) stay static
        filled = list(leaves)
        for i, array in zip(dynamic, arrays):
            filled[i] = array
        call_args, call_kwargs = jax.tree_util.tree_unflatten(treedef, filled)
        return fn(*call_args, **call_kwargs)

    with jax.disable_jit():
        jax.eval_shape(traced, *[leaves[i] for i in dynamic])
    return planner.plan()


def layer_rulebook(plan_: Plan, sites: str, geometry: sc.ConvGeometry) -> tuple[Plan, PaddedRulebook]:
    """The padded rulebook of ``geometry`` on ``sites``, and the plan that holds it.

    Raises:
        PlanError: when it is missing and cannot be built (the plan is traced and
            carries no planner that knows ``sites``).
    """
    key = rulebook_key(sites, geometry)
    if key in plan_.rulebooks:
        return plan_, plan_.rulebooks[key]
    planner = plan_.planner
    if planner is not None and planner.knows(sites):
        key, out_name = planner.build(sites, geometry)
        built = planner.built
        new = plan_.with_entries({out_name: built.sites[out_name]}, {key: built.rulebooks[key]})
        return new, new.rulebooks[key]
    if not plan_.is_concrete():
        raise PlanError(
            f"the plan has no rulebook for this layer ({geometry.describe()} on site set "
            f"{sites!r}; plan key {key!r}) and cannot build one inside jit, where the "
            "indices are abstract. Build the complete plan outside jit: "
            "x = x.with_plan(sparsecore.jax.plan(net, params, x)) (or "
            "plan.recipe.apply(x) for the next cloud), then call the jitted net. Plan "
            f"keys present: {sorted(plan_.rulebooks)}"
        )
    new, key, _ = plan_.with_layer(sites, geometry)
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


