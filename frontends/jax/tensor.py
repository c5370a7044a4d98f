"""The JAX `SparseTensor`: padded features on one site set of a `Plan` (a pytree).

Leaves: the features ``[capacity, C]`` and the plan's arrays. Static: the name of
the site set the features live on. Rows past ``num_active`` are padding: every
sparsecore op writes zeros there and never reads them, so elementwise functions
(``x.replace(features=jax.nn.relu(x.features))``) need no care; reductions over
rows should use ``x.mask`` (or the global pools).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import sparsecore as sc
from sparsecore.interop import (as_batch_size, as_indices, as_spatial_shape, check_indices_in_range,
                                check_unique_sites, is_jax_tracer, to_core_array)

from .buckets import CapacityError, CapacityPolicy, as_policy
from .ops import to_dense
from .plan import Plan, Sites, SitesInfo, require_concrete

__all__ = ["SparseTensor"]


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or "@" in name:
        raise ValueError(f"name must be a non-empty string without '/' or '@', got {name!r}")
    return name


def _read(path: str, doc: str) -> property:
    """A read-only property following the dotted attribute ``path`` from the tensor (``"sites.count"``)."""
    names = path.split(".")

    def get(self: Any) -> Any:
        value = self
        for name in names:
            value = getattr(value, name)
        return value

    return property(get, doc=doc)


@partial(jax.tree_util.register_dataclass, data_fields=["features", "plan"], meta_fields=["sites_name"])
@dataclass(frozen=True, eq=False, repr=False)
class SparseTensor:
    """Features on the active sites of a batched grid, with the plan of its network.

    Create one outside ``jit`` with `from_arrays` (or `from_dense`,
    `sparsecore.jax.voxelize`), complete its plan with ``x.with_plan(sparsecore.jax.plan(net, params, x))``,
    then pass it to jitted functions.

    Attributes:
        features: ``[capacity, C]``; rows past ``num_active`` are padding (zeros after any sparsecore op).
        plan: the `Plan` (site sets and rulebooks).
        sites_name: the site set the features live on (static).
    """

    features: Any
    plan: Plan
    sites_name: str

    # ------------------------------------------------------------------ views
    @property
    def sites(self) -> Sites:
        """The `Sites` (padded indices and count) the features live on."""
        return self.plan.site(self.sites_name)

    info = _read("sites.info", "The static `SitesInfo` of the site set.")
    indices = _read("sites.indices", "int32 ``[capacity, 1 + D]``; padding rows have batch index ``batch_size``.")
    num_active = _read("sites.count", "int32 scalar: the true number of sites (an array: it may vary between clouds).")
    capacity = _read("sites.info.capacity", "Rows of the padded arrays (static).")
    spatial_shape = _read("sites.info.spatial_shape", "The grid, ``D`` ints (static).")
    batch_size = _read("sites.info.batch_size", "Number of batch elements (static).")
    ndim = _read("sites.info.ndim", "Number of spatial axes (static).")

    @property
    def mask(self) -> Any:
        """bool ``[capacity]``: True on true rows."""
        return self.sites.mask()

    @property
    def num_channels(self) -> int:
        return int(self.features.shape[1])

    def __repr__(self) -> str:
        return (f"SparseTensor(sites={self.sites_name!r}, features={getattr(self.features, 'shape', '?')}, "
                f"spatial_shape={self.spatial_shape}, batch_size={self.batch_size})")

    # ------------------------------------------------------------------ updates
    def replace(self, features: Any) -> "SparseTensor":
        """The same sites and plan with new features ``[capacity, C']`` (works inside jit)."""
        shape = getattr(features, "shape", None)
        if shape is None or len(shape) != 2 or shape[0] != self.capacity:
            raise ValueError(
                f"features must have shape [capacity, C] = [{self.capacity}, C] (padded rows "
                f"included), got {shape}; transform x.features elementwise or row-wise"
            )
        return SparseTensor(features, self.plan, self.sites_name)

    def with_plan(self, plan: Plan) -> "SparseTensor":
        """This tensor carrying ``plan``, which must hold its site set (the same sites).

        When the plan pads the site set to another capacity (``Buckets(linked=True)``
        settles capacities once the whole network is known, or `repad`), the feature
        rows are padded or trimmed to match; only padding rows are removed.
        """
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a sparsecore.jax.Plan, got {type(plan).__name__}")
        new, old = plan.site(self.sites_name).info, self.info
        if (new.name, new.spatial_shape, new.batch_size, new.parent) != (old.name, old.spatial_shape,
                                                                          old.batch_size, old.parent):
            raise ValueError(
                f"the plan's site set {self.sites_name!r} is {new}, this tensor's is {old}; build the "
                "plan from this tensor"
            )
        features = self.features
        if new.capacity > old.capacity:
            features = jnp.pad(features, ((0, new.capacity - old.capacity), (0, 0)))
        elif new.capacity < old.capacity:
            if not is_jax_tracer(plan.site(self.sites_name).count) and int(plan.site(self.sites_name).count) > new.capacity:
                raise CapacityError(self.sites_name, int(plan.site(self.sites_name).count), new.capacity)
            features = features[: new.capacity]
        return SparseTensor(features, plan, self.sites_name)

    def dense(self, channels_first: bool = True) -> Any:
        """``[B, C, *spatial]`` (or ``[B, *spatial, C]``); differentiable, works inside jit."""
        return to_dense(self.features, self.indices, self.spatial_shape, self.batch_size, channels_first)

    def valid_features(self) -> np.ndarray:
        """The true rows of the features as NumPy (outside jit only)."""
        require_concrete(self.features, "features", "SparseTensor.valid_features")
        return np.asarray(self.features)[: int(self.num_active)]

    def valid_indices(self) -> np.ndarray:
        """The true rows of the indices as NumPy (outside jit only)."""
        return self.sites.numpy_indices()

    # ------------------------------------------------------------------ creation
    @classmethod
    def from_arrays(cls, features: Any, indices: Any, spatial_shape: Any, batch_size: int, *,
                    capacity: CapacityPolicy | int | None = None, name: str = "input") -> "SparseTensor":
        """A tensor on input sites, padded by the capacity policy (outside jit).

        Args:
            features: ``[N, C]`` float array (NumPy or JAX).
            indices: integer ``[N, 1 + D]`` (batch first, then the axes of ``spatial_shape``),
                concrete (NumPy or a JAX array, not a tracer); sites must be unique.
            spatial_shape: ``D`` positive ints.
            batch_size: number of batch elements.
            capacity: a `Buckets` / `Fixed` policy, an int (fixed rows and pairs), or None
                (``Buckets()``); it also sizes every rulebook planned from this tensor.
            name: the site set's name in the plan.

        Raises:
            TypeError: for tracer indices (with where to build the plan), bad dtypes.
            ValueError: for mismatched shapes, out-of-range or duplicate sites.
            CapacityError: when a `Fixed` capacity is too small.
        """
        require_concrete(indices, "indices", "SparseTensor.from_arrays")
        name = _check_name(name)
        policy = as_policy(capacity)
        if not hasattr(features, "shape") or not hasattr(features, "dtype"):
            features = np.asarray(features)
        if len(features.shape) != 2:
            raise ValueError(f"features must be 2-D [N, C], got shape {tuple(features.shape)}")
        if not jnp.issubdtype(features.dtype, jnp.floating):
            raise TypeError(f"features must be a float array, got dtype {features.dtype}")
        rows = int(features.shape[0])
        # the shared checks of the core, with messages naming the argument
        shape, batch_size = as_spatial_shape(spatial_shape), as_batch_size(batch_size)
        core_indices = np.asarray(as_indices(to_core_array(indices, "indices"), len(shape)))
        if core_indices.shape[0] != rows:
            raise ValueError(f"features has {rows} rows but {core_indices.shape[0]} are expected: one per active "
                             "site (features and indices must have one row per site)")
        check_indices_in_range(core_indices, shape, batch_size)
        check_unique_sites(core_indices, shape, batch_size)
        cap = policy.capacity(rows, name)
        info = SitesInfo(name, shape, batch_size, cap)
        sites = Sites.from_numpy(core_indices, info)
        # pad on the host and transfer once: jnp.zeros(...).at[:rows].set(...) would compile an XLA
        # program for every distinct row count, and JAX keeps them all (a leak when streaming clouds)
        padded = np.zeros((cap, features.shape[1]), np.dtype(features.dtype))
        padded[:rows] = np.asarray(features)
        return cls(jax.device_put(padded), Plan({name: sites}, {}, policy).device_put(), name)

    @classmethod
    def from_dense(cls, dense: Any, *, channels_first: bool = False,
                   capacity: CapacityPolicy | int | None = None, name: str = "input") -> "SparseTensor":
        """The sites of a dense ``[B, *spatial, C]`` grid whose feature vector is not all zero (outside jit)."""
        require_concrete(dense, "dense", "SparseTensor.from_dense")
        array = np.asarray(dense)
        features, indices = sc.from_dense(array, channels_first=channels_first)
        shape = array.shape[2:] if channels_first else array.shape[1:-1]
        return cls.from_arrays(features, indices, tuple(shape), int(array.shape[0]), capacity=capacity, name=name)
