"""Issue 36's device check: spconv's basic network eager vs captured, per step, on a GPU.

Measures, on one GPU, in one process (each row on its own, a failure recorded and the rest still run):

- ``torch eager exact``: sparsecore.torch, exact mode (today's default: reads back per build);
- ``torch eager capacity``: capacity mode (`sparsecore.capacity`, the default policy after a warm-up);
- ``torch CUDA graph``: the capacity-mode step recorded with ``torch.cuda.graph`` and replayed on static
  input buffers;
- ``CuPy graph (core)``: the core network (`sparsecore.benchmark.network.core_forward`) in capacity mode
  recorded with CuPy's stream capture and replayed;
- ``spconv implicit GEMM``: spconv 2.x's ``ConvAlgo.MaskImplicitGemm`` (when ``spconv`` imports);

each for the forward (inference, rulebook builds included) and a training step (forward, backward, SGD),
in float32 and float16: milliseconds per step (CUDA events, median of ``--repeats``), and the core's host
operations per step in exact and capacity mode (`tools/host_operations.py`'s counting on CuPy). It
prints a table and writes ``--json``. Without a GPU it says so and exits 0 (nothing is measured; never a
timing from a CPU). The lead's tools/gpu_check.sh can call it:

    python tools/capture_check.py --scene basic --json "$OUT/capture_check.json"
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import numpy as np  # noqa: E402


def gpu_missing() -> str | None:
    """Why there is no usable GPU here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no CUDA device"
    except Exception as error:  # CuPy missing or broken: the core's GPU path cannot run
        return f"CuPy cannot reach a CUDA device ({type(error).__name__}: {error})"
    return None


