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
import warnings
from typing import Any, Optional

import torch
import torch.nn.functional as F

from .checkpoint_checks import check_saved_layout, check_saved_values

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


def _saved_weight(module: Any, state_dict: dict, key: str, layout: str) -> torch.Tensor:
    """The checkpoint's weight under ``key``, checked against the shape ``layout`` gives this layer."""
    weight = state_dict[key]
    variable = f"SPCONV_SAVED_WEIGHT_LAYOUT={layout}"
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"state_dict[{key!r}] is a {type(weight).__module__}.{type(weight).__name__}, not a "
                        f"torch.Tensor; {variable} reorders tensors: convert it first (torch.from_numpy)")
    expected = tuple(module.weight.shape)  # [out, *kernel, in // groups]
    kernel = expected[1:-1]
    saved = (*kernel, expected[0], expected[-1]) if layout == "RSKC" else (*kernel, expected[-1], expected[0])
    order = "[*kernel, out, in]" if layout == "RSKC" else "[*kernel, in, out]"
    shape = tuple(weight.shape)
    if shape == saved:
        if shape == expected:
            warnings.warn(
                f"state_dict[{key!r}] has shape {list(shape)}, which is both the {layout} layout {order} that "
                f"{variable} asks for and sparsecore's (and spconv's) own [out, *kernel, in]; it is read as "
                f"{layout}. If this checkpoint was saved without {variable}, unset the variable to load it",
                UserWarning, stacklevel=4)
        return weight
    if shape == expected:
        raise ValueError(f"state_dict[{key!r}] has shape {list(shape)}: the layout [out, *kernel, in] "
                         f"(sparsecore's and spconv's default, KRSC), not the {layout} layout {order} = "
                         f"{list(saved)} that {variable} asks for; unset the variable (or set KRSC) to load "
                         "this checkpoint")
    raise ValueError(f"state_dict[{key!r}] has shape {list(shape)} ({weight.dim()}-D), but {variable} reads this "
                     f"layer's weight as {order} = {list(saved)} ({len(saved)}-D): the checkpoint does not fit "
                     f"{type(module).__name__}({module.in_channels}, {module.out_channels}, kernel_size="
                     f"{list(kernel)})")


def weight_layout_hook(module: Any, state_dict: dict, prefix: str, *args: Any) -> None:
    """A ``load_state_dict`` pre-hook: fills a missing voxel-count buffer and applies
    ``SPCONV_SAVED_WEIGHT_LAYOUT`` (``KRSC``, the default, ``RSKC`` or ``RSCK``), as spconv.

    Under ``RSKC`` / ``RSCK`` the saved weight must have the shape that layout gives the layer;
    a shape that is also the default layout's (the two coincide, e.g. 3 channels in and out with
    a 3x3x3 kernel under ``RSKC``) loads with a warning naming the key, since the file cannot say
    which it is.

    It also runs `checkpoint_checks` (NaN, infinity, int or bool values for float parameters;
    torch's dense layout or a transposed 1x1 weight), naming the key.

    Raises:
        ValueError: for another layout name, or a weight (named by its key) whose shape is not the
            layout's (the message says when it is the default layout's instead), non-finite values,
            or a layout `checkpoint_checks.check_saved_layout` recognises.
        TypeError: a weight that is not a torch tensor, or an int / bool tensor for a float parameter
            (named by its key).
    """
    name = prefix + MAX_NUM_VOXELS_DURING_TRAINING
    if hasattr(module, MAX_NUM_VOXELS_DURING_TRAINING) and name not in state_dict:
        state_dict[name] = torch.zeros(1, dtype=torch.int32)
    check_saved_values(module, state_dict, prefix)  # NaN, inf, int or bool for float parameters
    layout = os.environ.get("SPCONV_SAVED_WEIGHT_LAYOUT", "")
    key = prefix + "weight"
    if not layout or layout == "KRSC" or key not in state_dict:
        check_saved_layout(module, state_dict, prefix)  # torch's dense layout, a transposed 1x1 weight
        return
    if layout not in ("RSKC", "RSCK"):
        raise ValueError(f"SPCONV_SAVED_WEIGHT_LAYOUT must be KRSC, RSKC or RSCK, got {layout!r}")
    ndim = module.ndim
    weight = _saved_weight(module, state_dict, key, layout)
    if layout == "RSKC":  # [*k, out, in] -> [out, *k, in]
        state_dict[key] = weight.permute(ndim, *range(ndim), ndim + 1).contiguous()
    else:  # RSCK: [*k, in, out] -> [out, *k, in]
        state_dict[key] = weight.permute(ndim + 1, *range(ndim), ndim).contiguous()
