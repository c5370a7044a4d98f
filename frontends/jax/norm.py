"""Batch normalisation of sparse features, with the running statistics as explicit state.

Functional, like flax's and haiku's batch statistics handled by hand: the
learnt scale and shift are parameters, the running mean and variance are a
separate state pytree that `batch_norm` takes and returns::

    params, state = sj.init_batch_norm(32)
    y, state = sj.batch_norm(params, state, x, train=True)    # batch statistics, state updated
    y, _ = sj.batch_norm(params, state, x, train=False)       # running statistics, state unchanged

Only the true rows of a `SparseTensor` (``x.mask``) enter the statistics, so the
padding rows of a capacity bucket never pull the mean and variance towards
zero, and the padding rows of the output are zero, as after every sparsecore
op. The numerics follow ``torch.nn.BatchNorm1d`` (so a checkpoint of
``sparsecore.torch`` or spconv loads with its names: ``weight``, ``bias``,
``running_mean``, ``running_var``, ``num_batches_tracked``): training
normalises with the biased variance of the batch and updates
``running = (1 - momentum) * running + momentum * batch`` with the unbiased
variance; evaluation normalises with the running statistics.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from .primitives import compute_dtype
from .tensor import SparseTensor

__all__ = ["init_batch_norm", "batch_norm"]


def init_batch_norm(num_features: int, *, dtype: Any = jnp.float32) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(params, state)`` of a batch norm over ``num_features`` channels, torch's initial values.

    Returns:
        params: ``{"weight": ones [C], "bias": zeros [C]}`` (the learnt scale and shift).
        state: ``{"running_mean": zeros [C], "running_var": ones [C]}``.
    """
    if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
        raise ValueError(f"num_features must be a positive int (the channels), got {num_features!r}")
    # made on the host and transferred: jnp.ones / jnp.zeros compile once per shape
    ones, zeros = np.ones((num_features,), np.dtype(dtype)), np.zeros((num_features,), np.dtype(dtype))
    params = {"weight": jax.device_put(ones), "bias": jax.device_put(zeros)}
    state = {"running_mean": jax.device_put(zeros), "running_var": jax.device_put(ones)}
    return params, state


def _vector(tree: Mapping[str, Any] | None, key: str, what: str, channels: int) -> Any:
    if not isinstance(tree, Mapping) or key not in tree:
        seen = sorted(tree) if isinstance(tree, Mapping) else type(tree).__name__
        raise ValueError(
            f"batch_norm: {what} must be a mapping with {key!r} (as made by sparsecore.jax.init_batch_norm or "
            f"loaded from a BatchNorm1d state_dict), got {seen}"
        )
    value = tree[key]
    shape = tuple(getattr(value, "shape", ()))
    if shape != (channels,):
        raise ValueError(f"batch_norm: {what}[{key!r}] must have shape [{channels}] (the input's channels), "
                         f"got {shape}")
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(f"batch_norm: {what}[{key!r}] must be a float array, got dtype {value.dtype}")
    return value


def _check_number(value: Any, name: str, low: float, high: float, *, open_low: bool) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    inside = (number > low if open_low else number >= low) and number <= high
    if isinstance(value, bool) or not inside:
        bound = f"({low}, {high}]" if open_low else f"[{low}, {high}]"
        raise ValueError(f"batch_norm: {name} must be a number in {bound}, got {value!r}")
    return number


