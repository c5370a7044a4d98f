"""How many host operations the GPU path issues, per layer of spconv's basic network: on the CPU emulation or a GPU.

On a GPU every array operation costs host time (about 20 us of CuPy on the H200
of 2026-12-04, docs/performance_history.md), so the forward of spconv's basic network is
bound by how many it issues, not by the device. This counts them per layer and
per stage (rulebooks, convolution, pool) of the forward with its rulebook builds
and of the backward (the engine is `host_counting`):

- ``launch``: a kernel launch; ``matmul``: a backend GEMM (one cuBLAS call on the GPU);
- ``xp``: a call of the array library (``xp.empty``, ``xp.ascontiguousarray``...);
- ``ufunc`` / ``method``: arithmetic or an array method (``astype``, ``argsort``...);
- ``index``: indexing that makes a view or a copy;
- ``read``: a read of device data back to the host (``int(x)``, ``x.get()``,
  ``xp.asnumpy``, a boolean mask, a data-sized function such as ``xp.unique``):
  on a GPU each one waits for every launch queued before it.

Every operation counts once (cheap and dear alike; reads are among the host
operations), so read the totals as an upper bound and the call sites
(``--sites``) for what to cut. Run from the repository root:

    python tools/host_operations.py [--scene synthetic|basic] [--run-all] [--json PATH] [--sites 30] [--capacity]
    python tools/host_operations.py --device cuda --scene basic --json gpu.json --compare emulation.json

``--device emulation`` (the default) runs the network on the emulated kernel
backend (the CUDA kernels compiled by g++, tests/cuda_emulation) with
`DeviceArray` inputs; by default the feature kernels' launches are counted but
not run (the counts do not depend on feature values; the geometry kernels run),
so the real scan counts in minutes; ``--run-all`` runs every kernel.
``--device cuda`` counts the same operations on CuPy arrays on a GPU, every
kernel run. ``--compare`` checks the per-layer counts (host operations,
launches, cuBLAS calls, reads) against another run's ``--json`` and exits 1
where they differ: on the device run they must equal the emulation's.

The end of the report compares the counts with issue 28's targets for the
emulation (forward with builds <= 200 host operations and <= 6 reads, backward
<= 100 and no read; per conv layer 1 forward launch and no cuBLAS call, <= 2
backward launches). No assertion: a measurement; compare counts of one scene
between commits. ``--capacity`` counts capacity mode (`sparsecore.capacity`: issue 36's
targets, 0 reads back per step) after one uncounted warm-up step has taught the
default policy its counts, and prints per pool the rows needed and allocated.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import numpy as np  # noqa: E402

import host_counting  # noqa: E402
from host_counting import OUTSIDE, CountingLibrary, Tally  # noqa: E402
from host_operation_report import (PASS_TITLES, PASSES, LayerCount, TargetResult, compare_documents,  # noqa: E402
                                   format_capacity, format_report, layer_counts, pass_counts, stage_counts,
                                   target_results)
from sparsecore.benchmark import network  # noqa: E402

__all__ = ["CountingTarget", "emulation_target", "cuda_target", "count_network", "PassScratch",
           "feature_pass_scratch", "PASSES", "PASS_TITLES", "LayerCount", "layer_counts", "pass_counts", "stage_counts",
           "TargetResult", "target_results",
           "compare_documents", "format_report", "capacity_rows", "format_capacity", "main"]

FORMAT = "sparsecore host operations, format 1"


@dataclass(frozen=True)
class CountingTarget:
    """Where the network runs while it is counted.

    Attributes:
        name: ``"emulation"`` or ``"cuda"``.
        library: the device array library (the emulation's device NumPy, or ``cupy``).
        array_type: its array type (``DeviceArray`` or ``cupy.ndarray``).
        backend: the `KernelBackend` on ``library`` (its ``xp`` gets wrapped for counting).
        to_device: a host array on the device.
        synchronize: waits for the device.
        ufunc_override: see `host_counting.counting`.
        internal_files: files that are never a call site (the emulation's, this tool's).
    """

    name: str
    library: Any
    array_type: type
    backend: Any
    to_device: Callable[[np.ndarray], Any]
    synchronize: Callable[[], None]
    ufunc_override: Callable[..., Any] | None = None
    internal_files: tuple[str, ...] = ()


def emulation_target(launcher: Any | None = None, prebuild: bool = False) -> CountingTarget:
    """The emulated kernel backend on `DeviceArray` (32-thread blocks, 2 blocks per launch, as the tests run).

    Args:
        launcher: the launcher (default: the emulation's; a ``RecordingLauncher`` in tests).
        prebuild: build every kernel file's library first (in parallel) instead of on first use.
    """
    from sparsecore.backends import kernel_registry
    from sparsecore.backends.kernel_backend import KernelBackend
    from tests.cuda_emulation import device_arrays, harness
    from tests.cuda_emulation.emulated_launcher import EmulatedLauncher

    if harness.compiler_path() is None:
        raise RuntimeError("the emulation needs g++ (or $CXX): none found")
    if prebuild:
        harness.build_libraries([entry.file for entry in kernel_registry.KERNEL_FILES])
    backend = KernelBackend(device_arrays.DEVICE_NUMPY, launcher or EmulatedLauncher(), name="emulated",
                            block_threads=32, max_blocks=2)

    def ufunc_override(self: Any, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        plain = tuple(np.asarray(item) if isinstance(item, device_arrays.DeviceArray) else item for item in inputs)
        if "out" in kwargs:
            kwargs["out"] = tuple(np.asarray(item) if isinstance(item, device_arrays.DeviceArray) else item
                                  for item in kwargs["out"])
        return device_arrays._to_device(getattr(ufunc, method)(*plain, **kwargs))

    return CountingTarget("emulation", device_arrays.DEVICE_NUMPY, device_arrays.DeviceArray, backend,
                          device_arrays.to_device, lambda: None, ufunc_override,
                          (__file__, device_arrays.__file__))


def cuda_target() -> CountingTarget:
    """The GPU backend on CuPy arrays (needs a CUDA device)."""
    import cupy

    from sparsecore.backends import require_cuda
    from sparsecore.backends.cupy_backend import CUPY_BACKEND

    require_cuda("tools/host_operations.py --device cuda",
                 "Count on the CPU emulation instead: --device emulation.")
    return CountingTarget("cuda", cupy, cupy.ndarray, CUPY_BACKEND, cupy.asarray,
                          lambda: cupy.cuda.Device().synchronize(), None, (__file__,))


def _git_commit() -> str:
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}{' (modified)' if dirty else ''}" if commit else "unknown"


@contextlib.contextmanager
def _quiet_garbage() -> Iterator[None]:
    """Feature kernels that are not run leave uninitialised values: their casts may warn."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def count_network(target: CountingTarget, scene: Any, scene_name: str,
                  layers: tuple[network.NetworkLayer, ...] = network.REFERENCE_NETWORK,
                  skip_feature_kernels: bool = False, tally: Tally | None = None,
                  capacity: Any = None) -> dict[str, Any]:
    """Counts one forward (rulebooks built) and one backward of ``layers`` on ``scene``.

    A first, uncounted forward and backward warms up (compiles the kernels).

    Args:
        target: where it runs.
        scene: a `scenes.VoxelScene`.
        scene_name: its name in the document.
        layers: the network (a prefix of the reference network in tests).
        skip_feature_kernels: count the feature kernels' launches without running them.
        tally: the `Tally` to count into (a fresh one by default; tests watch its ``pass_name``).
        capacity: None (exact mode), or a `sparsecore.capacity` policy: capacity mode. The warm-up
            forward runs in capacity mode too and `sparsecore.check_capacity` (uncounted) teaches the
            policy its counts, so the counted step runs at the capacities the policy learned; the
            document then holds ``capacity``: per pool its rows needed and its capacity.

    Returns:
        The JSON-ready document: header fields, the layers, and flat ``counts``
        and ``sites`` records (pass, layer index or None, stage, kind/site, count).
    """
    tally = Tally(target.internal_files) if tally is None else tally
    library = CountingLibrary(target.library, tally)
    backend = _replace_xp(target.backend, library)
    generator = np.random.default_rng(0)
    weights = tuple(None if weight is None else target.to_device(weight)
                    for weight in network.network_weights(layers, 0))
    channels = layers[0].in_channels
    features = target.to_device(generator.standard_normal((len(scene.indices), channels)).astype(np.float32))
    indices = target.to_device(np.ascontiguousarray(scene.indices, dtype=np.int32))
    shape = tuple(scene.spatial_shape)

    def is_device(value: Any) -> bool:
        return isinstance(value, target.array_type)

    started = time.monotonic()
    with _quiet_garbage(), host_counting.routed(is_device, library, backend), \
            host_counting.counting(tally, backend, target.array_type, skip_feature_kernels, target.ufunc_override):
        warm = network.core_forward(features, indices, shape, weights, layers, backend=backend, capacity=capacity)
        if capacity is not None:  # the warm-up teaches the policy (one read, not counted)
            import sparsecore as sc

            needed = sc.check_capacity(warm.rulebooks, capacity)
            warm = network.core_forward(features, indices, shape, weights, layers, backend=backend,
                                        capacity=capacity)
        grad = target.to_device(generator.standard_normal(tuple(warm.output.shape)).astype(np.float32))
        network.core_backward(warm, grad, weights, layers, backend=backend)
        target.synchronize()
        tally.pass_name = "forward"
        state = network.core_forward(features, indices, shape, weights, layers, recorder=tally, backend=backend,
                                     capacity=capacity)
        tally.pass_name = None
        target.synchronize()
        tally.pass_name = "backward"
        network.core_backward(state, grad, weights, layers, recorder=tally, backend=backend)
        tally.pass_name = None
        target.synchronize()
    mode = "feature kernels counted, not run" if skip_feature_kernels else "every kernel run"
    extra: dict[str, Any] = {}
    if capacity is not None:
        mode += f", capacity mode ({capacity!r})"
        extra["capacity"] = capacity_rows(state, layers, needed)
    return {**extra,
        "format": FORMAT,
        "device": target.name,
        "mode": mode,
        "scene": scene_name,
        "sites": int(len(scene.indices)),
        "commit": _git_commit(),
        "seconds": round(time.monotonic() - started, 1),
        "layers": [{"index": layer.index, "name": layer.name, "kind": layer.kind,
                    "builds_rulebook": layer.builds_rulebook} for layer in layers],
        "counts": [{"pass": pass_name, "layer": _layer_index(label), "stage": stage, "kind": kind, "count": count}
                   for (pass_name, label, stage, kind), count in sorted(tally.counts.items(), key=str)],
        "call_sites": [{"pass": pass_name, "layer": _layer_index(label), "stage": stage, "site": site,
                        "count": count}
                       for (pass_name, label, stage, site), count in tally.sites.most_common()],
    }


def capacity_rows(state: Any, layers: tuple[network.NetworkLayer, ...], needed: dict[str, int]) -> list[dict]:
    """Per layer of a capacity-mode forward: its output rows needed (exact mode's), the rows allocated, and
    the bytes of its output features and tables either way (the memory target of issue 36)."""
    rows = []
    exact = int(state.rulebooks[0].num_input) if state.rulebooks else 0  # the scene's sites: no padding
    for layer, rulebook in zip(layers, state.rulebooks):
        allocated = int(rulebook.num_output)
        exact = int(needed.get(layer.name, exact))  # a submanifold layer keeps its input's rows
        volume = 27 if layer.kind == "subm" else 8
        per_row = 4 * layer.out_channels + 4 * (4 + volume + 1)  # features, then site, neighbour row, mask
        rows.append({"layer": layer.name, "needed": exact, "capacity": allocated,
                     "exact_bytes": exact * per_row, "capacity_bytes": allocated * per_row})
    return rows


@dataclass(frozen=True)
class PassScratch:
    """The memory one feature pass allocates beyond what it returns.

    Attributes:
        direction: ``"forward"`` or ``"backward"``.
        reference_bytes: the output (forward) or the input gradient (backward): the target's yardstick.
        result_bytes: everything the pass returns (the backward's weight gradient too).
        peak_bytes: the most bytes allocated during the pass above its start, its results included.
    """

    direction: str
    reference_bytes: int
    result_bytes: int
    peak_bytes: int

    @property
    def scratch_bytes(self) -> int:
        """Peak allocated beyond the results."""
        return max(self.peak_bytes - self.result_bytes, 0)

    @property
    def ratio(self) -> float:
        """Scratch over the reference size (issue 28's target: at most 0.25)."""
        return self.scratch_bytes / max(self.reference_bytes, 1)


@contextlib.contextmanager
def _peak_meter(target: CountingTarget) -> Iterator[list[int]]:
    """Yields a list that holds, after the block, the peak bytes allocated above the block's start.

    The emulation's arrays are NumPy's, which report their buffers to
    `tracemalloc`; on the GPU, CuPy's memory pool is followed by a hook.
    """
    measured: list[int] = []
    if target.name == "cuda":
        from sparsecore.benchmark.gpu_memory import _peak_hook_class

        target.synchronize()
        hook = _peak_hook_class(target.library)()
        with hook:
            yield measured
            target.synchronize()
        measured.append(int(hook.peak))
        return
    import tracemalloc

    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        yield measured
        measured.append(int(tracemalloc.get_traced_memory()[1] - base))
    finally:
        if started:
            tracemalloc.stop()


def feature_pass_scratch(target: CountingTarget, scene: Any, channels: int = 64,
                         skip_feature_kernels: bool = False) -> tuple[PassScratch, PassScratch]:
    """Scratch memory of a SubMConv3d ``channels -> channels`` forward and backward pass on ``scene``.

    The rulebook is built and one forward and backward run first (kernels
    compile, the rulebook's memoised views are made: they belong to the
    rulebook, not to a pass); the second forward and backward are measured.

    Returns:
        ``(forward, backward)``.
    """
    import sparsecore as sc
    from sparsecore.benchmark.cases import LayerSpec
    from sparsecore.benchmark.cpu import layer_weight

    tally = Tally(target.internal_files)  # counts nothing (no pass named): only the kernels' skipping is wanted
    generator = np.random.default_rng(5)
    count = len(scene.indices)
    features = target.to_device(generator.standard_normal((count, channels)).astype(np.float32))
    grad = target.to_device(generator.standard_normal((count, channels)).astype(np.float32))
    weight = target.to_device(layer_weight(LayerSpec("scratch", "subm", channels, channels), 5))
    indices = target.to_device(np.ascontiguousarray(scene.indices, dtype=np.int32))
    geometry = sc.ConvGeometry.create(3, 3, kind="subm")
    backend = target.backend

    def is_device(value: Any) -> bool:
        return isinstance(value, target.array_type)

    with _quiet_garbage(), host_counting.routed(is_device, target.library, backend), \
            host_counting.counting(tally, backend, target.array_type, skip_feature_kernels, target.ufunc_override):
        rulebook = sc.build_rulebook(indices, tuple(scene.spatial_shape), 1, geometry)
        sc.conv_backward(grad, features, weight, rulebook, backend=backend)
        sc.conv_forward(features, weight, rulebook, backend=backend)
        target.synchronize()
        with _peak_meter(target) as forward_peak:
            output = sc.conv_forward(features, weight, rulebook, backend=backend)
        with _peak_meter(target) as backward_peak:
            grad_input, grad_weight = sc.conv_backward(grad, features, weight, rulebook, backend=backend)
    forward = PassScratch("forward", int(output.nbytes), int(output.nbytes), forward_peak[0])
    backward = PassScratch("backward", int(grad_input.nbytes), int(grad_input.nbytes + grad_weight.nbytes),
                           backward_peak[0])
    return forward, backward


def _replace_xp(backend: Any, library: Any) -> Any:
    import dataclasses

    return dataclasses.replace(backend, xp=library)


def _layer_index(label: str) -> int | None:
    return None if label == OUTSIDE else int(label.split()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scene", default="synthetic", choices=("synthetic", "basic"),
                        help="synthetic: the small synthetic scene (seconds); basic: the real 125k-voxel scan")
    parser.add_argument("--device", default="emulation", choices=("emulation", "cuda"),
                        help="emulation: the kernels compiled by g++ on the CPU (default); cuda: CuPy on a GPU")
    parser.add_argument("--run-all", action="store_true",
                        help="emulation: run the feature kernels too (by default they are counted, not run)")
    parser.add_argument("--layers", type=int, default=len(network.REFERENCE_NETWORK),
                        help="count the first LAYERS layers of the network only (default: all 20)")
    parser.add_argument("--sites", type=int, default=25, help="call sites to list per pass (0: none)")
    parser.add_argument("--memory", action="store_true",
                        help="also measure the scratch memory of a SubMConv3d 64->64 forward and backward on the "
                        "scene (peak allocated beyond the results: tracemalloc on the emulation, CuPy's pool on a GPU)")
    parser.add_argument("--capacity", action="store_true",
                        help="capacity mode (sparsecore.capacity, the default LearnedCapacity policy after one "
                        "warm-up step): host operations per step with no read back, and the memory it takes")
    parser.add_argument("--json", metavar="PATH", help="also write the counts as JSON (for --compare)")
    parser.add_argument("--compare", metavar="PATH",
                        help="compare the per-layer counts with another run's --json; exit 1 where they differ")
    args = parser.parse_args(argv)

    target = emulation_target(prebuild=args.run_all) if args.device == "emulation" else cuda_target()
    scene = network.network_scene(args.scene, "small")
    if not 1 <= args.layers <= len(network.REFERENCE_NETWORK):
        parser.error(f"--layers must be between 1 and {len(network.REFERENCE_NETWORK)}, got {args.layers}")
    policy = None
    if args.capacity:
        import sparsecore as sc

        policy = sc.LearnedCapacity()
    document = count_network(target, scene, args.scene, network.REFERENCE_NETWORK[:args.layers],
                             skip_feature_kernels=args.device == "emulation" and not args.run_all, capacity=policy)
    if args.memory:
        passes = feature_pass_scratch(target, scene, 64,
                                      skip_feature_kernels=args.device == "emulation" and not args.run_all)
        document["scratch"] = [{"direction": item.direction, "channels": 64, "reference_bytes": item.reference_bytes,
                                "result_bytes": item.result_bytes, "peak_bytes": item.peak_bytes,
                                "scratch_bytes": item.scratch_bytes} for item in passes]
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    print(format_report(document, args.sites))
    if args.capacity:
        print(format_capacity(document))
    if not args.compare:
        return 0
    other = json.loads(Path(args.compare).read_text(encoding="utf-8"))
    differences = compare_documents(document, other)
    where = f"{other['device']} ({other['mode']}, scene {other['scene']}, commit {other['commit']})"
    if other["scene"] != document["scene"]:
        differences.insert(0, f"the scenes differ: {document['scene']} vs {other['scene']}")
    if differences:
        print(f"compared with {args.compare}, {where}: {len(differences)} lines differ (this run vs that one)")
        print("\n".join(differences))
        return 1
    print(f"compared with {args.compare}, {where}: every layer's counts are equal")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
