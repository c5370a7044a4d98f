"""Sparse convolution feature passes over a rulebook: fused map kernels on the GPU, gather-GEMM-scatter on the CPU.

Given a rulebook (a `Rulebook`, `PairMap` or `NeighbourMap`), these are plain
functions of (features, weight) with static output shapes: what PyTorch
autograd and JAX ``custom_vjp`` wrap. Weights are
``[out_channels, *kernel_size, in_channels // groups]`` (checked by
`sparsecore.conv_weight`, whose checks are re-exported here).

On a kernel backend (the GPU, or its CPU emulation) each pass is fused kernels
over the rulebook's neighbour map (`sparsecore._rulebook_views.map_view`):
the forward one ``sc_implicit_gemm`` launch (bias in its epilogue), the
backward one for the input gradient and one ``sc_weight_gradient``
(`sparsecore.backends._kernel_fused`): no cuBLAS call, no gathered rows, no
scatter, bitwise reproducible.

On the NumPy backend, the dataflow over pairs: the kernel offsets are taken
in chunks (`sparsecore._chunks`, sized by the backend): per chunk one gather of its input rows laid out ``[m, W]``
(``m`` offsets padded to ``W`` pairs with row -1), one batched GEMM
``[m, W, a] @ [m, a, b]`` (`sparsecore._conv_products`), and one
`scatter_add_planned` of the products; the layout and its scatter plan are
built once per rulebook (`sparsecore._conv_products.chunk_layout`). A submanifold centre offset (every row to
itself) is a plain GEMM that initialises the output. Products run in
``backend.compute_dtype`` (float32 for float16 inputs).

On the CPU (NumPy backend), `sparsecore.cpu_dataflow.dataflow_on_cpu` chooses per
layer and stage between that dataflow and two compiled ones: ``"tiled"`` (every
ungrouped layer: per block of destination rows and per offset, the paired rows copied
into a cached tile, one BLAS GEMM, the products added into the block, over a tile plan
built once per rulebook) and ``"fused"`` (grouped layers: compiled row loops over a
neighbour table built once per rulebook). The per-offset products run side
by side on `sparsecore.threads`' thread count, summed in offset order: results are
bitwise identical at every thread count.
"""

from __future__ import annotations

from typing import Any

from ._chunks import PairChunk, check_padded_pairs
from ._conv_products import (
    ChunkLayout,
    batched_outer,
    batched_product,
    chunk_layout,
    grouped_outer,
    grouped_product,
    offset_chunks,
    offset_index,
    offset_matrices,
    weight_from_matrices,
)
from ._capacity_builds import exact_of, padded_rows
from ._dispatch import check_same_device, to_core_array
from ._rulebook_views import index_rows, map_view, pair_view, refuse_bfloat16, runs_fused_passes
from ._validation import as_features
from .backends import ArrayBackend, backend_for
from .bf16_cpu_dataflow import bfloat16_route, check_bfloat16_operands, dot_backward, dot_forward, is_bfloat16
from .conv_weight import check_conv_weight, check_weight_layout
from .cpu_dataflow import (
    FUSED_GROUPED_BACKWARD_MAX_MATRIX,
    FUSED_MAX_MATRIX,
    cpu_blas_threads,
    dataflow_on_cpu,
    fused_backward,
    fused_forward,
    fused_on_cpu,
    map_in_order,
    pass_workers,
    tiled_backward,
    tiled_forward,
    waves,
)
from .memory_budget import check_pass
from .neighbour_map import NeighbourMap
from .rulebook import PairMap, Rulebook
from .threads import serialised_kernels

__all__ = ["conv_forward", "conv_backward", "check_conv_weight", "check_weight_layout", "fused_on_cpu",
           "dataflow_on_cpu", "FUSED_MAX_MATRIX", "FUSED_GROUPED_BACKWARD_MAX_MATRIX"]


