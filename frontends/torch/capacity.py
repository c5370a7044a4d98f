"""Capacity mode in `sparsecore.torch`: what reduces over rows must leave the padding out.

A `SparseConvTensor` made by ``SparseConvTensor.capacity_mode(...)`` (`capacity_tensor`,
`sparsecore.capacity`) has
padding rows after its true ones (batch index -1): the layers compute nothing
from them, but a module that reduces over rows would count them. Here:

- `masked_batch_norm`: a training-mode ``BatchNorm1d`` (``nn.BatchNorm1d``,
  `SparseBatchNorm`) over the true rows only: batch statistics and the running
  statistics' update from the true rows, the padding rows' outputs set to 0
  (so their gradient is 0); in eval mode it is the module itself (row-wise).
  Device ops only (a mask, sums), no read back: it captures in a CUDA graph.
  Its sums differ from torch's own kernel in the last bits: the true rows equal
  exact mode's to float rounding, not bitwise.
- `masked_features`: the features with the padding rows zeroed (for a loss or a
  reduction written by the user);
- `padded_global_pool`: `SparseGlobalMaxPool` / `SparseGlobalAvgPool` over the
  true rows (the padding goes to a spare batch element that is cut off), with
  no read back (the exact pools group rows by batch on the host).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sparsecore.capacity import as_capacity_policy, check_capacity

__all__ = ["capacity_tensor", "padded_global_pool", "masked_batch_norm", "masked_features", "has_padding", "device_count", "valid_rows",
           "check_tensor_capacity", "dense_of_padded"]


def has_padding(x: Any) -> bool:
    """Whether ``x`` is a capacity-mode `SparseConvTensor` (its rows may end in padding)."""
    return getattr(x, "capacity", None) is not None


def masked_features(x: Any) -> torch.Tensor:
    """``x.features`` with capacity mode's padding rows set to 0 (no read back)."""
    return x.features * x.valid_rows().unsqueeze(1).to(x.features.dtype)


def masked_batch_norm(module: nn.modules.batchnorm._BatchNorm, features: torch.Tensor,
                      valid: torch.Tensor) -> torch.Tensor:
    """``module`` (a 1-D batch norm) on ``features [N, C]`` whose rows ``valid`` (bool ``[N]``) are the true ones.

    Training mode (or no running statistics): normalised by the true rows' mean and biased variance; the
    running mean and (unbiased) variance updated from them as ``BatchNorm1d`` does, ``num_batches_tracked``
    counted. Eval mode: the module as it is (row-wise). Padding rows come out as 0.
    """
    use_batch = module.training or module.running_mean is None
    if not use_batch:
        out = module(features)
        return out * valid.unsqueeze(1).to(out.dtype)
    mask = valid.unsqueeze(1).to(features.dtype)
    count = mask.sum()
    safe = count.clamp(min=1)
    mean = (features * mask).sum(0) / safe
    centred = (features - mean) * mask
    variance = (centred * centred).sum(0) / safe
    out = centred * torch.rsqrt(variance + module.eps)
    if module.affine:
        out = out * module.weight + module.bias
    out = out * mask
    if module.training and module.track_running_stats and module.running_mean is not None:
        with torch.no_grad():
            if module.num_batches_tracked is not None:
                module.num_batches_tracked.add_(1)
            momentum = module.momentum
            if momentum is None:  # a cumulative average, as BatchNorm1d's
                momentum = 1.0 / float(module.num_batches_tracked)
            unbiased = variance * (count / (count - 1).clamp(min=1))
            module.running_mean.mul_(1 - momentum).add_(mean.detach().to(module.running_mean.dtype), alpha=momentum)
            module.running_var.mul_(1 - momentum).add_(unbiased.detach().to(module.running_var.dtype),
                                                       alpha=momentum)
    return out


def device_count(x: Any) -> torch.Tensor:
    """The true rows, an int32 ``[1]`` tensor on the tensor's device (no read back): in capacity mode the rows
    before the padding, in exact mode all of them."""
    return (x.indices[:, 0] >= 0).sum(dtype=torch.int32).reshape(1)


def valid_rows(x: Any) -> torch.Tensor:
    """bool ``[N]``: True for the true rows, False for capacity mode's padding (no read back)."""
    return x.indices[:, 0] >= 0


