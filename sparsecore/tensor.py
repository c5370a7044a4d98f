"""The core sparse tensor: features on active sites of a batched grid, plus its rulebook cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from ._dispatch import array_library, check_same_device, device_of, from_core_array
from ._kernel_builds import check_sites
from .capacity import as_capacity_policy, check_capacity
from .interop import as_batch_size, as_features, as_indices, as_spatial_shape
from .dense import from_dense, padded_to_dense, to_dense
from .layer_geometry import GeometryCache, InputSites, sites_identity
from .rulebook import Rulebook

__all__ = ["SparseTensor", "RulebookCache"]


def in_library_of(core: Any, given: Any) -> Any:
    """``core`` (validated from ``given``) in ``given``'s library: ``given`` itself when it is that view.

    A torch tensor or JAX array that needed no conversion is kept as it is (same
    object); one that was converted (int64 indices to int32) comes back converted,
    in its library. NumPy, CuPy, sequences and other DLPack objects give the core array.
    """
    if core is given or array_library(given) not in ("torch", "jax"):
        return core
    if str(core.dtype) == str(given.dtype).rsplit(".", 1)[-1] and tuple(core.shape) == tuple(given.shape):
        return given
    return from_core_array(core, like=given)


class RulebookCache:
    """Rulebooks by ``indice_key``: a tensor's handle on an immutable
    `sparsecore.layer_geometry.GeometryCache` (``value``).

    The sharing rule is the one of every frontend (spconv's ``indice_dict``): a
    layer's output holds a new handle on the cache `find_layer_rulebook` returns
    (the input's entries plus the layer's, copy-on-write), so a key made on one
    branch is not seen by the input or by a sibling branch; ``replace`` (new
    features on the same sites) shares the handle. A later submanifold layer with
    the same key reuses the rulebook, and an inverse conv with the same key
    reverses it. `put` and `sparsecore.functional.layer_rulebook` store into the
    handle itself, for callers that drive the feature passes themselves.
    """

    def __init__(self, value: GeometryCache | None = None) -> None:
        self.value = GeometryCache() if value is None else value

    def get(self, key: str) -> Rulebook | None:
        """The rulebook stored under ``key``, or None."""
        return self.value.aliases.get(key)

    def put(self, key: str, rulebook: Rulebook) -> None:
        """Stores ``rulebook`` under ``key`` (replacing any previous one)."""
        self.value = self.value.with_alias(key, rulebook)

    def keys(self) -> list[str]:
        """The stored keys, in insertion order."""
        return list(self.value.aliases)

    def __contains__(self, key: object) -> bool:
        return key in self.value.aliases

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.value.aliases))

    def __len__(self) -> int:
        return len(self.value.aliases)


@dataclass(frozen=True, eq=False)
class SparseTensor:
    """Features on the active sites of a batched ``D``-dimensional grid.

    Args:
        features: ``[N, C]`` float16/32/64 (NumPy or CuPy, a torch tensor, a JAX
            array, or any DLPack array).
        indices: integer ``[N, 1 + D]``: batch index, then coordinates in the
            order of ``spatial_shape``. Stored as int32 (int64 & co. converted once
            when the values fit).

    ``features`` and ``indices`` stay in the caller's library (a torch tensor in
    gives torch tensors in the fields, and in the tensors the functional API
    derives from this one); ``core_features`` and ``core_indices`` are the
    NumPy / CuPy views the core computes on (the same objects for NumPy / CuPy).
        spatial_shape: ``D`` positive ints (1 to 4 axes).
        batch_size: number of batch elements.
        rulebooks: a cache to share; a fresh one when omitted.
        capacity: None (exact mode, the default), or capacity mode (`sparsecore.capacity`):
            True / ``"learned"`` / ``"bound"`` / rows / a policy. Every layer on this tensor and
            on the tensors derived from it then builds at a capacity with no read back: rows
            whose batch index is -1 are padding (last), and the sites are checked in the first
            build, read by `sparsecore.check_capacity` (``x.check_capacity()``), not here.

    Raises:
        ValueError / TypeError: on malformed shapes, dtypes, devices, out-of-range
            or duplicate sites (checked once here; tensors derived by the library
            keep the guarantee without a new check).
    """

    features: Any
    indices: Any
    spatial_shape: tuple[int, ...]
    batch_size: int
    rulebooks: RulebookCache = field(default_factory=RulebookCache)
    capacity: Any = None
    _checked: bool = field(default=False, repr=False)
    core_features: Any = field(init=False, repr=False)
    core_indices: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        shape = as_spatial_shape(self.spatial_shape)
        batch = as_batch_size(self.batch_size)
        indices = as_indices(self.indices, len(shape))
        features = as_features(self.features, indices.shape[0])
        check_same_device(features=features, indices=indices)
        object.__setattr__(self, "capacity", as_capacity_policy(self.capacity))
        if not self._checked and self.capacity is None:  # capacity mode: checked in the first build
            check_sites(indices, shape, batch)  # on the GPU one kernel pass and one read back
            object.__setattr__(self, "_checked", True)
        object.__setattr__(self, "spatial_shape", shape)
        object.__setattr__(self, "batch_size", batch)
        # the core computes on these views; the fields keep the caller's library (torch in, torch out)
        object.__setattr__(self, "core_indices", indices)
        object.__setattr__(self, "core_features", features)
        object.__setattr__(self, "indices", in_library_of(indices, self.indices))
        object.__setattr__(self, "features", in_library_of(features, self.features))

    def __setstate__(self, state: dict) -> None:
        # an unpickled tensor is checked again (a pickle may carry any arrays)
        self.__dict__.update(state)
        object.__setattr__(self, "_checked", False)
        self.__post_init__()

    def __repr__(self) -> str:
        """One short line: sizes, dtypes, library, device and cached rulebooks; never the arrays' values."""
        library = type(self.features).__module__.split(".")[0]
        return (f"SparseTensor(active_sites={self.num_active}, channels={self.num_channels}, "
                f"features={_shape_text(self.features)} {self.core_features.dtype}, "
                f"indices={_shape_text(self.indices)} {self.core_indices.dtype}, spatial_shape={self.spatial_shape}, "
                f"batch_size={self.batch_size}, library={library}, device={device_of(self.core_features)}, "
                f"cached_rulebooks={len(self.rulebooks.keys())})")

    @property
    def ndim(self) -> int:
        """Number of spatial axes ``D``."""
        return len(self.spatial_shape)

    @property
    def num_active(self) -> int:
        """Number of active sites ``N``."""
        return int(self.indices.shape[0])

    @property
    def num_channels(self) -> int:
        """Feature channels ``C``."""
        return int(self.features.shape[1])

    def replace(self, features: Any, *, rulebooks: RulebookCache | None = None) -> "SparseTensor":
        """The same sites with new features ``[N, C']``, sharing this tensor's rulebook cache
        (spconv's ``replace_feature``) unless ``rulebooks`` gives the one to hold."""
        out = SparseTensor(features, self.indices, self.spatial_shape, self.batch_size,
                           self.rulebooks if rulebooks is None else rulebooks, self.capacity, _checked=self._checked)
        if out.indices is self.indices:  # one core view of the sites: cached rulebooks match by identity
            object.__setattr__(out, "core_indices", self.core_indices)
        return out

    def with_sites(self, features: Any, indices: Any, spatial_shape: Sequence[int],
                   core_indices: Any = None, *, rulebooks: RulebookCache | None = None) -> "SparseTensor":
        """A tensor on new sites the library produced, sharing this tensor's cache unless
        ``rulebooks`` gives the one to hold.

        ``core_indices``: the core array ``indices`` views (a rulebook's output
        sites), kept as the new tensor's ``core_indices`` so that the rulebooks
        built on it are found by identity (`sites`).
        """
        out = SparseTensor(features, indices, tuple(spatial_shape), self.batch_size,
                           self.rulebooks if rulebooks is None else rulebooks, self.capacity, _checked=True)
        if core_indices is not None and tuple(core_indices.shape) == tuple(out.core_indices.shape):
            object.__setattr__(out, "core_indices", core_indices)
        return out

    def check_capacity(self) -> dict[str, int]:
        """Reads the counts and site checks of the capacity builds in this tensor's rulebook cache (one read
        back), teaches them to its policy, and raises `sparsecore.capacity.CapacityOverflowError` (or the site
        checks' ValueError) for the first layer that failed (`sparsecore.capacity.check_capacity`).

        Returns:
            ``{layer name: output rows needed}``; empty in exact mode.
        """
        return check_capacity([*self.rulebooks.value.canonical.values(), *self.rulebooks.value.aliases.values()],
                              self.capacity)

    @property
    def sites(self) -> InputSites:
        """The input sites as the geometry path reads them (identity: the ``core_indices`` object)."""
        return InputSites(sites_identity(self.core_indices), self.core_indices, self.spatial_shape,
                          self.batch_size, self._checked)

    def dense(self, channels_first: bool = True) -> Any:
        """The dense grid: ``[B, C, *spatial]`` (or ``[B, *spatial, C]``)."""
        densify = to_dense if self.capacity is None else padded_to_dense  # capacity mode: no read back
        dense = densify(self.core_features, self.core_indices, self.spatial_shape, self.batch_size,
                        channels_first=channels_first)
        return from_core_array(dense, like=self.features)

    @classmethod
    def from_dense(cls, dense: Any, channels_first: bool = False) -> "SparseTensor":
        """A sparse tensor of the sites of ``dense`` whose feature vector is not all zero.

        Args:
            dense: ``[B, *spatial, C]`` (or ``[B, C, *spatial]`` with ``channels_first``).
        """
        features, indices = from_dense(dense, channels_first=channels_first)
        features, indices = from_core_array(features, like=dense), from_core_array(indices, like=dense)
        shape = dense.shape[2:] if channels_first else dense.shape[1:-1]
        return cls(features, indices, tuple(shape), int(dense.shape[0]), _checked=True)


def _shape_text(array: Any) -> str:
    return "[" + ", ".join(str(int(size)) for size in array.shape) + "]"
