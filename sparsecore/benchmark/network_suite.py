"""The ``network`` and ``gpu`` suites: the reference network, timed per stage and per layer.

For every scene and dtype, one case: the forward (13 rulebook builds
included) and the backward of `network.REFERENCE_NETWORK`, each the median of
many runs after warm-up (CUDA events on the GPU), then a few instrumented runs
that split the time into rulebooks, gather, GEMM, scatter, the rest of the
convolutions, and pooling, and time every layer. Where spconv is importable,
the same network with the same weights runs in the same process and the two
are checked against each other. On the GPU, TF32 is CuPy's ``CUPY_TF32=1``,
which CuPy reads when it is imported: the dtypes whose TF32 setting differs
from this process's run in a child process of this suite, whose rows are
merged into the table. The ``gpu`` suite adds the peak memory of one
SubMConv3d 64->64 on the basic scan.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

import numpy as np

from sparsecore.benchmark import network
from sparsecore.benchmark.cases import Row
from sparsecore.benchmark.clocks import InstrumentedBackend, StageRecorder, TimedWork, measure_interleaved_ms
from sparsecore.benchmark.network_checks import compare_with_spconv, core_subm_memory_rows, prepare_spconv_peers
from sparsecore.benchmark.network_layers import BITWISE_STAGE, LayerStack, bitwise_row, kernel_timed, layer_rows
from sparsecore.benchmark.network import REFERENCE_NETWORK, Device

__all__ = [
    "FORWARD_STAGES",
    "BACKWARD_STAGES",
    "NetworkOptions",
    "case_row_keys",
    "run_network_case",
    "run_network_suite",
    "rows_from_json",
]

FORWARD_STAGES = ("rulebooks", "gather", "GEMM", "scatter", "conv other", "pool", "profiled total")
BACKWARD_STAGES = ("gather", "GEMM", "scatter", "conv other", "pool", "profiled total")
_CHILD_MINIMUM_SECONDS = 30.0


@dataclass(frozen=True)
class NetworkOptions:
    """What one run of the suite covers.

    Attributes:
        device: ``"cpu"`` or ``"cuda"``.
        scenes: scene names (`network.SCENE_NAMES`).
        scale: the synthetic scene's size.
        dtypes: dtype names (`network.DTYPE_NAMES`).
        repeat: timed runs per measurement, at most.
        warmup: untimed runs first.
        max_seconds: time budget per measurement (fewer runs when exceeded, at least 3).
        profile_runs: instrumented runs for the stage and layer rows (median per row).
        compare_spconv: run spconv beside sparsecore where it is importable.
        spconv_algorithms: spconv ``ConvAlgo`` choices (`network_spconv.SPCONV_ALGORITHMS` keys);
            the first is the one in the main rows.
        layers: print one forward and one backward row per layer.
        memory: measure the peak memory of a SubMConv3d 64->64 (cuda only).
        seed: seed of the weights, the synthetic scene and the output gradient.
        child_timeout: seconds allowed to the child process that runs the other TF32 setting.
        time_limit: seconds after which no further case starts (None: no limit); the
            cases left are listed as skipped.
        bitwise: run the forward and the backward twice more and compare every bit
            (`network_layers.bitwise_row`).
    """

    device: str
    scenes: tuple[str, ...]
    scale: str
    dtypes: tuple[str, ...]
    repeat: int
    warmup: int
    max_seconds: float
    profile_runs: int
    compare_spconv: bool
    spconv_algorithms: tuple[str, ...]
    layers: bool
    memory: bool
    seed: int
    child_timeout: float
    time_limit: float | None = None
    bitwise: bool = False

    def child_arguments(self, dtypes: tuple[str, ...], json_path: str) -> list[str]:
        """Command-line arguments of ``network`` that repeat these options for ``dtypes``."""
        arguments = [
            "network", "--device", self.device, "--scene", ",".join(self.scenes), "--scale", self.scale,
            "--dtype", ",".join(dtypes), "--repeat", str(self.repeat), "--warmup", str(self.warmup),
            "--max-seconds", str(self.max_seconds), "--profile-runs", str(self.profile_runs),
            "--seed", str(self.seed), "--spconv-algo", ",".join(self.spconv_algorithms),
            "--json", json_path, "--no-memory",
        ]
        if not self.compare_spconv:
            arguments.append("--no-spconv")
        if not self.layers:
            arguments.append("--no-layers")
        arguments.append("--bitwise" if self.bitwise else "--no-bitwise")
        return arguments


def case_row_keys(prefix: str, algorithms: tuple[str, ...], layers: bool,
                  bitwise: bool = False) -> list[tuple[str, str]]:
    """(case, stage) of the rows of one case, in order.

    Args:
        prefix: ``"<scene> <dtype>"``.
        algorithms: the spconv algorithms compared (none without spconv).
        layers: whether the per-layer rows are included.
        bitwise: whether the run-to-run bitwise row is included.
    """
    keys = [(f"{prefix} network", "forward"), (f"{prefix} network", "backward")]
    for algorithm in algorithms[1:]:
        keys += [(f"{prefix} network", f"forward, spconv {algorithm}"),
                 (f"{prefix} network", f"backward, spconv {algorithm}")]
    if bitwise:
        keys.append((f"{prefix} network", BITWISE_STAGE))
    keys += [(f"{prefix} forward stages", stage) for stage in FORWARD_STAGES]
    keys += [(f"{prefix} backward stages", stage) for stage in BACKWARD_STAGES]
    if layers:
        for layer in REFERENCE_NETWORK:
            keys += [(f"{prefix} {layer.name}", "forward"), (f"{prefix} {layer.name}", "backward")]
    return keys


def _median_totals(recorders: list[StageRecorder]) -> dict[str, float]:
    per_label: dict[str, list[float]] = {}
    for recorder in recorders:
        for label, milliseconds in recorder.totals_ms().items():
            per_label.setdefault(label, []).append(milliseconds)
    return {label: statistics.median(values) for label, values in per_label.items()}


def _stage_values(totals: dict[str, float], direction: str) -> dict[str, float]:
    primitives = sum(totals.get(label, 0.0) for label in ("gather", "GEMM", "scatter"))
    values = {label: totals.get(label, 0.0) for label in ("rulebooks", "gather", "GEMM", "scatter", "pool")}
    values["conv other"] = totals.get("convolution", 0.0) - primitives
    values["profiled total"] = sum(totals.get(f"{direction} {layer.index}", 0.0) for layer in REFERENCE_NETWORK)
    return values


def _peer_times(times: tuple[tuple[float, int], tuple[float, int]]) -> tuple[float, float, int]:
    """``((forward ms, runs), (backward ms, runs))`` as `compare_with_spconv` takes them."""
    (forward_ms, _), (backward_ms, backward_runs) = times
    return forward_ms, backward_ms, backward_runs


def run_network_case(device: Device, scene: Any, scene_name: str, dtype_name: str,
                     options: NetworkOptions, spconv_torch: Any | None) -> list[Row]:
    """Times one scene in one dtype and checks it against spconv.

    Args:
        device: where sparsecore runs.
        scene: the `scenes.VoxelScene`.
        scene_name: its name in the table.
        dtype_name: ``"float32"``, ``"float16"`` or ``"tf32"``.
        options: the suite's options.
        spconv_torch: the torch module of an open `spconv_network_session`, or None.

    Returns:
        The case's rows, in `case_row_keys` order.
    """
    from sparsecore.backends import backend_for

    prefix = f"{scene_name} {dtype_name}"
    storage = network.storage_dtype(dtype_name)
    host_weights = network.network_weights(REFERENCE_NETWORK, options.seed)
    features = device.put(scene.features, storage)
    indices = device.put(scene.indices)
    weights = tuple(None if weight is None else device.put(weight, storage) for weight in host_weights)
    shape = tuple(scene.spatial_shape)

    def forward(_: Any = None) -> network.CoreForward:
        return network.core_forward(features, indices, shape, weights)

    state = forward()
    output_indices = device.get(state.output_indices)
    order = np.lexsort(output_indices.T[::-1])
    generator = np.random.default_rng(options.seed + 1000)
    grad_sorted = generator.uniform(-0.2, 0.2, (len(order), REFERENCE_NETWORK[-1].out_channels)).astype(np.float32)
    grad_rows = np.empty_like(grad_sorted)
    grad_rows[order] = grad_sorted
    grad_output = device.put(grad_rows, storage)
    peers = [] if spconv_torch is None else prepare_spconv_peers(
        spconv_torch, device.name, dtype_name, scene, output_indices[order], grad_sorted, options)
    ready = [peer for peer in peers if not isinstance(peer, Exception)]
    # sparsecore and every spconv algorithm take turns run by run
    forward_times = measure_interleaved_ms([TimedWork(device.clock, forward)] + [peer.forward for peer in ready],
                                           options.repeat, options.warmup, options.max_seconds)
    backward_times = measure_interleaved_ms(
        [TimedWork(device.clock, lambda _: network.core_backward(state, grad_output, weights))]
        + [peer.backward for peer in ready], options.repeat, options.warmup, options.max_seconds)
    (forward_ms, forward_runs), (backward_ms, backward_runs) = forward_times[0], backward_times[0]
    timed = iter(zip(forward_times[1:], backward_times[1:]))
    peer_times = [None if isinstance(peer, Exception) else _peer_times(next(timed)) for peer in peers]

    forward_recorders, backward_recorders = [], []
    for _ in range(max(options.profile_runs, 1)):  # every layer's interval, and each of its launches (on GPUs)
        recorder = StageRecorder(device.clock)
        stack = LayerStack(recorder)
        instrumented = InstrumentedBackend(kernel_timed(backend_for(features), stack), recorder)
        profiled = network.core_forward(features, indices, shape, weights, recorder=stack, backend=instrumented)
        forward_recorders.append(recorder)
        recorder = StageRecorder(device.clock)
        stack = LayerStack(recorder)
        network.core_backward(profiled, grad_output, weights, recorder=stack,
                              backend=InstrumentedBackend(kernel_timed(backend_for(features), stack), recorder))
        backward_recorders.append(recorder)
    forward_totals, backward_totals = _median_totals(forward_recorders), _median_totals(backward_recorders)

    sites = f"{len(scene.indices)} -> {len(order)} sites"
    rows = [
        Row(f"{prefix} network", "forward", forward_ms,
            notes=[f"median of {forward_runs}", "13 rulebook builds included", sites]),
        Row(f"{prefix} network", "backward", backward_ms, notes=[f"median of {backward_runs}"]),
    ]
    for direction, totals, stages in (("forward", forward_totals, FORWARD_STAGES),
                                      ("backward", backward_totals, BACKWARD_STAGES)):
        values = _stage_values(totals, direction)
        for stage in stages:
            row = Row(f"{prefix} {direction} stages", stage, values[stage])
            if stage == "profiled total":
                row.notes.append(f"median of {len(forward_recorders)} instrumented runs")
            rows.append(row)
    if options.layers:
        rows += layer_rows(prefix, state.rulebooks, forward_totals, backward_totals)
    if options.bitwise:
        rows.insert(2, bitwise_row(prefix, device.get, forward,
                                   lambda saved: network.core_backward(saved, grad_output, weights)))
    if not peers:
        return rows
    # the check runs with spconv's max-pool floor at 0 (see network.core_forward)
    floored = network.core_forward(features, indices, shape, weights, spconv_pool_floor=True)
    floored_grad, _ = network.core_backward(floored, grad_output, weights)
    # the same network in float64 (same sites, same floor): how far each engine is from exact arithmetic
    weights64 = tuple(None if weight is None else device.put(weight, np.float64) for weight in host_weights)
    exact = network.core_forward(device.put(scene.features, np.float64), indices, shape, weights64,
                                 spconv_pool_floor=True)
    exact_grad, _ = network.core_backward(exact, device.put(grad_rows, np.float64), weights64)
    extra_rows = compare_with_spconv(peers, peer_times, dtype_name, device.get(floored.output)[order],
                                     device.get(floored_grad), rows[0], rows[1],
                                     reference=(device.get(exact.output)[order], device.get(exact_grad)))
    return rows[:2] + extra_rows + rows[2:]


def rows_from_json(path: str | Path) -> tuple[dict[str, str], list[Row]]:
    """The header and rows of a JSON file written by `report.write_json`."""
    document = json.loads(Path(path).read_text(encoding="utf-8"))
    names = {item.name for item in fields(Row)}
    rows = [Row(**{key: value for key, value in row.items() if key in names}) for row in document["rows"]]
    return document["header"], rows


def _run_child(options: NetworkOptions, dtypes: tuple[str, ...], tf32: bool,
               seconds: float) -> tuple[list[Row], str]:
    """Runs ``dtypes`` in a child process with ``CUPY_TF32`` set to ``tf32``; returns its rows and a status.

    The child gets ``seconds`` (at most ``options.child_timeout``), and a
    time limit of its own a little shorter, so it ends its last case itself.
    """
    timeout = min(options.child_timeout, seconds)
    environment = dict(os.environ, CUPY_TF32="1" if tf32 else "0")
    label = f"child process (CUPY_TF32={environment['CUPY_TF32']}) for {', '.join(dtypes)}"
    if timeout < _CHILD_MINIMUM_SECONDS:
        return [Row(f"{dtype} child process", "forward", agreement="SKIPPED",
                    notes=[f"{label}: {max(timeout, 0):.0f} s left"]) for dtype in dtypes], label
    with tempfile.TemporaryDirectory() as directory:
        json_path = str(Path(directory) / "rows.json")
        arguments = options.child_arguments(dtypes, json_path)
        arguments += ["--time-limit", f"{max(timeout * 0.6, timeout - 60):.0f}"]
        command = [sys.executable, "-m", "sparsecore.benchmark", *arguments]
        try:
            completed = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return [Row(f"{dtype} child process", "forward", agreement="FAILED",
                        notes=[f"{label} ran past {timeout:.0f} s"]) for dtype in dtypes], label
        if not Path(json_path).is_file():
            tail = (completed.stdout + completed.stderr).strip().splitlines()[-3:]
            return [Row(f"{dtype} child process", "forward", agreement="FAILED",
                        notes=[f"{label} exited {completed.returncode}: " + " | ".join(tail)])
                    for dtype in dtypes], label
        _, rows = rows_from_json(json_path)
        return rows, label


def _failed_case_rows(prefix: str, error: Exception) -> list[Row]:
    message = f"sparsecore failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return [Row(f"{prefix} network", "forward", agreement="FAILED", notes=[message]),
            Row(f"{prefix} network", "backward", agreement="FAILED")]


def run_network_suite(options: NetworkOptions,
                      progress: Callable[[dict[str, str], list[Row]], None] | None = None,
                      ) -> tuple[dict[str, str], list[Row]]:
    """Runs every case of the options (and the memory row), in this process and, for TF32, a child.

    Args:
        options: what to run.
        progress: called with the header and the rows so far after every case
            (to save partial results should the run be stopped).

    Returns:
        Header lines (without the machine description) and rows in table order.
    """
    from sparsecore.benchmark.peer_spconv import spconv_unavailable_reason

    started = time.monotonic()
    device = network.device_for(options.device)
    this_tf32 = os.environ.get("CUPY_TF32", "0") == "1"
    here = tuple(dtype for dtype in options.dtypes if device.name == "cpu" or (dtype == "tf32") == this_tf32)
    elsewhere = tuple(dtype for dtype in options.dtypes if dtype not in here)
    reason = spconv_unavailable_reason() if options.compare_spconv else "not requested"
    spconv_status = "not requested" if not options.compare_spconv else (
        f"not available ({reason})" if reason else f"compared in this process ({', '.join(options.spconv_algorithms)})")
    header = {"device": device.description, "spconv": spconv_status,
              "tf32": f"CUPY_TF32={'1' if this_tf32 else '0'} in this process (read by CuPy at import)"}
    rows: list[Row] = []

    def time_left() -> float:
        return math.inf if options.time_limit is None else options.time_limit - (time.monotonic() - started)

    def report_progress() -> None:
        if progress is not None:
            progress(header, rows)

    loaded = {}
    for scene_name in options.scenes:
        try:
            loaded[scene_name] = network.network_scene(scene_name, options.scale, options.seed)
        except (OSError, ValueError) as error:
            rows += _failed_case_rows(f"{scene_name}", error)
            continue
        scene = loaded[scene_name]
        header[f"scene {scene_name}"] = (f"{scene.source}: {len(scene.indices)} voxels, spatial shape "
                                         f"{tuple(scene.spatial_shape)}")
        for dtype_name in here:
            if time_left() <= 0:
                rows.append(Row(f"{scene_name} {dtype_name} network", "forward", agreement="SKIPPED",
                                notes=[f"--time-limit {options.time_limit:g} s reached"]))
                continue
            rows += _run_case_guarded(device, scene, scene_name, dtype_name, options, reason is None)
            report_progress()
    if options.memory and device.name == "cuda" and loaded and time_left() > 0:
        scene_name = "basic" if "basic" in loaded else next(iter(loaded))
        for dtype_name in here:
            rows.extend(core_subm_memory_rows(device, loaded[scene_name], scene_name, dtype_name, options.seed,
                                              options.spconv_algorithms if reason is None else ()))
        report_progress()
    if elsewhere:
        child_rows, label = _run_child(options, elsewhere, tf32="tf32" in elsewhere, seconds=time_left())
        rows += child_rows
        header["child"] = label
        report_progress()
    return header, rows


def _run_case_guarded(device: Device, scene: Any, scene_name: str, dtype_name: str, options: NetworkOptions,
                      spconv_available: bool) -> list[Row]:
    """`run_network_case`, with spconv when its session opens, and a failure row instead of an exception."""
    prefix = f"{scene_name} {dtype_name}"
    with contextlib.ExitStack() as stack:
        torch, session_problem = None, None
        if spconv_available:
            from sparsecore.benchmark.network_spconv import spconv_network_session

            try:
                torch = stack.enter_context(spconv_network_session(device.name, dtype_name))
            except Exception as error:  # run sparsecore alone, and say why
                session_problem = f"spconv not run: {type(error).__name__}: {error}"
        try:
            rows = run_network_case(device, scene, scene_name, dtype_name, options, torch)
        except Exception as error:  # one broken case must leave the others' rows
            return _failed_case_rows(prefix, error)
        if session_problem is not None:
            rows[0].notes.append(session_problem)
        return rows
