"""A sparse layer's eager forward, owned here from the input checks to the output tensor.

`SparseConvolution.forward` is `conv_forward` and the windowed pools' forward
is `pool_forward`: one function each, in this module, runs the whole call:

1. the input checks (`check_input`: a valid `SparseConvTensor` of the layer's
   dimension and channels, on one device with the weight);
2. the rulebook (`layer_indice_data`): found or built by the core's one
   geometry path, `sparsecore.layer_geometry.find_layer_rulebook` (reuse by
   sites and geometry, spconv's ``indice_key`` rules, inverse convs), wrapped
   as an `IndiceData` whose neighbour tensors the ops carry, and the output's
   ``indice_dict`` (a copy of the input's with this layer's key added: spconv's
   copy-on-write). It runs eagerly, outside ``torch.compile`` graphs
   (``torch.compiler.disable``: a graph break before each layer that looks up a
   rulebook; the feature pass after it is captured);
3. the feature pass: one custom op of `sparsecore.torch.ops` (`DECLARED`),
   called with the `IndiceData`'s neighbour tensors;
4. the output tensor on the rulebook's output sites (and, for a conv, its
   fused tail: ``add_input``, then the activation).

The rulebook and the feature pass share one device and stream context
(`_convert.core_context`). A ``torch.export`` trace takes `sparsecore.torch.exportable`'s
path instead, and an input made with ``benchmark=True`` hands the same steps
to `benchmark_mode` (spconv's per-layer records): neither sits in the plain
forward. `SparseModule` (the marker base), `nd_variants` (the public 1-4D
classes) and `geometry_repr` are shared by every layer here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, TypeVar

import torch
from torch import nn

import sparsecore as sc
from sparsecore.layer_geometry import InputSites, find_layer_rulebook, sites_identity

from ._convert import check_same_device, core_context
from .benchmark_mode import recorded_forward, start_benchmark
from .exportable import export_forward, export_pool_forward
from .fx import FxLeafModule
from .indice_data import IndiceData, input_cache, layer_data, output_indice_dict
from .ops import DECLARED
from .spconv_rules import MAX_NUM_VOXELS_DURING_TRAINING, apply_activation, effective_weight, layer_rulebook_key
from .tensor import SparseConvTensor

__all__ = ["SparseModule", "nd_variants", "geometry_repr", "check_input", "check_same_dtype", "layer_indice_data", "autocast_inputs",
           "LayerSteps", "conv_forward", "convolve", "conv_epilogue", "pool_forward", "start_benchmark"]


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


def geometry_repr(kernel_size: Sequence[int], stride: Sequence[int], padding: Sequence[int],
                  dilation: Sequence[int]) -> str:
    """The start of a layer's ``extra_repr``: kernel and stride, then padding and dilation where not default."""
    text = f"kernel_size={kernel_size}, stride={stride}"
    if any(padding):
        text += f", padding={padding}"
    if any(d != 1 for d in dilation):
        text += f", dilation={dilation}"
    return text


# --------------------------------------------------------------------------- 1. the input checks


def check_input(layer: str, x: Any, in_channels: Optional[int] = None, ndim: Optional[int] = None) -> None:
    """Raises a clear error for a non-SparseConvTensor input, a tensor that fails its checks
    (shapes, rows, range, duplicate sites), or a channel / dimension mismatch."""
    if not isinstance(x, SparseConvTensor):
        raise TypeError(f"{layer} expects a sparsecore.torch.SparseConvTensor, got {type(x).__name__}")
    x._ensure_valid()  # free for a tensor known valid; a full check after reassigned indices / unpickling
    features, shape = x._features, x._spatial_shape
    if ndim is not None and len(shape) != ndim:
        raise ValueError(
            f"{layer} is a {ndim}-D layer but the input has {len(shape)} spatial axes "
            f"(spatial_shape {shape})"
        )
    if features.ndim != 2:
        raise ValueError(f"{layer}: features must be 2-D [N, C], got shape {tuple(features.shape)}")
    if features.dtype in (torch.qint8, torch.quint8, torch.int8):
        raise TypeError(
            f"{layer} is a float layer but its input features are {features.dtype} (int8): dequantize them "
            "first (x.dequantize()), or convert this layer too (sparsecore.torch.quantization)")
    if in_channels is not None and features.shape[1] != in_channels:
        raise ValueError(
            f"{layer} has in_channels={in_channels} but the input features have "
            f"{features.shape[1]} channels (features shape {tuple(features.shape)}); check the "
            "previous layer's out_channels or this layer's in_channels"
        )


