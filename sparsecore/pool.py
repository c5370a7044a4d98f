"""Pooling feature passes over a rulebook, and global pooling per batch element.

Max pooling takes the maximum over the *active* inputs of each window (empty
sites do not count as zeros) and remembers the input row of the maximum for
the backward pass; ties go to the earliest kernel offset. Average pooling
divides by the number of active inputs in the window ("real point count",
as spconv documents), not by the kernel volume.

A pass takes a `Rulebook`, `PairMap` or `NeighbourMap`. On a kernel backend
(the GPU, or its emulation) each pass is one launch over the neighbour map
(``kernels_cu/pool_maps.cu``: the forward over the output side, the backward
per input row over the input side, no atomics); the NumPy backend runs over
the pairs.
"""

from __future__ import annotations

from typing import Any

from ._capacity_builds import exact_of, padded_rows
from ._dispatch import array_module, check_same_device, to_core_array
from ._validation import as_batch_size, as_features
from ._chunks import check_padded_pairs
from ._rulebook_views import index_rows, map_view, pair_view, refuse_bfloat16, runs_fused_passes
from .backends import ArrayBackend, backend_for
from .neighbour_map import NeighbourMap
from .rulebook import PairMap, Rulebook
from .threads import serialised_kernels

__all__ = [
    "max_pool_forward",
    "max_pool_backward",
    "avg_pool_forward",
    "avg_pool_backward",
    "global_max_pool_forward",
    "global_max_pool_backward",
    "global_avg_pool_forward",
    "global_avg_pool_backward",
]


def _sum_dtype(xp: Any, dtype: Any) -> Any:
    """Pools sum float16 and bfloat16 in float32 (no GEMM to speed up, so no reason to round more)."""
    return xp.float32 if dtype == xp.float16 or dtype.name == "bfloat16" else dtype


def _pass_operands(values: Any, rulebook: Rulebook | PairMap | NeighbourMap, backend: ArrayBackend | None,
                   stage: str) -> tuple[ArrayBackend, Any, Any]:
    """Checks a pooling pass's rows and picks its backend.

    Args:
        values: the forward's ``features [N_in, C]`` or the backward's ``grad_output [N_out, C]``.
        rulebook: the layer's rulebook (a padded pair map only on a backend that skips row -1).
        backend: the caller's backend, or None for the backend of ``values``.
        stage: ``"forward"`` or ``"backward"``.

    Returns:
        ``(backend, values, view)``: on a kernel backend ``values`` as given and the `NeighbourMap`
        (the fused passes make operands contiguous); else contiguous ``values`` and
        ``(pair_input, pair_output, offset_starts)``.
    """
    if stage == "forward":
        values = as_features(values, rulebook.num_input, bfloat16=True)
        check_same_device(features=values, indices=index_rows(rulebook))
    else:
        values = as_features(values, rulebook.num_output, name="grad_output",
                             rows_meaning="output site of the rulebook", bfloat16=True)
        check_same_device(grad_output=values, indices=index_rows(rulebook))
    backend = backend if backend is not None else backend_for(values)
    if runs_fused_passes(backend):
        return backend, values, map_view(rulebook, backend.xp)
    refuse_bfloat16(backend, **{"features" if stage == "forward" else "grad_output": values})
    rulebook = pair_view(rulebook)
    check_padded_pairs(rulebook, backend)
    pairs = (rulebook.pair_input, rulebook.pair_output, tuple(rulebook.offset_starts))
    return backend, backend.xp.ascontiguousarray(values), pairs


def max_pool_forward(features: Any, rulebook: Rulebook | PairMap | NeighbourMap, *,
                     backend: ArrayBackend | None = None) -> tuple[Any, Any]:
    """Maximum over each output's active inputs.

    Args:
        features: ``[N_in, C]`` float array.
        rulebook: a pooling (or conv) rulebook with ``num_input == N_in``.

    Returns:
        ``(out [N_out, C], argmax [N_out, C] int32)``, ``argmax`` holding the input
        row that gave each maximum.
    """
    exact = exact_of(rulebook)
    if exact is not None and not runs_fused_passes(backend or backend_for(features)):  # a padded capacity build
        out, argmax = max_pool_forward(features[:exact.num_input], exact, backend=backend)
        return padded_rows(out, rulebook.num_output), padded_rows(argmax, rulebook.num_output, -1)
    backend, source, view = _pass_operands(features, rulebook, backend, "forward")
    if runs_fused_passes(backend):
        return backend.fused_passes.max_pool_forward(source, view)
    with serialised_kernels(source):  # numba's workqueue layer: one thread at a time (sparsecore.threads)
        return backend.max_pool_pairs(source, *view, rulebook.num_output)