def conv_forward(features: Any, weight: Any, rulebook: Rulebook | PairMap | NeighbourMap, bias: Any | None = None,
                 groups: int = 1, *, backend: ArrayBackend | None = None) -> Any:
    """Sparse convolution forward: ``out[o] += features[i] @ W_k`` for each pair ``(i, o)`` of offset ``k``.

    Args:
        features: ``[N_in, C_in]`` float16/32/64, or bfloat16 (``ml_dtypes.bfloat16``; then the weight
            too) on the NumPy backend and the kernel backend.
        weight: ``[C_out, *kernel_size, C_in // groups]``.
        rulebook: the layer's `Rulebook`, `PairMap` or `NeighbourMap` (``num_input == N_in``).
        bias: optional ``[C_out]``.
        groups: channel groups (``C_in`` and ``C_out`` divisible by it).
        backend: the primitives to run on; by default the backend of ``features``.

    Returns:
        ``[N_out, C_out]`` in the features' dtype.
    """
    features = as_features(features, rulebook.num_input, bfloat16=True)
    weight = check_conv_weight(weight, rulebook, features.shape[1], groups)
    if bias is not None:
        bias = to_core_array(bias, "bias")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape [{weight.shape[0]}] (out_channels), got {tuple(bias.shape)}")
    check_same_device(features=features, weight=weight, bias=bias, indices=index_rows(rulebook))
    backend = backend if backend is not None else backend_for(features)
    if runs_fused_passes(backend):  # one sc_implicit_gemm launch over the map
        return backend.fused_passes.conv_forward(features, weight, map_view(rulebook, backend.xp), bias, groups)
    exact = exact_of(rulebook)
    if exact is not None:  # a padded capacity build on the host: the exact pass on the true rows, then padding
        out = conv_forward(features[:exact.num_input], weight, exact, bias, groups, backend=backend)
        return padded_rows(out, rulebook.num_output, 0 if bias is None else bias.astype(out.dtype, copy=False))
    refuse_bfloat16(backend, features=features, weight=weight, bias=bias)
    check_bfloat16_operands(features=features, weight=weight)
    rulebook = pair_view(rulebook)
    check_padded_pairs(rulebook, backend)
    check_pass("conv_forward", rulebook.num_output, weight.shape[0], rulebook.num_input, features.shape[1], features)
    with serialised_kernels(features), cpu_blas_threads(backend):
        route = bfloat16_route(backend, features.shape[1], weight.shape[0], groups, rulebook.num_pairs) if (
            is_bfloat16(features.dtype)) else "widened"
        if route != "widened":  # sparsecore.bf16_cpu_dataflow: AMX tiles or vdpbf16ps
            return dot_forward(features, weight, rulebook, bias, route)
        return _forward_pass(backend, features, weight, rulebook, bias, groups)


def _forward_pass(backend: ArrayBackend, features: Any, weight: Any, rulebook: Rulebook | PairMap,
                  bias: Any | None, groups: int) -> Any:
    """`conv_forward` on checked arguments."""
    xp = backend.xp
    dtype = backend.compute_dtype(features.dtype)
    # contiguous operands keep the GEMMs on BLAS (a stride-0 or strided view,
    # e.g. an expanded autograd gradient, drops NumPy to a slow generic loop)
    source = xp.ascontiguousarray(features, dtype=dtype)
    matrices = offset_matrices(weight, groups, dtype)
    dataflow = dataflow_on_cpu(backend, features.shape[1], weight.shape[0], groups)
    if dataflow != "per_offset":
        if bias is None:
            out = xp.zeros((rulebook.num_output, weight.shape[0]), dtype=dtype)
        else:  # the bias is where the sums start (one write instead of zeros plus an add)
            out = xp.empty((rulebook.num_output, weight.shape[0]), dtype=dtype)
            out[...] = bias.astype(dtype, copy=False)
        flow = fused_forward if dataflow == "fused" else tiled_forward
        flow(source, xp.ascontiguousarray(matrices), rulebook, out)
        return out.astype(features.dtype, copy=False)
    identity = rulebook.identity_offset
    if identity >= 0 and rulebook.num_input:
        # the identity offset covers every row: its product initialises the output
        out = xp.ascontiguousarray(grouped_product(backend, source, matrices[identity]))
    else:
        out = xp.zeros((rulebook.num_output, weight.shape[0]), dtype=dtype)

    def product(chunk: PairChunk) -> tuple[ChunkLayout, Any]:
        layout = chunk_layout(backend, rulebook, chunk, "forward")  # [m, W] rows, kept per rulebook
        gathered = backend.gather_rows(source, layout.input_rows).reshape(layout.count, layout.width, -1)
        return layout, batched_product(backend, gathered, matrices[offset_index(chunk)])

    workers = pass_workers(backend, rulebook, features.shape[1], weight.shape[0])
    for wave in waves(offset_chunks(backend, rulebook, features.shape[1], weight.shape[0]), workers):
        # products side by side, scatters in offset order: the sums do not depend on the workers
        for layout, products in map_in_order(workers, product, wave):
            backend.scatter_add_planned(out, layout.scatter, products)
    if bias is not None:
        out += bias.astype(dtype, copy=False)
    return out.astype(features.dtype, copy=False)


