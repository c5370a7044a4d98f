"""Checks beside the network timings: agreement with spconv, and the peak-memory row.

Agreement: the two networks' outputs are compared on the same sites (sorted),
and the gradients of the input features row by row, by the relative error
``|ours - theirs| / |theirs|`` (Frobenius norms), with the largest element
difference and the count of elements off by more than 1e-3 of the largest
value shown beside it. The norm decides, against a tolerance per dtype
(`TOLERANCES`). Gradients get more room than outputs: a max pool whose two
best inputs differ by rounding alone may pick either, and the gradient of
that output then goes to another input row and spreads back through every
layer below. On the basic scan at one BLAS thread that gave a gradient error
of 7.4e-4 in float32 (134 of 376,686 elements off by more than 1e-3 of the
largest), against 9e-7 at two threads; the outputs agreed to 7e-7 either way.
float16 rounds every stored activation, so ties and such flips are common
there, and spconv's backward sends a tied maximum's gradient to every tied
input where sparsecore sends it to the first: its tolerances are loose.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sparsecore.benchmark.cases import LayerSpec, Row
from sparsecore.benchmark.cpu import layer_weight

__all__ = [
    "TOLERANCES",
    "MEMORY_CHANNELS",
    "compare_network_arrays",
    "prepare_spconv_peers",
    "compare_with_spconv",
    "relative_error",
    "core_subm_memory_rows",
]

# dtype -> (outputs, input gradient) relative tolerances
TOLERANCES = {"float32": (1e-4, 5e-3), "tf32": (2e-2, 1e-1), "float16": (2e-2, 1e-1)}
MEMORY_CHANNELS = 64
_MEBIBYTE = 2.0**20


def compare_network_arrays(name: str, ours: np.ndarray, theirs: np.ndarray, dtype_name: str,
                           gradient: bool = False) -> str:
    """The agreement cell for two arrays that should hold the same values.

    Args:
        name: what is compared, for the message.
        ours: sparsecore's array (host).
        theirs: spconv's array (host), rows aligned with ``ours``.
        dtype_name: the benchmark dtype, which sets the tolerance.
        gradient: whether the arrays are gradients (the second tolerance of `TOLERANCES`).

    Returns:
        ``"ok (rel ...)"`` or ``"MISMATCH: ..."``.
    """
    if ours.shape != theirs.shape:
        return f"MISMATCH: {name} shapes {ours.shape} vs {theirs.shape}"
    if ours.size == 0:
        return "ok (empty)"
    ours64, theirs64 = ours.astype(np.float64), theirs.astype(np.float64)
    if not np.all(np.isfinite(ours64)):
        return f"MISMATCH: {name} of sparsecore hold {int(np.sum(~np.isfinite(ours64)))} non-finite values"
    difference = ours64 - theirs64
    relative = relative_error(ours64, theirs64)
    worst = float(np.max(np.abs(difference)))
    scale = float(np.max(np.abs(theirs64)))
    tolerance = TOLERANCES[dtype_name][1 if gradient else 0]
    far = int(np.count_nonzero(np.abs(difference) > 1e-3 * scale))
    summary = f"rel {relative:.1e}, max {worst:.1e} of {scale:.1e}, {far} of {difference.size} off > 1e-3"
    if not relative <= tolerance:
        return f"MISMATCH: {name} {summary} (tolerance {tolerance:.0e})"
    return f"ok ({summary})"


def relative_error(values: np.ndarray, reference: np.ndarray) -> float:
    """``|values - reference| / |reference|`` in Frobenius norms, computed in float64 (0 for empty arrays)."""
    if values.shape != reference.shape:
        raise ValueError(f"relative_error: shapes {values.shape} and {reference.shape} differ")
    reference64 = reference.astype(np.float64)
    difference = float(np.linalg.norm(values.astype(np.float64) - reference64))
    return difference / max(float(np.linalg.norm(reference64)), 1e-30) if values.size else 0.0


def prepare_spconv_peers(torch: Any, device_name: str, dtype_name: str, scene: Any, sorted_indices: np.ndarray,
                         grad_sorted: np.ndarray, options: Any) -> list[Any]:
    """spconv's network for every algorithm of the options, run once and ready to be timed.

    Args:
        torch: from an open `network_spconv.spconv_network_session`.
        device_name: ``"cpu"`` or ``"cuda"``.
        dtype_name: the benchmark dtype.
        scene: the `scenes.VoxelScene` (host arrays).
        sorted_indices: sparsecore's output sites, sorted.
        grad_sorted: the output gradient on the sorted sites.
        options: the suite's `NetworkOptions`.

    Returns:
        Per algorithm of ``options.spconv_algorithms``, in order: its
        `network_spconv.SpconvNetwork`, or the exception it raised (reported
        in the table by `compare_with_spconv`; a ValueError says the output
        sites differ).
    """
    from sparsecore.benchmark import network
    from sparsecore.benchmark.network_spconv import prepare_spconv_network

    peers: list[Any] = []
    for algorithm in options.spconv_algorithms:
        try:
            peers.append(prepare_spconv_network(
                torch, device_name, dtype_name, algorithm, network.REFERENCE_NETWORK,
                network.network_weights(network.REFERENCE_NETWORK, options.seed), scene.features, scene.indices,
                tuple(scene.spatial_shape), sorted_indices, grad_sorted))
        except Exception as error:  # reported in the table, sparsecore's numbers kept
            peers.append(error)
    return peers


def compare_with_spconv(peers: list[Any], peer_times: list[tuple[float, float, int] | None], dtype_name: str,
                        sorted_output: np.ndarray, grad_features: np.ndarray, forward_row: Row,
                        backward_row: Row, reference: tuple[np.ndarray, np.ndarray] | None = None) -> list[Row]:
    """Fills the rows with spconv's times and checks its results against sparsecore's.

    Args:
        peers: `prepare_spconv_peers`'s list (networks or the errors they raised).
        peer_times: per peer, ``(forward ms, backward ms, backward runs)`` timed beside
            sparsecore's, or None for a peer that failed.
        dtype_name: the benchmark dtype.
        sorted_output: sparsecore's output (with spconv's pool floor) on its sorted sites.
        grad_features: sparsecore's gradient of the input features for that network.
        forward_row: the case's forward row, filled from the first algorithm.
        backward_row: the case's backward row, likewise.
        reference: sparsecore's float64 output (sorted sites) and input gradient of the
            same network, or None: each backward row then notes both engines' relative
            errors against it, which says which engine is closer where they disagree.

    Returns:
        Forward and backward rows for each further algorithm.
    """
    extra_rows: list[Row] = []
    for position, (peer, times) in enumerate(zip(peers, peer_times)):
        algorithm = getattr(peer, "algorithm", None) or f"algorithm {position}"
        if position == 0:
            forward, backward = forward_row, backward_row
        else:
            forward = Row(forward_row.case, f"forward, spconv {algorithm}", forward_row.sparsecore_ms)
            backward = Row(backward_row.case, f"backward, spconv {algorithm}", backward_row.sparsecore_ms)
            extra_rows += [forward, backward]
        if isinstance(peer, Exception):
            text = str(peer).splitlines()[0] if str(peer) else ""
            forward.notes.append(f"spconv failed: {type(peer).__name__}: {text}")
            if isinstance(peer, ValueError):
                forward.agreement = "MISMATCH: output sites"
            continue
        forward.notes.append(f"spconv {algorithm}; checked with spconv's max-pool floor at 0 (spconv#754)"
                             if position == 0 else f"spconv {algorithm}")
        forward.spconv_ms, backward.spconv_ms, backward_runs = times
        backward.notes.append(f"spconv median of {backward_runs}, taking turns with sparsecore")
        peer_order = np.lexsort(peer.output_indices.T[::-1])
        forward.agreement = compare_network_arrays("outputs", sorted_output, peer.output_features[peer_order],
                                                   dtype_name)
        backward.agreement = compare_network_arrays("input gradient", grad_features, peer.grad_features,
                                                    dtype_name, gradient=True)
        if reference is not None:
            exact_output, exact_grad = reference
            backward.notes.append(
                f"rel. error vs float64 (outputs / input gradients): sparsecore "
                f"{relative_error(sorted_output, exact_output):.1e} / {relative_error(grad_features, exact_grad):.1e}, "
                f"spconv {relative_error(peer.output_features[peer_order], exact_output):.1e} / "
                f"{relative_error(peer.grad_features, exact_grad):.1e}")
    return extra_rows


def core_subm_memory_rows(device: Any, scene: Any, scene_name: str, dtype_name: str, seed: int,
                          spconv_algorithms: tuple[str, ...]) -> list[Row]:
    """Peak device memory of one SubMConv3d 64->64: rulebook build, forward and backward.

    The values go in the rows' time columns, in MiB (the stage says so), with
    their ratio; the notes say how each was measured. One row per spconv
    algorithm: the first's stage is ``"<dtype> peak MiB (not ms)"``, a further
    one's ``"<dtype> peak MiB (not ms), spconv <algorithm>"``.

    Args:
        device: a cuda `network.Device`.
        scene: the sites (the basic scan: 125,562 voxels).
        scene_name: its name in the table.
        dtype_name: the benchmark dtype.
        seed: seed of the features, weight and output gradient.
        spconv_algorithms: spconv algorithms to measure beside it (empty to skip spconv).

    Returns:
        The memory rows (one without spconv).
    """
    import sparsecore as sc
    from sparsecore.benchmark import network
    from sparsecore.benchmark.clocks import measure_median_ms
    from sparsecore.benchmark.gpu_memory import measure_pool_peak

    storage = network.storage_dtype(dtype_name)
    count = len(scene.indices)
    generator = np.random.default_rng(seed + 2000)
    host_features = generator.standard_normal((count, MEMORY_CHANNELS)).astype(np.float32)
    host_grad = generator.standard_normal((count, MEMORY_CHANNELS)).astype(np.float32)
    host_weight = layer_weight(LayerSpec("memory", "subm", MEMORY_CHANNELS, MEMORY_CHANNELS), seed)
    features, grad, weight = (device.put(array, storage) for array in (host_features, host_grad, host_weight))
    indices = device.put(scene.indices)
    geometry = sc.ConvGeometry.create(3, 3, kind="subm")
    shape = tuple(scene.spatial_shape)

    def layer(backend: Any | None = None) -> Any:
        rulebook = sc.build_rulebook(indices, shape, 1, geometry, backend=backend)
        output = sc.conv_forward(features, weight, rulebook, backend=backend)
        return output, sc.conv_backward(grad, features, weight, rulebook, backend=backend)

    row = Row(f"memory SubMConv3d {MEMORY_CHANNELS}->{MEMORY_CHANNELS} {scene_name} ({count} voxels)",
              f"{dtype_name} peak MiB (not ms)")
    try:
        layer()  # compiles the kernels and creates the cuBLAS handle outside the measurement
        peak = measure_pool_peak(device.xp, layer)
    except Exception as error:  # keep the row, say what broke
        row.agreement = "FAILED"
        row.notes.append(f"sparsecore failed: {type(error).__name__}: {error}")
        return [row]
    row.sparsecore_ms = peak.peak_bytes / _MEBIBYTE
    row.notes.append(f"sparsecore: CuPy pool peak in use, inputs excluded; pool reservation "
                     f"+{peak.reserved_growth_bytes / _MEBIBYTE:.1f} MiB, {peak.blocks} allocations")
    try:
        milliseconds, runs = measure_median_ms(device.clock, lambda _: layer(), lambda: None, 5, 1, 10.0)
        row.notes.append(f"rulebook + forward + backward {milliseconds:.3g} ms (median of {runs})")
    except Exception as error:  # the peak stands without the time
        row.notes.append(f"timing failed: {type(error).__name__}: {error}")
    rows = [row]
    for position, spconv_algorithm in enumerate(spconv_algorithms):
        if position:
            rows.append(Row(row.case, f"{row.stage}, spconv {spconv_algorithm}", row.sparsecore_ms))
        try:
            from sparsecore.benchmark.network_spconv import spconv_network_session, spconv_subm_peak_bytes

            with spconv_network_session("cuda", dtype_name) as torch:
                spconv_subm_peak_bytes(torch, dtype_name, spconv_algorithm, host_features, scene.indices, shape,
                                       host_weight, host_grad)  # warm-up
                peak_bytes = spconv_subm_peak_bytes(torch, dtype_name, spconv_algorithm, host_features,
                                                    scene.indices, shape, host_weight, host_grad)
        except Exception as error:  # spconv's failure does not hide sparsecore's number
            rows[-1].notes.append(f"spconv {spconv_algorithm} failed: {type(error).__name__}: {error}")
            continue
        rows[-1].spconv_ms = peak_bytes / _MEBIBYTE
        rows[-1].notes.append(f"spconv {spconv_algorithm}: torch max_memory_allocated above start")
    return rows
