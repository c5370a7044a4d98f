"""The CPU benchmark: sparsecore's NumPy engine, and spconv's CPU build beside it.

For each layer of ``cases.LAYERS`` it times three stages separately on the
same scene: building the rulebook from the indices, the forward feature pass
given the rulebook, and the backward pass (gradients of features and weight)
given the rulebook. It then times voxelization of the first points of the raw
scan. Where spconv is importable, the same layers run in spconv with the same
weights in the same process, the two engines taking turns run by run within
each stage (so a shared machine's changing load falls on both alike), and the
outputs and gradients of both are checked against each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparsecore.benchmark import scenes
from sparsecore.benchmark.cases import (
    LAYERS,
    VOXELIZE,
    VOXELIZE_STAGE,
    LayerSpec,
    Row,
    VoxelizeSpec,
)
from sparsecore.benchmark.clocks import HostClock, TimedWork, measure_interleaved_ms
from sparsecore.benchmark.timing import MachinePeaks

__all__ = [
    "RELATIVE_TOLERANCE",
    "BenchmarkInputs",
    "layer_weight",
    "compare_arrays",
    "layer_work",
    "rate_note",
    "run_layer",
    "run_voxelize",
    "run_cpu_benchmark",
]

RELATIVE_TOLERANCE = 1e-4
MILLISECONDS = 1000.0


@dataclass(frozen=True)
class BenchmarkInputs:
    """What the benchmark runs on.

    Attributes:
        scene: the voxels the convolutions run on.
        points: the raw points voxelization runs on (all of them; the case takes its first ones).
        points_source: where the points came from.
    """

    scene: scenes.VoxelScene
    points: np.ndarray
    points_source: str


def layer_weight(layer: LayerSpec, seed: int) -> np.ndarray:
    """A float32 weight ``[out, k, k, k, in]`` scaled like a kaiming initialisation.

    Args:
        layer: the layer.
        seed: random seed.

    Returns:
        The weight, spconv's layout.
    """
    generator = np.random.default_rng(seed)
    kernel = layer.kernel_size
    shape = (layer.out_channels, kernel, kernel, kernel, layer.in_channels)
    fan_in = layer.in_channels * kernel**3
    return (generator.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)


def compare_arrays(name: str, ours: np.ndarray, theirs: np.ndarray) -> str | None:
    """Compares two float arrays with a tolerance relative to their scale.

    Args:
        name: what is compared, for the message.
        ours: sparsecore's array.
        theirs: spconv's array.

    Returns:
        None when they agree, else a short description of the difference.
    """
    if ours.shape != theirs.shape:
        return f"{name} shapes {ours.shape} vs {theirs.shape}"
    if ours.size == 0:
        return None
    scale = max(float(np.max(np.abs(theirs))), 1e-30)
    worst = float(np.max(np.abs(ours.astype(np.float64) - theirs.astype(np.float64))))
    if worst > RELATIVE_TOLERANCE * scale:
        return f"{name} differ by {worst:.3g} (scale {scale:.3g})"
    return None


def layer_work(layer: LayerSpec, num_pairs: int, stage: str) -> tuple[float, float]:
    """``(flops, bytes)`` of a conv stage: the multiply-adds and the gathered and scattered rows.

    Forward: ``2 * pairs * C_in * C_out`` FLOP and ``4 * pairs * (C_in + C_out)`` bytes
    (float32 rows read per pair and added per pair); backward (features and weight): twice both.
    """
    scale = 2.0 if stage == "backward" else 1.0
    flops = scale * 2.0 * num_pairs * layer.in_channels * layer.out_channels
    moved = scale * 4.0 * num_pairs * (layer.in_channels + layer.out_channels)
    return flops, moved


def rate_note(flops: float, moved: float, seconds: float, peaks: MachinePeaks | None) -> str:
    """``"x GFLOP/s (p% of peak), y GB/s (q%)"`` for a stage that took ``seconds``."""
    gflops, gigabytes = flops / seconds / 1e9, moved / seconds / 1e9
    if peaks is None:
        return f"{gflops:.1f} GFLOP/s, {gigabytes:.1f} GB/s"
    return (f"{gflops:.1f} GFLOP/s ({100 * gflops / peaks.gflops:.0f}% of peak), "
            f"{gigabytes:.1f} GB/s ({100 * gigabytes / peaks.gigabytes_per_second:.0f}%)")


def _sorted_rows(indices: np.ndarray) -> np.ndarray:
    return np.lexsort(indices.T[::-1])


def _interleaved_seconds(ours: TimedWork, theirs: TimedWork | None, repeat: int) -> tuple[float, float | None]:
    """Median seconds of ``ours`` and ``theirs`` (None: not timed), the two taking turns run by run."""
    works = [ours] if theirs is None else [ours, theirs]
    medians = [milliseconds / MILLISECONDS for milliseconds, _ in measure_interleaved_ms(works, repeat, 1, math.inf)]
    return medians[0], (medians[1] if theirs is not None else None)


def _spconv_failure(rows: list[Row], error: Exception) -> None:
    """Notes spconv's failure on ``rows`` (its numbers stay out; sparsecore's are timed alone)."""
    message = f"spconv failed: {type(error).__name__}: {error}"
    for row in rows:
        row.agreement = "MISMATCH" if isinstance(error, ValueError) else "-"
        row.notes.append(message)


def run_layer(
    layer: LayerSpec, scene: scenes.VoxelScene, repeat: int, spconv_torch: Any | None, seed: int = 0,
    peaks: MachinePeaks | None = None,
) -> list[Row]:
    """Times one layer's stages in sparsecore (and spconv, each stage's runs taking turns), checking they agree.

    Args:
        layer: the layer.
        scene: its input sites.
        repeat: timed repeats per stage.
        spconv_torch: the torch module inside ``spconv_session`` to compare
            against spconv, or None to run sparsecore alone.
        seed: random seed for features, weight and output gradient.
        peaks: the machine's measured peaks, for the rows' "% of peak" (None: rates only).

    Returns:
        Three rows: rulebook, forward, backward.
    """
    import sparsecore as sc

    generator = np.random.default_rng(seed)
    features = generator.standard_normal((len(scene.indices), layer.in_channels)).astype(np.float32)
    weight = layer_weight(layer, seed + 1)
    geometry = sc.ConvGeometry.create(
        3, layer.kernel_size, stride=layer.stride, padding=layer.padding, kind=layer.kind
    )

    def build() -> Any:
        return sc.build_rulebook(scene.indices, scene.spatial_shape, scene.batch_size, geometry)

    rulebook = build()
    output = np.asarray(sc.conv_forward(features, weight, rulebook))
    grad_output = generator.standard_normal(output.shape).astype(np.float32)
    grad_features, grad_weight = sc.conv_backward(grad_output, features, weight, rulebook)
    size_note = f"{rulebook.num_input} -> {rulebook.num_output} sites, {rulebook.num_pairs} pairs"
    rows = [Row(layer.name, "rulebook", notes=[size_note]), Row(layer.name, "forward"), Row(layer.name, "backward")]
    peer = None
    output_indices = np.asarray(rulebook.output_indices)
    order = _sorted_rows(output_indices)
    if spconv_torch is not None:
        from sparsecore.benchmark.peer_spconv import prepare_spconv_layer

        try:
            peer = prepare_spconv_layer(spconv_torch, layer, features, scene.indices, scene.spatial_shape,
                                        scene.batch_size, weight, output_indices[order], grad_output[order])
        except Exception as error:  # report spconv's failure in the table, keep sparsecore's numbers
            _spconv_failure(rows, error)
    clock = HostClock()
    ours = (TimedWork(clock, lambda _: build()),
            TimedWork(clock, lambda _: sc.conv_forward(features, weight, rulebook)),
            TimedWork(clock, lambda _: sc.conv_backward(grad_output, features, weight, rulebook)))
    theirs = (None, None, None) if peer is None else (peer.rulebook, peer.forward, peer.backward)
    for row, our_work, their_work in zip(rows, ours, theirs):
        our_seconds, their_seconds = _interleaved_seconds(our_work, their_work, repeat)
        row.sparsecore_ms = our_seconds * MILLISECONDS
        row.spconv_ms = None if their_seconds is None else their_seconds * MILLISECONDS
        if row.stage != "rulebook":
            row.notes.append(rate_note(*layer_work(layer, rulebook.num_pairs, row.stage), our_seconds, peaks))
    if peer is None:
        return rows

    peer_order = _sorted_rows(peer.output_indices)
    sites_agree = np.array_equal(peer.output_indices[peer_order], output_indices[order])
    rows[0].agreement = "ok" if sites_agree else "MISMATCH: output sites"
    forward_problem = compare_arrays("outputs", output[order], peer.output_features[peer_order])
    rows[1].agreement = "ok" if forward_problem is None else f"MISMATCH: {forward_problem}"
    backward_problems = [
        problem
        for problem in (
            compare_arrays("grad features", np.asarray(grad_features), peer.grad_features),
            compare_arrays("grad weight", np.asarray(grad_weight), peer.grad_weight),
        )
        if problem is not None
    ]
    rows[2].agreement = "ok" if not backward_problems else "MISMATCH: " + "; ".join(backward_problems)
    return rows


def run_voxelize(spec: VoxelizeSpec, points: np.ndarray, repeat: int, spconv_torch: Any | None) -> Row:
    """Times voxelization of the first ``spec.num_points`` points (beside spconv's, taking turns).

    Args:
        spec: voxel size, range and capacities.
        points: float32 ``[P, 3+]`` points.
        repeat: timed repeats.
        spconv_torch: the torch module inside ``spconv_session``, or None.

    Returns:
        The voxelize row.
    """
    from sparsecore.voxelization import voxelize

    subset = np.ascontiguousarray(points[: spec.num_points], dtype=np.float32)

    def run() -> Any:
        return voxelize(
            subset, spec.voxel_size, spec.coordinate_range, spec.max_num_points_per_voxel, spec.max_num_voxels
        )

    result = run()
    ours = np.asarray(result.indices)
    row = Row(spec.name, VOXELIZE_STAGE)
    row.notes.append(f"{len(subset)} points -> {len(ours)} voxels")
    peer = None
    if spconv_torch is not None:
        from sparsecore.benchmark.peer_spconv import prepare_spconv_voxelize

        try:
            peer = prepare_spconv_voxelize(spconv_torch, spec, subset)
        except Exception as error:  # report spconv's failure in the table
            row.notes.append(f"spconv failed: {type(error).__name__}: {error}")
    our_seconds, their_seconds = _interleaved_seconds(
        TimedWork(HostClock(), lambda _: run()), None if peer is None else peer.voxelize, repeat)
    row.sparsecore_ms = our_seconds * MILLISECONDS
    if peer is None:
        return row
    row.spconv_ms = their_seconds * MILLISECONDS
    same_order = np.array_equal(ours, peer.coordinates)
    same_counts = np.array_equal(np.asarray(result.num_points_per_voxel), peer.num_points_per_voxel)
    if same_order and same_counts:
        row.agreement = "ok"
    elif ours.shape == peer.coordinates.shape and np.array_equal(
        ours[_sorted_rows(ours)], peer.coordinates[_sorted_rows(peer.coordinates)]
    ):
        row.agreement = "ok (same voxels, other order)"
    else:
        row.agreement = f"MISMATCH: {len(ours)} vs {len(peer.coordinates)} voxels"
    return row


def run_cpu_benchmark(inputs: BenchmarkInputs, repeat: int, compare_with_spconv: bool = True,
                      peaks: MachinePeaks | None = None) -> tuple[list[Row], str]:
    """Runs every case.

    Args:
        inputs: scene and points.
        repeat: timed repeats per stage.
        compare_with_spconv: run spconv beside sparsecore where it is importable.
        peaks: the machine's measured peaks, for the rows' "% of peak".

    Returns:
        The rows in table order, and a line saying whether spconv was compared
        (and why not, when it was not).
    """
    rows: list[Row] = []
    spconv_status = "not requested"
    if compare_with_spconv:
        from sparsecore.benchmark.peer_spconv import spconv_session, spconv_unavailable_reason

        reason = spconv_unavailable_reason()
        if reason is not None:
            spconv_status = f"not available ({reason})"
        else:
            spconv_status = "compared (torch single-threaded for spconv)"
            with spconv_session() as torch:
                for layer in LAYERS:
                    rows.extend(run_layer(layer, inputs.scene, repeat, torch, peaks=peaks))
                rows.append(run_voxelize(VOXELIZE, inputs.points, repeat, torch))
            return rows, spconv_status
    for layer in LAYERS:
        rows.extend(run_layer(layer, inputs.scene, repeat, None, peaks=peaks))
    rows.append(run_voxelize(VOXELIZE, inputs.points, repeat, None))
    return rows, spconv_status
