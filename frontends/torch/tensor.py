"""`SparseConvTensor`, spconv's sparse tensor type (`IndiceData`, a layer's saved rulebook, is re-exported).

The tensor holds torch ``features [N, C]`` and ``indices [N, 1 + D]`` (int32,
batch first), the ``spatial_shape`` and ``batch_size``, and ``indice_dict``:
rulebooks saved by layers with an ``indice_key``, as `IndiceData` views of a
core `sparsecore.Rulebook` (module `indice_data`). As in spconv,
``replace_feature`` and ``shadow_copy`` share the dict, while each layer hands
its output a copy with its own key added, so running a model twice on one
input starts afresh (the core's sharing rule, `sparsecore.layer_geometry`).
The argument checks are in `tensor_checks`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from sparsecore.geometry import normalize_per_axis
from sparsecore.interop import as_batch_size

from ._convert import as_int32_indices, core_context, core_view
from .capacity import capacity_tensor, check_tensor_capacity, dense_of_padded, device_count, valid_rows
from .fx import ProxyableSparseMeta
from .indice_data import IndiceData
from .tensor_checks import (as_shape_list, check_selection, check_sites, dense_zeros, feature_functions,
                            validate)

__all__ = ["SparseConvTensor", "IndiceData", "expand_nd"]

_FEATURES_MESSAGE = (
    "you can't set feature directly, use 'x = x.replace_feature(your_new_feature)' to generate "
    "new SparseConvTensor instead."
)


def expand_nd(ndim: int, value: Union[int, Sequence[int], np.ndarray], name: str = "value") -> list[int]:
    """An int or a sequence of ``ndim`` ints as a list of ``ndim`` Python ints (spconv ``expand_nd``):
    the core's `sparsecore.geometry.normalize_per_axis` (its checks and messages), as a list."""
    return list(normalize_per_axis(value, ndim, name, minimum=-(2**31)))


