"""Plans: a network's geometry, built eagerly by the core and padded to static shapes (the data).

A `Plan` is a pytree holding every site set (`Sites`) and every rulebook
(`PaddedRulebook`, in the one padded form of `layout`) a network needs for one
batch of clouds. Its arrays are padded to capacities from a `CapacityPolicy`
(see `buckets`); true counts are array values, capacities and layer
parameters are static (they are the jit cache key), and so is the plan's
configuration: the feature-pass implementation its layers use when they name
none (`Plan.with_impl`). Building a layer's entries (`Plan.with_layer`) runs
outside ``jit`` on concrete indices; inside ``jit`` the plan's arrays are
ordinary traced inputs. Tracing a whole network to plan it is `planner`'s.

Naming is canonical, so layers find their geometry without user keys:

- a site set has a name: ``"input"`` (or the name given at creation), and a
  strided / transposed layer on sites ``S`` makes sites ``S/<geometry tag>``;
- a rulebook's key is ``<geometry tag>@<input sites>``: two layers with the same
  geometry on the same sites share it (spconv's ``indice_key`` reuse, automatic);
- an inverse conv on sites made by a regular layer reverses that layer's rulebook
  (its arrays swapped) and returns to the parent sites.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

import sparsecore as sc
from sparsecore.interop import is_jax_tracer

from .buckets import Buckets, CapacityError, CapacityPolicy
from .layout import CHUNK, PaddedRulebook, RulebookInfo, pair_layout
from .ops import IMPLS

__all__ = [
    "CHUNK",
    "pair_layout",
    "Sites",
    "SitesInfo",
    "PaddedRulebook",
    "RulebookInfo",
    "Plan",
    "PlanError",
    "Recipe",
    "geometry_tag",
    "rulebook_key",
    "child_sites_name",
    "require_concrete",
]


class PlanError(ValueError):
    """A layer's geometry is not in the plan and cannot be built here (inside jit)."""


def require_concrete(value: Any, name: str, where: str) -> None:
    """Raises a TypeError that explains where geometry must be built when ``value`` is a tracer."""
    if is_jax_tracer(value):
        raise TypeError(
            f"{where}: {name} is a JAX tracer (an abstract value inside jax.jit, grad, vmap or "
            "eval_shape), but building geometry needs concrete integer coordinates: rulebooks "
            "and output sites depend on their values. Build the plan outside jit, e.g. "
            "x = sparsecore.jax.SparseTensor.from_arrays(features, indices, spatial_shape, "
            "batch_size); x = x.with_plan(sparsecore.jax.plan(net, params, x)); then pass x "
            "into the jitted function."
        )


def _per_axis(values: tuple[int, ...]) -> str:
    return str(values[0]) if len(set(values)) == 1 else "x".join(str(v) for v in values)


def geometry_tag(geometry: sc.ConvGeometry) -> str:
    """A short canonical string naming a geometry, e.g. ``"regular_k3s2p1d1"``."""
    tag = (f"{geometry.kind}{geometry.ndim}d_k{_per_axis(geometry.kernel_size)}"
           f"s{_per_axis(geometry.stride)}p{_per_axis(geometry.padding)}"
           f"d{_per_axis(geometry.dilation)}")
    if any(geometry.output_padding):
        tag += f"op{_per_axis(geometry.output_padding)}"
    return tag


def rulebook_key(sites: str, geometry: sc.ConvGeometry) -> str:
    """The plan key of the rulebook of ``geometry`` on the site set ``sites``."""
    return f"{geometry_tag(geometry)}@{sites}"


def child_sites_name(sites: str, geometry: sc.ConvGeometry) -> str:
    """The name of the output sites of a regular / transposed layer on ``sites``."""
    return f"{sites}/{geometry_tag(geometry)}"


@dataclass(frozen=True)
class SitesInfo:
    """Static description of a site set.

    Attributes:
        name: the site set's name in its plan.
        spatial_shape: the grid, ``D`` ints.
        batch_size: number of batch elements.
        capacity: rows of the padded arrays.
        parent: ``(input sites, geometry)`` of the layer that produced these sites,
            or ``None`` for input sites.
    """

    name: str
    spatial_shape: tuple[int, ...]
    batch_size: int
    capacity: int
    parent: tuple[str, sc.ConvGeometry] | None = None

    @property
    def ndim(self) -> int:
        return len(self.spatial_shape)


