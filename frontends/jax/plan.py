"""Plans: a network's geometry, built eagerly by the core and padded to static shapes.

A `Plan` is a pytree holding every site set (`Sites`) and every rulebook
(`PaddedRulebook`) a network needs for one batch of clouds. Its arrays are
padded to capacities from a `CapacityPolicy` (see `buckets`); true counts are
array values, capacities and layer parameters are static (they are the jit
cache key). Everything here runs outside ``jit`` on concrete indices; inside
``jit`` the plan's arrays are ordinary traced inputs.

Naming is canonical, so layers find their geometry without user keys:

- a site set has a name: ``"input"`` (or the name given at creation), and a
  strided / transposed layer on sites ``S`` makes sites ``S/<geometry tag>``;
- a rulebook's key is ``<geometry tag>@<input sites>``: two layers with the same
  geometry on the same sites share it (spconv's ``indice_key`` reuse, automatic);
- an inverse conv on sites made by a regular layer reverses that layer's rulebook
  (its arrays swapped) and returns to the parent sites.

Padded layout of a rulebook with ``K`` offsets: ``pair_input, pair_output:
int32 [K, Q]``, offset ``k``'s first ``counts[k]`` entries are its pairs and the
rest are padding. ``Q`` follows from the row capacities (`pair_layout`): an
offset pairs each input and each output at most once, so it has at most
``min(rows in, rows out)`` pairs; ``Q`` is that bound rounded up to a multiple
of the ``chunk`` the jnp feature passes loop over (they visit only the chunks
holding true pairs, so a large ``Q`` costs memory, not arithmetic). Padding entries are distinct
out-of-range rows (``capacity + j``): a gather with ``mode="fill"`` reads zeros
there and a scatter with ``mode="drop"`` ignores them, so padding contributes
nothing and the scatter indices stay unique. The identity offset of a
submanifold rulebook (the kernel centre, ``i -> i`` for every row) is not
stored: ``counts[centre]`` is the number of input rows and its slots are padding.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

import sparsecore as sc

from .buckets import Buckets, CapacityError, CapacityPolicy

if TYPE_CHECKING:
    from .planner import Recipe

__all__ = [
    "CHUNK",
    "pair_layout",
    "Sites",
    "SitesInfo",
    "PaddedRulebook",
    "RulebookInfo",
    "Plan",
    "PlanError",
    "geometry_tag",
    "rulebook_key",
    "child_sites_name",
    "is_tracer",
    "require_concrete",
]


CHUNK = 2048  # pairs per step of the jnp feature passes' loops


def pair_layout(capacity_in: int, capacity_out: int) -> tuple[int, int]:
    """``(Q, chunk)`` of a rulebook between site sets of these capacities: ``Q`` a multiple of ``chunk``."""
    bound = min(int(capacity_in), int(capacity_out))
    chunk = min(CHUNK, -(-bound // 8) * 8)
    return -(-bound // chunk) * chunk, chunk


class PlanError(ValueError):
    """A layer's geometry is not in the plan and cannot be built here (inside jit)."""


def is_tracer(value: Any) -> bool:
    """True for an abstract value seen while tracing (jit, grad, eval_shape, ...)."""
    return isinstance(value, jax.core.Tracer)


def require_concrete(value: Any, name: str, where: str) -> None:
    """Raises a TypeError that explains where geometry must be built when ``value`` is a tracer."""
    if is_tracer(value):
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


@jax.tree_util.register_pytree_node_class
class Sites:
    """The active sites of one grid, padded to ``info.capacity`` rows.

    Attributes:
        indices: int32 ``[capacity, 1 + D]``; rows past ``count`` are padding with
            batch index ``batch_size`` (out of range, so dense scatters drop them).
        count: int32 scalar, the true number of sites.
        info: the static `SitesInfo`.
    """

    def __init__(self, indices: Any, count: Any, info: SitesInfo) -> None:
        self.indices, self.count, self.info = indices, count, info

    def tree_flatten(self) -> tuple[tuple[Any, Any], SitesInfo]:
        return (self.indices, self.count), self.info

    @classmethod
    def tree_unflatten(cls, info: SitesInfo, children: tuple[Any, Any]) -> "Sites":
        return cls(children[0], children[1], info)

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


