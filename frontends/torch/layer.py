"""What every sparse layer shares: the `SparseModule` base, benchmark records, and the eager forward.

`layer_forward` is the frame of a sparse conv's and a sparse pool's eager
forward: check the input, start the benchmark record, find or build the
rulebook (`_geometry.layer_indice_data`, spconv's ``indice_key`` rules), run
the feature pass, record the voxel count, and hand the output its sites and
``indice_dict``. The layers differ only in the feature pass they give it.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch
from torch import nn

from ._convert import check_same_device
from ._geometry import check_input, layer_indice_data
from .fx import FxLeafModule
from .spconv_rules import MAX_NUM_VOXELS_DURING_TRAINING
from .tensor import IndiceData, SparseConvTensor

__all__ = ["SparseModule", "nd_variants", "start_benchmark", "layer_forward", "geometry_repr"]


class SparseModule(FxLeafModule, nn.Module):
    """Marker base class: `SparseSequential` hands these modules the whole `SparseConvTensor`.

    Under ``torch.fx`` tracing a sparse module is a leaf (one ``call_module`` node).
    """

    def __init__(self, name: Optional[str] = None) -> None:
        super().__init__()
        self.name = name
        self._sparse_unique_name = ""


LayerClass = TypeVar("LayerClass", bound=type)


def nd_variants(base: LayerClass, doc: str,
                **attributes: Any) -> tuple[LayerClass, LayerClass, LayerClass, LayerClass]:
    """The public 1-D to 4-D classes of a layer class (``_SubMConvNd`` -> ``SubMConv1d`` ... ``SubMConv4d``).

    Each variant is a subclass of ``base`` with ``_ndim`` set (``base``, or an
    ``__init__`` given in ``attributes``, takes spconv's per-class argument list
    and passes ``self._ndim`` on), named as spconv names it, documented by
    ``doc.format(ndim=n)`` and placed in ``base``'s module (where the caller
    binds the four names, so pickles find them there).

    Args:
        base: a layer class named ``<Family>`` or ``_<Family>Nd``.
        doc: the docstring template.
        **attributes: further class attributes of every variant (e.g. ``__init__``).

    Returns:
        The classes for 1, 2, 3 and 4 spatial axes.
    """
    family = base.__name__.lstrip("_").removesuffix("Nd")
    return tuple(type(base)(f"{family}{ndim}d", (base,), {
        **attributes, "_ndim": ndim, "__doc__": doc.format(ndim=ndim), "__module__": base.__module__,
        "__qualname__": f"{family}{ndim}d"}) for ndim in range(1, 5))


# --------------------------------------------------------------------------- benchmark records


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _BenchmarkRecord:
    """Fills ``input.benchmark_record[name]`` like spconv's benchmark mode."""

    def __init__(self, entry: dict, device: torch.device) -> None:
        self.entry = entry
        self.device = device
        _synchronize(device)
        self.start = time.perf_counter()

    def indices_done(self) -> None:
        _synchronize(self.device)
        now = time.perf_counter()
        self.entry["indice_gen_time"].append(now - self.start)
        self.start = now

    def done(self, num_points: int, num_out_points: int) -> None:
        _synchronize(self.device)
        self.entry["time"].append(time.perf_counter() - self.start)
        self.entry["num_points"].append(int(num_points))
        self.entry["num_out_points"].append(int(num_out_points))


@torch.compiler.disable
def start_benchmark(module: SparseModule, input: SparseConvTensor, kind: str,
                    params: Callable[[], dict]) -> _BenchmarkRecord:
    """Starts timing one layer call in benchmark mode (``SparseConvTensor(..., benchmark=True)``)."""
    name = module.name
    if name is None:
        raise ValueError(
            "benchmark mode needs named sparse modules: pass name=... to the layers (or give them "
            "names with assign_name_for_sparse_modules and set .name)"
        )
    if name not in input.benchmark_record:
        input.benchmark_record[name] = {"type": kind, "indice_gen_time": [], "time": [], "num_points": [],
                                        "num_out_points": [], "params": params()}
    return _BenchmarkRecord(input.benchmark_record[name], input.features.device)