@partial(jax.tree_util.register_dataclass, data_fields=["indices", "count"], meta_fields=["info"])
@dataclass(frozen=True, eq=False, repr=False)
class Sites:
    """The active sites of one grid, padded to ``info.capacity`` rows (a pytree: arrays and static info).

    Attributes:
        indices: int32 ``[capacity, 1 + D]``; rows past ``count`` are padding with
            batch index ``batch_size`` (out of range, so dense scatters drop them).
        count: int32 scalar, the true number of sites.
        info: the static `SitesInfo`.
    """

    indices: Any
    count: Any
    info: SitesInfo

    def mask(self) -> Any:
        """bool ``[capacity]``: True on true rows."""
        return jnp.arange(self.info.capacity) < self.count

    def __repr__(self) -> str:
        return f"Sites({self.info.name!r}, capacity={self.info.capacity}, spatial_shape={self.info.spatial_shape})"

    @classmethod
    def from_numpy(cls, indices: np.ndarray, info: SitesInfo) -> "Sites":
        """Pads concrete int32 ``[n, 1 + D]`` indices to ``info.capacity`` rows (NumPy leaves)."""
        count = int(indices.shape[0])
        padded = np.zeros((info.capacity, indices.shape[1]), dtype=np.int32)
        padded[:count] = indices
        padded[count:, 0] = info.batch_size
        return cls(padded, np.asarray(count, dtype=np.int32), info)

    def numpy_indices(self) -> np.ndarray:
        """The true rows as NumPy (concrete sites only)."""
        require_concrete(self.indices, "the site indices", f"sites {self.info.name!r}")
        return np.asarray(self.indices)[: int(self.count)]


def _check_impl(impl: str | None) -> str | None:
    if impl is not None and impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
    return impl


