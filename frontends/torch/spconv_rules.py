"""spconv 2.x's layer conventions, shared by the eager, export and ONNX paths of a sparse conv.

- the 1x1 reading: spconv computes a layer with a kernel of volume 1 (subm,
  or stride 1) as ``features @ weight.view(in, out)`` (its issue #450), and so
  does sparsecore.torch (`spconv_1x1_weight`, `effective_weight`);
- the 1x1 key rule: that shortcut neither reads nor saves its
  ``indice_key`` (`layer_rulebook_key`);
- fused activations named as spconv names them (`activation_name`,
  `apply_activation`);
- saved weight layouts (``SPCONV_SAVED_WEIGHT_LAYOUT``, `weight_layout_hook`).

The functions take the layer (a ``SparseConvolution`` or a layer with the same
attributes) and read its attributes; they import no layer class.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import torch
import torch.nn.functional as F

__all__ = [
    "MAX_NUM_VOXELS_DURING_TRAINING",
    "spconv_1x1_weight",
    "effective_weight",
    "layer_rulebook_key",
    "activation_name",
    "apply_activation",
    "weight_layout_hook",
]

#: The buffer name of ``record_voxel_count`` (spconv's state_dict key).
MAX_NUM_VOXELS_DURING_TRAINING = "max_num_voxels_during_training"

_ACTIVATIONS = {"none": None, "none_": None, "relu": "relu", "sigmoid": "sigmoid", "leakyrelu": "leaky_relu",
                "leaky_relu": "leaky_relu"}


def spconv_1x1_weight(weight: torch.Tensor, in_channels: int, out_channels: int) -> torch.Tensor:
    """The core-layout weight that computes spconv's 1x1 product with the stored tensor.

    spconv 2.x computes a 1x1 layer as ``features @ weight.view(in, out)``; the
    core computes ``features @ weight[:, 0, ..., 0, :].T``. This returns
    ``weight.reshape(in, out).T`` laid out as ``[out, 1, ..., 1, in]``, a
    differentiable function of ``weight``, so gradients reach the stored
    parameter in spconv's reading too.

    Args:
        weight: ``[out, 1, ..., 1, in]``, as stored in the module and its state_dict.
        in_channels, out_channels: the layer's channels.

    Returns:
        A tensor of ``weight``'s shape, dtype and device.
    """
    return weight.reshape(in_channels, out_channels).t().reshape(weight.shape)


def effective_weight(module: Any) -> torch.Tensor:
    """The ``[out, *kernel, in // groups]`` weight the layer computes with (spconv's 1x1 reading applied)."""
    if getattr(module, "reads_weight_as_spconv_1x1", False):
        return spconv_1x1_weight(module.weight, module.in_channels, module.out_channels)
    return module.weight


def layer_rulebook_key(module: Any) -> Optional[str]:
    """The key the layer reads and saves: a SubM 1x1 layer ignores its ``indice_key`` (spconv's shortcut).

    spconv models give a SubM 1x1 projection the key of a 3x3 layer; a regular
    1x1 layer keeps its key (an inverse conv may need it).
    """
    if getattr(module, "conv1x1", False) and module.subm:
        return None
    return module.indice_key


def activation_name(act_type: Any) -> Optional[str]:
    """``None`` / "relu" / "sigmoid" / "leaky_relu" from a string or an enum like spconv's ``tv.gemm.Activation``.

    Raises:
        ValueError: for any other activation.
    """
    if act_type is None:
        return None
    name = getattr(act_type, "name", act_type)
    key = str(name).lower()
    if key not in _ACTIVATIONS:
        raise ValueError(f"act_type must be None, 'relu', 'sigmoid' or 'leaky_relu', got {act_type!r}")
    return _ACTIVATIONS[key]


def apply_activation(features: torch.Tensor, activation: Optional[str], alpha: float = 0.0) -> torch.Tensor:
    """``features`` through the activation `activation_name` returned (``alpha``: leaky ReLU's slope)."""
    if activation == "relu":
        return F.relu(features)
    if activation == "sigmoid":
        return torch.sigmoid(features)
    if activation == "leaky_relu":
        return F.leaky_relu(features, alpha)
    return features


def weight_layout_hook(module: Any, state_dict: dict, prefix: str, *args: Any) -> None:
    """A ``load_state_dict`` pre-hook: fills a missing voxel-count buffer and applies
    ``SPCONV_SAVED_WEIGHT_LAYOUT`` (``KRSC``, the default, ``RSKC`` or ``RSCK``), as spconv.

    Raises:
        ValueError: for another layout name.
    """
    name = prefix + MAX_NUM_VOXELS_DURING_TRAINING
    if hasattr(module, MAX_NUM_VOXELS_DURING_TRAINING) and name not in state_dict:
        state_dict[name] = torch.zeros(1, dtype=torch.int32)
    layout = os.environ.get("SPCONV_SAVED_WEIGHT_LAYOUT", "")
    key = prefix + "weight"
    if not layout or layout == "KRSC" or key not in state_dict:
        return
    ndim = module.ndim
    weight = state_dict[key]
    if layout == "RSKC":  # [*k, out, in] -> [out, *k, in]
        state_dict[key] = weight.permute(ndim, *range(ndim), ndim + 1).contiguous()
    elif layout == "RSCK":  # [*k, in, out] -> [out, *k, in]
        state_dict[key] = weight.permute(ndim + 1, *range(ndim), ndim).contiguous()
    else:
        raise ValueError(f"SPCONV_SAVED_WEIGHT_LAYOUT must be KRSC, RSKC or RSCK, got {layout!r}")
