"""Sparse convolution feature passes: gather, GEMM, scatter-add over a rulebook.

Given a `Rulebook`, these are plain functions of (features, weight) with static
output shapes: what PyTorch autograd and JAX ``custom_vjp`` wrap. Weights are
``[out_channels, *kernel_size, in_channels // groups]``; grouped and depthwise
convolutions use a batched GEMM per kernel offset.

Dataflow: the kernel offsets are taken in chunks (`sparsecore._chunks`, sized
by the backend): per chunk one gather of its input rows laid out ``[m, W]``
(``m`` offsets padded to ``W`` pairs with row -1), one batched GEMM
``[m, W, a] @ [m, a, b]``, and one `scatter_add_pairs` of the products.
A submanifold centre offset (every row to itself) is a plain GEMM that
initialises the output. Products run in ``backend.compute_dtype``: float32 for
float16 inputs on NumPy, float16 (cuBLAS, float32 accumulation) on the GPU.

On the CPU (NumPy backend), layers whose per-group weight matrix is at most
`FUSED_MAX_MATRIX` run fused instead (`fused_on_cpu`; the backward only above
`FUSED_BACKWARD_MIN_MATRIX`): the forward and the d-features are compiled output-stationary loops over a neighbour table
(`sparsecore.backends._cpu_kernels`), each output row summing its offsets in
a fixed order on any number of threads; the d-weights are one BLAS GEMM per
offset. On the CPU, BLAS runs on one thread inside a pass and the per-offset
products run side by side on `sparsecore.threads`' thread count, summed in
offset order: results are bitwise identical at every thread count.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Any, Callable, Sequence

from ._chunks import PairChunk, check_padded_pairs, chunk_rows, pair_chunks
from ._dispatch import check_same_device, to_core_array
from ._validation import as_features
from .backends import ArrayBackend, NumpyBackend, backend_for
from . import threads
from .backends import _cpu_kernels
from .rulebook import PairMap, Rulebook

__all__ = ["conv_forward", "conv_backward", "check_conv_weight", "check_weight_layout", "fused_on_cpu",
           "FUSED_MAX_MATRIX", "FUSED_BACKWARD_MIN_MATRIX"]

FUSED_MAX_MATRIX = 64 * 64
"""Largest per-group weight matrix (``in_per_group * out_per_group``) run by the fused CPU kernels;
larger ones run per-offset BLAS GEMMs (docs/performance.md has the measurements)."""

FUSED_BACKWARD_MIN_MATRIX = 32 * 32
"""The backward runs fused only above this per-group matrix: below it the per-offset BLAS backward
was faster (16 -> 16: 102 ms against 140 ms on one thread)."""


def check_weight_layout(weight: Any, in_channels: int, groups: int, ndim: int) -> None:
    """Checks that ``weight`` is laid out ``[out_channels, *kernel_size, in_channels // groups]``.

    Runs before anything reads the kernel size from the weight, so a weight in
    torch's ``[out, in, *k]`` layout is reported as a layout error (with the
    permutation that fixes it), not as a strange kernel size.

    Args:
        weight: a core array.
        in_channels: channels of the input features.
        groups: number of channel groups.
        ndim: spatial axes of the conv.

    Raises:
        ValueError: on a wrong rank, a ``groups`` that does not divide the channels,
            or a last axis that is not ``in_channels // groups``.
    """
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"groups must be a positive int, got {groups!r}")
    layout = "[out_channels, *kernel_size, in_channels // groups] (spconv 2.x's layout)"
    shape = tuple(int(size) for size in weight.shape)
    if weight.ndim != ndim + 2:
        raise ValueError(
            f"weight must have shape {layout}: {ndim + 2} axes for a {ndim}-D conv, got shape {shape}"
        )
    if in_channels % groups:
        raise ValueError(f"groups={groups} must divide in_channels ({in_channels})")
    expected = in_channels // groups
    if shape[-1] == expected:
        return
    message = (
        f"weight must be laid out {layout}, so its last axis must be {expected} "
        f"(in_channels {in_channels} // groups {groups}), got shape {shape}"
    )
    if shape[1] == expected:
        axes = ", ".join(str(axis) for axis in range(2, ndim + 2))
        message += (
            f", which is torch's Conv{ndim}d layout [out_channels, in_channels // groups, *kernel_size]. "
            f"Move the channel axis last: weight.permute(0, {axes}, 1) for a torch tensor, "
            "numpy.moveaxis(weight, 1, -1) for an array"
        )
    elif shape[0] == expected:
        message += (
            ", which looks like [in_channels, *kernel_size, out_channels]: swap the first and last "
            "axes (numpy.moveaxis(weight, [0, -1], [-1, 0]))"
        )
    else:
        message += "; check the layer's in_channels and groups"
    raise ValueError(message)


def check_conv_weight(weight: Any, rulebook: Rulebook | PairMap, in_channels: int, groups: int) -> Any:
    """Validates a conv weight against a rulebook and the input channels.

    The layout (`check_weight_layout`) is checked first, then the kernel axes
    against the rulebook's kernel size, the output channels and the dtype.

    Args:
        weight: ``[out_channels, *kernel_size, in_channels // groups]``.
        rulebook: the layer's rulebook.
        in_channels: channels of the input features.
        groups: number of channel groups.

    Returns:
        The weight as a core array.
    """
    weight = to_core_array(weight, "weight")
    kernel_size = tuple(rulebook.kernel_size)
    check_weight_layout(weight, in_channels, groups, len(kernel_size))
    if tuple(weight.shape[1:-1]) != kernel_size:
        raise ValueError(
            f"weight's kernel axes {tuple(weight.shape[1:-1])} do not match the rulebook's "
            f"kernel_size {kernel_size}; weight is [out_channels, *kernel_size, in_channels // groups]"
        )
    out_channels = weight.shape[0]
    if out_channels % groups:
        raise ValueError(
            f"groups={groups} must divide both in_channels ({in_channels}) and out_channels "
            f"({out_channels})"
        )
    if weight.dtype.kind != "f":
        raise TypeError(f"weight must be a float array, got dtype {weight.dtype}")
    return weight


def _offset_matrices(weight: Any, groups: int, dtype: Any) -> Any:
    """``[K, groups, in_per_group, out_per_group]`` matrices from a conv weight."""
    out_channels, in_per_group = weight.shape[0], weight.shape[-1]
    volume = 1
    for size in weight.shape[1:-1]:
        volume *= size
    flat = weight.astype(dtype, copy=False).reshape(groups, out_channels // groups, volume, in_per_group)
    return flat.transpose(2, 0, 3, 1)


def _grouped_product(backend: ArrayBackend, rows: Any, matrices: Any) -> Any:
    """``rows [P, g * a] @ block-diagonal(matrices [g, a, b]) -> [P, g * b]``."""
    groups, in_per_group, out_per_group = matrices.shape
    if groups == 1:
        return backend.matmul(rows, matrices[0])
    count = rows.shape[0]
    split = rows.reshape(count, groups, in_per_group).transpose(1, 0, 2)
    product = backend.matmul(split, matrices)
    return product.transpose(1, 0, 2).reshape(count, groups * out_per_group)


def _grouped_outer(backend: ArrayBackend, left: Any, right: Any, groups: int) -> Any:
    """``[g, a, b]`` per-group products ``left_g^T @ right_g`` for ``left [P, g*a], right [P, g*b]``."""
    count = left.shape[0]
    if groups == 1:
        return backend.matmul(left.T, right)[None]
    left_split = left.reshape(count, groups, -1).transpose(1, 2, 0)
    right_split = right.reshape(count, groups, -1).transpose(1, 0, 2)
    return backend.matmul(left_split, right_split)


def _chunks(backend: ArrayBackend, rulebook: Rulebook | PairMap, in_channels: int,
            out_channels: int) -> tuple[PairChunk, ...]:
    """The backend's chunks of the rulebook's offsets, the identity offset left out.

    A chunk of several offsets is padded with row -1 (`chunk_rows`), so only a
    backend that skips negative rows gets more than one offset per chunk.
    """
    identity = rulebook.identity_offset if rulebook.num_input else -1
    budget = backend.chunk_elements if backend.skips_negative_rows else 0
    return pair_chunks(tuple(rulebook.offset_starts), max(in_channels, out_channels, 1), budget, skip=identity)


def _offset_index(chunk: PairChunk) -> slice | list[int]:
    """Indexes a chunk's offsets along a ``[K, ...]`` axis: a slice (views) when they are consecutive."""
    first, last = chunk.offsets[0], chunk.offsets[-1]
    return slice(first, last + 1) if last - first + 1 == len(chunk.offsets) else list(chunk.offsets)


def _uniform_starts(chunk: PairChunk, width: int) -> tuple[int, ...]:
    """Run starts of the ``[m, W]`` layout: every offset owns ``W`` slots (``W >= 1``)."""
    return tuple(range(0, len(chunk.offsets) * width + 1, width))


def _batched_product(backend: ArrayBackend, rows: Any, matrices: Any) -> Any:
    """``rows [m, W, g * a]`` times block-diagonal ``matrices [m, g, a, b]``: ``[m * W, g * b]``, one batched GEMM."""
    count, width = rows.shape[:2]
    groups, in_per_group, out_per_group = matrices.shape[1:]
    if count == 1:  # one offset: a plain GEMM (NumPy's BLAS path for 2-D operands)
        return _grouped_product(backend, rows[0], matrices[0])
    if groups == 1:
        product = backend.matmul(rows, matrices[:, 0])
        return product.reshape(count * width, out_per_group)
    split = rows.reshape(count, width, groups, in_per_group).transpose(0, 2, 1, 3)
    product = backend.matmul(split, matrices)
    return product.transpose(0, 2, 1, 3).reshape(count * width, groups * out_per_group)


def _batched_outer(backend: ArrayBackend, left: Any, right: Any, groups: int) -> Any:
    """``[m, g, a, b]`` products ``left_g^T @ right_g`` for ``left [m, W, g*a]``, ``right [m, W, g*b]``."""
    count, width = left.shape[:2]
    if count == 1:
        return _grouped_outer(backend, left[0], right[0], groups)[None]
    if groups == 1:
        return backend.matmul(left.transpose(0, 2, 1), right)[:, None]
    left_split = left.reshape(count, width, groups, -1).transpose(0, 2, 3, 1)
    right_split = right.reshape(count, width, groups, -1).transpose(0, 2, 1, 3)
    return backend.matmul(left_split, right_split)


def fused_on_cpu(backend: ArrayBackend, in_channels: int, out_channels: int, groups: int,
                 stage: str = "forward") -> bool:
    """Whether a layer's pass runs the fused CPU dataflow (`sparsecore.backends._cpu_kernels`) rather than BLAS.

    The fused kernels read each neighbour row once and write each output row
    once, with no intermediate arrays, and run on every thread deterministically;
    per-offset BLAS GEMMs win when a layer's matrices are large enough for
    BLAS's blocking to beat a row-at-a-time product (above `FUSED_MAX_MATRIX`),
    and in the backward of narrow layers (up to `FUSED_BACKWARD_MIN_MATRIX`).
    The choice depends on sizes only, never on the thread count, so results stay
    bitwise identical at every thread count (docs/performance.md).

    Args:
        backend: the layer's backend (only the NumPy backend has fused kernels).
        in_channels: input channels.
        out_channels: output channels.
        groups: channel groups.
        stage: ``"forward"`` or ``"backward"``.

    Returns:
        True for the fused dataflow.
    """
    if not isinstance(backend, NumpyBackend):
        return False
    matrix = (in_channels // groups) * (out_channels // groups)
    if stage == "backward" and matrix <= FUSED_BACKWARD_MIN_MATRIX:
        return False
    return matrix <= FUSED_MAX_MATRIX


def _cpu_threads(backend: ArrayBackend) -> contextlib.AbstractContextManager[Any]:
    """On the NumPy backend, BLAS on one thread inside the pass; the pass itself runs offsets in parallel.

    OpenBLAS's results for one product differ in the last bits between processes
    started with different thread counts; one BLAS thread per product, with the
    products of several offsets computed side by side (`_map_in_order`), keeps
    every CPU pass bitwise identical at every thread count.
    """
    if isinstance(backend, NumpyBackend):
        return threads.blas_threads(1)
    return contextlib.nullcontext()


def _workers(backend: ArrayBackend, rulebook: Rulebook | PairMap, in_channels: int, out_channels: int) -> int:
    """How many offsets a pass computes side by side: `sparsecore.threads`' count on the CPU, else 1.

    Layers below `_cpu_kernels.SERIAL_MAX_WORK` (pairs times channels) run on the calling thread:
    starting workers costs more than they save there.
    """
    if not isinstance(backend, NumpyBackend):
        return 1
    if rulebook.num_pairs * (in_channels + out_channels) < _cpu_kernels.SERIAL_MAX_WORK:
        return 1
    return threads.get_num_threads()


def _map_in_order(workers: int, function: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """``[function(item) for item in items]``, on ``workers`` threads when more than one (results in order)."""
    if workers <= 1 or len(items) <= 1:
        return [function(item) for item in items]
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        return list(pool.map(function, items))


def _waves(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    """``items`` cut into consecutive groups of ``size`` (at least 1)."""
    size = max(1, size)
    return [items[start:start + size] for start in range(0, len(items), size)]


def _fused_forward(source: Any, matrices: Any, rulebook: Rulebook | PairMap, out: Any) -> None:
    """``out += conv(source)``, output-stationary over the rulebook's neighbour table."""
    table = _cpu_kernels.neighbour_table(rulebook.pair_output, rulebook.pair_input, tuple(rulebook.offset_starts),
                                         rulebook.num_output)
    _cpu_kernels.accumulate_rows(source, table, matrices, out, rulebook.num_pairs)


def _fused_backward(backend: ArrayBackend, source: Any, grad: Any, matrices: Any,
                    rulebook: Rulebook | PairMap) -> tuple[Any, Any]:
    """d-features input-stationary over the transposed map (fused); d-weights one BLAS GEMM per offset.

    Per-offset ``gathered_source^T @ gathered_grad`` on BLAS beat a compiled
    blocked outer-product kernel 2-4x at 16 and 64 channels (docs/performance.md).
    """
    xp = backend.xp
    starts = tuple(rulebook.offset_starts)
    table = _cpu_kernels.neighbour_table(rulebook.pair_input, rulebook.pair_output, starts, rulebook.num_input)
    grad_features = xp.zeros(source.shape, dtype=source.dtype)
    transposed = xp.ascontiguousarray(matrices.transpose(0, 1, 3, 2))
    _cpu_kernels.accumulate_rows(grad, table, transposed, grad_features, rulebook.num_pairs)
    groups = matrices.shape[1]
    grad_matrices = xp.zeros(matrices.shape, dtype=source.dtype)

    def outer(offset: int) -> Any:
        start, stop = starts[offset], starts[offset + 1]
        gathered_source = backend.gather_rows(source, rulebook.pair_input[start:stop])
        gathered_grad = backend.gather_rows(grad, rulebook.pair_output[start:stop])
        return _grouped_outer(backend, gathered_source, gathered_grad, groups)

    offsets = [offset for offset in range(len(starts) - 1) if starts[offset + 1] > starts[offset]]
    workers = _workers(backend, rulebook, source.shape[1], grad.shape[1])
    for offset, product in zip(offsets, _map_in_order(workers, outer, offsets)):
        grad_matrices[offset] = product
    return grad_features, grad_matrices


def conv_forward(features: Any, weight: Any, rulebook: Rulebook | PairMap, bias: Any | None = None,
                 groups: int = 1, *, backend: ArrayBackend | None = None) -> Any:
    """Sparse convolution forward: ``out[o] += features[i] @ W_k`` for each pair ``(i, o)`` of offset ``k``.

    Args:
        features: ``[N_in, C_in]`` float16/32/64.
        weight: ``[C_out, *kernel_size, C_in // groups]``.
        rulebook: the layer's `Rulebook` or `PairMap` (``num_input == N_in``).
        bias: optional ``[C_out]``.
        groups: channel groups (``C_in`` and ``C_out`` divisible by it).
        backend: the primitives to run on; by default the backend of ``features``.

    Returns:
        ``[N_out, C_out]`` in the features' dtype.
    """
    features = as_features(features, rulebook.num_input)
    weight = check_conv_weight(weight, rulebook, features.shape[1], groups)
    if bias is not None:
        bias = to_core_array(bias, "bias")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape [{weight.shape[0]}] (out_channels), got {tuple(bias.shape)}")
    check_same_device(features=features, weight=weight, bias=bias, indices=rulebook.pair_input)
    backend = backend if backend is not None else backend_for(features)
    check_padded_pairs(rulebook, backend)
    with _cpu_threads(backend):
        return _forward_pass(backend, features, weight, rulebook, bias, groups)


def _forward_pass(backend: ArrayBackend, features: Any, weight: Any, rulebook: Rulebook | PairMap,
                  bias: Any | None, groups: int) -> Any:
    """`conv_forward` on checked arguments."""
    xp = backend.xp
    dtype = backend.compute_dtype(features.dtype)
    # contiguous operands keep the GEMMs on BLAS (a stride-0 or strided view,
    # e.g. an expanded autograd gradient, drops NumPy to a slow generic loop)
    source = xp.ascontiguousarray(features, dtype=dtype)
    matrices = _offset_matrices(weight, groups, dtype)
    if fused_on_cpu(backend, features.shape[1], weight.shape[0], groups):
        out = xp.zeros((rulebook.num_output, weight.shape[0]), dtype=dtype)
        if bias is not None:
            out += bias.astype(dtype, copy=False)
        _fused_forward(source, xp.ascontiguousarray(matrices), rulebook, out)
        return out.astype(features.dtype, copy=False)
    identity = rulebook.identity_offset
    if identity >= 0 and rulebook.num_input:
        # the identity offset covers every row: its product initialises the output
        out = xp.ascontiguousarray(_grouped_product(backend, source, matrices[identity]))
    else:
        out = xp.zeros((rulebook.num_output, weight.shape[0]), dtype=dtype)

    def product(chunk: PairChunk) -> tuple[Any, Any, int]:
        input_rows, output_rows = chunk_rows(xp, (rulebook.pair_input, rulebook.pair_output), chunk)  # [m, W]
        count, width = input_rows.shape
        gathered = backend.gather_rows(source, input_rows.reshape(-1)).reshape(count, width, -1)
        return output_rows, _batched_product(backend, gathered, matrices[_offset_index(chunk)]), width

    workers = _workers(backend, rulebook, features.shape[1], weight.shape[0])
    for wave in _waves(_chunks(backend, rulebook, features.shape[1], weight.shape[0]), workers):
        # products side by side, scatters in offset order: the sums do not depend on the workers
        for chunk, (output_rows, products, width) in zip(wave, _map_in_order(workers, product, wave)):
            backend.scatter_add_pairs(out, output_rows.reshape(-1), products, _uniform_starts(chunk, width))
    if bias is not None:
        out += bias.astype(dtype, copy=False)
    return out.astype(features.dtype, copy=False)


def conv_backward(grad_output: Any, features: Any, weight: Any, rulebook: Rulebook | PairMap,
                  groups: int = 1, *, backend: ArrayBackend | None = None) -> tuple[Any, Any]:
    """Gradients of `conv_forward` with respect to the features and the weight.

    Args:
        grad_output: ``[N_out, C_out]``.
        features: ``[N_in, C_in]``, as passed to the forward.
        weight: ``[C_out, *kernel_size, C_in // groups]``.
        rulebook: the layer's rulebook.
        groups: channel groups.
        backend: the primitives to run on; by default the backend of ``features``.

    Returns:
        ``(grad_features [N_in, C_in], grad_weight [C_out, *kernel_size, C_in // groups])``
        in the dtypes of ``features`` and ``weight``. (The bias gradient is
        ``grad_output.sum(0)``.)
    """
    features = as_features(features, rulebook.num_input)
    weight = check_conv_weight(weight, rulebook, features.shape[1], groups)
    grad_output = as_features(grad_output, rulebook.num_output, name="grad_output",
                              rows_meaning="output site of the rulebook")
    if grad_output.shape[1] != weight.shape[0]:
        raise ValueError(
            f"grad_output has {grad_output.shape[1]} channels but the weight has "
            f"{weight.shape[0]} output channels"
        )
    check_same_device(grad_output=grad_output, features=features, weight=weight)
    backend = backend if backend is not None else backend_for(features)
    check_padded_pairs(rulebook, backend)
    with _cpu_threads(backend):
        return _backward_pass(backend, grad_output, features, weight, rulebook, groups)


def _backward_pass(backend: ArrayBackend, grad_output: Any, features: Any, weight: Any,
                   rulebook: Rulebook | PairMap, groups: int) -> tuple[Any, Any]:
    """`conv_backward` on checked arguments."""
    xp = backend.xp
    dtype = backend.compute_dtype(features.dtype)
    source = xp.ascontiguousarray(features, dtype=dtype)
    grad = xp.ascontiguousarray(grad_output, dtype=dtype)
    matrices = _offset_matrices(weight, groups, dtype)
    out_channels = weight.shape[0]
    if fused_on_cpu(backend, features.shape[1], out_channels, groups, "backward"):
        grad_features, grad_matrices = _fused_backward(backend, source, grad, xp.ascontiguousarray(matrices), rulebook)
        return (grad_features.astype(features.dtype, copy=False),
                _weight_from_matrices(grad_matrices, weight).astype(weight.dtype, copy=False))
    transposed = matrices.transpose(0, 1, 3, 2)
    grad_matrices = xp.zeros(matrices.shape, dtype=dtype)
    identity = rulebook.identity_offset
    if identity >= 0 and rulebook.num_input:
        grad_features = xp.ascontiguousarray(_grouped_product(backend, grad, transposed[identity]))
        grad_matrices[identity] = _grouped_outer(backend, source, grad, groups)
    else:
        grad_features = xp.zeros(source.shape, dtype=dtype)

    def products(chunk: PairChunk) -> tuple[Any, Any, Any, int]:
        input_rows, output_rows = chunk_rows(xp, (rulebook.pair_input, rulebook.pair_output), chunk)  # [m, W]
        count, width = input_rows.shape
        gathered_grad = backend.gather_rows(grad, output_rows.reshape(-1)).reshape(count, width, -1)
        gathered_source = backend.gather_rows(source, input_rows.reshape(-1)).reshape(count, width, -1)
        return (input_rows, _batched_product(backend, gathered_grad, transposed[_offset_index(chunk)]),
                _batched_outer(backend, gathered_source, gathered_grad, groups), width)

    workers = _workers(backend, rulebook, features.shape[1], weight.shape[0])
    for wave in _waves(_chunks(backend, rulebook, features.shape[1], weight.shape[0]), workers):
        for chunk, (input_rows, rows_product, outer, width) in zip(wave, _map_in_order(workers, products, wave)):
            backend.scatter_add_pairs(grad_features, input_rows.reshape(-1), rows_product,
                                      _uniform_starts(chunk, width))
            grad_matrices[_offset_index(chunk)] = outer
    grad_weight = _weight_from_matrices(grad_matrices, weight)
    return grad_features.astype(features.dtype, copy=False), grad_weight.astype(weight.dtype, copy=False)


def _weight_from_matrices(grad_matrices: Any, weight: Any) -> Any:
    """``[K, g, a, b]`` per-offset matrices back in the weight's layout ``[C_out, *kernel_size, a]``."""
    return grad_matrices.transpose(1, 3, 0, 2).reshape(
        (weight.shape[0],) + tuple(weight.shape[1:-1]) + (weight.shape[-1],))