@jax.tree_util.register_pytree_node_class
class Plan:
    """Every site set and rulebook of a network on one batch (a pytree).

    Attributes:
        sites: site-set name -> `Sites`.
        rulebooks: rulebook key -> `PaddedRulebook`.
        policy: the `CapacityPolicy` used to extend this plan eagerly (not part of
            the pytree; ``None`` on plans rebuilt inside a trace).
        impl: the feature-pass implementation of layers that pass ``impl=None``
            (``None``: `sparsecore.jax.default_impl`); static, part of the pytree's
            structure (so of the jit cache key). Set it with `with_impl`.
        planner: while `sparsecore.jax.plan` traces a network, the `Planner` that
            builds its geometry, carried explicitly by the plan of every traced
            tensor (static); ``None`` otherwise. Layers on such a plan build
            their geometry and skip the feature pass.
    """

    def __init__(self, sites: Mapping[str, Sites], rulebooks: Mapping[str, PaddedRulebook],
                 policy: CapacityPolicy | None = None, impl: str | None = None, planner: Any = None) -> None:
        self.sites = dict(sites)
        self.rulebooks = dict(rulebooks)
        self.policy = policy
        self.impl = _check_impl(impl)
        self.planner = planner

    def tree_flatten(self) -> tuple[tuple[tuple[Sites, ...], tuple[PaddedRulebook, ...]], tuple]:
        site_names = tuple(sorted(self.sites))
        keys = tuple(sorted(self.rulebooks))
        children = (tuple(self.sites[n] for n in site_names), tuple(self.rulebooks[k] for k in keys))
        return children, (site_names, keys, self.impl, self.planner)

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: tuple) -> "Plan":
        site_names, keys, impl, planner = aux
        return cls(dict(zip(site_names, children[0])), dict(zip(keys, children[1])), impl=impl, planner=planner)

    def __repr__(self) -> str:
        impl = "" if self.impl is None else f", impl={self.impl!r}"
        return f"Plan(sites={sorted(self.sites)}, rulebooks={sorted(self.rulebooks)}{impl})"

    def _with(self, sites: Mapping[str, Sites], rulebooks: Mapping[str, PaddedRulebook], **changes: Any) -> "Plan":
        fields = {"policy": self.policy, "impl": self.impl, "planner": self.planner, **changes}
        return Plan(sites, rulebooks, **fields)

    def site(self, name: str) -> Sites:
        """The site set ``name``; a clear error when absent."""
        if name not in self.sites:
            raise PlanError(f"the plan has no site set {name!r}; it has {sorted(self.sites)}")
        return self.sites[name]

    def configured(self, **changes: Any) -> "Plan":
        """This plan, the same entries, with other static configuration: ``policy``, ``impl``, ``planner``.

        Raises:
            TypeError: for another keyword.
        """
        unknown = sorted(set(changes) - {"policy", "impl", "planner"})
        if unknown:
            raise TypeError(f"Plan.configured takes policy, impl and planner, got {unknown}")
        return self._with(self.sites, self.rulebooks, **changes)

    def with_impl(self, impl: str | None) -> "Plan":
        """This plan with its layers' default feature-pass implementation set (``None``: `default_impl`).

        Raises:
            ValueError: for a name not in `sparsecore.jax.IMPLS`.
        """
        return self.configured(impl=_check_impl(impl))

    def with_entries(self, sites: Mapping[str, Sites] = {}, rulebooks: Mapping[str, PaddedRulebook] = {}) -> "Plan":
        """A new plan with these entries added (this one is unchanged)."""
        return self._with({**self.sites, **sites}, {**self.rulebooks, **rulebooks})

    def with_layer(self, sites: str, geometry: sc.ConvGeometry) -> tuple["Plan", str, str]:
        """This plan with the rulebook of ``geometry`` on ``sites`` and its output sites, found or built.

        The plan's rulebooks are its geometry cache, keyed by ``rulebook_key(sites,
        geometry)``: the string form of the core's canonical key (within a plan the
        sites name is the identity of the sites; it fixes their grid and batch size),
        the only index a traced plan can read. A rulebook not there comes from the
        core's one geometry path, `sparsecore.find_layer_rulebook`, with the sites name
        as the sites' identity, built from the concrete indices of ``sites`` (outside
        jit; the padded entries are the cache, so no core cache is kept beside them).
        It is padded into the plan (NumPy leaves, see `device_put`); new output sites
        get a capacity from the plan's policy (``Buckets()`` if none).

        Returns:
            ``(plan, rulebook key, output sites name)``.
        """
        key = rulebook_key(sites, geometry)
        if key in self.rulebooks:
            return self, key, self.rulebooks[key].info.output_sites
        source = self.site(sites)
        info = source.info
        found = sc.find_layer_rulebook(
            sc.GeometryCache(), sc.InputSites(sites, source.numpy_indices(), info.spatial_shape, info.batch_size,
                                         checked=True), geometry, layer=f"sparsecore.jax {geometry.describe()}")
        rulebook = found.rulebook
        new_sites: dict[str, Sites] = {}
        out_name, out_info = sites, info
        if geometry.kind != "subm":
            out_name = child_sites_name(sites, geometry)
            if out_name in self.sites:
                out_info = self.sites[out_name].info
            else:
                capacity = (self.policy or Buckets()).capacity(rulebook.num_output, out_name)
                out_info = SitesInfo(out_name, tuple(rulebook.output_spatial_shape), info.batch_size, capacity,
                                     parent=(sites, geometry))
                new_sites[out_name] = Sites.from_numpy(np.asarray(rulebook.output_indices), out_info)
        padded = PaddedRulebook.from_core(rulebook, key, info, out_info)
        return self.with_entries(new_sites, {key: padded}), key, out_name

    def merge(self, other: "Plan") -> "Plan":
        """The union of two plans; entries of the same name must have the same static info."""
        for name, entry in other.sites.items():
            if name in self.sites and self.sites[name].info != entry.info:
                raise ValueError(f"cannot merge plans: site set {name!r} differs ({self.sites[name].info} vs {entry.info})")
        for key, entry in other.rulebooks.items():
            if key in self.rulebooks and self.rulebooks[key].info != entry.info:
                raise ValueError(f"cannot merge plans: rulebook {key!r} differs")
        return self._with({**other.sites, **self.sites}, {**other.rulebooks, **self.rulebooks},
                          policy=self.policy or other.policy, impl=self.impl or other.impl,
                          planner=self.planner or other.planner)

    def device_put(self) -> "Plan":
        """The plan with every array a ``jax.Array`` (entries are built as NumPy; call outside jit)."""
        # jax.device_put transfers without compiling anything (jnp.asarray compiles a small
        # program per distinct shape)
        arrays = jax.tree_util.tree_map(jax.device_put, Plan(self.sites, self.rulebooks))
        return self._with(arrays.sites, arrays.rulebooks)

    def is_concrete(self) -> bool:
        """False when any array of the plan is a tracer."""
        return not any(is_jax_tracer(leaf) for leaf in jax.tree_util.tree_leaves(self))

    def repad(self, site_capacities: Mapping[str, int]) -> "Plan":
        """The same geometry padded to other row capacities (outside jit; NumPy leaves, see `device_put`).

        Raises:
            CapacityError: when a capacity is below the true count.
        """
        sites = {}
        for name, entry in self.sites.items():
            capacity = int(site_capacities.get(name, entry.info.capacity))
            indices = entry.numpy_indices()
            if capacity < indices.shape[0]:
                raise CapacityError(name, indices.shape[0], capacity)
            info = SitesInfo(name, entry.info.spatial_shape, entry.info.batch_size, capacity, entry.info.parent)
            sites[name] = Sites.from_numpy(indices, info)
        rulebooks = {key: entry.repad(sites[entry.info.input_sites].info.capacity,
                                      sites[entry.info.output_sites].info.capacity)
                     for key, entry in self.rulebooks.items()}
        return self._with(sites, rulebooks)

    def finalized(self) -> "Plan":
        """The plan as ``jax.Array`` leaves, at the capacities its policy settles once every entry is known.

        A policy with a ``finalize`` method (``Buckets(linked=True)``) sets the
        capacities of the whole plan here and the entries are re-padded to them.
        Call outside a trace.
        """
        finalize = getattr(self.policy, "finalize", None)
        capacities = finalize(self.rows()) if finalize is not None else None
        return (self.repad(capacities) if capacities is not None else self).device_put()

    def rows(self) -> dict[str, int]:
        """True rows per site set (concrete plans)."""
        return {name: int(entry.count) for name, entry in self.sites.items()}

    @property
    def signature(self) -> tuple:
        """The static shape key of this plan: its rulebook keys and the capacity of every site set.

        Two plans with the same signature give the same jit cache entry.
        """
        return (tuple(sorted(self.rulebooks)), tuple((n, self.sites[n].info.capacity) for n in sorted(self.sites)))

    @property
    def recipe(self) -> "Recipe":
        """The layers of this plan, to rebuild it on new clouds without tracing the network."""
        return Recipe.from_plan(self)


