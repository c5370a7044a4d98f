"""Where the host time of the GPU path goes: a profile of spconv's basic network on CuPy.

Run on a lent GPU machine (tools/README.md): after ``pip install -e .``,

    python3 -P tools/gpu_profile.py [--scene basic] [--dtype float32] [--repeat 5]

It prints, and writes to ``$OUT/gpu_profile.txt`` (or ``--output``):

- CuPy's own cost on this host: one tiny asynchronous operation, and one
  round trip that reads a device scalar back (a synchronisation);
- the network's forward (rulebooks included) and backward: wall time per pass
  with the device synchronised at its end, kernel launches and cuBLAS GEMMs
  per pass and per layer;
- cProfile of ``--repeat`` forward+backward passes, the top functions by own
  time and by cumulative time (the device reads, ``tolist``/``get``/``item``,
  show up here as calls).

No assertion: it is a measurement for docs/gpu.md, not a test.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator


def _per_operation_cost(cupy: Any) -> str:
    small = cupy.ones(16, cupy.float32)
    for _ in range(50):
        small = small + 1.0
    cupy.cuda.Device().synchronize()
    count = 2000
    began = time.perf_counter()
    for _ in range(count):
        small = small + 1.0
    queued = (time.perf_counter() - began) / count
    cupy.cuda.Device().synchronize()
    began = time.perf_counter()
    for _ in range(200):
        float(small[0])
    round_trip = (time.perf_counter() - began) / 200
    return (f"one tiny CuPy operation: {queued * 1e6:.1f} us of host time (asynchronous); "
            f"one device scalar read back: {round_trip * 1e6:.1f} us")


class _LayerLabels:
    """A recorder for `network.core_forward` / `core_backward` that knows which layer is running."""

    def __init__(self) -> None:
        self.stack = ["outside the layers"]

    @contextmanager
    def interval(self, label: str) -> Iterator[None]:
        layered = label.startswith(("forward ", "backward "))
        if layered:
            self.stack.append(label)
        try:
            yield
        finally:
            if layered:
                self.stack.pop()


@contextmanager
def _counting(counts: Counter, labels: _LayerLabels) -> Iterator[None]:
    """Counts kernel launches and GEMMs (cuBLAS on the GPU) of the kernel backend inside the block, also per layer.

    (`tools/host_operations.py --device cuda` counts every host operation per layer and stage.)"""
    from sparsecore.backends import cupy_backend
    from sparsecore.backends.kernel_backend import KernelBackend

    launch, matmul = cupy_backend.CupyLauncher.launch, KernelBackend.matmul

    def counted_launch(self: Any, expression: str, grid: int, block: int, args: tuple[Any, ...]) -> None:
        counts["launches"] += 1
        counts["kernel " + expression.split("<")[0]] += 1
        counts[(labels.stack[-1], "launches")] += 1
        launch(self, expression, grid, block, args)

    def counted_matmul(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["cublas matmul"] += 1
        counts[(labels.stack[-1], "GEMMs")] += 1
        return matmul(self, *args, **kwargs)

    cupy_backend.CupyLauncher.launch, KernelBackend.matmul = counted_launch, counted_matmul
    try:
        yield
    finally:
        cupy_backend.CupyLauncher.launch, KernelBackend.matmul = launch, matmul


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scene", default="basic", choices=("basic", "large"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the script")
    parser.add_argument("--output", default=os.path.join(os.environ.get("OUT", "."), "gpu_profile.txt"))
    args = parser.parse_args(argv)

    import numpy as np

    from sparsecore.benchmark import network

    device = network.device_for(args.device)
    lines: list[str] = [f"scene {args.scene}, {args.dtype}", device.description]
    if args.device == "cuda":
        import cupy

        synchronize = cupy.cuda.Device().synchronize
        lines.append(_per_operation_cost(cupy))
    else:
        def synchronize() -> None:
            return None
    scene = network.network_scene(args.scene)
    dtype = network.storage_dtype(args.dtype)
    features = device.put(scene.features, dtype)
    indices = device.put(scene.indices)
    weights = tuple(None if w is None else device.put(w, dtype) for w in network.network_weights(
        network.REFERENCE_NETWORK, 0))
    rng = np.random.default_rng(0)

    def forward() -> Any:
        return network.core_forward(features, indices, scene.spatial_shape, weights)

    state = forward()
    grad_output = device.put(rng.standard_normal(state.output.shape).astype(np.float32), dtype)

    def backward(state: Any) -> Any:
        return network.core_backward(state, grad_output, weights)

    for _ in range(3):  # warm-up: NVRTC and CuPy's own kernels compile here
        backward(forward())
    synchronize()

    times: dict[str, list[float]] = {"forward": [], "backward": []}
    for _ in range(args.repeat):
        began = time.perf_counter()
        state = forward()
        synchronize()
        times["forward"].append(time.perf_counter() - began)
        began = time.perf_counter()
        backward(state)
        synchronize()
        times["backward"].append(time.perf_counter() - began)
    for name, values in times.items():
        lines.append(f"{name}: median {np.median(values) * 1e3:.2f} ms wall (device synchronised at the end)")

    labels = _LayerLabels()
    for direction in ("forward", "backward"):
        counts: Counter = Counter()
        with _counting(counts, labels) if args.device == "cuda" else nullcontext():
            if direction == "forward":
                state = network.core_forward(features, indices, scene.spatial_shape, weights, recorder=labels)
            else:
                network.core_backward(state, grad_output, weights, recorder=labels)
            synchronize()
        totals = {name: value for name, value in counts.items() if isinstance(name, str)}
        lines.append(f"{direction}: {totals.get('launches', 0)} kernel launches, "
                     f"{sum(v for k, v in totals.items() if k.startswith('cublas'))} cuBLAS GEMMs")
        lines.extend(f"  {name}: {value}" for name, value in sorted(totals.items(), key=lambda item: -item[1])
                     if name != "launches")
        for layer in network.REFERENCE_NETWORK:
            label = f"{direction} {layer.index}"
            lines.append(f"  {layer.name} {direction}: {counts[(label, 'launches')]} launches, "
                         f"{counts[(label, 'GEMMs')]} GEMMs")

    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.repeat):
        backward(forward())
    synchronize()
    profile.disable()
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(key).print_stats(45)
        lines.append(f"--- cProfile, {args.repeat} x (forward + backward), by {key}")
        lines.append(text.getvalue())
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_callers(r"tolist|\.get|item|asnumpy|synchronize")
    lines.append("--- who reads the device")
    lines.append(text.getvalue())
    report = "\n".join(lines)
    with open(args.output, "w", encoding="utf-8") as handle:
        handle.write(report)
    print(report[:20000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
