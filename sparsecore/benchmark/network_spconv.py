"""The reference network in spconv 2.x, with sparsecore's weights, as the peer it is timed against.

Imported only when the comparison runs (it imports torch and spconv). The
network is spconv's own modules: SubMConv3d with the indice_keys ``c0`` ..
``c6`` and SparseMaxPool3d(2, 2), in a SparseSequential, every weight copied
from sparsecore's. On the GPU it runs on torch CUDA tensors (float16 through
``.half()``; TF32 through ``spconv.constants.SPCONV_ALLOW_TF32`` and torch's
``allow_tf32``), timed with torch CUDA events; on the CPU inside
`peer_spconv.spconv_session` (one torch thread, and the stream getter its CPU
backward needs), timed with the host clock. As in spconv's benchmark, the
forward runs under ``torch.no_grad`` on a fresh SparseConvTensor, so every
rulebook is built inside the timed region.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from sparsecore.benchmark.clocks import HostClock, TimedWork, TorchEventClock
from sparsecore.benchmark.network import NetworkLayer

__all__ = [
    "SPCONV_ALGORITHMS",
    "spconv_network_session",
    "SpconvNetwork",
    "prepare_spconv_network",
    "spconv_subm_peak_bytes",
]

# --spconv-algo names -> spconv.core.ConvAlgo member names
SPCONV_ALGORITHMS = {"native": "Native", "implicit_gemm": "MaskImplicitGemm"}


@contextlib.contextmanager
def spconv_network_session(device_name: str, dtype_name: str) -> Iterator[Any]:
    """Prepares torch and spconv for one device and dtype, and restores them after.

    Args:
        device_name: ``"cpu"`` or ``"cuda"``.
        dtype_name: ``"float32"``, ``"float16"`` or ``"tf32"`` (TF32 allowed only for the last).

    Yields:
        The ``torch`` module.

    Raises:
        RuntimeError: for ``"cuda"`` when torch sees no GPU.
    """
    if device_name == "cpu":
        from sparsecore.benchmark.peer_spconv import spconv_session

        with spconv_session() as torch:
            yield torch
        return
    import spconv.constants as spconv_constants
    import spconv.pytorch  # noqa: F401
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("spconv on cuda needs torch with a CUDA GPU")
    allow = dtype_name == "tf32"
    previous = (getattr(spconv_constants, "SPCONV_ALLOW_TF32", False), torch.backends.cuda.matmul.allow_tf32,
                torch.backends.cudnn.allow_tf32)
    spconv_constants.SPCONV_ALLOW_TF32 = allow
    torch.backends.cuda.matmul.allow_tf32 = allow
    torch.backends.cudnn.allow_tf32 = allow
    try:
        yield torch
    finally:
        spconv_constants.SPCONV_ALLOW_TF32 = previous[0]
        torch.backends.cuda.matmul.allow_tf32 = previous[1]
        torch.backends.cudnn.allow_tf32 = previous[2]


@dataclass(frozen=True)
class SpconvNetwork:
    """spconv's network, ready to be timed beside sparsecore's, and its results.

    Attributes:
        algorithm: the ``--spconv-algo`` name.
        forward: the forward, rulebooks included (no autograd graph).
        backward: the backward (a fresh graph per run, built untimed).
        output_indices: int32 ``[N_out, 4]`` in spconv's row order.
        output_features: float32 ``[N_out, 256]`` rows matching ``output_indices``.
        grad_features: float32 ``[N, 3]`` gradient of the input features.
    """

    algorithm: str
    forward: TimedWork
    backward: TimedWork
    output_indices: np.ndarray
    output_features: np.ndarray
    grad_features: np.ndarray


def _lexicographic_order(indices: np.ndarray) -> np.ndarray:
    return np.lexsort(indices.T[::-1])


def _build_network(torch: Any, layers: tuple[NetworkLayer, ...], weights: tuple[Any, ...], algorithm: Any,
                   device: Any, dtype: Any) -> Any:
    import spconv.pytorch as spconv

    modules = []
    for layer, weight in zip(layers, weights):
        if layer.kind == "subm":
            module = spconv.SubMConv3d(layer.in_channels, layer.out_channels, 3, bias=False,
                                       indice_key=layer.indice_key, algo=algorithm)
            with torch.no_grad():
                module.weight.copy_(torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32)))
        else:
            module = spconv.SparseMaxPool3d(2, 2, algo=algorithm)
        modules.append(module)
    return spconv.SparseSequential(*modules).to(device).to(dtype).train()


def prepare_spconv_network(torch: Any, device_name: str, dtype_name: str, algorithm_name: str,
                           layers: tuple[NetworkLayer, ...], weights: tuple[Any, ...], features: np.ndarray,
                           indices: np.ndarray, spatial_shape: tuple[int, ...],
                           sorted_output_indices: np.ndarray, grad_output_sorted: np.ndarray) -> SpconvNetwork:
    """Runs spconv's network forward and backward once, and prepares both for timing.

    Args:
        torch: from `spconv_network_session`.
        device_name: ``"cpu"`` or ``"cuda"``.
        dtype_name: ``"float32"``, ``"float16"`` or ``"tf32"``.
        algorithm_name: a key of `SPCONV_ALGORITHMS`.
        layers: the network.
        weights: float32 host weights (None for pools), copied into the modules.
        features: float32 ``[N, 3]`` host input features.
        indices: int32 ``[N, 4]`` host sites.
        spatial_shape: the input grid.
        sorted_output_indices: sparsecore's output sites, sorted, to align the
            output gradient with spconv's rows.
        grad_output_sorted: float32 gradient of the output for those sites.

    Returns:
        The forward and backward to time, and spconv's outputs.

    Raises:
        ValueError: when spconv's output sites differ from sparsecore's.
    """
    import spconv.pytorch as spconv
    from spconv.core import ConvAlgo

    algorithm = getattr(ConvAlgo, SPCONV_ALGORITHMS[algorithm_name])
    device = torch.device("cuda:0" if device_name == "cuda" else "cpu")
    dtype = torch.float16 if dtype_name == "float16" else torch.float32
    clock = HostClock() if device_name == "cpu" else TorchEventClock(torch)
    net = _build_network(torch, layers, weights, algorithm, device, dtype)
    features_tensor = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32)).to(device).to(dtype)
    indices_tensor = torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int32)).to(device)
    shape = [int(size) for size in spatial_shape]

    def forward(leaf: Any) -> Any:
        return net(spconv.SparseConvTensor(leaf, indices_tensor, shape, 1))

    def forward_without_grad(leaf: Any) -> Any:
        with torch.no_grad():
            return forward(leaf)

    first = forward_without_grad(features_tensor)
    output_indices = first.indices.cpu().numpy().astype(np.int32)
    output_features = first.features.float().cpu().numpy()
    order = _lexicographic_order(output_indices)
    if output_indices.shape != sorted_output_indices.shape or not np.array_equal(
            output_indices[order], sorted_output_indices):
        raise ValueError(
            f"spconv's network ends on {len(output_indices)} sites and sparsecore's on "
            f"{len(sorted_output_indices)}, not the same set"
        )
    grad_rows = np.empty_like(grad_output_sorted)
    grad_rows[order] = grad_output_sorted
    grad_tensor = torch.from_numpy(np.ascontiguousarray(grad_rows, dtype=np.float32)).to(device).to(dtype)

    def fresh_graph() -> Any:
        leaf = features_tensor.detach().clone().requires_grad_(True)
        return leaf, forward(leaf)

    def backward(graph: Any) -> None:
        graph[1].features.backward(grad_tensor)

    leaf, output = fresh_graph()
    backward((leaf, output))
    grad_features = leaf.grad.float().cpu().numpy()
    return SpconvNetwork(algorithm_name, TimedWork(clock, forward_without_grad, lambda: features_tensor),
                         TimedWork(clock, backward, fresh_graph), output_indices, output_features, grad_features)


def spconv_subm_peak_bytes(torch: Any, dtype_name: str, algorithm_name: str, features: np.ndarray,
                           indices: np.ndarray, spatial_shape: tuple[int, ...], weight: np.ndarray,
                           grad_output: np.ndarray) -> int:
    """Peak bytes torch's allocator holds above its start while spconv runs one SubMConv3d.

    The layer's rulebook build, forward and backward are included; the input
    tensors are allocated before the measurement starts and not counted.

    Args:
        torch: from `spconv_network_session` (cuda).
        dtype_name: ``"float32"``, ``"float16"`` or ``"tf32"``.
        algorithm_name: a key of `SPCONV_ALGORITHMS`.
        features: ``[N, C_in]`` host features.
        indices: int32 ``[N, 4]`` host sites.
        spatial_shape: the grid.
        weight: ``[C_out, 3, 3, 3, C_in]`` host weight.
        grad_output: ``[N, C_out]`` host gradient, rows in input order (a subm
            conv keeps its input's sites and order).

    Returns:
        ``torch.cuda.max_memory_allocated()`` minus the bytes allocated at the start.
    """
    import spconv.pytorch as spconv
    from spconv.core import ConvAlgo

    device = torch.device("cuda:0")
    dtype = torch.float16 if dtype_name == "float16" else torch.float32
    module = spconv.SubMConv3d(weight.shape[-1], weight.shape[0], 3, bias=False,
                               algo=getattr(ConvAlgo, SPCONV_ALGORITHMS[algorithm_name]))
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32)))
    module = module.to(device).to(dtype)
    leaf = torch.from_numpy(np.ascontiguousarray(features)).to(device).to(dtype).requires_grad_(True)
    indices_tensor = torch.from_numpy(np.ascontiguousarray(indices, dtype=np.int32)).to(device)
    grad_tensor = torch.from_numpy(np.ascontiguousarray(grad_output)).to(device).to(dtype)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    output = module(spconv.SparseConvTensor(leaf, indices_tensor, [int(size) for size in spatial_shape], 1))
    output.features.backward(grad_tensor)
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated() - start)