# --------------------------------------------------------------------------- 2. the rulebook


@torch.compiler.disable
def layer_indice_data(layer: str, x: SparseConvTensor, geometry: sc.ConvGeometry, indice_key: Optional[str],
                      algo: Any = None, *, neighbour_tensors: bool = True) -> tuple[IndiceData, dict]:
    """The rulebook of a layer with ``geometry`` on ``x`` and the output's ``indice_dict``.

    Args:
        layer: the layer's name, for messages.
        x: the input tensor (checked by `check_input`).
        geometry: the layer's geometry (kind ``"inverse"`` for an inverse conv).
        indice_key: the layer's key, or None.
        algo: recorded on a new `IndiceData` (spconv compatibility; unused).
        neighbour_tensors: make the neighbour tensors the float ops carry (here, eagerly,
            outside compiled graphs); the int8 layers, which hand the core the rulebook
            itself, pass False.

    Returns:
        ``(data, indice_dict)``: the rulebook's view and the dict to hand to the output.

    Raises:
        ValueError: an inverse conv without a matching key, a non-submanifold layer
            whose key exists, or a saved rulebook that does not fit.
        TypeError: an ``indice_dict`` entry under the key that is not an `IndiceData`.
    """
    core_indices = x.core_indices()
    indices, indice_dict = x._indices, x.indice_dict
    sites = InputSites(sites_identity(core_indices), core_indices, tuple(x._spatial_shape), x._batch_size,
                       checked=x._trusted and not x._sites_unchecked)
    with core_context(indices.device):
        found = find_layer_rulebook(input_cache(indice_dict, indice_key), sites, geometry, indice_key, layer=layer,
                                    capacity=x.capacity)
        saved = indice_dict.get(indice_key) if indice_key is not None else None
        data = layer_data(found.rulebook, indices, saved, geometry.kind, algo, neighbour_tensors)
    return data, output_indice_dict(indice_dict, found.cache, indice_key, geometry.kind, data)


# --------------------------------------------------------------------------- 3. and 4.: the steps of a call


def autocast_inputs(*tensors: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
    """Casts float32 tensors to the autocast dtype when autocast is on for their device.

    The core then multiplies in that dtype's storage with float32 accumulation.
    """
    first = next(t for t in tensors if t is not None)
    device_type = first.device.type
    if not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None and t.dtype == torch.float32 else t for t in tensors)


@dataclass(frozen=True)
class LayerSteps:
    """One layer call, cut where spconv's benchmark mode reads its clock (`benchmark_mode`).

    Attributes:
        check: ``() -> device``: the input checks; returns the input's device.
        rulebook: ``() -> (data, indice_dict)``: the rulebook (`layer_indice_data`).
        features: ``(data) -> out_features``: the feature pass (one custom op).
        output: ``(data, indice_dict, out_features) -> SparseConvTensor``: the output tensor.
    """

    check: Callable[[], torch.device]
    rulebook: Callable[[], tuple[IndiceData, dict]]
    features: Callable[[IndiceData], torch.Tensor]
    output: Callable[[IndiceData, dict, torch.Tensor], SparseConvTensor]


def _run(steps: LayerSteps) -> SparseConvTensor:
    """A layer call: checks, then the rulebook and the feature pass in one device context, then the output."""
    with core_context(steps.check()):
        data, indice_dict = steps.rulebook()
        out_features = steps.features(data)
    return steps.output(data, indice_dict, out_features)


