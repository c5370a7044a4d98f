"""``python -m sparsecore.benchmark runtime``: sparsecore.runtime against sparsecore.torch on one backbone.

A SECOND-style backbone (SubMConv3d / SparseConv3d 16-32-64-64 with BatchNorm
and ReLU, ``.dense()`` and the BEV reshape) runs on the real scan (125,562
voxels): in ``sparsecore.torch`` (eval, ``torch.no_grad``) and, exported with
``export_onnx`` (BatchNorm folded, ReLU fused, FP16 weights), through
``sparsecore.runtime`` in float32 and float16. Rulebook builds are inside
every timing (both paths build them per run). The variants take turns, so a
machine shared with other work loads them alike; the table gives the median
and the minimum. ``--device cuda`` runs the torch model on the GPU and the
runtime on CuPy arrays.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sparsecore.benchmark import scenes
from sparsecore.benchmark.backbones import second_backbone
from sparsecore.benchmark.timing import (VariantTiming, add_scan_suite_parser, machine_description, summarize_times,
                                         time_alternating)

__all__ = ["RuntimeTiming", "add_parser", "run_runtime_command", "second_backbone"]


@dataclass(frozen=True)
class RuntimeTiming(VariantTiming):
    """One variant's times (`VariantTiming`), in milliseconds per forward (rulebooks included).

    Attributes:
        relative_to_torch: sparsecore.torch's median over this variant's (> 1: faster than torch).
        max_abs_difference: the largest absolute difference of its output from sparsecore.torch's.
    """

    relative_to_torch: float
    max_abs_difference: float


def add_parser(suites: Any) -> None:
    """Registers the ``runtime`` sub-command on the benchmark's sub-parsers."""
    parser = add_scan_suite_parser(
        suites, "runtime", "sparsecore.runtime (exported ONNX) vs sparsecore.torch on a SECOND-style backbone",
        __doc__.split("\n\n")[1], 5, scenes.VOXELS_FILE_NAME)
    parser.add_argument("--threads", type=int, default=0,
                        help="threads of sparsecore's CPU passes, torch's intra-op pool and BLAS (default 0: leave "
                        "them as they are)")
    parser.add_argument("--int8", action="store_true",
                        help="also time the backbone converted to int8 (PTQ calibrated on the scan) in "
                        "sparsecore.torch and exported with precision='int8' through sparsecore.runtime (CPU only)")


def run_runtime_command(arguments: argparse.Namespace) -> int:
    """Times the variants and prints the table (and writes JSON with ``--json``)."""
    import torch

    if arguments.repeat < 1:
        raise SystemExit(f"--repeat must be at least 1, got {arguments.repeat}")
    try:
        scene = scenes.load_voxel_scene(scenes.require_data_file(arguments.voxels, scenes.VOXELS_FILE_NAME))
    except (OSError, ValueError) as error:
        raise SystemExit(f"error: {error}") from None
    with contextlib.ExitStack() as stack:
        if arguments.threads:
            import threadpoolctl

            import sparsecore

            torch.set_num_threads(arguments.threads)
            stack.enter_context(threadpoolctl.threadpool_limits(arguments.threads))
            stack.enter_context(sparsecore.num_threads(arguments.threads))
        return _run(arguments, scene)


def _run(arguments: argparse.Namespace, scene: scenes.VoxelScene) -> int:
    import torch

    import sparsecore.runtime as runtime
    import sparsecore.torch as spconv

    device = torch.device(arguments.device)
    model = second_backbone(scene.features.shape[1]).to(device)
    features, indices = torch.from_numpy(scene.features).to(device), torch.from_numpy(scene.indices).to(device)
    shape, batch = list(scene.spatial_shape), scene.batch_size
    x = spconv.SparseConvTensor(features, indices, shape, batch)
    if arguments.device == "cuda":
        import cupy

        core_features, core_indices = cupy.asarray(scene.features), cupy.asarray(scene.indices)
        synchronize, to_host = torch.cuda.synchronize, cupy.asnumpy
    else:
        core_features, core_indices = scene.features, scene.indices
        synchronize, to_host = (lambda: None), np.asarray
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "second.onnx"
        spconv.export_onnx(model, spconv.SparseConvTensor(features.cpu(), indices.cpu(), shape, batch)
                           if arguments.device == "cuda" else x, path)
        sessions = {dtype: runtime.load(path, dtype=dtype) for dtype in ("float32", "float16")}

    def torch_forward() -> Any:
        with torch.no_grad():
            return model(spconv.SparseConvTensor(features, indices, shape, batch))

    functions = {"sparsecore.torch float32": torch_forward}
    for dtype, session in sessions.items():
        functions[f"sparsecore.runtime {dtype}"] = (
            lambda session=session: session.run(core_features, core_indices, batch, shape))
    if getattr(arguments, "int8", False):
        if arguments.device != "cpu":
            raise SystemExit("--int8 runs on the CPU only (--device cpu)")
        from sparsecore.benchmark.runtime_int8 import int8_variants

        functions.update(int8_variants(model, x, lambda: spconv.SparseConvTensor(features, indices, shape, batch),
                                       core_features, core_indices, batch, shape))
    reference = torch_forward().cpu().numpy()
    outputs = {"sparsecore.torch float32": reference}
    for dtype, session in sessions.items():
        outputs[f"sparsecore.runtime {dtype}"] = to_host(
            session.run(core_features, core_indices, batch, shape).dense).astype(np.float32)
    for name in ("sparsecore.torch int8", "sparsecore.runtime int8"):  # with --int8 (on the CPU)
        if name in functions:
            outputs[name] = np.asarray(functions[name](), dtype=np.float32)
    times = time_alternating(functions, arguments.repeat, synchronize)
    rows = [RuntimeTiming(name, *numbers, float(np.abs(outputs[name] - reference).max()))
            for name, numbers in summarize_times(times, "sparsecore.torch float32").items()]
    header = machine_description()
    header.update({
        "scene": f"{scene.source}: {len(scene.indices)} voxels, spatial shape {scene.spatial_shape}",
        "model": "SECOND-style backbone, 8 sparse convs 16-32-64-64, BatchNorm + ReLU, dense + BEV reshape "
                 f"-> {tuple(reference.shape)}",
        "device": arguments.device,
        "threads": arguments.threads or "as configured",
        "timing": f"ms per forward incl. rulebooks; median / min of {arguments.repeat} alternating runs after 1 "
                  "warm-up, time.perf_counter",
    })
    for key, value in header.items():
        print(f"{key}: {value}")
    print(f"\n{'variant':28} {'median ms':>10} {'min ms':>10} {'torch / this':>13} {'max |out - torch|':>18}")
    for row in rows:
        print(f"{row.variant:28} {row.median_ms:10.1f} {row.min_ms:10.1f} {row.relative_to_torch:13.2f} "
              f"{row.max_abs_difference:18.2e}")
    if arguments.json:
        Path(arguments.json).write_text(json.dumps({"header": {k: str(v) for k, v in header.items()},
                                                    "rows": [asdict(row) for row in rows]}, indent=2))
    return 0
