"""`SparseConvTensor` (spconv's sparse tensor type) and `IndiceData` (a layer's saved rulebook).

The tensor holds torch ``features [N, C]`` and ``indices [N, 1 + D]`` (int32,
batch first), the ``spatial_shape`` and ``batch_size``, and ``indice_dict``:
rulebooks saved by layers with an ``indice_key``, as `IndiceData` wrapping a
core `sparsecore.Rulebook`. As in spconv, ``replace_feature`` and
``shadow_copy`` share the dict, while each layer hands its output a copy with
its own key added, so running a model twice on one input starts afresh.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

import sparsecore as sc
from sparsecore.interop import (as_batch_size, as_spatial_shape, check_dense_size, check_indices_in_range,
                               check_unique_sites, memory_limit)

from ._convert import as_int32_indices, core_context, core_view
from .fx import ProxyableSparseMeta

__all__ = ["SparseConvTensor", "IndiceData", "expand_nd"]

_FEATURES_MESSAGE = (
    "you can't set feature directly, use 'x = x.replace_feature(your_new_feature)' to generate "
    "new SparseConvTensor instead."
)


def expand_nd(ndim: int, value: Union[int, Sequence[int], np.ndarray], name: str = "value") -> list[int]:
    """An int or a sequence of ``ndim`` ints as a list of ``ndim`` Python ints (spconv ``expand_nd``)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return [int(value)] * ndim
    try:
        values = [int(v) for v in value]
    except TypeError:
        raise ValueError(f"{name} must be an int or a sequence of {ndim} ints, got {value!r}") from None
    if len(values) != ndim:
        raise ValueError(f"{name} must have {ndim} entries (one per spatial axis), got {value!r}")
    return values


class IndiceData:
    """A layer's rulebook, as saved under an ``indice_key`` (spconv's ``IndiceData``).

    Attributes (spconv names): ``indices`` (the layer's input sites),
    ``out_indices``, ``spatial_shape`` / ``out_spatial_shape`` (lists),
    ``is_subm``, ``ksize``, ``stride``, ``padding``, ``dilation``, ``algo``.
    sparsecore's own: ``rulebook`` (the core `sparsecore.Rulebook`),
    ``pair_input`` / ``pair_output`` (int32 torch views of its pairs),
    ``offset_starts``, ``num_input``, ``num_output``, ``kernel_size``,
    ``identity_offset``. spconv's ``indice_pairs`` (its ``[2, K, N]`` Native
    layout) does not exist; ``indice_pair_num`` (pairs per offset) does.
    """

    def __init__(self, rulebook: sc.Rulebook, indices: torch.Tensor, out_indices: torch.Tensor,
                 pair_input: torch.Tensor, pair_output: torch.Tensor, algo: Any = None,
                 out_core_indices: Any = None) -> None:
        self.rulebook = rulebook
        self.indices = indices
        self.out_indices = out_indices
        # the core array ``out_indices`` views, when known (saves a comparison when it is reused)
        self.out_core_indices = out_core_indices
        self.pair_input = pair_input
        self.pair_output = pair_output
        self.algo = algo
        geometry = rulebook.geometry
        self.offset_starts = list(rulebook.offset_starts)
        self.num_input = rulebook.num_input
        self.num_output = rulebook.num_output
        self.kernel_size = list(geometry.kernel_size)
        self.identity_offset = int(rulebook.identity_offset)
        self.spatial_shape = list(rulebook.input_spatial_shape)
        self.out_spatial_shape = list(rulebook.output_spatial_shape)
        self.is_subm = geometry.kind == "subm"
        self.ksize = list(geometry.kernel_size)
        self.stride = list(geometry.stride)
        self.padding = list(geometry.padding)
        self.dilation = list(geometry.dilation)

    @property
    def indice_pair_num(self) -> torch.Tensor:
        """Pairs per kernel offset, int32 ``[K]``."""
        return torch.tensor(self.rulebook.offset_counts, dtype=torch.int32)

    def inverse(self) -> "IndiceData":
        """The rulebook of the inverse conv that undoes this (regular) layer."""
        return IndiceData(sc.inverse_rulebook(self.rulebook), self.out_indices, self.indices,
                          self.pair_output, self.pair_input, self.algo, self.rulebook.input_indices)

    def __repr__(self) -> str:
        return (f"IndiceData({self.rulebook.geometry.describe()}, {self.num_input} -> {self.num_output} "
                f"sites, {self.rulebook.num_pairs} pairs)")


def _as_shape_list(spatial_shape: Any) -> list[int]:
    return list(as_spatial_shape(spatial_shape))


