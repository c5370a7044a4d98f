"""The ``buffer_callback`` bridge: feature passes run by the core, on XLA's buffers.

Each pass is a ``jax.custom_vjp`` whose forward and backward are
``jax.experimental.buffer_callback`` calls. Inside a callback the buffers are
viewed as core arrays without a copy (``sparsecore._dispatch.to_core_array``:
NumPy through ``np.from_dlpack`` on the CPU, CuPy on CUDA), the padded
``[K, Q]`` pair arrays are cut to their true per-offset counts into a
`sparsecore.PairMap`, the core computes on the true rows, and the result is
written into the output buffer, whose padding rows are zeroed (outputs arrive
uninitialised).

GPU: the buffers are CuPy views on XLA's stream (``ctx.stream``, made CuPy's
current stream around the call), and the passes run on the padded arrays as
they are (`padded`): no count is read back to the host, so nothing in the
callback synchronises the stream. This path has not yet run on a GPU (none was
lent while it was built; its logic runs in CI through the CPU emulation of the
kernels), so ``impl="jnp"`` stays the default on GPUs. One gap remains: the
core allocates its scratch (gathered rows, products) from CuPy's memory pool,
not from buffers XLA declares, so leave GPU memory to CuPy
(``XLA_PYTHON_CLIENT_MEM_FRACTION``) when using it.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

import sparsecore as sc
from sparsecore._dispatch import is_cupy_array, to_core_array

from . import padded
from .ops import _varying_like

__all__ = ["conv", "max_pool", "avg_pool"]


class _ExternalStream:
    """Wraps XLA's CUDA stream pointer for ``cupy.cuda.Stream.from_external``."""

    def __init__(self, pointer: int) -> None:
        self.pointer = int(pointer)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.pointer)


@contextlib.contextmanager
def _core_scope(ctx: Any, probe: Any) -> Iterator[None]:
    """Runs the block on XLA's stream when the buffers are on a GPU (CuPy's current stream inside it)."""
    if not is_cupy_array(probe):
        yield
        return
    import cupy  # a CUDA buffer arrived, so CuPy is the engine for it

    try:
        from sparsecore.backends import cupy_backend  # noqa: F401
    except ImportError as error:
        raise RuntimeError(
            "sparsecore.jax impl='callback' on a GPU needs the core's CuPy backend, which "
            f"could not be loaded ({error}); use impl='jnp' on GPUs"
        ) from error
    with cupy.cuda.Stream.from_external(_ExternalStream(ctx.stream)):
        yield


_CORE_DTYPES = (jnp.float16, jnp.float32, jnp.float64)


def _check_dtype(features: Any) -> None:
    if features.dtype not in [jnp.dtype(d) for d in _CORE_DTYPES]:
        raise TypeError(
            f"impl='callback' runs the sparsecore core, which computes in float16, float32 or float64; "
            f"got features of dtype {features.dtype}. Cast them, or use impl='jnp'."
        )


def _view(buffer: Any, name: str) -> Any:
    return to_core_array(buffer, name)


def _scalar(buffer: Any) -> int:
    view = _view(buffer, "count")
    return int(view.get() if is_cupy_array(view) else view)


def _pair_map(pair_input: Any, pair_output: Any, counts: Any, n_in: int, n_out: int,
              kernel_size: tuple[int, ...], identity: int) -> sc.PairMap:
    """The true pairs of a padded ``[K, Q]`` rulebook, as the core's `PairMap`."""
    rows_in, rows_out = _view(pair_input, "pair_input"), _view(pair_output, "pair_output")
    count_view = _view(counts, "counts")
    per_offset = (count_view.get() if is_cupy_array(count_view) else np.asarray(count_view)).tolist()
    xp = np if not is_cupy_array(rows_in) else __import__("cupy")
    parts_in, parts_out, starts = [], [], [0]
    for offset, count in enumerate(per_offset):
        if offset == identity:
            rows = xp.arange(n_in, dtype=xp.int32)
            parts_in.append(rows)
            parts_out.append(rows)
            count = n_in
        else:
            parts_in.append(rows_in[offset, :count])
            parts_out.append(rows_out[offset, :count])
        starts.append(starts[-1] + int(count))
    return sc.PairMap(xp.concatenate(parts_in), xp.concatenate(parts_out), tuple(starts), n_in, n_out,
                      tuple(kernel_size), identity)


