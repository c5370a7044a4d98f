"""The JAX `SparseTensor`: padded features on one site set of a `Plan` (a pytree).

Leaves: the features ``[capacity, C]`` and the plan's arrays. Static: the name of
the site set the features live on. Rows past ``num_active`` are padding: every
sparsecore op writes zeros there and never reads them, so elementwise functions
(``x.replace(features=jax.nn.relu(x.features))``) need no care; reductions over
rows should use ``x.mask`` (or the global pools).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import sparsecore as sc

from .buckets import CapacityError, CapacityPolicy, as_policy
from .plan import Plan, Sites, SitesInfo, is_tracer, require_concrete

__all__ = ["SparseTensor"]


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or "@" in name:
        raise ValueError(f"name must be a non-empty string without '/' or '@', got {name!r}")
    return name


def _check_unique(indices: np.ndarray, spatial_shape: tuple[int, ...], batch_size: int) -> None:
    if indices.shape[0] < 2:
        return
    keys = sc.pack_keys(indices, spatial_shape, batch_size)
    order = np.argsort(keys, kind="stable")
    same = np.flatnonzero(keys[order][1:] == keys[order][:-1])
    if same.shape[0]:
        first, second = sorted((int(order[same[0]]), int(order[same[0] + 1])))
        raise ValueError(
            f"indices contains duplicate sites: rows {first} and {second} are both "
            f"{indices[first].tolist()}. Each active site must appear once; merge duplicate "
            "points first (for example with sparsecore.jax.voxelize)."
        )


@jax.tree_util.register_pytree_node_class
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

    def __init__(self, features: Any, plan: Plan, sites_name: str) -> None:
        self.features, self.plan, self.sites_name = features, plan, sites_name

    def tree_flatten(self) -> tuple[tuple[Any, Plan], str]:
        return (self.features, self.plan), self.sites_name

    @classmethod
    def tree_unflatten(cls, sites_name: str, children: tuple[Any, Plan]) -> "SparseTensor":
        return cls(children[0], children[1], sites_name)

    # ------------------------------------------------------------------ views
    @property
    def sites(self) -> Sites:
        """The `Sites` (padded indices and count) the features live on."""
        return self.plan.site(self.sites_name)

    @property
    def info(self) -> SitesInfo:
        return self.sites.info

    @property
    def indices(self) -> Any:
        """int32 ``[capacity, 1 + D]``; padding rows have batch index ``batch_size``."""
        return self.sites.indices

    @property
    def num_active(self) -> Any:
        """int32 scalar: the true number of sites (an array: it may vary between clouds)."""
        return self.sites.count

    @property
    def mask(self) -> Any:
        """bool ``[capacity]``: True on true rows."""
        return self.sites.mask()

    @property
    def capacity(self) -> int:
        return self.info.capacity

    @property
    def spatial_shape(self) -> tuple[int, ...]:
        return self.info.spatial_shape

    @property
    def batch_size(self) -> int:
        return self.info.batch_size

    @property
    def ndim(self) -> int:
        return len(self.info.spatial_shape)

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
            if not is_tracer(plan.site(self.sites_name).count) and int(plan.site(self.sites_name).count) > new.capacity:
                raise CapacityError(self.sites_name, int(plan.site(self.sites_name).count), new.capacity)
            features = features[: new.capacity]
        return SparseTensor(features, plan, self.sites_name)

    def dense(self, channels_first: bool = True) -> Any:
        """``[B, C, *spatial]`` (or ``[B, *spatial, C]``); differentiable, works inside jit."""
        from .ops import to_dense

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
        index_array = np.asarray(sc._dispatch.to_core_array(indices, "indices"))
        # the core validates shapes, dtypes and ranges (with messages naming the argument)
        core = sc.SparseTensor(np.zeros((rows, 0), np.float32), index_array, tuple(spatial_shape), batch_size)
        core_indices = np.asarray(core.indices)
        _check_unique(core_indices, core.spatial_shape, core.batch_size)
        cap = policy.capacity(rows, name)
        info = SitesInfo(name, core.spatial_shape, core.batch_size, cap)
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