def _scatter_by_argmax(grad_output: Any, argmax: Any, num_input: int, backend: ArrayBackend) -> Any:
    xp = array_module(grad_output)
    channels = grad_output.shape[1]
    if num_input == 0 or grad_output.shape[0] == 0:
        return xp.zeros((num_input, channels), dtype=grad_output.dtype)
    valid = argmax >= 0
    flat_index = (argmax.astype(xp.int64) * channels + xp.arange(channels, dtype=xp.int64))[valid]
    values = grad_output[valid].astype(xp.float64)
    summed = backend.index_add(num_input * channels, flat_index, values)
    return summed.reshape(num_input, channels).astype(grad_output.dtype)


def max_pool_backward(grad_output: Any, argmax: Any, num_input: int, *,
                      rulebook: Rulebook | PairMap | NeighbourMap | None = None,
                      backend: ArrayBackend | None = None) -> Any:
    """Gradient of `max_pool_forward`: each output's gradient goes to its argmax row.

    Args:
        grad_output: ``[N_out, C]``.
        argmax: ``[N_out, C]`` int32 from the forward.
        num_input: ``N_in``.
        rulebook: the forward's rulebook, when there is one (not for global
            pooling). With it the gradient is summed per input over its pairs
            (one ``sc_max_pool_map_backward`` launch over the map's input side
            on the GPU, no host synchronisation; `ArrayBackend.max_pool_backward_pairs`
            on the CPU); without it, scattered by argmax.

    Returns:
        ``[N_in, C]`` in ``grad_output``'s dtype: summed in float64 without a
        rulebook, in the compute dtype over the pairs with one; deterministic.
    """
    grad_output = as_features(grad_output, name="grad_output", bfloat16=True)
    argmax = to_core_array(argmax, "argmax")
    if argmax.shape != grad_output.shape:
        raise ValueError(f"argmax has shape {tuple(argmax.shape)}, grad_output {tuple(grad_output.shape)}; they must match")
    num_input = int(num_input)
    if argmax.dtype.kind not in "iu":
        raise TypeError(f"argmax must be an integer array (from the forward), got dtype {argmax.dtype}")
    if rulebook is not None:
        if rulebook.num_output != grad_output.shape[0] or rulebook.num_input != num_input:
            raise ValueError(
                f"the rulebook maps {rulebook.num_input} inputs to {rulebook.num_output} outputs, but "
                f"grad_output has {grad_output.shape[0]} rows and num_input is {num_input}; pass the "
                "forward's rulebook"
            )
        backend = backend if backend is not None else backend_for(grad_output)
        if runs_fused_passes(backend):  # per input row over the map's input side
            return backend.fused_passes.max_pool_backward(grad_output, argmax, map_view(rulebook, backend.xp))
        exact = exact_of(rulebook)
        if exact is not None:  # a padded capacity build on the host: the exact pass on the true rows
            grad = max_pool_backward(grad_output[:exact.num_output], argmax[:exact.num_output], exact.num_input,
                                     rulebook=exact, backend=backend)
            return padded_rows(grad, num_input)
        refuse_bfloat16(backend, grad_output=grad_output)
        rulebook = pair_view(rulebook)
        check_padded_pairs(rulebook, backend)
        with serialised_kernels(grad_output):
            return backend.max_pool_backward_pairs(grad_output, argmax, rulebook.pair_input, rulebook.pair_output,
                                                   tuple(rulebook.offset_starts), num_input)
    if argmax.size and (int(argmax.max()) >= num_input or int(argmax.min()) < -1):
        raise ValueError(
            f"argmax holds rows from {int(argmax.min())} to {int(argmax.max())}, but there are "
            f"{num_input} input rows (valid: -1 for none, 0 to {num_input - 1}); pass the "
            "argmax returned by the forward with the forward's num_input"
        )
    backend = backend if backend is not None else backend_for(grad_output)
    return _scatter_by_argmax(grad_output, argmax, num_input, backend)


def avg_pool_forward(features: Any, rulebook: Rulebook | PairMap | NeighbourMap, *,
                     backend: ArrayBackend | None = None) -> Any:
    """Mean over each output's active inputs (`ArrayBackend.avg_pool_pairs`).

    Sums in float32 for 16-bit storage (float64 for float64), in kernel-offset
    order, then divides by the window's count of active inputs; an output
    without inputs is 0. On the GPU one ``sc_avg_pool_map`` launch reads
    the input rows in place (no gathered copy).

    Args:
        features: ``[N_in, C]``.
        rulebook: a pooling rulebook.
        backend: the primitives to run on; by default the backend of ``features``.

    Returns:
        ``[N_out, C]`` in the features' dtype.
    """
    exact = exact_of(rulebook)
    if exact is not None and not runs_fused_passes(backend or backend_for(features)):  # a padded capacity build
        return padded_rows(avg_pool_forward(features[:exact.num_input], exact, backend=backend), rulebook.num_output)
    backend, source, view = _pass_operands(features, rulebook, backend, "forward")
    if runs_fused_passes(backend):
        return backend.fused_passes.avg_pool_forward(source, view)
    with serialised_kernels(source):
        return backend.avg_pool_pairs(source, *view, rulebook.num_output)