def _device_pairs(pair_input: Any, pair_output: Any, n_in: Any, capacity_in: int, capacity_out: int,
                  kernel_size: tuple[int, ...], identity: int) -> sc.PairMap:
    """The padded pairs of a GPU callback, counts left on the device (`padded.padded_pair_map`)."""
    return padded.padded_pair_map(_view(pair_input, "pair_input"), _view(pair_output, "pair_output"),
                                  capacity_in, capacity_out, _view(n_in, "n_in"), kernel_size, identity)


def _gpu_backend() -> Any:
    from sparsecore.backends.cupy_backend import CUPY_BACKEND

    return CUPY_BACKEND


def _write(out: Any, value: Any, rows: int) -> None:
    """``out[:rows] = value``, ``out[rows:] = 0`` (callback outputs arrive uninitialised)."""
    view = _view(out, "out")
    view[:rows] = value
    view[rows:] = 0


# ---------------------------------------------------------------------------- conv


def _conv_forward_callback(static, ctx, out, features, weight, pair_input, pair_output, counts, n_in, n_out):
    groups, kernel_size, identity = static
    x = _view(features, "features")
    with _core_scope(ctx, x):
        if is_cupy_array(x):
            out_view = _view(out, "out")
            pairs = _device_pairs(pair_input, pair_output, n_in, x.shape[0], out_view.shape[0], kernel_size, identity)
            out_view[...] = padded.conv_forward(_gpu_backend(), x, _view(weight, "weight"), pairs,
                                                _view(n_in, "n_in"), _view(n_out, "n_out"), groups)
            return
        rows_in, rows_out = _scalar(n_in), _scalar(n_out)
        pairs = _pair_map(pair_input, pair_output, counts, rows_in, rows_out, kernel_size, identity)
        result = sc.conv_forward(x[:rows_in], _view(weight, "weight"), pairs, groups=groups)
        _write(out, result, rows_out)


def _conv_backward_callback(static, ctx, outs, grad_out, features, weight, pair_input, pair_output, counts,
                            n_in, n_out):
    groups, kernel_size, identity = static
    x = _view(features, "features")
    with _core_scope(ctx, x):
        if is_cupy_array(x):
            grad = _view(grad_out, "grad_output")
            pairs = _device_pairs(pair_input, pair_output, n_in, x.shape[0], grad.shape[0], kernel_size, identity)
            grad_x, grad_w = padded.conv_backward(_gpu_backend(), grad, x, _view(weight, "weight"), pairs,
                                                  _view(n_in, "n_in"), _view(n_out, "n_out"), groups)
            _view(outs[0], "grad_features")[...] = grad_x
            _view(outs[1], "grad_weight")[...] = grad_w
            return
        rows_in, rows_out = _scalar(n_in), _scalar(n_out)
        pairs = _pair_map(pair_input, pair_output, counts, rows_in, rows_out, kernel_size, identity)
        grad_x, grad_w = sc.conv_backward(_view(grad_out, "grad_output")[:rows_out], x[:rows_in],
                                          _view(weight, "weight"), pairs, groups=groups)
        _write(outs[0], grad_x, rows_in)
        _view(outs[1], "grad_weight")[...] = grad_w


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv(static, features, weight, pair_input, pair_output, counts, n_in, n_out):
    return _conv_fwd(static, features, weight, pair_input, pair_output, counts, n_in, n_out)[0]


def _conv_fwd(static, features, weight, pair_input, pair_output, counts, n_in, n_out):
    capacity_out, groups, kernel_size, identity = static
    shape = jax.ShapeDtypeStruct((capacity_out, weight.shape[0]), features.dtype)
    call = buffer_callback(partial(_conv_forward_callback, (groups, kernel_size, identity)), shape)
    out = _varying_like(call(features, weight, pair_input, pair_output, counts, n_in, n_out), features, weight)
    return out, (features, weight, pair_input, pair_output, counts, n_in, n_out)


