"""The int8 rows of ``python -m sparsecore.benchmark runtime --int8``.

The benchmark's SECOND-style backbone goes through spconv's PTQ workflow
(`sparsecore.torch.quantization`: ``prepare_fx`` with spconv's qconfig
mapping, calibrated on the scan itself, ``convert_fx``, `transform_qdq`,
`remove_conv_add_dq`), is exported with ``export_onnx(..., precision="int8")``
and timed both as the converted torch model and through `sparsecore.runtime`'s
int8 mode (every sparse conv int8 x int8 with int32 sums; the dense output
dequantized by ``ScatterDense``).

`backbone_rows` (``python -m sparsecore.benchmark int8``) times the same
backbone through `sparsecore.runtime` only: the float32 export against the
int8 export, the latter on its automatic route (the VNNI kernel where the
CPU has avx512_vnni) and on today's route (``SPARSECORE_CPU_ISA=generic``),
at each thread count, all taking turns.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["int8_variants", "int8_session", "backbone_rows"]

BACKBONE = "backbone (runtime)"
"""The rows' layer name."""


def _converted(net: Any, example: Any, bev_shape: tuple[int, ...]) -> Any:
    import torch
    import torch.ao.quantization.quantize_fx as qfx
    from torch import nn

    import sparsecore.torch.quantization as spconvq

    class Traceable(nn.Module):  # the backbone with its BEV view as constants (fx cannot unpack shapes)
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: Any) -> Any:
            return self.net(x).dense().view(*bev_shape)

    mapping = spconvq.get_default_spconv_qconfig_mapping(False)
    backend = spconvq.get_spconv_backend_config()
    with warnings.catch_warnings():  # torch marks these two calls of ours deprecated (the fx workflow): that alone
        warnings.filterwarnings("ignore", message=r"torch\.ao\.quantization is deprecated", category=DeprecationWarning)
        prepared = qfx.prepare_fx(Traceable().eval(), mapping, (), backend_config=backend,
                                  prepare_custom_config=spconvq.get_spconv_prepare_custom_config())
        with torch.no_grad():
            prepared(example)  # calibration: the scan itself
        spconvq.prepare_spconv_torch_inference(True)
        converted = qfx.convert_fx(prepared, qconfig_mapping=mapping, backend_config=backend)
    return spconvq.remove_conv_add_dq(spconvq.transform_qdq(converted))


def int8_session(model: Any, example: Any) -> tuple[Any, Any]:
    """The backbone converted to int8 (PTQ calibrated on ``example``) and its `sparsecore.runtime` session.

    Args:
        model: the benchmark's float backbone (`sparsecore.benchmark.backbones.second_backbone`).
        example: the CPU `SparseConvTensor` of the scan.

    Returns:
        ``(converted torch model, runtime session of its int8 export)``.
    """
    import torch

    import sparsecore.runtime as runtime
    import sparsecore.torch as spconv

    with torch.no_grad():
        bev_shape = tuple(model(example).shape)
    converted = _converted(model.net, example, bev_shape)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "second_int8.onnx"
        spconv.export_onnx(converted, example, path, precision="int8")
        return converted, runtime.load(path)


def backbone_rows(voxels_path: str | None, repeat: int, thread_counts: Sequence[int]) -> tuple[list[dict], list[str]]:
    """The backbone through `sparsecore.runtime`, float32 export against int8 export, at each thread count.

    Returns:
        Rows (the fields of `sparsecore.benchmark.int8.Int8Timing`, layer `BACKBONE`) and notes; no rows and
        a note saying why where torch or onnx is missing.
    """
    try:
        import onnx  # noqa: F401 (the export needs it)
        import torch
    except ImportError:
        return [], ["backbone: not timed (the int8 export needs torch and onnx)"]
    import sparsecore as sc
    import sparsecore.runtime as runtime
    import sparsecore.torch as spconv
    from sparsecore.backends import x86_features
    from sparsecore.benchmark import scenes
    from sparsecore.benchmark.backbones import second_backbone
    from sparsecore.benchmark.timing import time_alternating

    scene = scenes.load_voxel_scene(scenes.require_data_file(voxels_path, scenes.VOXELS_FILE_NAME))
    shape, batch = list(scene.spatial_shape), scene.batch_size
    model = second_backbone(scene.features.shape[1]).eval()
    example = spconv.SparseConvTensor(torch.from_numpy(scene.features), torch.from_numpy(scene.indices), shape, batch)
    _, int8 = int8_session(model, example)
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "second.onnx"
        spconv.export_onnx(model, example, path)
        float32 = runtime.load(path)

    def run(session: Any, isa: str) -> Any:
        with x86_features.cpu_isa(isa):
            return session.run(scene.features, scene.indices, batch, shape).dense

    int8_name = "int8 (vnni)" if x86_features.uses("avx512_vnni") else "int8 (auto)"
    variants = {"float32": lambda: run(float32, "auto"), int8_name: lambda: run(int8, "auto"),
                "int8 today": lambda: run(int8, "generic")}
    outputs = {name: np.asarray(function(), dtype=np.float32) for name, function in variants.items()}
    same = np.array_equal(outputs[int8_name], outputs["int8 today"])
    error = float(np.abs(outputs[int8_name] - outputs["float32"]).max() / np.abs(outputs["float32"]).max())
    functions = {}
    for threads in thread_counts:
        for name, function in variants.items():
            functions[(threads, name)] = lambda threads=threads, function=function: _on_threads(sc, threads, function)
    times = time_alternating(functions, repeat, lambda: None)
    rows = []
    for threads in thread_counts:
        base = float(np.median(times[(threads, "float32")]))
        for name in variants:
            median = float(np.median(times[(threads, name)]))
            one = float(np.median(times[(1, name)])) / median if (1, name) in times else 0.0
            rows.append(dict(variant=name, median_ms=median, min_ms=float(min(times[(threads, name)])), layer=BACKBONE,
                             device="cpu", threads=threads, relative_to_float=base / median,
                             relative_to_one_thread=one))
    return rows, [f"{BACKBONE}: SECOND-style, 8 sparse convs, incl. rulebooks; int8 routes bitwise equal: "
                  f"{'yes' if same else 'NO'}; max |int8 - float32| / max |float32| = {error:.3f}"]


def _on_threads(sc: Any, threads: int, function: Callable[[], Any]) -> Any:
    with sc.num_threads(threads):
        return function()


def int8_variants(model: Any, example: Any, run_input: Callable[[], Any], core_features: Any, core_indices: Any,
                  batch_size: int, spatial_shape: list[int]) -> dict[str, Callable[[], Any]]:
    """The timed functions ``"sparsecore.torch int8"`` and ``"sparsecore.runtime int8"``.

    Args:
        model: the benchmark's float backbone (its ``net`` is quantized; BatchNorm folded by ``prepare_fx``).
        example: the CPU `SparseConvTensor` of the scan (calibration and export).
        run_input: makes the `SparseConvTensor` the torch model runs on.
        core_features, core_indices: the scan as the runtime takes it (NumPy or CuPy).
        batch_size, spatial_shape: the scan's.

    Returns:
        name -> function returning the dense BEV output (torch tensor or array).
    """
    import torch

    converted, session = int8_session(model, example)

    def torch_int8() -> Any:
        with torch.no_grad():
            return converted(run_input())

    return {"sparsecore.torch int8": torch_int8,
            "sparsecore.runtime int8": lambda: session.run(core_features, core_indices, batch_size,
                                                           spatial_shape).dense}