def _median_ms(torch: Any, work: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return float(np.median(times))


def _torch_model(torch: Any, layers: Any, dtype: Any) -> Any:
    import sparsecore.torch as spconv

    modules = []
    for layer in layers:
        if layer.kind == "subm":
            modules.append(spconv.SubMConv3d(layer.in_channels, layer.out_channels, 3, bias=False,
                                             indice_key=layer.indice_key))
        else:
            modules.append(spconv.SparseMaxPool3d(2, 2))
    return spconv.SparseSequential(*modules).cuda().to(dtype)


def _spconv_model(torch: Any, layers: Any, dtype: Any) -> Any:
    import spconv.pytorch as spconv
    from spconv.core import ConvAlgo

    modules = []
    for layer in layers:
        if layer.kind == "subm":
            modules.append(spconv.SubMConv3d(layer.in_channels, layer.out_channels, 3, bias=False,
                                             indice_key=layer.indice_key, algo=ConvAlgo.MaskImplicitGemm))
        else:
            modules.append(spconv.SparseMaxPool3d(2, 2, algo=ConvAlgo.MaskImplicitGemm))
    return spconv.SparseSequential(*modules).cuda().to(dtype)


def _torch_rows(torch: Any, scene: Any, layers: Any, dtype_name: str, repeats: int) -> dict[str, Any]:
    """Eager exact, eager capacity and CUDA-graph forward / training step of sparsecore.torch."""
    import sparsecore as sc
    import sparsecore.torch as spconv
    from sparsecore.torch.capacity import masked_features

    dtype = getattr(torch, dtype_name)
    rows: dict[str, Any] = {}
    features = torch.from_numpy(np.random.default_rng(0).standard_normal((len(scene.indices), 3))).cuda().to(dtype)
    indices = torch.from_numpy(np.ascontiguousarray(scene.indices, dtype=np.int32)).cuda()
    shape = list(scene.spatial_shape)
    model = _torch_model(torch, layers, dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    policy = sc.LearnedCapacity()

    def forward(capacity: Any) -> Any:
        if capacity is None:
            return model(spconv.SparseConvTensor(features, indices, shape, 1))
        return model(spconv.SparseConvTensor.capacity_mode(features, indices, shape, 1, capacity))

    def train(capacity: Any) -> Any:
        optimizer.zero_grad(set_to_none=False)
        loss = masked_features(forward(capacity)).float().square().mean()
        loss.backward()
        optimizer.step()
        return loss

    def measured(name: str, work: Callable[[], Any]) -> None:
        try:
            work()
            torch.cuda.synchronize()
            rows[name] = round(_median_ms(torch, work, repeats), 3)
        except Exception as error:  # recorded, the other rows still run
            rows[name] = f"failed: {type(error).__name__}: {error}"
            traceback.print_exc()

    with torch.no_grad():
        measured("torch eager exact forward", lambda: forward(None))
        forward(policy).check_capacity()  # the warm-up: the policy learns the counts
        measured("torch eager capacity forward", lambda: forward(policy))
    measured("torch eager exact training step", lambda: train(None))
    measured("torch eager capacity training step", lambda: train(policy))
    for name, step in (("forward", lambda: forward(policy)), ("training step", lambda: train(policy))):
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode(name == "forward"):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), torch.inference_mode(name == "forward"):
                step()
            measured(f"torch CUDA graph {name}", graph.replay)
        except Exception as error:
            rows[f"torch CUDA graph {name}"] = f"failed: {type(error).__name__}: {error}"
            traceback.print_exc()
    try:
        spconv_model = _spconv_model(torch, layers, dtype)
        import spconv.pytorch as peer

        with torch.no_grad():
            measured("spconv implicit GEMM forward",
                     lambda: spconv_model(peer.SparseConvTensor(features, indices, shape, 1)))
        peer_optimizer = torch.optim.SGD(spconv_model.parameters(), lr=1e-6)

        def peer_train() -> None:
            peer_optimizer.zero_grad(set_to_none=False)
            spconv_model(peer.SparseConvTensor(features, indices, shape, 1)).features.float().square().mean().backward()
            peer_optimizer.step()

        measured("spconv implicit GEMM training step", peer_train)
    except ImportError:
        rows["spconv implicit GEMM forward"] = "not installed"
    return rows


def _cupy_rows(scene: Any, layers: Any, dtype_name: str, repeats: int) -> dict[str, Any]:
    """The core network in capacity mode, recorded by CuPy's stream capture and replayed, against eager."""
    import cupy
    import torch

    import sparsecore as sc
    from sparsecore.benchmark import network

    rows: dict[str, Any] = {}
    weights = tuple(None if weight is None else cupy.asarray(weight.astype(dtype_name))
                    for weight in network.network_weights(layers, 0))
    features = cupy.asarray(np.random.default_rng(0).standard_normal((len(scene.indices), 3)).astype(dtype_name))
    indices = cupy.asarray(np.ascontiguousarray(scene.indices, dtype=np.int32))
    shape = tuple(scene.spatial_shape)
    policy = sc.LearnedCapacity()

    def forward() -> Any:
        return network.core_forward(features, indices, shape, weights, layers, capacity=policy)

    try:
        sc.check_capacity(forward().rulebooks, policy)
        rows["CuPy eager capacity forward (core)"] = round(_median_ms(torch, forward, repeats), 3)
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            forward()
            stream.synchronize()
            stream.begin_capture()
            try:
                forward()
            finally:
                graph = stream.end_capture()
        rows["CuPy graph forward (core)"] = round(_median_ms(torch, lambda: graph.launch(stream), repeats), 3)
    except Exception as error:
        rows["CuPy graph forward (core)"] = f"failed: {type(error).__name__}: {error}"
        traceback.print_exc()
    return rows


def _host_operations(scene: Any, layers: Any) -> dict[str, Any]:
    import host_operations

    import sparsecore as sc

    rows: dict[str, Any] = {}
    target = host_operations.cuda_target()
    for mode, policy in (("exact", None), ("capacity", sc.LearnedCapacity())):
        document = host_operations.count_network(target, scene, "capture", layers, capacity=policy)
        for pass_name in host_operations.PASSES:
            operations, launches, matmuls, reads = host_operations.pass_counts(document, pass_name)
            rows[f"host ops {mode} {pass_name}"] = {"operations": operations, "launches": launches,
                                                    "matmuls": matmuls, "reads": reads}
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scene", default="basic", choices=("basic", "synthetic"))
    parser.add_argument("--repeats", type=int, default=20, help="timed steps per row (median)")
    parser.add_argument("--dtypes", default="float32,float16")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    missing = gpu_missing()
    if missing is not None:
        print(f"capture_check: no GPU here ({missing}); nothing measured. Run it on a machine with a CUDA GPU.")
        return 0
    import torch

    from sparsecore.benchmark import network

    started = time.monotonic()
    scene = network.network_scene(args.scene, "small")
    layers = network.REFERENCE_NETWORK
    results: dict[str, Any] = {"scene": args.scene, "sites": int(len(scene.indices)),
                               "device": torch.cuda.get_device_name(0)}
    for dtype_name in args.dtypes.split(","):
        results[dtype_name] = {**_torch_rows(torch, scene, layers, dtype_name, args.repeats),
                               **_cupy_rows(scene, layers, dtype_name, args.repeats)}
    try:
        results["host operations"] = _host_operations(scene, layers)
    except Exception as error:
        results["host operations"] = f"failed: {type(error).__name__}: {error}"
    results["seconds"] = round(time.monotonic() - started, 1)
    print(f"capture_check on {results['device']}: scene {args.scene} ({results['sites']} sites), ms per step "
          f"(median of {args.repeats})")
    for dtype_name in args.dtypes.split(","):
        for name, value in results[dtype_name].items():
            print(f"  {dtype_name:<8} {name:<40} {value}")
    print(f"  host operations per step: {results['host operations']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