def _conv_bwd(static, residuals, grad_out):
    capacity_out, groups, kernel_size, identity = static
    features, weight, pair_input, pair_output, counts, n_in, n_out = residuals
    shapes = (jax.ShapeDtypeStruct(features.shape, features.dtype), jax.ShapeDtypeStruct(weight.shape, weight.dtype))
    call = buffer_callback(partial(_conv_backward_callback, (groups, kernel_size, identity)), shapes)
    grad_x, grad_w = call(grad_out.astype(features.dtype), features, weight, pair_input, pair_output, counts,
                          n_in, n_out)
    return (_varying_like(grad_x, features), _varying_like(grad_w, weight), None, None, None, None, None)


_conv.defvjp(_conv_fwd, _conv_bwd)


def conv(features: Any, weight: Any, pair_input: Any, pair_output: Any, counts: Any, n_in: Any, n_out: Any, *,
         capacity_out: int, identity_offset: int, groups: int) -> Any:
    """Sparse conv feature pass by the core (see `sparsecore.jax.ops.conv`)."""
    _check_dtype(features)
    if weight.dtype != features.dtype:
        weight = weight.astype(features.dtype)
    kernel_size = tuple(int(k) for k in weight.shape[1:-1])
    return _conv((capacity_out, groups, kernel_size, identity_offset), features, weight, pair_input, pair_output,
                 counts, jnp.asarray(n_in, jnp.int32), jnp.asarray(n_out, jnp.int32))


# ---------------------------------------------------------------------------- pools


def _max_forward_callback(static, ctx, outs, features, pair_input, pair_output, counts, n_in, n_out):
    kernel_size, identity = static
    x = _view(features, "features")
    with _core_scope(ctx, x):
        if is_cupy_array(x):
            out_view, arg_view = _view(outs[0], "out"), _view(outs[1], "argmax")
            pairs = _device_pairs(pair_input, pair_output, n_in, x.shape[0], out_view.shape[0], kernel_size, identity)
            out_view[...], arg_view[...] = padded.max_pool_forward(_gpu_backend(), x, pairs)
            return
        rows_in, rows_out = _scalar(n_in), _scalar(n_out)
        pairs = _pair_map(pair_input, pair_output, counts, rows_in, rows_out, kernel_size, identity)
        out, argmax = sc.max_pool_forward(x[:rows_in], pairs)
        _write(outs[0], out, rows_out)
        arg_view = _view(outs[1], "argmax")
        arg_view[:rows_out] = argmax
        arg_view[rows_out:] = -1


def _max_backward_callback(static, ctx, out, grad_out, argmax, pair_input, pair_output, n_in, n_out):
    kernel_size, identity = static
    grad = _view(grad_out, "grad_output")
    with _core_scope(ctx, grad):
        out_view = _view(out, "out")
        capacity_in = out_view.shape[0]
        if is_cupy_array(grad):
            pairs = _device_pairs(pair_input, pair_output, n_in, capacity_in, grad.shape[0], kernel_size, identity)
            out_view[...] = padded.max_pool_backward(_gpu_backend(), grad, _view(argmax, "argmax"), pairs)
            return
        rows_out = _scalar(n_out)
        result = sc.max_pool_backward(grad[:rows_out], _view(argmax, "argmax")[:rows_out], capacity_in)
        out_view[...] = result


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _max_pool(static, features, pair_input, pair_output, counts, n_in, n_out):
    return _max_pool_fwd(static, features, pair_input, pair_output, counts, n_in, n_out)[0]


def _max_pool_fwd(static, features, pair_input, pair_output, counts, n_in, n_out):
    capacity_out, kernel_size, identity = static
    shapes = (jax.ShapeDtypeStruct((capacity_out, features.shape[1]), features.dtype),
              jax.ShapeDtypeStruct((capacity_out, features.shape[1]), jnp.int32))
    call = buffer_callback(partial(_max_forward_callback, (kernel_size, identity)), shapes)
    out, argmax = call(features, pair_input, pair_output, counts, n_in, n_out)
    out, argmax = _varying_like(out, features), _varying_like(argmax, features)
    return out, (argmax, pair_input, pair_output, n_in, n_out, features[:, :0])


def _max_pool_bwd(static, residuals, grad_out):
    _, kernel_size, identity = static
    argmax, pair_input, pair_output, n_in, n_out, like = residuals
    call = buffer_callback(partial(_max_backward_callback, (kernel_size, identity)),
                           jax.ShapeDtypeStruct((like.shape[0], grad_out.shape[1]), like.dtype))
    grad = call(grad_out.astype(like.dtype), argmax, pair_input, pair_output, n_in, n_out)
    return _varying_like(grad, like), None, None, None, None, None