def conv_backward(grad_output: Any, features: Any, weight: Any, rulebook: Rulebook | PairMap | NeighbourMap,
                  groups: int = 1, *, backend: ArrayBackend | None = None) -> tuple[Any, Any]:
    """Gradients of `conv_forward` with respect to the features and the weight.

    Args:
        grad_output: ``[N_out, C_out]``.
        features: ``[N_in, C_in]``, as passed to the forward.
        weight: ``[C_out, *kernel_size, C_in // groups]``.
        rulebook: the layer's `Rulebook`, `PairMap` or `NeighbourMap`.
        groups: channel groups.
        backend: the primitives to run on; by default the backend of ``features``.

    Returns:
        ``(grad_features [N_in, C_in], grad_weight [C_out, *kernel_size, C_in // groups])``
        in the dtypes of ``features`` and ``weight``. (The bias gradient is
        ``grad_output.sum(0)``.)
    """
    features = as_features(features, rulebook.num_input, bfloat16=True)
    weight = check_conv_weight(weight, rulebook, features.shape[1], groups)
    grad_output = as_features(grad_output, rulebook.num_output, name="grad_output",
                              rows_meaning="output site of the rulebook", bfloat16=True)
    if grad_output.shape[1] != weight.shape[0]:
        raise ValueError(
            f"grad_output has {grad_output.shape[1]} channels but the weight has "
            f"{weight.shape[0]} output channels"
        )
    check_same_device(grad_output=grad_output, features=features, weight=weight)
    backend = backend if backend is not None else backend_for(features)
    if runs_fused_passes(backend):  # input gradient and weight gradient: one launch each
        grad_features, grad_weight = backend.fused_passes.conv_backward(grad_output, features, weight,
                                                                        map_view(rulebook, backend.xp), groups)
        return grad_features, grad_weight if grad_weight.dtype == weight.dtype else grad_weight.astype(weight.dtype)
    exact = exact_of(rulebook)
    if exact is not None:  # a padded capacity build on the host: the exact pass on the true rows
        grad_features, grad_weight = conv_backward(grad_output[:exact.num_output], features[:exact.num_input],
                                                   weight, exact, groups, backend=backend)
        return padded_rows(grad_features, rulebook.num_input), grad_weight
    refuse_bfloat16(backend, features=features, weight=weight, grad_output=grad_output)
    check_bfloat16_operands(features=features, weight=weight, grad_output=grad_output)
    rulebook = pair_view(rulebook)
    check_padded_pairs(rulebook, backend)
    check_pass("conv_backward", rulebook.num_input, features.shape[1], rulebook.num_output, weight.shape[0], features)
    with serialised_kernels(features), cpu_blas_threads(backend):
        route = bfloat16_route(backend, features.shape[1], weight.shape[0], groups, rulebook.num_pairs) if (
            is_bfloat16(features.dtype)) else "widened"
        if route != "widened":
            return dot_backward(grad_output, features, weight, rulebook, route)
        return _backward_pass(backend, grad_output, features, weight, rulebook, groups)


def _backward_pass(backend: ArrayBackend, grad_output: Any, features: Any, weight: Any,
                   rulebook: Rulebook | PairMap, groups: int) -> tuple[Any, Any]:
    """`conv_backward` on checked arguments."""
    xp = backend.xp
    dtype = backend.compute_dtype(features.dtype)
    source = xp.ascontiguousarray(features, dtype=dtype)
    grad = xp.ascontiguousarray(grad_output, dtype=dtype)
    matrices = offset_matrices(weight, groups, dtype)
    out_channels = weight.shape[0]
    dataflow = dataflow_on_cpu(backend, features.shape[1], out_channels, groups, "backward")
    if dataflow != "per_offset":
        if dataflow == "fused":
            grad_features, grad_matrices = fused_backward(backend, source, grad, xp.ascontiguousarray(matrices),
                                                          rulebook)
        else:
            grad_features, grad_matrices = tiled_backward(source, grad, matrices, rulebook)
        return (grad_features.astype(features.dtype, copy=False),
                weight_from_matrices(grad_matrices, weight).astype(weight.dtype, copy=False))
    transposed = matrices.transpose(0, 1, 3, 2)
    grad_matrices = xp.zeros(matrices.shape, dtype=dtype)
    identity = rulebook.identity_offset
    if identity >= 0 and rulebook.num_input:
        grad_features = xp.ascontiguousarray(grouped_product(backend, grad, transposed[identity]))
        grad_matrices[identity] = grouped_outer(backend, source, grad, groups)
    else:
        grad_features = xp.zeros(source.shape, dtype=dtype)

    def products(chunk: PairChunk) -> tuple[ChunkLayout, Any, Any]:
        layout = chunk_layout(backend, rulebook, chunk, "backward")  # [m, W] rows, kept per rulebook
        shape = (layout.count, layout.width, -1)
        gathered_grad = backend.gather_rows(grad, layout.output_rows).reshape(shape)
        gathered_source = backend.gather_rows(source, layout.input_rows).reshape(shape)
        outer = batched_outer(backend, gathered_source, gathered_grad, groups)
        return layout, batched_product(backend, gathered_grad, transposed[offset_index(chunk)]), outer

    workers = pass_workers(backend, rulebook, features.shape[1], weight.shape[0])
    for wave in waves(offset_chunks(backend, rulebook, features.shape[1], weight.shape[0]), workers):
        for chunk, (layout, rows_product, outer) in zip(wave, map_in_order(workers, products, wave)):
            backend.scatter_add_planned(grad_features, layout.scatter, rows_product)
            grad_matrices[offset_index(chunk)] = outer
    grad_weight = weight_from_matrices(grad_matrices, weight)
    return grad_features.astype(features.dtype, copy=False), grad_weight.astype(weight.dtype, copy=False)