@dataclass(frozen=True)
class Recipe:
    """The layers of a plan, in an order that can be rebuilt on new input sites.

    Attributes:
        inputs: names of the input site sets.
        layers: ``(input sites, geometry)`` pairs, each buildable from the ones before.
        impl: the plan's implementation choice (`Plan.with_impl`), given to the plans it builds.
    """

    inputs: tuple[str, ...]
    layers: tuple[tuple[str, sc.ConvGeometry], ...]
    impl: str | None = None

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
        return cls(inputs, tuple(layers), plan_.impl)

    def apply(self, x: Any) -> Any:
        """``x`` (a concrete `SparseTensor` with fresh input sites) with the complete plan."""
        plan_ = getattr(x, "plan", None)
        if not isinstance(plan_, Plan) or not hasattr(x, "with_plan"):
            raise TypeError(f"Recipe.apply needs a sparsecore.jax.SparseTensor, got {type(x).__name__}")
        missing = [name for name in self.inputs if name not in plan_.sites]
        if missing:
            raise ValueError(f"the recipe starts from site sets {list(self.inputs)}, but the tensor's "
                             f"plan has {sorted(plan_.sites)}; create it with name={missing[0]!r}")
        if not plan_.is_concrete():
            raise TypeError("Recipe.apply builds geometry from concrete indices: call it outside jit")
        for sites, geometry in self.layers:
            plan_, _, _ = plan_.with_layer(sites, geometry)
        return x.with_plan(plan_.with_impl(self.impl or plan_.impl).finalized())
