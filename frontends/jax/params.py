"""Parameters as plain pytrees: init functions and checkpoint loading.

Weights use the spconv 2.x layout ``[out_channels, *kernel_size, in_channels // groups]``,
so tensors from a spconv or ``sparsecore.torch`` ``state_dict`` load unchanged.
Initialisation follows spconv's ``reset_parameters``: kaiming-uniform with
``a = sqrt(5)``, i.e. ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` with
``fan_in = in_channels // groups * prod(kernel_size)``, for the weight and the bias.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["init_conv", "uniform_from_key", "conv_weight_shape", "params_from_state_dict", "spconv_1x1_weight"]


def conv_weight_shape(in_channels: int, out_channels: int, kernel_size: int | Sequence[int], ndim: int = 3,
                      groups: int = 1) -> tuple[int, ...]:
    """``(out_channels, *kernel_size, in_channels // groups)``."""
    for name, value in (("in_channels", in_channels), ("out_channels", out_channels), ("groups", groups),
                        ("ndim", ndim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    kernel = (kernel_size,) * ndim if isinstance(kernel_size, int) else tuple(int(k) for k in kernel_size)
    if len(kernel) != ndim or min(kernel) < 1:
        raise ValueError(f"kernel_size must be a positive int or {ndim} positive ints, got {kernel_size!r}")
    if in_channels % groups or out_channels % groups:
        raise ValueError(f"groups={groups} must divide in_channels ({in_channels}) and out_channels ({out_channels})")
    return (out_channels,) + kernel + (in_channels // groups,)


def init_conv(key: Any, in_channels: int, out_channels: int, kernel_size: int | Sequence[int], *, ndim: int = 3,
              groups: int = 1, bias: bool = False, dtype: Any = jnp.float32) -> dict[str, Any]:
    """``{"weight": [out, *k, in // groups]}`` (and ``"bias": [out]`` when ``bias``), spconv's init.

    The values are drawn on the host with NumPy from a generator seeded by the
    key's bits (`uniform_from_key`): the same key gives the same weights, and no
    XLA computation is compiled per weight shape (``jax.random.uniform`` compiled
    one per shape, 1-4 s each on a CPU).

    Args:
        key: a ``jax.random`` key (raw ``uint32`` or typed).
        in_channels, out_channels, kernel_size, ndim, groups: the layer's shape.
        bias: whether to include a bias.
        dtype: parameter dtype.
    """
    shape = conv_weight_shape(in_channels, out_channels, kernel_size, ndim, groups)
    fan_in = shape[-1] * math.prod(shape[1:-1])
    bound = 1.0 / math.sqrt(fan_in)
    generator = _generator(key)
    params = {"weight": _on_device(generator.uniform(-bound, bound, shape), dtype)}
    if bias:
        params["bias"] = _on_device(generator.uniform(-bound, bound, (out_channels,)), dtype)
    return params


def uniform_from_key(key: Any, shape: Sequence[int], bound: float, dtype: Any = jnp.float32) -> Any:
    """``U(-bound, bound)`` of ``shape`` drawn with NumPy from a generator seeded by ``key``'s bits.

    Reproducible from the key, and nothing is compiled (unlike ``jax.random.uniform``, one
    XLA compile per shape).

    Args:
        key: a ``jax.random`` key (raw ``uint32`` or typed).
        shape: the array's shape.
        bound: the half-width of the interval.
        dtype: the result's dtype.

    Returns:
        A ``jnp`` array of ``shape`` and ``dtype``.
    """
    return _on_device(_generator(key).uniform(-bound, bound, tuple(shape)), dtype)


def _on_device(values: np.ndarray, dtype: Any) -> Any:
    # cast on the host and transfer: a cast on the device, or jnp.asarray (a jitted copy), compiles per shape
    return jax.device_put(values.astype(np.dtype(dtype)))


def _generator(key: Any) -> np.random.Generator:
    """A NumPy generator seeded by all the bits of one ``jax.random`` key."""
    if jnp.issubdtype(getattr(key, "dtype", np.uint32), jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    words = np.asarray(key)
    if words.dtype != np.uint32 or words.ndim != 1 or words.size < 1:
        raise ValueError(f"key must be one jax.random key (e.g. jax.random.PRNGKey(0): uint32 [2]), got "
                         f"{words.dtype} {words.shape}; split a batch of keys first")
    return np.random.default_rng([int(word) for word in words])


def _as_array(value: Any) -> Any:
    if hasattr(value, "detach"):  # a torch tensor: no torch import needed
        value = value.detach().cpu().numpy()
    return jnp.asarray(np.asarray(value))


def _is_one_by_one_weight(name: str, shape: tuple[int, ...]) -> bool:
    """A sparse conv weight ``[out, 1, ..., 1, in]`` (1 to 4 spatial axes) under a ``*.weight`` key."""
    return name.endswith("weight") and 3 <= len(shape) <= 6 and all(size == 1 for size in shape[1:-1])


def spconv_1x1_weight(weight: Any) -> Any:
    """The weight that computes spconv's 1x1 product with a stored ``[out, 1, ..., 1, in]`` tensor.

    spconv 2.x (and ``sparsecore.torch``, which follows it) computes a layer of
    kernel volume 1 as ``features @ weight.view(in, out)``, reading the stored
    bytes in another order than its ``[out, *kernel, in]`` layout says;
    ``sparsecore.jax`` computes every layer as the layout says. This returns
    ``weight.reshape(in, out).T`` laid out as ``[out, 1, ..., 1, in]``, so the JAX
    layer computes what the checkpoint computed in spconv.

    Args:
        weight: ``[out, 1, ..., 1, in]`` array (NumPy or JAX).

    Returns:
        A ``jnp`` array of the same shape and dtype.
    """
    weight = jnp.asarray(weight)
    out_channels, in_channels = int(weight.shape[0]), int(weight.shape[-1])
    return weight.reshape(in_channels, out_channels).T.reshape(weight.shape)


def params_from_state_dict(state_dict: Mapping[str, Any], *, spconv_1x1: bool = True) -> dict[str, Any]:
    """A nested dict of jnp arrays from a flat ``state_dict`` (keys split on ``"."``).

    ``{"net.0.weight": t}`` becomes ``{"net": {"0": {"weight": array}}}``; torch
    tensors and NumPy arrays are accepted. Weights keep their layout, except the
    weights of kernel volume 1 (``[out, 1, ..., 1, in]`` under a ``*.weight`` key):
    spconv and ``sparsecore.torch`` read those as ``view(in, out)``, so with
    ``spconv_1x1=True`` (the default) they are rewritten by `spconv_1x1_weight`
    and the JAX layers compute what the checkpoint computed. Pass
    ``spconv_1x1=False`` for a dict whose 1x1 weights already follow the layout
    (e.g. one saved from JAX parameters).
    """
    tree: dict[str, Any] = {}
    for name, value in state_dict.items():
        node = tree
        parts = str(name).split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"state_dict key {name!r} clashes with a tensor at {part!r}")
        array = _as_array(value)
        if spconv_1x1 and _is_one_by_one_weight(str(name), tuple(array.shape)):
            array = spconv_1x1_weight(array)
        node[parts[-1]] = array
    return tree
