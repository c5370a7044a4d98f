"""The ``buffer_callback`` bridge: feature passes run by the core, on XLA's buffers, declared from a table.

Each pass is a ``jax.custom_vjp`` whose forward and backward are
``jax.experimental.buffer_callback`` calls. Inside a callback the buffers are
viewed as core arrays without a copy (`sparsecore.interop.to_core_array`:
NumPy through ``np.from_dlpack`` on the CPU, CuPy on CUDA) and one function of
`padded` computes on the full padded rows (padding rows of the inputs count
as zero, padding rows of the results are zero); the result is copied into the
output buffer (outputs arrive uninitialised).

The rulebook reaches the core in the form its backend reads, both made from the
plan's ``[K, Q]`` rows (-1 = no pair; see `layout`) without a host read:

- GPU: a padded `sparsecore.neighbour_map.NeighbourMap` (`padded.neighbour_map`)
  over tables XLA computes inside the compiled program (`layout.map_arrays`:
  per-row neighbours, masks and mask-sorted orders, rows past the true counts -1),
  so the core runs its fused map kernels with no host operation to convert the
  rulebook. The buffers are CuPy views on XLA's stream (``ctx.stream``, made
  CuPy's current stream around the call), and no count is read back to the
  host, so nothing in the callback synchronises the stream. This path has not
  yet run on a GPU (its logic runs in CI through the CPU emulation of the
  kernels), so ``impl="jnp"`` stays the default on GPUs. The core allocates its
  scratch from CuPy's memory pool, not from buffers XLA declares: leave GPU
  memory to CuPy (``XLA_PYTHON_CLIENT_MEM_FRACTION``).
- CPU: the NumPy backend reads pairs and cannot skip -1 rows, so the true pairs
  of each offset (a view each) are joined once per call (`padded.true_pair_map`).

Which form a pass carries (`Static.form`) is chosen when it is traced, from JAX's
default backend (`rulebook_form`); each form also runs on the other device (a map
on the CPU is turned into pairs by the core, pairs on a GPU are read as a padded
`sparsecore.PairMap`), only slower.

A pass is one `CallbackOp` entry of `OPS` (name, inputs, shape rules,
forward, saved residuals, backward); `_declare` makes its ``custom_vjp``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback

from sparsecore.interop import FLOAT_DTYPES, is_cupy_array, to_core_array

from . import layout, padded
from .primitives import varying_like

__all__ = ["CallbackOp", "OPS", "Static", "Pass", "rulebook_form", "conv", "max_pool", "avg_pool"]

_PAIR_ARRAYS = ("pair_input", "pair_output", "counts")
_SIDE = ("neighbours", "masks", "order")
_COUNTS = ("n_in", "n_out")


@dataclass(frozen=True)
class Static:
    """The static parameters of one callback pass (part of the jit cache key).

    Attributes:
        capacity_in, capacity_out: input and output rows.
        kernel_size: the rulebook's kernel size.
        identity: the subm centre offset, or -1.
        groups: channel groups (convs; 1 for pools).
        dtype: the features' dtype name (the dtype of the results and gradients).
        form: ``"map"`` (the rulebook operands are `layout.map_arrays`' tables) or ``"pairs"``
            (the plan's ``[K, Q]`` rows and counts).
    """

    capacity_in: int
    capacity_out: int
    kernel_size: tuple[int, ...]
    identity: int
    groups: int
    dtype: str
    form: str = "pairs"

    @property
    def rulebook_names(self) -> tuple[str, ...]:
        """Names of the rulebook operands, in order (the row counts last)."""
        if self.form == "pairs":
            return _PAIR_ARRAYS + _COUNTS
        sides = ("output",) if self.identity >= 0 else ("output", "input")  # a subm map is symmetric
        return tuple(f"{side}_{name}" for side in sides for name in _SIDE) + _COUNTS


@dataclass(frozen=True)
class Pass:
    """What an op's callback functions receive besides its arrays.

    Attributes:
        backend: the core backend (None on the host: the core picks NumPy).
        pairs: the core rulebook over the full padded rows: a `sparsecore.neighbour_map.NeighbourMap`
            (``form="map"``) or a `sparsecore.PairMap`.
        n_in, n_out: the true input and output rows (0-d arrays, on the device on a GPU).
        static: the `Static` parameters.
    """

    backend: Any
    pairs: padded.CoreRulebook
    n_in: Any
    n_out: Any
    static: Static


@dataclass(frozen=True)
class CallbackOp:
    """One feature pass run by the core (an entry of `OPS`).

    Attributes:
        name: the op's name.
        inputs: names of its array inputs (before the rulebook arrays); the first
            ``differentiable`` get gradients.
        differentiable: how many leading inputs are differentiable.
        forward_shapes: ``(static, *inputs) -> tuple of jax.ShapeDtypeStruct`` (first: the op's result).
        forward: ``(pass, *inputs) -> tuple of core arrays`` matching ``forward_shapes``.
        saved: ``(inputs, outputs) -> tuple of arrays`` kept for the backward.
        saved_names: names of the saved arrays.
        backward_shapes: ``(static, grad, *saved) -> tuple of ShapeDtypeStruct``, one per differentiable input.
        backward: ``(pass, grad, *saved) -> tuple of core arrays`` matching ``backward_shapes``.
    """

    name: str
    inputs: tuple[str, ...]
    differentiable: int
    forward_shapes: Callable[..., tuple]
    forward: Callable[..., tuple]
    saved: Callable[[tuple, tuple], tuple]
    saved_names: tuple[str, ...]
    backward_shapes: Callable[..., tuple]
    backward: Callable[..., tuple]


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

    with cupy.cuda.Stream.from_external(_ExternalStream(ctx.stream)):
        yield


def _gpu_backend() -> Any:
    try:
        from sparsecore.backends.cupy_backend import CUPY_BACKEND
    except ImportError as error:
        raise RuntimeError(
            "sparsecore.jax impl='callback' on a GPU needs the core's CuPy backend, which "
            f"could not be loaded ({error}); use impl='jnp' on GPUs"
        ) from error
    return CUPY_BACKEND


def _view(buffer: Any, name: str) -> Any:
    return to_core_array(buffer, name)


def _pass(static: Static, rulebook: list[Any], probe: Any) -> Pass:
    layout = (static.capacity_in, static.capacity_out, static.kernel_size)
    arrays, (n_in, n_out) = rulebook[:-2], rulebook[-2:]
    backend = _gpu_backend() if is_cupy_array(probe) else None
    if static.form == "map":
        return Pass(backend, padded.neighbour_map(tuple(arrays), *layout), n_in, n_out, static)
    pair_input, pair_output, counts = arrays
    if backend is not None:
        return Pass(backend, padded.pair_map(pair_input, pair_output, *layout, static.identity), n_in, n_out, static)
    return Pass(None, padded.true_pair_map(pair_input, pair_output, counts, *layout, static.identity), n_in, n_out,
                static)


def _run(function: Callable[..., tuple], names: tuple[str, ...], static: Static, ctx: Any, outs: Any,
         *buffers: Any) -> None:
    """The body of every callback: view the buffers, run ``function``, copy its results out."""
    views = [_view(buffer, name) for buffer, name in zip(buffers, names + static.rulebook_names)]
    arrays, rulebook = views[: len(names)], views[len(names):]
    with _core_scope(ctx, arrays[0]):
        results = function(_pass(static, rulebook, arrays[0]), *arrays)
        for out, result in zip(outs, results):
            _view(out, "out")[...] = result


def _declare(op: CallbackOp) -> Callable[..., Any]:
    """The ``custom_vjp`` of ``op``: ``call(static, *inputs, *rulebook arrays) -> the op's result``."""
    def forward(static: Static, *args: Any) -> tuple[Any, tuple]:
        inputs, rulebook = args[: len(op.inputs)], args[len(op.inputs):]
        call = buffer_callback(partial(_run, op.forward, op.inputs, static), op.forward_shapes(static, *inputs))
        outputs = tuple(varying_like(out, *inputs[: op.differentiable]) for out in call(*args))
        return outputs[0], (op.saved(inputs, outputs), rulebook)

    def backward(static: Static, residuals: tuple, grad: Any) -> tuple:
        saved, rulebook = residuals
        grad = grad.astype(static.dtype)
        call = buffer_callback(partial(_run, op.backward, ("grad_output",) + op.saved_names, static),
                               op.backward_shapes(static, grad, *saved))
        not_differentiable = (None,) * (len(op.inputs) - op.differentiable + len(rulebook))
        return tuple(varying_like(g, grad) for g in call(grad, *saved, *rulebook)) + not_differentiable

    @partial(jax.custom_vjp, nondiff_argnums=(0,))
    def call(static: Static, *args: Any) -> Any:
        return forward(static, *args)[0]

    call.defvjp(forward, backward)
    call.__name__ = call.__qualname__ = f"callback_{op.name}"
    return call


def _rows(static: Static, rows: int, channels: int, dtype: Any = None) -> Any:
    return jax.ShapeDtypeStruct((rows, channels), static.dtype if dtype is None else dtype)


OPS: dict[str, CallbackOp] = {op.name: op for op in (
    CallbackOp(
        "conv", ("features", "weight"), 2,
        forward_shapes=lambda s, x, w: (_rows(s, s.capacity_out, w.shape[0]),),
        forward=lambda p, x, w: (padded.conv_forward(p.backend, x, w, p.pairs, p.n_in, p.n_out, p.static.groups),),
        saved=lambda inputs, outputs: inputs, saved_names=("features", "weight"),
        backward_shapes=lambda s, g, x, w: (jax.ShapeDtypeStruct(x.shape, x.dtype),
                                            jax.ShapeDtypeStruct(w.shape, w.dtype)),
        backward=lambda p, g, x, w: padded.conv_backward(p.backend, g, x, w, p.pairs, p.n_in, p.n_out,
                                                         p.static.groups)),
    CallbackOp(
        "max_pool", ("features",), 1,
        forward_shapes=lambda s, x: (_rows(s, s.capacity_out, x.shape[1]),
                                     _rows(s, s.capacity_out, x.shape[1], jnp.int32)),
        forward=lambda p, x: padded.max_pool_forward(p.backend, x, p.pairs),
        saved=lambda inputs, outputs: outputs[1:], saved_names=("argmax",),
        backward_shapes=lambda s, g, argmax: (_rows(s, s.capacity_in, g.shape[1]),),
        backward=lambda p, g, argmax: (padded.max_pool_backward(p.backend, g, argmax, p.pairs),)),
    CallbackOp(
        "avg_pool", ("features",), 1,
        forward_shapes=lambda s, x: (_rows(s, s.capacity_out, x.shape[1]),),
        forward=lambda p, x: (padded.avg_pool_forward(p.backend, x, p.pairs),),
        saved=lambda inputs, outputs: (), saved_names=(),
        backward_shapes=lambda s, g: (_rows(s, s.capacity_in, g.shape[1]),),
        backward=lambda p, g: (padded.avg_pool_backward(p.backend, g, p.pairs),)),
)}
_CALLS = {name: _declare(op) for name, op in OPS.items()}


def _check_dtype(features: Any) -> None:
    """float16/32/64 anywhere; bfloat16 where the passes run on the CPU (the core's NumPy backend reads
    ``ml_dtypes.bfloat16``: `sparsecore.bf16_cpu_dataflow`)."""
    dtype = np.dtype(features.dtype)
    if dtype in FLOAT_DTYPES or (dtype.name == "bfloat16" and rulebook_form() == "pairs"):
        return
    raise TypeError(
        f"impl='callback' runs the sparsecore core, which computes in float16, float32 or float64 (and "
        f"bfloat16 on the CPU); got features of dtype {features.dtype}. Cast them, or use impl='jnp'."
    )


def rulebook_form() -> str:
    """The rulebook form a callback pass traced now carries: ``"map"`` where JAX's default backend is a GPU
    (the core's fused kernels read neighbour maps), else ``"pairs"`` (the NumPy backend reads pairs)."""
    return "map" if jax.default_backend() in ("gpu", "cuda", "rocm") else "pairs"


def _call(name: str, inputs: tuple, rulebook: tuple, capacity_out: int, kernel_size: tuple[int, ...],
          identity: int, groups: int = 1) -> Any:
    features = inputs[0]
    _check_dtype(features)
    static = Static(int(features.shape[0]), int(capacity_out), tuple(int(k) for k in kernel_size), int(identity),
                    int(groups), np.dtype(features.dtype).name, rulebook_form())
    pair_input, pair_output, counts, n_in, n_out = rulebook
    if static.form == "map":
        arrays = layout.map_arrays(pair_input, pair_output, static.capacity_in, static.capacity_out,
                                   symmetric=static.identity >= 0)
    else:
        arrays = (pair_input, pair_output, counts)
    return _CALLS[name](static, *inputs, *arrays, jnp.asarray(n_in, jnp.int32), jnp.asarray(n_out, jnp.int32))


def conv(features: Any, weight: Any, pair_input: Any, pair_output: Any, counts: Any, n_in: Any, n_out: Any, *,
         capacity_out: int, identity_offset: int, groups: int) -> Any:
    """Sparse conv feature pass by the core (see `sparsecore.jax.ops.conv`)."""
    weight = weight if weight.dtype == features.dtype else weight.astype(features.dtype)
    return _call("conv", (features, weight), (pair_input, pair_output, counts, n_in, n_out), capacity_out,
                 weight.shape[1:-1], identity_offset, groups)


def max_pool(features: Any, pair_input: Any, pair_output: Any, counts: Any, n_in: Any, n_out: Any, *,
             capacity_out: int, identity_offset: int, kernel_size: tuple[int, ...]) -> Any:
    """Max pool feature pass by the core (ties: the earliest kernel offset)."""
    return _call("max_pool", (features,), (pair_input, pair_output, counts, n_in, n_out), capacity_out,
                 kernel_size, identity_offset)


def avg_pool(features: Any, pair_input: Any, pair_output: Any, counts: Any, n_in: Any, n_out: Any, *,
             capacity_out: int, identity_offset: int, kernel_size: tuple[int, ...]) -> Any:
    """Average pool feature pass by the core."""
    return _call("avg_pool", (features,), (pair_input, pair_output, counts, n_in, n_out), capacity_out,
                 kernel_size, identity_offset)