def _steps(module: Any, input: SparseConvTensor, in_channels: Optional[int], indice_key: Optional[str],
           weight: Optional[torch.Tensor], feature_pass: Any) -> LayerSteps:
    """The steps of one call of ``module`` on ``input`` (``feature_pass(features, data)``: its op)."""
    layer = type(module).__name__

    def check() -> torch.device:
        check_input(layer, input, in_channels, module.ndim)
        indices = input._indices
        check_same_device(layer, features=input._features, indices=indices, weight=weight)
        return indices.device

    def rulebook() -> tuple[IndiceData, dict]:
        return layer_indice_data(layer, input, module._geometry, indice_key, module.algo)

    def output(data: IndiceData, indice_dict: dict, out_features: torch.Tensor) -> SparseConvTensor:
        buffer = getattr(module, MAX_NUM_VOXELS_DURING_TRAINING, None)
        if buffer is not None:  # the largest output seen, when recorded
            with torch.no_grad():
                buffer.clamp_(min=out_features.shape[0])
        indices, spatial_shape, core_indices = data.output_sites()
        return SparseConvTensor._derived(input, out_features, indices, spatial_shape, indice_dict,
                                         core_indices=core_indices)

    return LayerSteps(check, rulebook, lambda data: feature_pass(input._features, data), output)


# --------------------------------------------------------------------------- the convolution


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


def _conv_steps(module: Any, input: SparseConvTensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor]) -> LayerSteps:
    def feature_pass(features: torch.Tensor, data: IndiceData) -> torch.Tensor:
        features, cast_weight, cast_bias = autocast_inputs(features, weight, bias)
        check_same_dtype(type(module).__name__, features, cast_weight, cast_bias)
        return DECLARED["conv_forward"](features, cast_weight, cast_bias, *data.op_arguments(), module.groups)

    return _steps(module, input, module.in_channels, layer_rulebook_key(module), weight, feature_pass)


def convolve(module: Any, input: SparseConvTensor, weight: torch.Tensor,
             bias: Optional[torch.Tensor]) -> SparseConvTensor:
    """``module``'s convolution of ``input`` with ``weight`` (core layout) and ``bias``, without the fused tail.

    The float layers and the quantization modules (a fake-quantized weight) share it.

    Raises:
        TypeError, ValueError: for an input that is not a valid `SparseConvTensor` of
            the layer's dimension and channels, tensors on several devices, or an
            ``indice_key`` whose saved rulebook does not fit.
    """
    return _run(_conv_steps(module, input, weight, bias))


def conv_epilogue(module: Any, out: SparseConvTensor, add_input: Optional[SparseConvTensor]) -> SparseConvTensor:
    """The fused tail of a conv (eager or exported): ``add_input``, then the activation."""
    if add_input is not None:
        out = out.replace_feature(out.features + add_input.features)
    if module._activation is not None:
        out = out.replace_feature(apply_activation(out.features, module._activation, module.act_alpha))
    return out


def conv_forward(self: Any, input: SparseConvTensor,
                 add_input: Optional[SparseConvTensor] = None) -> SparseConvTensor:
    """Convolves ``input``; ``add_input`` (same sites as the output) is added before the activation."""
    if torch.compiler.is_exporting():  # geometry as an opaque op: frontends/torch/exportable.py
        return export_forward(self, input, add_input)
    steps = _conv_steps(self, input, effective_weight(self), self.bias)
    if getattr(input, "benchmark", False):
        out = recorded_forward(self, input, "SparseConvolution", steps)
    else:
        out = _run(steps)
    return conv_epilogue(self, out, add_input)


# --------------------------------------------------------------------------- the windowed pools


def _pooled(module: Any) -> Any:
    if module._kind == "SparseMaxPool":
        return lambda features, data: DECLARED["max_pool_forward"](features, *data.op_arguments())[0]
    return lambda features, data: DECLARED["avg_pool_forward"](features, *data.op_arguments())


def pool_forward(self: Any, input: SparseConvTensor) -> SparseConvTensor:
    """Pools ``input`` over the active sites of each window (max or mean, by the layer's ``_kind``)."""
    if torch.compiler.is_exporting():  # geometry as an opaque op: frontends/torch/exportable.py
        return export_pool_forward(self, input)
    steps = _steps(self, input, None, self.indice_key, None, _pooled(self))
    if getattr(input, "benchmark", False):
        return recorded_forward(self, input, self._kind, steps)
    return _run(steps)
