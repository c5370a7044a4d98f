"""The core sparse tensor: features on active sites of a batched grid, plus its rulebook cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from ._dispatch import check_same_device
from .interop import (as_batch_size, as_features, as_indices, as_spatial_shape, check_indices_in_range,
                      check_unique_sites)
from .dense import from_dense, to_dense
from .rulebook import Rulebook

__all__ = ["SparseTensor", "RulebookCache"]


class RulebookCache:
    """Rulebooks by ``indice_key``, shared by every tensor derived from one input.

    A layer that names an ``indice_key`` stores its rulebook here; a later
    submanifold layer with the same key reuses it, and an inverse conv with the
    same key reverses it (spconv's ``indice_dict``).
    """

    def __init__(self) -> None:
        self._rulebooks: dict[str, Rulebook] = {}

    def get(self, key: str) -> Rulebook | None:
        """The rulebook stored under ``key``, or None."""
        return self._rulebooks.get(key)

    def put(self, key: str, rulebook: Rulebook) -> None:
        """Stores ``rulebook`` under ``key`` (replacing any previous one)."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"indice_key must be a non-empty string, got {key!r}")
        self._rulebooks[key] = rulebook

    def keys(self) -> list[str]:
        """The stored keys, in insertion order."""
        return list(self._rulebooks)

    def __contains__(self, key: object) -> bool:
        return key in self._rulebooks

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._rulebooks))

    def __len__(self) -> int:
        return len(self._rulebooks)


@dataclass(frozen=True, eq=False)
class SparseTensor:
    """Features on the active sites of a batched ``D``-dimensional grid.

    Args:
        features: ``[N, C]`` float16/32/64 (NumPy or CuPy, or any DLPack array).
        indices: integer ``[N, 1 + D]``: batch index, then coordinates in the
            order of ``spatial_shape``. Stored as int32.
        spatial_shape: ``D`` positive ints (1 to 4 axes).
        batch_size: number of batch elements.
        rulebooks: a cache to share; a fresh one when omitted.

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
    _checked: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        shape = as_spatial_shape(self.spatial_shape)
        batch = as_batch_size(self.batch_size)
        indices = as_indices(self.indices, len(shape))
        features = as_features(self.features, indices.shape[0])
        check_same_device(features=features, indices=indices)
        if not self._checked:
            check_indices_in_range(indices, shape, batch)
            check_unique_sites(indices, shape, batch)
            object.__setattr__(self, "_checked", True)
        object.__setattr__(self, "spatial_shape", shape)
        object.__setattr__(self, "batch_size", batch)
        object.__setattr__(self, "indices", indices)
        object.__setattr__(self, "features", features)

    def __setstate__(self, state: dict) -> None:
        # an unpickled tensor is checked again (a pickle may carry any arrays)
        self.__dict__.update(state)
        object.__setattr__(self, "_checked", False)
        self.__post_init__()

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

    def replace(self, features: Any) -> "SparseTensor":
        """The same sites and rulebook cache with new features ``[N, C']``."""
        return SparseTensor(features, self.indices, self.spatial_shape, self.batch_size,
                            self.rulebooks, _checked=self._checked)

    def with_sites(self, features: Any, indices: Any, spatial_shape: Sequence[int]) -> "SparseTensor":
        """A tensor on new sites the library produced, sharing this tensor's cache."""
        return SparseTensor(features, indices, tuple(spatial_shape), self.batch_size,
                            self.rulebooks, _checked=True)

    def dense(self, channels_first: bool = True) -> Any:
        """The dense grid: ``[B, C, *spatial]`` (or ``[B, *spatial, C]``)."""
        return to_dense(self.features, self.indices, self.spatial_shape, self.batch_size,
                        channels_first=channels_first)

    @classmethod
    def from_dense(cls, dense: Any, channels_first: bool = False) -> "SparseTensor":
        """A sparse tensor of the sites of ``dense`` whose feature vector is not all zero.

        Args:
            dense: ``[B, *spatial, C]`` (or ``[B, C, *spatial]`` with ``channels_first``).
        """
        features, indices = from_dense(dense, channels_first=channels_first)
        shape = dense.shape[2:] if channels_first else dense.shape[1:-1]
        return cls(features, indices, tuple(shape), int(dense.shape[0]), _checked=True)