class SparseConvTensor(metaclass=ProxyableSparseMeta):
    """Features on the active sites of a batched grid (spconv ``SparseConvTensor``).

    Under ``torch.fx`` tracing, constructing one from traced values is a graph node
    (the metaclass); torch functions that act row by row (``F.relu``,
    ``F.batch_norm``, ``F.linear``, ...) applied to the tensor act on its features
    (``__torch_function__``), so a traced ``nn.ReLU`` / ``nn.BatchNorm1d`` node
    fed a SparseConvTensor runs as it does inside a `SparseSequential`.

    Args:
        features: ``[N, C]`` float tensor.
        indices: ``[N, ndim + 1]`` int32 tensor: batch index, then coordinates in the
            order of ``spatial_shape`` (zyx for LiDAR), on the device of ``features``.
        spatial_shape: ``ndim`` ints.
        batch_size: number of batch elements (> 0).
        grid, voxel_num, benchmark, permanent_thrust_allocator, enable_timer, force_algo:
            accepted for spconv compatibility (stored; sparsecore needs no grid or allocator).
        indice_dict: rulebooks by ``indice_key`` to start from.

    Raises:
        ValueError / TypeError: on malformed shapes or dtypes, mismatched row counts,
            mixed devices, or sites outside ``[0, batch_size) x [0, spatial_shape)``
            (spconv does not check the range; a wrong site is a silent bug there).
    """

    def __init__(self, features: torch.Tensor, indices: torch.Tensor,
                 spatial_shape: Union[Sequence[int], np.ndarray], batch_size: int,
                 grid: Optional[torch.Tensor] = None, voxel_num: Optional[torch.Tensor] = None,
                 indice_dict: Optional[dict] = None, benchmark: bool = False,
                 permanent_thrust_allocator: bool = False, enable_timer: bool = False,
                 force_algo: Any = None) -> None:
        shape = as_shape_list(spatial_shape)
        indices = as_int32_indices(indices)  # int64 & co. converted once when the values fit int32
        validate(features, indices, shape, batch_size)
        check_sites(indices, shape, int(batch_size))
        self._init(features, indices, shape, int(batch_size), grid, voxel_num, indice_dict, benchmark,
                   trusted=True)
        self.force_algo = force_algo

    def _init(self, features, indices, spatial_shape, batch_size, grid, voxel_num, indice_dict,
              benchmark, trusted: bool = False) -> None:
        self._features = features
        self._indices = indices
        self._spatial_shape = spatial_shape
        self._batch_size = batch_size
        self.indice_dict = {} if indice_dict is None else indice_dict
        self.grid = grid
        self.voxel_num = voxel_num
        self.benchmark = benchmark
        self.benchmark_record: dict = {}
        self.thrust_allocator = None
        self._timer = None
        self.force_algo = None
        self.int8_scale = None
        # True when the sites are known valid (checked here, or produced by the library):
        # unique, in range, one per feature row. Assigning indices, spatial_shape or
        # batch_size, or unpickling, clears it; `_ensure_valid` checks again once.
        self._trusted = trusted
        self._core_indices: tuple[Any, Any] | None = None
        self.capacity = None  # capacity mode's policy (sparsecore.capacity), None in exact mode
        self._sites_unchecked = False

    @classmethod
    def _derived(cls, source: "SparseConvTensor", features: torch.Tensor, indices: torch.Tensor,
                 spatial_shape: Sequence[int], indice_dict: dict, trusted: bool = True,
                 core_indices: Any = None) -> "SparseConvTensor":
        """A tensor made by the library from ``source`` (no re-validation).

        ``core_indices``: the core array that ``indices`` views, when known.
        """
        out = cls.__new__(cls)
        out._init(features, indices, list(spatial_shape), source.batch_size, source.grid, source.voxel_num,
                  indice_dict, source.benchmark, trusted)
        out.benchmark_record = source.benchmark_record
        out.thrust_allocator = source.thrust_allocator
        out._timer = source._timer
        out.force_algo = source.force_algo
        out.int8_scale = source.int8_scale
        out.capacity = source.capacity
        out._sites_unchecked = source._sites_unchecked and indices is source._indices
        if core_indices is not None:
            out._core_indices = (indices, core_indices)
        elif source._core_indices is not None and source._core_indices[0] is indices:
            out._core_indices = source._core_indices
        return out

    # ------------------------------------------------------------------ properties

    @property
    def features(self) -> torch.Tensor:
        """``[N, C]`` features (read-only: use `replace_feature`)."""
        return self._features

    @features.setter
    def features(self, value: torch.Tensor) -> None:
        raise ValueError(_FEATURES_MESSAGE)

    # Assigning indices, spatial_shape or batch_size (as spconv code sometimes does) makes the
    # next use (a layer, dense(), replace_feature, +, tables, sparse_add) re-check the whole
    # tensor once: shapes, dtypes, rows, range and duplicates.

    def _ensure_valid(self) -> "SparseConvTensor":
        """Checks the tensor unless it is known valid (then free); returns it.

        Raises:
            ValueError / TypeError: as the constructor does.
        """
        if not self._trusted:
            validate(self._features, self._indices, self._spatial_shape, self._batch_size)
            check_sites(self._indices, self._spatial_shape, self._batch_size)
            self._trusted = True
        return self

    def __getstate__(self) -> dict:
        # without the caches: `_core_indices` holds a NumPy / CuPy view that torch.load(weights_only=True)
        # refuses (torch.export.save pickles a program's example inputs), and trust is not carried over
        return {name: value for name, value in self.__dict__.items() if name not in ("_core_indices", "_trusted")}

    def __setstate__(self, state: dict) -> None:
        # an unpickled (or copied) tensor is checked again at its first use
        self.__dict__.update(state)
        self._trusted = False
        self._core_indices = None

    @property
    def indices(self) -> torch.Tensor:
        """``[N, ndim + 1]`` int32 sites, batch index first."""
        return self._indices

    @indices.setter
    def indices(self, value: torch.Tensor) -> None:
        self._indices = as_int32_indices(value)
        self._trusted = False

    @property
    def spatial_shape(self) -> list[int]:
        """The grid's extent per spatial axis."""
        return self._spatial_shape

    @spatial_shape.setter
    def spatial_shape(self, value: Sequence[int]) -> None:
        self._spatial_shape = as_shape_list(value)
        self._trusted = False

    @property
    def batch_size(self) -> int:
        """Number of batch elements."""
        return self._batch_size

    @batch_size.setter
    def batch_size(self, value: int) -> None:
        self._batch_size = as_batch_size(value)
        self._trusted = False

    @property
    def ndim(self) -> int:
        """Number of spatial axes."""
        return len(self.spatial_shape)

    @property
    def spatial_size(self) -> int:
        """``prod(spatial_shape)``."""
        return int(np.prod(self.spatial_shape))

    @property
    def is_quantized(self) -> bool:
        """True for qint8 features (sparsecore has no int8 kernels)."""
        return self._features.dtype == torch.qint8

    def core_indices(self) -> Any:
        """The indices as a core (NumPy / CuPy) array, a view cached while ``indices`` is unchanged.

        That array object is the identity of the sites for the core's rulebook cache
        (`sparsecore.layer_geometry.sites_identity`): tensors derived with the same
        indices, and layer outputs (``_derived(core_indices=...)``), keep it.
        """
        cached = self._core_indices
        if cached is None or cached[0] is not self.indices:
            with core_context(self.indices.device):
                cached = (self.indices, core_view(self.indices, "indices"))
            self._core_indices = cached
        return cached[1]

    # capacity mode (docs/capture.md): a tensor made by `capacity_mode`, its count on the device, its one read
    capacity_mode = classmethod(capacity_tensor)
    device_count, valid_rows, check_capacity = property(device_count), valid_rows, check_tensor_capacity

    # ------------------------------------------------------------------ derived tensors

    def replace_feature(self, feature: torch.Tensor) -> "SparseConvTensor":
        """The same sites, rulebooks (shared dict) and settings with new features ``[N, C']``."""
        self._ensure_valid()
        if not isinstance(feature, torch.Tensor) or feature.ndim != 2 or feature.shape[0] != self.indices.shape[0]:
            shape = tuple(feature.shape) if isinstance(feature, torch.Tensor) else type(feature).__name__
            raise ValueError(
                f"replace_feature: the new features must be a 2-D tensor [N, C] with one row per site "
                f"(N = {self.indices.shape[0]}), got {shape}"
            )
        if feature.is_complex():
            raise TypeError(f"replace_feature: the new features must be real (a float dtype), got {feature.dtype}")
        if feature.device != self.indices.device:
            raise ValueError(
                f"replace_feature got features on {feature.device} but the indices are on "
                f"{self.indices.device}; keep features and indices on one device"
            )
        return SparseConvTensor._derived(self, feature, self.indices, self.spatial_shape, self.indice_dict,
                                         self._trusted)

    def shadow_copy(self) -> "SparseConvTensor":
        """A new tensor with every member unchanged (the indice_dict is shared)."""
        return SparseConvTensor._derived(self, self._features, self.indices, self.spatial_shape,
                                         self.indice_dict, self._trusted)

    def select_by_index(self, valid_indices: torch.Tensor) -> "SparseConvTensor":
        """The sites picked by ``valid_indices`` (bool mask or row indices), with no saved rulebooks.

        Raises:
            ValueError / TypeError: a mask of another length than the rows, row indices
                outside ``[-N, N)``, or neither a bool nor an integer tensor.
        """
        check_selection(valid_indices, self.indices.shape[0])
        picked = self.indices[valid_indices]
        features = self._features[valid_indices]
        is_mask = isinstance(valid_indices, torch.Tensor) and valid_indices.dtype == torch.bool
        # a mask keeps unique sites unique; row indices may repeat rows, so re-check them
        return SparseConvTensor._derived(self, features, picked, self.spatial_shape, {},
                                         self._trusted and is_mask)

    def minus(self) -> "SparseConvTensor":
        """Negated features."""
        return self.replace_feature(-self._features)

    def dequantize(self) -> "SparseConvTensor":
        """Dequantized features."""
        return self.replace_feature(self._features.dequantize())

    def q_scale(self) -> float:
        """Quantization scale of qint8 features."""
        if self.is_quantized:
            return self._features.q_scale()
        raise ValueError("sparse tensor must be quantized")

    def find_indice_pair(self, key: Optional[str]) -> Optional[IndiceData]:
        """The `IndiceData` saved under ``key``, or None."""
        if key is None:
            return None
        return self.indice_dict.get(key)

    # ------------------------------------------------------------------ dense

    def dense(self, channels_first: bool = True) -> torch.Tensor:
        """The dense grid ``[B, C, *spatial]`` (or ``[B, *spatial, C]``); differentiable.

        Raises:
            ValueError: for a tensor that fails its checks (e.g. reassigned indices
                outside a smaller spatial_shape), or a grid larger than the memory.
        """
        self._ensure_valid()
        channels = self._features.shape[1]
        out = dense_zeros(self._features, self.batch_size, self.spatial_shape, channels_first_memory=channels_first)
        index = self.indices.to(self._features.device).long()
        if self.capacity is not None:  # capacity mode: the padding rows left out
            out = dense_of_padded(self, out, index)
        else:
            out = out.index_put(tuple(index.unbind(1)), self._features)  # keeps the zeros' memory layout
        if not channels_first:
            return out
        return out.movedim(-1, 1).contiguous()  # already contiguous: no copy

    @classmethod
    def from_dense(cls, x: torch.Tensor) -> "SparseConvTensor":
        """Sites of a channels-last ``[B, *spatial, C]`` tensor whose feature vector is not all zero.

        Sites come sorted by (batch, coordinates); the features stay differentiable.
        """
        if not isinstance(x, torch.Tensor) or not 3 <= x.ndim <= 6:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"from_dense needs a channels-last [B, *spatial, C] tensor with 1 to 4 "
                             f"spatial axes, got {shape}")
        active = (x != 0).any(dim=-1)
        indices = active.nonzero().to(torch.int32)
        features = x[active]
        out = cls.__new__(cls)
        out._init(features, indices, list(x.shape[1:-1]), int(x.shape[0]), None, None, None, False, True)
        return out

    # ------------------------------------------------------------------ arithmetic

    def _other_features(self, other: Union["SparseConvTensor", torch.Tensor]) -> torch.Tensor:
        self._ensure_valid()
        if isinstance(other, SparseConvTensor):
            other._ensure_valid()
            if other.indices is not self.indices and (
                    other.indices.shape != self.indices.shape or not torch.equal(other.indices, self.indices)):
                raise ValueError(
                    "adding SparseConvTensors with different indices; '+' adds features site by site "
                    "and needs identical indices. Use sparsecore.torch.functional.sparse_add for the "
                    "union of two site sets."
                )
            return other.features
        if isinstance(other, torch.Tensor):
            try:
                shape = torch.broadcast_shapes(self._features.shape, other.shape)
            except RuntimeError:
                shape = None
            if shape != self._features.shape:
                raise ValueError(
                    f"a torch.Tensor added to a SparseConvTensor must broadcast to its features "
                    f"{tuple(self._features.shape)} ([N, C], one row per site, or [C]), got shape {tuple(other.shape)}"
                )
            return other
        raise TypeError(
            f"a SparseConvTensor adds a SparseConvTensor on the same sites or a torch.Tensor of features, "
            f"got {type(other).__name__}"
        )

    def __add__(self, other: Union["SparseConvTensor", torch.Tensor]) -> "SparseConvTensor":
        return self.replace_feature(self._features + self._other_features(other))

    def __radd__(self, other: Union["SparseConvTensor", torch.Tensor]) -> "SparseConvTensor":
        return self.replace_feature(self._other_features(other) + self._features)

    def __iadd__(self, other: Union["SparseConvTensor", torch.Tensor]) -> "SparseConvTensor":
        self._features = self._features + self._other_features(other)
        return self

    # ------------------------------------------------------------------ torch functions on the features

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """Row-wise torch functions (`_feature_functions`) on a SparseConvTensor act on its features.

        As in `SparseSequential`, a tensor without active sites is returned unchanged.
        """
        kwargs = {} if kwargs is None else kwargs
        if not args or not isinstance(args[0], SparseConvTensor) or func not in feature_functions():
            return NotImplemented
        source = args[0]
        if source.indices.shape[0] == 0:
            return source
        return source.replace_feature(func(source.features, *args[1:], **kwargs))

    def dim(self) -> int:
        """Dimensions of the features (2), for ``nn`` modules that check their input's rank."""
        return self._features.dim()

    def __repr__(self) -> str:
        return (f"SparseConvTensor[shape={tuple(self._features.shape)}, spatial_shape={self.spatial_shape}, "
                f"batch_size={self.batch_size}]")


