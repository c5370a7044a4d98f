"""spconv 2.x (CPU build) as the peer the CPU benchmark compares against.

Imported only when the comparison runs: it imports torch and spconv. Two
measured defects of spconv's CPU build are worked around here, inside
``spconv_session`` only, and undone when it closes:

- results are wrong with more than one torch thread (a race in its CPU
  scatter-add), so torch runs single-threaded;
- its CPU backward calls ``torch.cuda.current_stream()``, which fails with a
  CPU-only torch, so ``spconv.pytorch.ops.get_current_stream`` is replaced by
  a function returning stream 0.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from sparsecore.benchmark.cases import LayerSpec, VoxelizeSpec
from sparsecore.benchmark.clocks import HostClock, TimedWork

__all__ = [
    "spconv_unavailable_reason",
    "spconv_session",
    "SpconvLayer",
    "prepare_spconv_layer",
    "SpconvVoxelize",
    "prepare_spconv_voxelize",
]


def spconv_unavailable_reason() -> str | None:
    """Why spconv cannot be compared against, or None when it can.

    Returns:
        None when ``torch`` and ``spconv.pytorch`` import, else the import error's text.
    """
    try:
        import spconv.pytorch  # noqa: F401
        import torch  # noqa: F401
    except Exception as error:  # spconv raises more than ImportError when its build is broken
        return f"{type(error).__name__}: {error}"
    return None


def _cpu_stream() -> int:
    return 0


@contextlib.contextmanager
def spconv_session() -> Iterator[Any]:
    """Prepares torch and spconv for correct CPU runs, and restores them after.

    Yields:
        The ``torch`` module.
    """
    import spconv.pytorch.ops as spconv_ops
    import torch

    previous_threads = torch.get_num_threads()
    previous_stream_getter = getattr(spconv_ops, "get_current_stream", None)
    torch.set_num_threads(1)
    if previous_stream_getter is not None:
        spconv_ops.get_current_stream = _cpu_stream
    try:
        yield torch
    finally:
        torch.set_num_threads(previous_threads)
        if previous_stream_getter is not None:
            spconv_ops.get_current_stream = previous_stream_getter


@dataclass(frozen=True)
class SpconvLayer:
    """One spconv layer, ready to be timed beside sparsecore's, and its results.

    Attributes:
        rulebook: ``ops.get_indice_pairs``, as the module calls it.
        forward: the feature pass given the rulebook (no autograd graph).
        backward: the backward pass given the rulebook (a fresh graph per run, built untimed).
        output_indices: int32 ``[N_out, 4]`` from the layer's end-to-end forward.
        output_features: ``[N_out, C_out]``, rows matching ``output_indices``.
        grad_features: ``[N_in, C_in]`` gradient for ``grad_output``.
        grad_weight: gradient of the weight, spconv layout ``[out, k, k, k, in]``.
    """

    rulebook: TimedWork
    forward: TimedWork
    backward: TimedWork
    output_indices: np.ndarray
    output_features: np.ndarray
    grad_features: np.ndarray
    grad_weight: np.ndarray


def _lexicographic_order(indices: np.ndarray) -> np.ndarray:
    return np.lexsort(indices.T[::-1])


def prepare_spconv_layer(
    torch: Any,
    layer: LayerSpec,
    features: np.ndarray,
    indices: np.ndarray,
    spatial_shape: tuple[int, ...],
    batch_size: int,
    weight: np.ndarray,
    sorted_output_indices: np.ndarray,
    grad_output_sorted: np.ndarray,
) -> SpconvLayer:
    """Runs one layer in spconv with sparsecore's weight, and prepares its stages for timing.

    Args:
        torch: the torch module (from ``spconv_session``).
        layer: the layer to build (``bias=False``).
        features: ``[N_in, C_in]`` input features.
        indices: int32 ``[N_in, 4]`` input sites.
        spatial_shape: the input grid (z, y, x).
        batch_size: number of batch elements.
        weight: ``[out, k, k, k, in]``, copied into the spconv layer.
        sorted_output_indices: sparsecore's output sites, sorted, to align the
            gradient of the output with spconv's row order.
        grad_output_sorted: gradient of the output for those sorted sites.

    Returns:
        The stages to time, spconv's outputs and gradients (input rows in input order).

    Raises:
        ValueError: when spconv's output sites differ from sparsecore's, so the
            output gradient cannot be aligned.
    """
    import spconv.pytorch as spconv
    from spconv.core import ConvAlgo
    from spconv.pytorch import functional as spconv_functional
    from spconv.pytorch import ops as spconv_ops

    layer_class = spconv.SubMConv3d if layer.kind == "subm" else spconv.SparseConv3d
    module = layer_class(
        layer.in_channels,
        layer.out_channels,
        layer.kernel_size,
        stride=layer.stride,
        padding=layer.padding,
        bias=False,
        algo=ConvAlgo.Native,
    )
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(np.ascontiguousarray(weight)))
    indices_tensor = torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int32))
    shape = [int(size) for size in spatial_shape]

    # End-to-end forward through the module: the outputs to compare.
    input_features = torch.from_numpy(np.ascontiguousarray(features)).requires_grad_(True)
    output = module(spconv.SparseConvTensor(input_features, indices_tensor, shape, batch_size))
    output_indices = output.indices.numpy().astype(np.int32)
    order = _lexicographic_order(output_indices)
    if output_indices.shape != sorted_output_indices.shape or not np.array_equal(
        output_indices[order], sorted_output_indices
    ):
        raise ValueError(
            f"spconv found {len(output_indices)} output sites and sparsecore "
            f"{len(sorted_output_indices)}, not the same set"
        )
    grad_output = np.empty_like(grad_output_sorted)
    grad_output[order] = grad_output_sorted
    grad_output_tensor = torch.from_numpy(grad_output)
    output.features.backward(grad_output_tensor)
    grad_features = input_features.grad.numpy().copy()
    grad_weight = module.weight.grad.numpy().copy()
    output_features = output.features.detach().numpy().copy()

    # Stage timings, as the module does them for the Native algorithm.
    def build_pairs() -> Any:
        return spconv_ops.get_indice_pairs(
            indices_tensor,
            batch_size,
            shape,
            ConvAlgo.Native,
            [layer.kernel_size] * 3,
            [layer.stride] * 3,
            [layer.padding] * 3,
            [1] * 3,
            [0] * 3,
            layer.kind == "subm",
            False,
        )

    output_ids, pairs, pair_counts = build_pairs()
    num_output = int(output_ids.shape[0])
    feature_pass = (
        spconv_functional.indice_subm_conv if layer.kind == "subm" else spconv_functional.indice_conv
    )
    weight_tensor = module.weight.detach()

    def forward() -> Any:
        with torch.no_grad():
            return feature_pass(input_features.detach(), weight_tensor, pairs, pair_counts, num_output, ConvAlgo.Native)

    def fresh_graph() -> Any:
        leaf_features = input_features.detach().requires_grad_(True)
        leaf_weight = weight_tensor.clone().requires_grad_(True)
        return feature_pass(leaf_features, leaf_weight, pairs, pair_counts, num_output, ConvAlgo.Native)

    clock = HostClock()
    return SpconvLayer(
        TimedWork(clock, lambda _: build_pairs()),
        TimedWork(clock, lambda _: forward()),
        TimedWork(clock, lambda graph_output: graph_output.backward(grad_output_tensor), fresh_graph),
        output_indices,
        output_features,
        grad_features,
        grad_weight,
    )


@dataclass(frozen=True)
class SpconvVoxelize:
    """spconv's ``PointToVoxel``, ready to be timed, and its output.

    Attributes:
        voxelize: one call.
        coordinates: int32 ``[M, 3]`` voxel coordinates (z, y, x).
        num_points_per_voxel: ``[M]`` point counts.
    """

    voxelize: TimedWork
    coordinates: np.ndarray
    num_points_per_voxel: np.ndarray


def prepare_spconv_voxelize(torch: Any, spec: VoxelizeSpec, points: np.ndarray) -> SpconvVoxelize:
    """Voxelizes with spconv's ``PointToVoxel``, and prepares the call for timing.

    Args:
        torch: the torch module (from ``spconv_session``).
        spec: voxel size, range and capacities.
        points: float32 ``[P, F]`` points, x, y, z first.

    Returns:
        The call to time and spconv's voxel coordinates.
    """
    from spconv.pytorch.utils import PointToVoxel

    generator = PointToVoxel(
        vsize_xyz=list(spec.voxel_size),
        coors_range_xyz=list(spec.coordinate_range),
        num_point_features=points.shape[1],
        max_num_voxels=spec.max_num_voxels,
        max_num_points_per_voxel=spec.max_num_points_per_voxel,
    )
    points_tensor = torch.from_numpy(np.ascontiguousarray(points))
    _, coordinates, num_points = generator(points_tensor)
    return SpconvVoxelize(TimedWork(HostClock(), lambda _: generator(points_tensor)),
                          coordinates.numpy().astype(np.int32).copy(), num_points.numpy().copy())