def avg_pool_backward(grad_output: Any, rulebook: Rulebook | PairMap | NeighbourMap, *,
                      backend: ArrayBackend | None = None) -> Any:
    """Gradient of `avg_pool_forward` (`ArrayBackend.avg_pool_backward_pairs`).

    Args:
        grad_output: ``[N_out, C]``.
        rulebook: the forward's rulebook.
        backend: the primitives to run on; by default the backend of ``grad_output``.

    Returns:
        ``[N_in, C]``.
    """
    exact = exact_of(rulebook)
    if exact is not None and not runs_fused_passes(backend or backend_for(grad_output)):  # a padded capacity build
        return padded_rows(avg_pool_backward(grad_output[:exact.num_output], exact, backend=backend),
                           rulebook.num_input)
    backend, source, view = _pass_operands(grad_output, rulebook, backend, "backward")
    if runs_fused_passes(backend):
        return backend.fused_passes.avg_pool_backward(source, view)
    with serialised_kernels(source):
        return backend.avg_pool_backward_pairs(source, *view, rulebook.num_input)


def _batch_rows(indices: Any, batch_size: int, num_rows: int) -> tuple[Any, list[Any]]:
    indices = to_core_array(indices, "indices")
    if indices.ndim != 2 or indices.shape[0] != num_rows or indices.shape[1] < 2:
        raise ValueError(
            f"indices must be [N, 1 + D] with one row per feature row ({num_rows}), got "
            f"shape {tuple(indices.shape)}"
        )
    xp = array_module(indices)
    batch = indices[:, 0]
    if num_rows and (int(batch.min()) < 0 or int(batch.max()) >= batch_size):
        raise ValueError(f"indices' batch column must lie in [0, {batch_size}), got values "
                         f"from {int(batch.min())} to {int(batch.max())}")
    order = xp.argsort(batch, kind="stable")
    bounds = xp.searchsorted(batch[order], xp.arange(batch_size + 1)).tolist()
    return batch, [order[bounds[b]:bounds[b + 1]] for b in range(batch_size)]


def global_max_pool_forward(features: Any, indices: Any, batch_size: int) -> tuple[Any, Any]:
    """Channel-wise maximum over each batch element's sites.

    Args:
        features: ``[N, C]``.
        indices: ``[N, 1 + D]`` (only the batch column is read).
        batch_size: ``B``.

    Returns:
        ``(out [B, C], argmax [B, C] int32)``; an empty batch element gives 0 and argmax -1.
    """
    features = as_features(features, bfloat16=True)
    batch_size = as_batch_size(batch_size)
    xp = array_module(features)
    _, rows_per_batch = _batch_rows(indices, batch_size, features.shape[0])
    out = xp.zeros((batch_size, features.shape[1]), dtype=features.dtype)
    argmax = xp.full((batch_size, features.shape[1]), -1, dtype=xp.int32)
    for element, rows in enumerate(rows_per_batch):
        if rows.shape[0] == 0:
            continue
        rows = xp.sort(rows)
        values = features[rows]
        best = xp.argmax(values, axis=0)
        argmax[element] = rows[best]
        out[element] = values[best, xp.arange(features.shape[1])]
    return out, argmax


def global_max_pool_backward(grad_output: Any, argmax: Any, num_input: int, *,
                             backend: ArrayBackend | None = None) -> Any:
    """Gradient of `global_max_pool_forward`: ``[B, C]`` to ``[N, C]``."""
    return max_pool_backward(grad_output, argmax, num_input, backend=backend)


def global_avg_pool_forward(features: Any, indices: Any, batch_size: int) -> Any:
    """Channel-wise mean over each batch element's sites (0 for an empty element).

    Returns:
        ``[B, C]`` in the features' dtype.
    """
    features = as_features(features, bfloat16=True)
    batch_size = as_batch_size(batch_size)
    xp = array_module(features)
    dtype = _sum_dtype(xp, features.dtype)
    _, rows_per_batch = _batch_rows(indices, batch_size, features.shape[0])
    out = xp.zeros((batch_size, features.shape[1]), dtype=dtype)
    for element, rows in enumerate(rows_per_batch):
        if rows.shape[0]:
            out[element] = features[xp.sort(rows)].astype(dtype).mean(axis=0)
    return out.astype(features.dtype, copy=False)


def global_avg_pool_backward(grad_output: Any, indices: Any, batch_size: int) -> Any:
    """Gradient of `global_avg_pool_forward`: ``[B, C]`` to ``[N, C]``."""
    grad_output = as_features(grad_output, batch_size, name="grad_output",
                              rows_meaning="batch element (the forward's output is [B, C])", bfloat16=True)
    indices = to_core_array(indices, "indices")
    xp = array_module(grad_output)
    batch = indices[:, 0].astype(xp.int64)
    counts = xp.maximum(xp.bincount(batch, minlength=batch_size), 1)
    dtype = _sum_dtype(xp, grad_output.dtype)
    grad = grad_output.astype(dtype)[batch] / counts[batch][:, None].astype(dtype)
    return grad.astype(grad_output.dtype, copy=False)