@torch.compiler.disable
def _check_sites(indices: torch.Tensor, spatial_shape: list[int], batch_size: int) -> None:
    """The sites rule (see `sparsecore.interop`): in range and unique, checked once per tensor."""
    with core_context(indices.device):
        sites = core_view(indices, "indices")
        check_indices_in_range(sites, spatial_shape, batch_size)
        check_unique_sites(sites, spatial_shape, batch_size)


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
        shape = _as_shape_list(spatial_shape)
        indices = as_int32_indices(indices)  # int64 & co. converted once when the values fit int32
        _validate(features, indices, shape, batch_size)
        _check_sites(indices, shape, int(batch_size))
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
            _validate(self._features, self._indices, self._spatial_shape, self._batch_size)
            _check_sites(self._indices, self._spatial_shape, self._batch_size)
            self._trusted = True
        return self

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
        self._spatial_shape = _as_shape_list(value)
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
        """The indices as a core (NumPy / CuPy) array, a view cached while ``indices`` is unchanged."""
        cached = self._core_indices
        if cached is None or cached[0] is not self.indices:
            with core_context(self.indices.device):
                cached = (self.indices, core_view(self.indices, "indices"))
            self._core_indices = cached
        return cached[1]

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
        _check_selection(valid_indices, self.indices.shape[0])
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
        out = _dense_zeros(self._features, self.batch_size, self.spatial_shape)
        index = self.indices.to(self._features.device).long()
        out = out.index_put(tuple(index.unbind(1)), self._features)
        if not channels_first:
            return out
        return out.movedim(-1, 1).contiguous()

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
        if not args or not isinstance(args[0], SparseConvTensor) or func not in _feature_functions():
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


def _feature_functions() -> frozenset:
    """The torch functions that act on each feature row alone (applied to a SparseConvTensor's features)."""
    functional = torch.nn.functional
    return frozenset((
        functional.relu, functional.relu_, torch.relu, torch.relu_, functional.relu6, functional.leaky_relu,
        functional.elu, functional.gelu, functional.silu, functional.hardtanh, functional.sigmoid, torch.sigmoid,
        torch.tanh, functional.batch_norm, functional.linear, functional.dropout, functional.layer_norm,
    ))


def _check_selection(valid_indices: Any, rows: int) -> None:
    if not isinstance(valid_indices, torch.Tensor) or valid_indices.is_floating_point() or valid_indices.is_complex():
        kind = valid_indices.dtype if isinstance(valid_indices, torch.Tensor) else type(valid_indices).__name__
        raise TypeError(f"select_by_index: valid_indices must be a bool mask or an integer tensor of rows, got {kind}")
    if valid_indices.dtype == torch.bool:
        if tuple(valid_indices.shape) != (rows,):
            raise ValueError(f"select_by_index: a bool valid_indices must have one entry per site ({rows}), "
                             f"got shape {tuple(valid_indices.shape)}")
    elif valid_indices.numel() and not torch.compiler.is_compiling():
        low, high = int(valid_indices.min()), int(valid_indices.max())
        if low < -rows or high >= rows:
            raise ValueError(f"select_by_index: valid_indices holds row {low if low < -rows else high}, outside "
                             f"[-{rows}, {rows}) for this tensor's {rows} sites")


def _dense_zeros(features: torch.Tensor, batch_size: int, spatial_shape: list[int]) -> torch.Tensor:
    """Zeros ``[B, *spatial, C]`` like ``features``, sized before allocating."""
    channels = features.shape[1]
    if features.device.type == "cuda":
        limit = torch.cuda.mem_get_info(features.device)[1]
    else:
        limit = memory_limit(np)
    size = check_dense_size(batch_size, spatial_shape, channels, features.element_size(), limit)
    try:
        return features.new_zeros((batch_size, *spatial_shape, channels))
    except (RuntimeError, MemoryError) as error:
        raise ValueError(
            f"dense(): cannot allocate the grid of batch_size {batch_size} x spatial_shape {spatial_shape} x "
            f"{channels} channels ({size / 2**30:.3g} GiB): {error}. Densify a cropped region or a coarser "
            "grid, or stay sparse"
        ) from None


def _validate(features: Any, indices: Any, spatial_shape: list[int], batch_size: Any) -> None:
    if not isinstance(features, torch.Tensor) or not isinstance(indices, torch.Tensor):
        raise TypeError(
            f"features and indices must be torch.Tensors, got {type(features).__name__} and "
            f"{type(indices).__name__}"
        )
    if features.ndim != 2:
        raise ValueError(f"features must be 2-D [N, C], got shape {tuple(features.shape)}")
    if features.is_complex():
        raise TypeError(f"features must be real (a float or quantized dtype), got {features.dtype}")
    if indices.ndim != 2:
        raise ValueError(f"indices must be 2-D [N, ndim + 1] (batch index first), got shape {tuple(indices.shape)}")
    if indices.dtype != torch.int32:
        raise TypeError(
            f"indices must be an integer tensor (int32 as spconv stores them; int64 and other integer "
            f"dtypes are converted once when their values fit int32), got {indices.dtype}; floor "
            "coordinates and convert with indices.int()"
        )
    ndim = indices.shape[1] - 1
    if len(spatial_shape) != ndim or not 1 <= ndim <= 4:
        raise ValueError(
            f"indices must be [N, ndim + 1] with one column per spatial axis of spatial_shape "
            f"{spatial_shape} ({len(spatial_shape)} axes) plus the batch column, got shape "
            f"{tuple(indices.shape)}"
        )
    as_spatial_shape(spatial_shape)
    as_batch_size(batch_size)
    if features.shape[0] != indices.shape[0]:
        raise ValueError(
            f"features has {features.shape[0]} rows but indices has {indices.shape[0]}; they must "
            "have one row per active site"
        )
    if features.device != indices.device:
        raise ValueError(
            f"features is on {features.device} but indices is on {indices.device}; put both on "
            "one device (indices.to(features.device))"
        )