@dataclass(frozen=True)
class RulebookInfo:
    """Static description of a padded rulebook.

    Attributes:
        key: the plan key (``rulebook_key(input_sites, geometry)``).
        geometry: the core `ConvGeometry`.
        input_sites, output_sites: site-set names.
        pair_capacity: ``Q``, padded pairs per offset (`pair_layout` of the row capacities).
        chunk: pairs per loop step of the jnp feature passes (divides ``Q``).
        identity_offset: the subm centre offset (pairs not stored), or -1.
    """

    key: str
    geometry: sc.ConvGeometry
    input_sites: str
    output_sites: str
    pair_capacity: int
    chunk: int
    identity_offset: int = -1

    @property
    def kernel_volume(self) -> int:
        return self.geometry.kernel_volume


@jax.tree_util.register_pytree_node_class
class PaddedRulebook:
    """A core rulebook in the padded ``[K, Q]`` layout (see the module docstring).

    Attributes:
        pair_input, pair_output: int32 ``[K, Q]``.
        counts: int32 ``[K]`` true pairs per offset.
        info: the static `RulebookInfo`.
    """

    def __init__(self, pair_input: Any, pair_output: Any, counts: Any, info: RulebookInfo) -> None:
        self.pair_input, self.pair_output, self.counts, self.info = pair_input, pair_output, counts, info

    def tree_flatten(self) -> tuple[tuple[Any, Any, Any], RulebookInfo]:
        return (self.pair_input, self.pair_output, self.counts), self.info

    @classmethod
    def tree_unflatten(cls, info: RulebookInfo, children: tuple[Any, Any, Any]) -> "PaddedRulebook":
        return cls(*children, info)

    def __repr__(self) -> str:
        return f"PaddedRulebook({self.info.key!r}, pair_capacity={self.info.pair_capacity})"

    @staticmethod
    def _layout(pieces: list[tuple[Any, Any]], counts: np.ndarray, info: RulebookInfo, input_capacity: int,
                output_capacity: int) -> tuple[np.ndarray, np.ndarray]:
        capacity = info.pair_capacity
        padding = np.arange(capacity, dtype=np.int32)
        pair_input = np.empty((counts.shape[0], capacity), dtype=np.int32)
        pair_output = np.empty((counts.shape[0], capacity), dtype=np.int32)
        pair_input[:] = input_capacity + padding
        pair_output[:] = output_capacity + padding
        for offset, (rows_in, rows_out) in enumerate(pieces):
            if offset != info.identity_offset:
                pair_input[offset, : rows_in.shape[0]] = rows_in
                pair_output[offset, : rows_out.shape[0]] = rows_out
        return pair_input, pair_output

    @classmethod
    def from_core(cls, rulebook: sc.Rulebook, key: str, input_sites: SitesInfo,
                  output_sites: SitesInfo) -> "PaddedRulebook":
        """Pads a core `Rulebook` (NumPy) into the ``[K, Q]`` layout (NumPy leaves)."""
        capacity, chunk = pair_layout(input_sites.capacity, output_sites.capacity)
        info = RulebookInfo(key, rulebook.geometry, input_sites.name, output_sites.name, capacity, chunk,
                            int(rulebook.identity_offset))
        counts = np.asarray(rulebook.offset_counts, dtype=np.int32).reshape(rulebook.kernel_volume)
        pieces = [rulebook.pairs(offset) for offset in range(rulebook.kernel_volume)]
        return cls(*cls._layout(pieces, counts, info, input_sites.capacity, output_sites.capacity), counts, info)

    def repad(self, input_capacity: int, output_capacity: int) -> "PaddedRulebook":
        """The same pairs laid out for new row capacities (concrete rulebooks; NumPy leaves)."""
        old = self.info
        capacity, chunk = pair_layout(input_capacity, output_capacity)
        info = RulebookInfo(old.key, old.geometry, old.input_sites, old.output_sites, capacity, chunk,
                            old.identity_offset)
        counts = np.asarray(self.counts).astype(np.int32)
        old_in, old_out = np.asarray(self.pair_input), np.asarray(self.pair_output)
        pieces = [(old_in[k, :c], old_out[k, :c]) for k, c in enumerate(counts.tolist())]
        return PaddedRulebook(*self._layout(pieces, counts, info, input_capacity, output_capacity), counts, info)