def check_tensor_capacity(x: Any) -> dict:
    """Reads the counts and site checks of the capacity builds in ``x``'s rulebooks (one read back), teaches
    them to its policy, and raises `sparsecore.CapacityOverflowError` for a layer that overflowed (or the
    site checks' ValueError). Returns ``{layer: rows needed}``; empty in exact mode (`sparsecore.check_capacity`)."""
    rulebooks = [getattr(data, "rulebook", None) for data in x.indice_dict.values()]
    cache = getattr(x.indice_dict, "geometry_cache", None)
    if cache is not None:
        rulebooks += list(cache.canonical.values())
    return check_capacity([rulebook for rulebook in rulebooks if rulebook is not None], x.capacity)


def dense_of_padded(x: Any, out: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``out`` (zeros ``[B, *spatial, C]``) with ``x``'s true rows written at ``index`` (long ``[N, 1 + D]``); the
    padding rows add zeros at site 0 (no read back)."""
    valid = x.valid_rows()
    index = index * valid.unsqueeze(1)
    values = x.features * valid.unsqueeze(1).to(x.features.dtype)
    return out.index_put(tuple(index.unbind(1)), values, accumulate=True)


def capacity_tensor(cls: type, features: torch.Tensor, indices: torch.Tensor, spatial_shape: Any, batch_size: int,
                    capacity: Any = True, indice_dict: Any = None) -> Any:
    """``SparseConvTensor.capacity_mode(features, indices, spatial_shape, batch_size, capacity=True)``: a tensor
    in capacity mode (`sparsecore.capacity`, docs/capture.md).

    Every layer on it and on the tensors derived from it builds at a capacity with no read back; rows whose
    batch index is -1 are padding (after the true rows: a static input buffer's tail); the sites are checked
    by the first layer's build and read by ``check_capacity``, not here (the constructor's checks read back).

    Args:
        features: ``[N, C]`` float tensor.
        indices: ``[N, 1 + D]`` integer tensor (int32 kept, others converted when they fit).
        spatial_shape: ``D`` ints.
        batch_size: batch elements.
        capacity: the policy: True or ``"learned"`` (a new `sparsecore.LearnedCapacity`; pass one policy
            object to every step so that it learns), ``"bound"``, rows, or a policy.
        indice_dict: rulebooks by ``indice_key`` to start from.

    Raises:
        ValueError / TypeError: malformed shapes or dtypes (as the constructor), or ``capacity`` None.
    """
    from .tensor_checks import as_shape_list, validate
    from ._convert import as_int32_indices

    policy = as_capacity_policy(capacity)
    if policy is None:
        raise ValueError("capacity_mode needs a capacity policy (True, 'learned', 'bound', rows or a policy), got "
                         "None; for exact mode use the SparseConvTensor constructor")
    shape = as_shape_list(spatial_shape)
    indices = as_int32_indices(indices)
    validate(features, indices, shape, batch_size)
    out = cls.__new__(cls)
    out._init(features, indices, shape, int(batch_size), None, None, indice_dict, False, trusted=True)
    out.capacity, out._sites_unchecked = policy, True
    return out


def padded_global_pool(features: torch.Tensor, indices: torch.Tensor, batch_size: int, kind: str) -> torch.Tensor:
    """``[B, C]`` channel-wise max (``kind="max"``) or mean (``"avg"``) over each batch element's true rows.

    Padding rows (batch index -1) are sent to a spare element ``B`` that is cut off; an element without
    rows gives 0. Device ops only (``index_add`` / ``scatter_reduce``), differentiable by torch.
    """
    batch = indices[:, 0].long()
    batch = torch.where(batch >= 0, batch, torch.full_like(batch, batch_size))
    channels = features.shape[1]
    if kind == "avg":
        sums = features.new_zeros(batch_size + 1, channels).index_add(0, batch, features)
        counts = features.new_zeros(batch_size + 1).index_add(0, batch, torch.ones_like(features[:, 0]))
        return (sums / counts.clamp(min=1).unsqueeze(1))[:batch_size]
    lowest = torch.finfo(features.dtype).min
    out = features.new_full((batch_size + 1, channels), lowest).scatter_reduce(
        0, batch.unsqueeze(1).expand(-1, channels), features, "amax", include_self=True)[:batch_size]
    return torch.where(out == lowest, torch.zeros_like(out), out)