# --------------------------------------------------------------------------- the eager forward


def check_same_dtype(layer: str, features: torch.Tensor, weight: torch.Tensor,
                     bias: Optional[torch.Tensor] = None) -> None:
    """Raises a TypeError naming both dtypes unless features, weight and bias share one (as torch's own
    layers do; call it after autocast's casts, which leave float64 as it is).

    The core promotes mixed float dtypes (its documented rule); a torch layer does not.
    """
    mixed = {name: tensor.dtype for name, tensor in (("weight", weight), ("bias", bias))
             if tensor is not None and tensor.dtype != features.dtype}
    if mixed:
        listing = ", ".join(f"its {name} is {dtype}" for name, dtype in mixed.items())
        raise TypeError(
            f"{layer}: the input features are {features.dtype} but {listing}; a layer computes in one dtype "
            f"(as torch's own layers do): convert the layer (layer.to({features.dtype})) or the input "
            f"(x.replace_feature(x.features.to({next(iter(mixed.values()))}))), or run float32 under "
            "torch.autocast for a lower precision"
        )


def layer_forward(module: Any, input: SparseConvTensor, kind: str, indice_key: Optional[str],
                  feature_pass: Callable[[IndiceData], torch.Tensor], in_channels: Optional[int] = None,
                  weight: Optional[torch.Tensor] = None) -> SparseConvTensor:
    """One eager call of a sparse conv or pool layer, around its feature pass.

    Args:
        module: the layer; reads ``ndim``, ``_geometry`` (a `sparsecore.ConvGeometry`),
            ``algo``, ``name`` and ``_benchmark_params``.
        input: the layer's input.
        kind: the layer type in benchmark records ("SparseConvolution", "SparseMaxPool", ...).
        indice_key: the key the layer reads and saves (None: neither).
        feature_pass: ``IndiceData -> [N_out, C_out]`` output features.
        in_channels: the channels the input must have (None: any).
        weight: a parameter that must be on the input's device.

    Returns:
        The output tensor on the rulebook's output sites, with the input's
        ``indice_dict`` plus the layer's rulebook under ``indice_key``.

    Raises:
        TypeError, ValueError: for an input that is not a valid `SparseConvTensor` of
            the layer's dimension and channels, tensors on several devices, or an
            ``indice_key`` whose saved rulebook does not fit.
    """
    layer = type(module).__name__
    check_input(layer, input, in_channels, module.ndim)
    check_same_device(layer, features=input.features, indices=input.indices, weight=weight)
    record = start_benchmark(module, input, kind, module._benchmark_params) if input.benchmark else None
    data, indice_dict = layer_indice_data(layer, input, module._geometry, indice_key, module.algo)
    if record is not None:
        record.indices_done()
    out_features = feature_pass(data)
    if record is not None:
        record.done(input.features.shape[0], out_features.shape[0])
    buffer = getattr(module, MAX_NUM_VOXELS_DURING_TRAINING, None)
    if buffer is not None:
        with torch.no_grad():
            buffer.clamp_(min=data.num_output)
    return SparseConvTensor._derived(input, out_features, data.out_indices, data.out_spatial_shape, indice_dict,
                                     core_indices=data.out_core_indices)


def geometry_repr(kernel_size: Sequence[int], stride: Sequence[int], padding: Sequence[int],
                  dilation: Sequence[int]) -> str:
    """The start of a layer's ``extra_repr``: kernel and stride, then padding and dilation where not default."""
    text = f"kernel_size={kernel_size}, stride={stride}"
    if any(padding):
        text += f", padding={padding}"
    if any(d != 1 for d in dilation):
        text += f", dilation={dilation}"
    return text