@jax.tree_util.register_pytree_node_class
class Plan:
    """Every site set and rulebook of a network on one batch (a pytree).

    Attributes:
        sites: site-set name -> `Sites`.
        rulebooks: rulebook key -> `PaddedRulebook`.
        policy: the `CapacityPolicy` used to extend this plan eagerly (not part of
            the pytree; ``None`` on plans rebuilt inside a trace).
    """

    def __init__(self, sites: Mapping[str, Sites], rulebooks: Mapping[str, PaddedRulebook],
                 policy: CapacityPolicy | None = None) -> None:
        self.sites = dict(sites)
        self.rulebooks = dict(rulebooks)
        self.policy = policy

    def tree_flatten(self) -> tuple[tuple[tuple[Sites, ...], tuple[PaddedRulebook, ...]], tuple]:
        site_names = tuple(sorted(self.sites))
        keys = tuple(sorted(self.rulebooks))
        children = (tuple(self.sites[n] for n in site_names), tuple(self.rulebooks[k] for k in keys))
        return children, (site_names, keys)

    @classmethod
    def tree_unflatten(cls, aux: tuple, children: tuple) -> "Plan":
        site_names, keys = aux
        return cls(dict(zip(site_names, children[0])), dict(zip(keys, children[1])))

    def __repr__(self) -> str:
        return f"Plan(sites={sorted(self.sites)}, rulebooks={sorted(self.rulebooks)})"

    def site(self, name: str) -> Sites:
        """The site set ``name``; a clear error when absent."""
        if name not in self.sites:
            raise PlanError(f"the plan has no site set {name!r}; it has {sorted(self.sites)}")
        return self.sites[name]

    def with_entries(self, sites: Mapping[str, Sites] = {}, rulebooks: Mapping[str, PaddedRulebook] = {}) -> "Plan":
        """A new plan with these entries added (this one is unchanged)."""
        return Plan({**self.sites, **sites}, {**self.rulebooks, **rulebooks}, self.policy)

    def merge(self, other: "Plan") -> "Plan":
        """The union of two plans; entries of the same name must have the same static info."""
        for name, entry in other.sites.items():
            if name in self.sites and self.sites[name].info != entry.info:
                raise ValueError(f"cannot merge plans: site set {name!r} differs ({self.sites[name].info} vs {entry.info})")
        for key, entry in other.rulebooks.items():
            if key in self.rulebooks and self.rulebooks[key].info != entry.info:
                raise ValueError(f"cannot merge plans: rulebook {key!r} differs")
        return Plan({**other.sites, **self.sites}, {**other.rulebooks, **self.rulebooks},
                    self.policy or other.policy)

    def device_put(self) -> "Plan":
        """The plan with every array a ``jax.Array`` (entries are built as NumPy; call outside jit)."""
        # jax.device_put transfers without compiling anything (jnp.asarray compiles a small
        # program per distinct shape)
        arrays = jax.tree_util.tree_map(jax.device_put, Plan(self.sites, self.rulebooks))
        return Plan(arrays.sites, arrays.rulebooks, self.policy)

    def is_concrete(self) -> bool:
        """False when any array of the plan is a tracer."""
        return not any(is_tracer(leaf) for leaf in jax.tree_util.tree_leaves(self))

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
        return Plan(sites, rulebooks, self.policy)

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
        from .planner import Recipe

        return Recipe.from_plan(self)


_ACTIVE_PLANNER: contextvars.ContextVar[Any] = contextvars.ContextVar("sparsecore_jax_planner", default=None)


def active_planner() -> Any:
    """The planner of the enclosing `sparsecore.jax.plan` call, or None."""
    return _ACTIVE_PLANNER.get()


@contextlib.contextmanager
def planning(planner: Any) -> Iterator[None]:
    """Makes ``planner`` the active planner for the duration of the block."""
    token = _ACTIVE_PLANNER.set(planner)
    try:
        yield
    finally:
        _ACTIVE_PLANNER.reset(token)


def default_policy() -> CapacityPolicy:
    return Buckets()
