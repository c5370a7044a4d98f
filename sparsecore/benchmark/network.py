"""spconv's reference benchmark network, built on sparsecore's core API (no torch needed).

How the layout was read (``data/README.md``, and spconv 2.3.8's own
benchmark module ``spconv/benchmark/basic.py`` read for the exact order):

- Seven blocks. Block ``b`` is two SubMConv3d (kernel 3, no bias) sharing the
  indice_key ``c<b>``: the first changes the channels, the second keeps them.
  Channels: block 0 is 3 -> 64 -> 64, then 64 -> 96 -> 96, 96 -> 128 -> 128,
  128 -> 160 -> 160, 160 -> 192 -> 192, 192 -> 224 -> 224, 224 -> 256 -> 256.
- A SparseMaxPool3d(kernel 2, stride 2, padding 0) follows each of the first
  six blocks: 14 SubMConv3d and 6 SparseMaxPool3d, 20 layers in all. (spconv
  gives the last two pools the keys ``m4`` and ``m5``; nothing reads them, so
  they change no computation.)
- Batch 1, no norm, no activation. Forward time includes building every
  rulebook: one per block (its first conv builds it, the second reuses it, as
  a shared indice_key does) and one per pool, 13 in all. The very first build
  checks its input sites (out of range, duplicates) as a fresh
  ``SparseTensor`` would; later builds take the library's own output sites.
- Max pooling: sparsecore's SparseMaxPool3d takes the maximum of the active
  inputs of a window; spconv's starts from zero, so its outputs are floored
  at 0 (spconv issue #754). The network has no activation, so about half the
  pooled values are negative: the agreement check runs sparsecore with that
  floor (``spconv_pool_floor``), the timed runs never do.
- Backward: given the forward's saved inputs, rulebooks and argmaxes,
  `conv_backward` and `max_pool_backward` run through the whole stack in
  reverse, gradients of the input features and of every weight included.

Scenes: "basic" is ``lidar_voxels_125k.npz`` as is (125,562 voxels, spatial
shape (80, 1600, 1600)). "large" is ``lidar_points_198k.npz`` plus 7 copies
shifted +1 .. +7 m in y, voxelized by `sparsecore.voxelize` at 0.1 m
over [-80, -80, -2, 80, 80, 6] with one point per voxel; each voxel's
features are its point's x, y, z. That gives 913,903 voxels, checked here.
"synthetic" is the benchmark's synthetic scan (`scenes.synthetic_voxel_scene`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from sparsecore.benchmark import scenes
from sparsecore.benchmark.cases import LayerSpec
from sparsecore.benchmark.clocks import NULL_RECORDER, Clock, CupyEventClock, HostClock
from sparsecore.benchmark.cpu import layer_weight

__all__ = [
    "NetworkLayer",
    "REFERENCE_NETWORK",
    "SCENE_NAMES",
    "LARGE_SCENE_VOXELS",
    "DTYPE_NAMES",
    "storage_dtype",
    "Device",
    "device_for",
    "network_scene",
    "network_weights",
    "CoreForward",
    "core_forward",
    "core_backward",
]

SCENE_NAMES = ("basic", "large", "synthetic")
LARGE_SCENE_VOXELS = 913_903
LARGE_SCENE_COPIES = 7
LARGE_SCENE_MAX_VOXELS = 1_600_000  # spconv's benchmark keeps at most this many
DTYPE_NAMES = ("float32", "float16", "tf32")
_BLOCK_CHANNELS = (64, 96, 128, 160, 192, 224, 256)
_INPUT_CHANNELS = 3


@dataclass(frozen=True)
class NetworkLayer:
    """One layer of the reference network.

    Attributes:
        index: position in the network, from 0.
        kind: ``"subm"`` (SubMConv3d, kernel 3, no bias) or ``"maxpool"``
            (SparseMaxPool3d, kernel 2, stride 2).
        in_channels: input feature width.
        out_channels: output feature width (equal to ``in_channels`` for a pool).
        indice_key: the spconv indice_key of a conv (``"c0"`` .. ``"c6"``), None for a pool.
        builds_rulebook: True for the first conv of a key and for every pool.
    """

    index: int
    kind: str
    in_channels: int
    out_channels: int
    indice_key: str | None
    builds_rulebook: bool

    @property
    def name(self) -> str:
        """The label printed in the table, e.g. ``"L03 SubMConv3d 64->96 [c1]"``."""
        if self.kind == "subm":
            return f"L{self.index:02d} SubMConv3d {self.in_channels}->{self.out_channels} [{self.indice_key}]"
        return f"L{self.index:02d} SparseMaxPool3d(2, 2) {self.in_channels}"


def _reference_layers() -> tuple[NetworkLayer, ...]:
    layers: list[NetworkLayer] = []
    in_channels = _INPUT_CHANNELS
    for block, channels in enumerate(_BLOCK_CHANNELS):
        key = f"c{block}"
        layers.append(NetworkLayer(len(layers), "subm", in_channels, channels, key, True))
        layers.append(NetworkLayer(len(layers), "subm", channels, channels, key, False))
        if block < len(_BLOCK_CHANNELS) - 1:
            layers.append(NetworkLayer(len(layers), "maxpool", channels, channels, None, True))
        in_channels = channels
    return tuple(layers)


REFERENCE_NETWORK: tuple[NetworkLayer, ...] = _reference_layers()


def storage_dtype(dtype_name: str) -> Any:
    """The NumPy dtype features and weights are stored in for a benchmark dtype name.

    ``"tf32"`` stores float32 (TF32 is a cuBLAS mode, chosen with ``CUPY_TF32=1``).
    """
    if dtype_name not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {dtype_name!r}")
    return np.float16 if dtype_name == "float16" else np.float32


@dataclass(frozen=True)
class Device:
    """Where the network runs.

    Attributes:
        name: ``"cpu"`` (NumPy arrays) or ``"cuda"`` (CuPy arrays, the kernel backend).
        xp: ``numpy`` or ``cupy``.
        clock: host timer or CUDA events on CuPy's current stream.
        description: the device in words, for the table's header.
    """

    name: str
    xp: Any
    clock: Clock
    description: str

    def put(self, array: np.ndarray, dtype: Any | None = None) -> Any:
        """A host array on this device, cast to ``dtype`` when given."""
        host = np.ascontiguousarray(array if dtype is None else array.astype(dtype))
        return host if self.xp is np else self.xp.asarray(host)

    def get(self, array: Any) -> np.ndarray:
        """An array of this device back on the host."""
        return np.asarray(array) if self.xp is np else self.xp.asnumpy(array)


def device_for(name: str) -> Device:
    """The `Device` called ``name``.

    Raises:
        RuntimeError: for ``"cuda"`` when CuPy does not import or sees no GPU.
    """
    if name == "cpu":
        return Device("cpu", np, HostClock(), "CPU (NumPy backend)")
    if name != "cuda":
        raise ValueError(f"device must be 'cpu' or 'cuda', got {name!r}")
    from sparsecore.backends import require_cuda  # raises CudaUnavailableError, a RuntimeError

    cupy = require_cuda("the GPU benchmark (network --device cuda, or gpu)",
                        "Run `python -m sparsecore.benchmark network --device cpu` (or `cpu`) on the CPU.")
    device_id = cupy.cuda.runtime.getDevice()
    properties = cupy.cuda.runtime.getDeviceProperties(device_id)
    gpu_name = properties["name"].decode() if isinstance(properties["name"], bytes) else str(properties["name"])
    runtime = cupy.cuda.runtime.runtimeGetVersion()
    driver = cupy.cuda.runtime.driverGetVersion()
    description = (
        f"{gpu_name} (device {device_id}, {properties['multiProcessorCount']} SMs, "
        f"{properties['totalGlobalMem'] / 2**30:.0f} GiB), CUDA runtime {runtime}, driver {driver}, "
        f"CuPy {cupy.__version__} (kernel backend)"
    )
    return Device("cuda", cupy, CupyEventClock(cupy), description)


def _large_scene(points_path: Any) -> scenes.VoxelScene:
    from sparsecore.voxelization import voxelize

    points = scenes.load_points(points_path)[:, :3]
    copies = [points] + [points + np.asarray([0.0, shift, 0.0], np.float32)
                         for shift in range(1, LARGE_SCENE_COPIES + 1)]
    merged = np.ascontiguousarray(np.concatenate(copies), dtype=np.float32)
    result = voxelize(merged, scenes.VOXEL_SIZE, scenes.COORDINATE_RANGE, 1, LARGE_SCENE_MAX_VOXELS)
    if result.num_voxels != LARGE_SCENE_VOXELS:
        raise ValueError(
            f"the large scene should have {LARGE_SCENE_VOXELS} voxels (spconv's benchmark), "
            f"got {result.num_voxels} from {points_path}"
        )
    features = np.ascontiguousarray(np.asarray(result.voxels).reshape(-1, 3), dtype=np.float32)
    coordinates = np.asarray(result.indices)
    indices = np.column_stack([np.zeros(len(coordinates), np.int32), coordinates]).astype(np.int32)
    source = (f"{points_path} + {LARGE_SCENE_COPIES} copies shifted +1..+{LARGE_SCENE_COPIES} m in y, "
              f"voxelized at 0.1 m, 1 point per voxel")
    return scenes.VoxelScene(features, indices, tuple(result.grid_size), 1, source)  # type: ignore[arg-type]


def network_scene(name: str, scale: str = "small", seed: int = 0) -> scenes.VoxelScene:
    """The input of one benchmark case.

    Args:
        name: ``"basic"``, ``"large"`` or ``"synthetic"``.
        scale: the synthetic scene's size (``scenes.SYNTHETIC_SCALES``).
        seed: the synthetic scene's seed.

    Returns:
        The scene (batch 1).

    Raises:
        FileNotFoundError: when the scan that "basic" or "large" needs is absent.
        ValueError: when the large scene does not have the expected voxel count.
    """
    if name == "synthetic":
        return scenes.synthetic_voxel_scene(scenes.SYNTHETIC_SCALES[scale], seed)
    file_name = {"basic": scenes.VOXELS_FILE_NAME, "large": scenes.POINTS_FILE_NAME}.get(name)
    if file_name is None:
        raise ValueError(f"scene must be one of {SCENE_NAMES}, got {name!r}")
    path = scenes.require_data_file(None, file_name)
    return scenes.load_voxel_scene(path) if name == "basic" else _large_scene(path)


def network_weights(layers: tuple[NetworkLayer, ...], seed: int) -> tuple[np.ndarray | None, ...]:
    """float32 weights ``[out, 3, 3, 3, in]`` for the convs (None for the pools)."""
    return tuple(
        layer_weight(LayerSpec(layer.name, "subm", layer.in_channels, layer.out_channels), seed + layer.index)
        if layer.kind == "subm" else None
        for layer in layers
    )


@dataclass(frozen=True)
class CoreForward:
    """What the forward pass keeps for the backward pass, and its result.

    Attributes:
        layer_inputs: each layer's input features.
        rulebooks: each layer's rulebook (a conv's, shared within its block, or a pool's).
        argmaxes: each pool's argmax (None for the convs).
        output: the last layer's features ``[N_out, 256]``.
        output_indices: the last layer's sites ``[N_out, 4]``.
    """

    layer_inputs: tuple[Any, ...]
    rulebooks: tuple[Any, ...]
    argmaxes: tuple[Any, ...]
    output: Any
    output_indices: Any


def core_forward(scene_features: Any, scene_indices: Any, spatial_shape: tuple[int, ...],
                 weights: tuple[Any, ...], layers: tuple[NetworkLayer, ...] = REFERENCE_NETWORK,
                 recorder: Any = NULL_RECORDER, backend: Any | None = None,
                 spconv_pool_floor: bool = False, capacity: Any = None) -> CoreForward:
    """The network's forward pass, rulebook builds included.

    Args:
        scene_features: ``[N, 3]`` input features (device array, benchmark dtype).
        scene_indices: ``[N, 4]`` int32 sites (device array).
        spatial_shape: the input grid (z, y, x).
        weights: one device weight per conv layer (None for pools), benchmark dtype.
        layers: the network.
        recorder: a `StageRecorder` for the profiled run (labels ``"rulebooks"``,
            ``"convolution"``, ``"pool"``, ``"forward <index>"``), or the null recorder.
        backend: the backend the convolutions run on (an `InstrumentedBackend`
            in the profiled run); by default the arrays' own.
        spconv_pool_floor: floor every pool's output at 0 (and send no gradient
            where the floor wins), as spconv's SparseMaxPool3d does (its output
            starts at zero: spconv issue #754). For the agreement check only;
            sparsecore's own max pool takes the maximum of the active inputs.
        capacity: None (exact builds), or a `sparsecore.capacity` policy: capacity builds (no read
            back; the first layer's site checks and the pools' counts stay on the device, for
            `sparsecore.check_capacity` on the state's rulebooks), each pool named by its layer.

    Returns:
        The saved state and the output.
    """
    import sparsecore as sc
    from sparsecore._dispatch import array_module
    from sparsecore.capacity import layer_capacity

    subm = sc.ConvGeometry.create(3, 3, kind="subm")
    features, indices, shape = scene_features, scene_indices, tuple(spatial_shape)
    inputs, rulebooks, argmaxes = [], [], []
    rulebook = None
    for layer, weight in zip(layers, weights):
        with recorder.interval(f"forward {layer.index}"):
            inputs.append(features)
            if layer.kind == "subm":
                if layer.builds_rulebook:
                    with recorder.interval("rulebooks"):
                        rulebook = sc.build_rulebook(indices, shape, 1, subm, assume_unique=layer.index > 0,
                                                     capacity=None if capacity is None else int(indices.shape[0]),
                                                     layer=layer.name)
                rulebooks.append(rulebook)
                argmaxes.append(None)
                with recorder.interval("convolution"):
                    features = sc.conv_forward(features, weight, rulebook, backend=backend)
            else:
                with recorder.interval("rulebooks"):
                    rows = None
                    if capacity is not None:
                        pool = sc.ConvGeometry.create(len(shape), 2, 2, kind="regular")
                        rows = layer_capacity(capacity, layer.name, pool, int(indices.shape[0]),
                                              pool.output_spatial_shape(shape), 1)
                    rulebook = sc.build_pool_rulebook(indices, shape, 1, 2, 2, assume_unique=True, capacity=rows,
                                                      layer=layer.name)
                rulebooks.append(rulebook)
                with recorder.interval("pool"):
                    features, argmax = sc.max_pool_forward(features, rulebook)
                if spconv_pool_floor:
                    xp = array_module(features)
                    below = features < 0
                    features = xp.where(below, xp.zeros((), features.dtype), features)
                    argmax = xp.where(below, xp.int32(-1), argmax)
                argmaxes.append(argmax)
                indices, shape = rulebook.output_indices, tuple(rulebook.output_spatial_shape)
    return CoreForward(tuple(inputs), tuple(rulebooks), tuple(argmaxes), features, indices)


def core_backward(state: CoreForward, grad_output: Any, weights: tuple[Any, ...],
                  layers: tuple[NetworkLayer, ...] = REFERENCE_NETWORK, recorder: Any = NULL_RECORDER,
                  backend: Any | None = None) -> tuple[Any, tuple[Any, ...]]:
    """The network's backward pass, last layer first.

    Args:
        state: from `core_forward`.
        grad_output: gradient of the output ``[N_out, 256]``.
        weights: the forward's weights.
        layers: the network.
        recorder: a `StageRecorder` (labels ``"convolution"``, ``"pool"``,
            ``"backward <index>"``), or the null recorder.
        backend: the backend the convolutions run on; by default the arrays' own.

    Returns:
        ``(gradient of the input features, one weight gradient per layer (None for pools))``.
    """
    import sparsecore as sc

    grad = grad_output
    weight_grads: list[Any] = [None] * len(layers)
    for layer in reversed(layers):
        position = layer.index
        with recorder.interval(f"backward {layer.index}"):
            if layer.kind == "subm":
                with recorder.interval("convolution"):
                    grad, weight_grads[position] = sc.conv_backward(
                        grad, state.layer_inputs[position], weights[position], state.rulebooks[position],
                        backend=backend)
            else:
                with recorder.interval("pool"):
                    grad = sc.max_pool_backward(grad, state.argmaxes[position],
                                                state.rulebooks[position].num_input,
                                                rulebook=state.rulebooks[position], backend=backend)
    return grad, tuple(weight_grads)