def batch_norm(params: Mapping[str, Any] | None, state: Mapping[str, Any], x: SparseTensor, *, train: bool,
               momentum: float = 0.1, eps: float = 1e-5,
               axis_name: Any = None) -> tuple[SparseTensor, dict[str, Any]]:
    """Per-channel batch normalisation over the true rows of ``x``; works under ``jit`` and ``grad``.

    Args:
        params: ``{"weight": [C], "bias": [C]}`` (scale and shift), or None for no affine step.
        state: ``{"running_mean": [C], "running_var": [C]}``; other entries are carried over
            (``num_batches_tracked``, when present, counts the training calls, as in torch).
        x: the input; its features ``[capacity, C]`` (rows past ``x.num_active`` are ignored).
        train: True: normalise with the statistics of the true rows of this batch (biased
            variance; gradients flow through them) and return the updated state; False:
            normalise with the running statistics and return ``state`` unchanged. A Python bool.
        momentum: weight of the batch in the running update, in ``[0, 1]`` (torch's convention).
        eps: added to the variance, positive.
        axis_name: in training, the named axis (``shard_map`` / ``pmap`` / ``vmap``) to share the
            statistics over: the mean and variance of the true rows of every device (sync batch norm).

    Returns:
        ``(y, new_state)``: ``y`` on ``x``'s sites with features ``[capacity, C]`` in ``x``'s dtype,
        padding rows zero; ``new_state`` the running statistics after this batch (unchanged in
        evaluation, and in training when the batch has no true rows). The running update uses
        the unbiased variance ``sum / (n - 1)`` (``sum / n`` when ``n = 1``) and is not differentiated.

    Raises:
        TypeError: ``x`` is not a `SparseTensor`, ``train`` not a bool, or a float array is not float.
        ValueError: a parameter or state entry is missing or has the wrong shape, or ``momentum`` /
            ``eps`` is out of range.
    """
    if not isinstance(x, SparseTensor):
        raise TypeError(f"batch_norm: x must be a sparsecore.jax.SparseTensor, got {type(x).__name__}")
    if not isinstance(train, bool):
        raise TypeError(f"batch_norm: train must be a Python bool (True: batch statistics, False: running "
                        f"statistics), got {train!r}; pass it as a static argument under jit")
    momentum = _check_number(momentum, "momentum", 0.0, 1.0, open_low=False)
    eps = _check_number(eps, "eps", 0.0, float("inf"), open_low=True)
    channels = x.num_channels
    running_mean = _vector(state, "running_mean", "state", channels)
    running_var = _vector(state, "running_var", "state", channels)
    weight = bias = None
    if params is not None:
        weight = _vector(params, "weight", "params", channels)
        bias = _vector(params, "bias", "params", channels)

    dtype = compute_dtype(x.features.dtype)
    mask = x.mask[:, None]
    features = jnp.where(mask, x.features.astype(dtype), 0)
    new_state = dict(state)
    if train:
        count = x.num_active.astype(dtype)
        total = jnp.sum(features, axis=0)
        if axis_name is not None:
            count, total = jax.lax.psum(count, axis_name), jax.lax.psum(total, axis_name)
        mean = total / jnp.maximum(count, 1)
        squares = jnp.sum(jnp.where(mask, jnp.square(features - mean), 0), axis=0)  # two passes: no cancellation
        if axis_name is not None:
            squares = jax.lax.psum(squares, axis_name)
        var = squares / jnp.maximum(count, 1)
        unbiased = jax.lax.stop_gradient(squares / jnp.maximum(count - 1, 1))
        seen = count > 0
        batch_mean = jax.lax.stop_gradient(mean)
        new_state["running_mean"] = jnp.where(
            seen, (1 - momentum) * running_mean + momentum * batch_mean.astype(running_mean.dtype), running_mean)
        new_state["running_var"] = jnp.where(
            seen, (1 - momentum) * running_var + momentum * unbiased.astype(running_var.dtype), running_var)
        if "num_batches_tracked" in state:
            new_state["num_batches_tracked"] = state["num_batches_tracked"] + 1
    else:
        mean, var = running_mean.astype(dtype), running_var.astype(dtype)
    out = (features - mean) * jax.lax.rsqrt(var + eps)
    if weight is not None:
        out = out * weight.astype(dtype) + bias.astype(dtype)
    return x.replace(jnp.where(mask, out, 0).astype(x.features.dtype)), new_state