_max_pool.defvjp(_max_pool_fwd, _max_pool_bwd)


def max_pool(features: Any, pair_input: Any, pair_output: Any, counts: Any, n_in: Any, n_out: Any, *,
             capacity_out: int, identity_offset: int, kernel_size: tuple[int, ...]) -> Any:
    """Max pool feature pass by the core."""
    _check_dtype(features)
    return _max_pool((capacity_out, tuple(kernel_size), identity_offset), features, pair_input, pair_output, counts,
                     jnp.asarray(n_in, jnp.int32), jnp.asarray(n_out, jnp.int32))


def _avg_forward_callback(static, ctx, out, features, pair_input, pair_output, counts, n_in, n_out):
    kernel_size, identity = static
    x = _view(features, "features")
    with _core_scope(ctx, x):
        if is_cupy_array(x):
            out_view = _view(out, "out")
            pairs = _device_pairs(pair_input, pair_output, n_in, x.shape[0], out_view.shape[0], kernel_size, identity)
            out_view[...] = padded.avg_pool_forward(_gpu_backend(), x, pairs)
            return
        rows_in, rows_out = _scalar(n_in), _scalar(n_out)
        pairs = _pair_map(pair_input, pair_output, counts, rows_in, rows_out, kernel_size, identity)
        _write(out, sc.avg_pool_forward(x[:rows_in], pairs), rows_out)


def _avg_backward_callback(static, ctx, out, grad_out, pair_input, pair_output, counts, n_in, n_out):
    kernel_size, identity = static
    grad = _view(grad_out, "grad_output")
    with _core_scope(ctx, grad):
        if is_cupy_array(grad):
            out_view = _view(out, "out")
            pairs = _device_pairs(pair_input, pair_output, n_in, out_view.shape[0], grad.shape[0], kernel_size,
                                  identity)
            out_view[...] = padded.avg_pool_backward(_gpu_backend(), grad, pairs)
            return
        rows_in, rows_out = _scalar(n_in), _scalar(n_out)
        pairs = _pair_map(pair_input, pair_output, counts, rows_in, rows_out, kernel_size, identity)
        _write(out, sc.avg_pool_backward(grad[:rows_out], pairs), rows_in)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _avg_pool(static, features, pair_input, pair_output, counts, n_in, n_out):
    return _avg_pool_fwd(static, features, pair_input, pair_output, counts, n_in, n_out)[0]


def _avg_pool_fwd(static, features, pair_input, pair_output, counts, n_in, n_out):
    capacity_out, kernel_size, identity = static
    shape = jax.ShapeDtypeStruct((capacity_out, features.shape[1]), features.dtype)
    out = buffer_callback(partial(_avg_forward_callback, (kernel_size, identity)), shape)(
        features, pair_input, pair_output, counts, n_in, n_out)
    out = _varying_like(out, features)
    return out, (pair_input, pair_output, counts, n_in, n_out, features[:, :0])


def _avg_pool_bwd(static, residuals, grad_out):
    capacity_out, kernel_size, identity = static
    pair_input, pair_output, counts, n_in, n_out, like = residuals
    shape = jax.ShapeDtypeStruct((like.shape[0], grad_out.shape[1]), like.dtype)
    grad = buffer_callback(partial(_avg_backward_callback, (kernel_size, identity)), shape)(
        grad_out.astype(like.dtype), pair_input, pair_output, counts, n_in, n_out)
    return _varying_like(grad, like), None, None, None, None, None


_avg_pool.defvjp(_avg_pool_fwd, _avg_pool_bwd)


def avg_pool(features: Any, pair_input: Any, pair_output: Any, counts: Any, n_in: Any, n_out: Any, *,
             capacity_out: int, identity_offset: int, kernel_size: tuple[int, ...]) -> Any:
    """Average pool feature pass by the core."""
    _check_dtype(features)
    return _avg_pool((capacity_out, tuple(kernel_size), identity_offset), features, pair_input, pair_output, counts,
                     jnp.asarray(n_in, jnp.int32), jnp.asarray(n_out, jnp.int32))
