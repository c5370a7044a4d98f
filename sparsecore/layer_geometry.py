"""The one geometry path: find or build a layer's rulebook, with spconv's ``indice_key`` rules.

Every layer of every frontend gets its rulebook from `find_layer_rulebook`:
the core functional API (`sparsecore.functional`, on a `SparseTensor`),
``sparsecore.torch`` (``_geometry.layer_indice_data``, on a SparseConvTensor)
and ``sparsecore.jax`` (its planner). The function is pure::

    find_layer_rulebook(cache: GeometryCache, sites: InputSites, geometry: ConvGeometry,
                        indice_key: str | None = None, *, layer: str = "") -> FoundRulebook
    # FoundRulebook(rulebook: Rulebook, cache: GeometryCache, reused: bool)

It reads an immutable `GeometryCache` and returns the rulebook plus the cache
to hand to the layer's output; the input's cache is never changed.

**Keys.** A rulebook is stored under its canonical key: the identity of the
input sites (``InputSites.identity``: an opaque hashable the caller supplies,
equal for tensors that share the very same sites; `sites_identity` makes one
from a core indices array, JAX passes a sites name), the input ``spatial_shape``
and ``batch_size``, and the `ConvGeometry`. A layer whose canonical key is in
the cache reuses that rulebook without a check, whether or not it names an
``indice_key`` (a new key then becomes an alias of it). ``indice_key`` is
spconv's alias on top of that, with spconv's rules:

- a submanifold layer (conv or pool) whose key is present reuses the rulebook
  under it after `check_rulebook_fits` (same geometry, grid and sites; a
  misfit is a ``ValueError`` naming the key and both geometries);
- any other layer whose key is present is an error, as spconv asserts, unless
  the rulebook under the key is this very layer's on these very sites
  (same canonical key: the same layer run again, it is reused);
- an inverse conv (``geometry.kind == "inverse"``) reverses the regular conv /
  pool rulebook under its key, after `check_inverse_fits` (its input must be
  that layer's output, with the same kernel size); the key is required;
- a new rulebook is built (`build_rulebook`) and stored under its canonical
  key and, with a key, under the key.

**Sharing (the one rule, copy-on-write).** The returned cache is the input's
cache plus what this layer added; a frontend hands it to the layer's output
and never writes into the input's. Tensors derived from one tensor with the
same sites (``replace_feature``, ``shadow_copy``, ``replace``) share its cache
value. This is spconv's observable behaviour: each layer gives its output a
copy of the input's ``indice_dict`` with its own key added, so running a model
twice on one input starts afresh, and two branches from one tensor do not see
each other's keys. The core `sparsecore.SparseTensor` (through
`sparsecore.functional`), ``sparsecore.torch`` and ``sparsecore.jax`` all keep
this rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Hashable, Mapping

from .capacity import as_capacity_policy, layer_capacity
from .geometry import ConvGeometry
from .reuse import check_inverse_fits, check_rulebook_fits
from .rulebook import Rulebook, build_rulebook, inverse_rulebook

__all__ = ["InputSites", "GeometryCache", "FoundRulebook", "find_layer_rulebook", "sites_identity",
           "SitesIdentity", "capacity_layer_name"]

_EMPTY: Mapping[Any, Rulebook] = MappingProxyType({})


@dataclass(frozen=True, eq=False)
class SitesIdentity:
    """A hashable stand-in for one sites array object: equal only for the very same object.

    Holds the array (so its ``id`` cannot be reused while a cache holds the key).
    """

    array: Any = field(repr=False)

    def __hash__(self) -> int:
        return id(self.array)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SitesIdentity) and other.array is self.array


def sites_identity(indices: Any) -> SitesIdentity:
    """The identity of a core indices array (NumPy / CuPy ``[N, 1 + D]``), for `InputSites`.

    Two tensors have the same identity exactly when they view one core array:
    the library keeps that array for tensors derived with the same sites and for
    layer outputs (a submanifold layer's output sites *are* its input's array,
    an inverse conv's output sites are the paired layer's input array).
    """
    return SitesIdentity(indices)


@dataclass(frozen=True)
class InputSites:
    """The input sites of a layer, as `find_layer_rulebook` reads them.

    Attributes:
        identity: opaque hashable, equal for inputs with the very same sites
            (see `sites_identity`); part of the canonical key.
        indices: int32 ``[N, 1 + D]`` core (NumPy / CuPy) array, batch first.
        spatial_shape: ``D`` ints, the input grid.
        batch_size: number of batch elements.
        checked: the sites are known in range and unique (the builder skips its checks).
    """

    identity: Hashable
    indices: Any = field(repr=False)
    spatial_shape: tuple[int, ...]
    batch_size: int
    checked: bool = False

    def canonical_key(self, geometry: ConvGeometry) -> tuple[Hashable, tuple[int, ...], int, ConvGeometry]:
        """The cache key of a layer with ``geometry`` on these sites."""
        return (self.identity, tuple(self.spatial_shape), int(self.batch_size), geometry)


@dataclass(frozen=True, eq=False)
class GeometryCache:
    """An immutable cache of rulebooks: by canonical key, and by ``indice_key`` (spconv's alias).

    Attributes:
        canonical: rulebooks by `InputSites.canonical_key`.
        aliases: rulebooks by ``indice_key``.

    Every method returns a new cache; none changes this one.
    """

    canonical: Mapping[Hashable, Rulebook] = field(default_factory=lambda: _EMPTY)
    aliases: Mapping[str, Rulebook] = field(default_factory=lambda: _EMPTY)

    @classmethod
    def from_aliases(cls, aliases: Mapping[str, Rulebook], base: "GeometryCache | None" = None) -> "GeometryCache":
        """``base``'s canonical entries (none by default) with these ``indice_key`` rulebooks."""
        canonical = base.canonical if base is not None else _EMPTY
        return cls(canonical, MappingProxyType(dict(aliases)))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # canonical keys name sites by object identity, which a pickle cannot keep: aliases only
        return (GeometryCache.from_aliases, (dict(self.aliases),))

    def with_alias(self, key: str, rulebook: Rulebook) -> "GeometryCache":
        """This cache with ``rulebook`` under ``indice_key`` ``key`` (replacing any there)."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"indice_key must be a non-empty string, got {key!r}")
        return GeometryCache(self.canonical, MappingProxyType({**self.aliases, key: rulebook}))

    def with_canonical(self, key: Hashable, rulebook: Rulebook) -> "GeometryCache":
        """This cache with ``rulebook`` under canonical key ``key``."""
        return GeometryCache(MappingProxyType({**self.canonical, key: rulebook}), self.aliases)


@dataclass(frozen=True)
class FoundRulebook:
    """What `find_layer_rulebook` returns.

    Attributes:
        rulebook: the layer's rulebook.
        cache: the cache to hand to the layer's output (the input's, plus this layer's entries).
        reused: True when the rulebook came from the cache (or reverses a cached one).
    """

    rulebook: Rulebook
    cache: GeometryCache
    reused: bool


def _missing_inverse_key(layer: str, key: str | None, cache: GeometryCache) -> ValueError:
    known = sorted(cache.aliases)
    return ValueError(
        f"{layer} needs the indice_key of the regular conv or pool layer it inverts (SparseConv / "
        f"SparseMaxPool in spconv): got indice_key={key!r}, and the input's rulebook cache holds "
        f"{known if known else 'no rulebooks'}. Give the paired layer the same indice_key and feed "
        "this layer a tensor derived from that layer's output."
    )


def _inverse(cache: GeometryCache, sites: InputSites, geometry: ConvGeometry, key: str | None,
             layer: str) -> FoundRulebook:
    saved = cache.aliases.get(key) if key is not None else None
    if saved is None:
        raise _missing_inverse_key(layer, key, cache)
    if saved.geometry.kind == "subm":
        raise ValueError(
            f"{layer}: indice_key {key!r} belongs to a submanifold layer; an inverse conv can only "
            "invert a regular (strided) conv or a max / average pool"
        )
    check_inverse_fits(saved, geometry.kernel_size, sites.indices, sites.spatial_shape, key)  # type: ignore[arg-type]
    return FoundRulebook(inverse_rulebook(saved), cache, reused=True)


def capacity_layer_name(layer: str, geometry: ConvGeometry, spatial_shape: tuple[int, ...],
                        indice_key: str | None = None) -> str:
    """A layer's name for its capacity policy: what it is, its key, and the grid it reads (stable across steps)."""
    key = f" [{indice_key}]" if indice_key else ""
    return f"{layer or geometry.describe()}{key} on grid {tuple(int(size) for size in spatial_shape)}"


def find_layer_rulebook(cache: GeometryCache, sites: InputSites, geometry: ConvGeometry,
                        indice_key: str | None = None, *, layer: str = "",
                        capacity: Any = None) -> FoundRulebook:
    """The rulebook of a layer with ``geometry`` on ``sites``, found in ``cache`` or built.

    The rules (reuse, ``indice_key``, inverse, sharing) are the module's docstring.

    Args:
        cache: the input's cache (not changed).
        sites: the input sites and their identity.
        geometry: the layer's geometry; kind ``"inverse"`` for an inverse conv (only
            its kernel size is read: the rest comes from the paired layer).
        indice_key: spconv's key, or None.
        layer: the layer's name, for messages (e.g. ``"SubMConv3d"``).
        capacity: None (exact mode), or a `sparsecore.capacity` policy (or what
            `sparsecore.capacity.as_capacity_policy` takes): a new rulebook is a capacity build,
            its capacity the policy's for the layer named `capacity_layer_name`.

    Returns:
        `FoundRulebook`: the rulebook and the cache to hand to the output.

    Raises:
        ValueError: an inverse conv without a matching key or paired with a
            submanifold layer, a cached rulebook that does not fit (naming the key
            and both geometries), a non-submanifold layer whose key exists, or
            invalid sites (out of range, duplicates) when building.
    """
    if not isinstance(geometry, ConvGeometry):
        raise TypeError(f"geometry must be a sparsecore.ConvGeometry, got {type(geometry).__name__}")
    if indice_key is not None and (not isinstance(indice_key, str) or not indice_key):
        raise ValueError(f"indice_key must be a non-empty string or None, got {indice_key!r}")
    layer = layer or ("an inverse conv" if geometry.kind == "inverse" else f"a {geometry.kind} layer")
    if geometry.kind == "inverse":
        return _inverse(cache, sites, geometry, indice_key, layer)
    canonical = sites.canonical_key(geometry)
    known = cache.canonical.get(canonical)
    saved = cache.aliases.get(indice_key) if indice_key is not None else None
    if saved is not None and saved is not known:
        if geometry.kind != "subm":
            raise ValueError(
                f"{layer}: indice_key {indice_key!r} already exists in this sparse tensor; only "
                "submanifold layers may share an indice_key (to reuse its rulebook). Give this "
                "layer its own indice_key."
            )
        check_rulebook_fits(saved, geometry, sites.indices, sites.spatial_shape, indice_key)  # type: ignore[arg-type]
        return FoundRulebook(saved, cache.with_canonical(canonical, saved), reused=True)
    if known is not None:
        if indice_key is not None and saved is None:
            cache = cache.with_alias(indice_key, known)
        return FoundRulebook(known, cache, reused=True)
    policy = as_capacity_policy(capacity)
    if policy is None:
        rulebook = build_rulebook(sites.indices, sites.spatial_shape, sites.batch_size, geometry,
                                  assume_unique=sites.checked)
    else:
        name = capacity_layer_name(layer, geometry, sites.spatial_shape, indice_key)
        rows = int(sites.indices.shape[0])
        size = rows if geometry.kind == "subm" else layer_capacity(
            policy, name, geometry, rows, geometry.output_spatial_shape(sites.spatial_shape), sites.batch_size)
        rulebook = build_rulebook(sites.indices, sites.spatial_shape, sites.batch_size, geometry,
                                  assume_unique=sites.checked, capacity=size, layer=name)
    cache = cache.with_canonical(canonical, rulebook)
    if indice_key is not None:
        cache = cache.with_alias(indice_key, rulebook)
    return FoundRulebook(rulebook, cache, reused=False)
