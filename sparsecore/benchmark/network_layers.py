"""Per-layer rows of the network benchmark (time, arithmetic, kernel time) and the run-to-run bitwise check.

Arithmetic counts 2 FLOP per multiply-add, centre offset included: a
convolution with P pairs (its rulebook's ``num_pairs``) from C_in to C_out
channels does ``2 P C_in C_out`` FLOP forward and twice that backward (input
gradient and weight gradient). A layer row's TFLOP/s divides that by the
layer's time between two CUDA events around it (launch gaps included, so a
host-bound layer shows it) and, on the kernel backend, by its kernel time: the
sum of CUDA-event intervals around each of the convolution's ``sc_*`` launches
(`KernelTimingLauncher`), which is the device's own time for those kernels
(cuBLAS and CuPy's own kernels are not launched through it and not included).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from sparsecore.benchmark.cases import Row
from sparsecore.benchmark.network import REFERENCE_NETWORK, NetworkLayer

__all__ = ["BITWISE_STAGE", "layer_flops", "LayerStack", "KernelTimingLauncher", "kernel_timed", "layer_rows",
           "bitwise_row"]

BITWISE_STAGE = "two runs bitwise equal"


def layer_flops(layer: NetworkLayer, pairs: int) -> float:
    """Forward FLOP of a convolution layer with ``pairs`` rulebook pairs (0 for a pool)."""
    return 2.0 * pairs * layer.in_channels * layer.out_channels if layer.kind == "subm" else 0.0


@dataclass
class LayerStack:
    """A recorder (`clocks.StageRecorder` protocol) that passes every interval on and knows the open layer.

    Attributes:
        recorder: where the intervals go.
        labels: the open layer labels (``"forward <i>"`` / ``"backward <i>"``), innermost last.
    """

    recorder: Any
    labels: list[str] = field(default_factory=list)

    @contextlib.contextmanager
    def interval(self, label: str) -> Iterator[None]:
        layered = label.startswith(("forward ", "backward "))
        if layered:
            self.labels.append(label)
        try:
            with self.recorder.interval(label):
                yield
        finally:
            if layered:
                self.labels.pop()


@dataclass(frozen=True)
class KernelTimingLauncher:
    """A `KernelLauncher` that marks each launch on the clock, under ``"kernels <layer label>"``.

    Attributes:
        inner: the launcher that runs the kernel.
        layers: the `LayerStack` of the run (its recorder takes the marks).
    """

    inner: Any
    layers: LayerStack

    def launch(self, expression: str, grid: int, block: int, args: tuple[Any, ...]) -> None:
        """Runs the launch between two marks."""
        label = f"kernels {self.layers.labels[-1]}" if self.layers.labels else "kernels outside the layers"
        with self.layers.recorder.interval(label):
            self.inner.launch(expression, grid, block, args)


def kernel_timed(backend: Any, layers: LayerStack) -> Any:
    """``backend`` with its launches marked (`KernelTimingLauncher`), or as it is when it has no launcher."""
    launcher = getattr(backend, "launcher", None)
    if launcher is None or not dataclasses.is_dataclass(backend):
        return backend
    return dataclasses.replace(backend, launcher=KernelTimingLauncher(launcher, layers))


def _rate(flops: float, milliseconds: float | None) -> str:
    if not flops or not milliseconds or milliseconds <= 0:
        return "-"
    return f"{flops / milliseconds / 1e9:.3g}"


def layer_rows(prefix: str, rulebooks: tuple[Any, ...], forward_totals: dict[str, float],
               backward_totals: dict[str, float], layers: tuple[NetworkLayer, ...] = REFERENCE_NETWORK) -> list[Row]:
    """One forward and one backward row per layer: its time, geometry, arithmetic and rates.

    Args:
        prefix: ``"<scene> <dtype>"``.
        rulebooks: each layer's rulebook (`network.CoreForward.rulebooks`).
        forward_totals: milliseconds per label of the instrumented forward (``"forward <i>"``,
            ``"kernels forward <i>"``).
        backward_totals: likewise for the backward.
        layers: the network.

    Returns:
        The rows, layer by layer, forward then backward.
    """
    rows = []
    for layer in layers:
        rulebook = rulebooks[layer.index]
        pairs = int(rulebook.num_pairs)
        flops = layer_flops(layer, pairs)
        geometry = f"{rulebook.num_input} -> {rulebook.num_output} sites, {pairs} pairs"
        if layer.builds_rulebook:
            geometry += ", builds its rulebook"
        for direction, totals, work in (("forward", forward_totals, flops), ("backward", backward_totals, 2 * flops)):
            label = f"{direction} {layer.index}"
            milliseconds = totals.get(label)
            notes = [geometry] if direction == "forward" else []
            if work:
                kernel_ms = totals.get(f"kernels {label}")
                notes.append(f"{work / 1e9:.3g} GFLOP; layer {_rate(work, milliseconds)} TFLOP/s")
                if kernel_ms:
                    notes.append(f"kernels {kernel_ms:.3g} ms, {_rate(work, kernel_ms)} TFLOP/s")
            rows.append(Row(f"{prefix} {layer.name}", direction, milliseconds, notes=notes))
    return rows


def _host_bytes(get: Callable[[Any], np.ndarray], arrays: list[Any]) -> list[bytes]:
    return [np.ascontiguousarray(get(array)).tobytes() for array in arrays]


def bitwise_row(prefix: str, get: Callable[[Any], np.ndarray], forward: Callable[[], Any],
                backward: Callable[[Any], tuple[Any, tuple[Any, ...]]]) -> Row:
    """Runs the forward twice and the backward twice on one forward's state; compares every bit.

    Args:
        prefix: ``"<scene> <dtype>"``.
        get: a device array on the host.
        forward: the network's forward (`network.core_forward` with its inputs).
        backward: the network's backward of a forward state (`network.core_backward`).

    Returns:
        The row ``(<prefix> network, "two runs bitwise equal")``: ``ok`` or
        ``MISMATCH`` naming what differed.
    """
    row = Row(f"{prefix} network", BITWISE_STAGE)
    try:
        first, second = forward(), forward()
        outputs = [_host_bytes(get, [state.output, state.output_indices]) for state in (first, second)]
        gradients = []
        for _ in range(2):
            grad_input, weight_grads = backward(first)
            gradients.append(_host_bytes(get, [grad_input, *[grad for grad in weight_grads if grad is not None]]))
    except Exception as error:  # keep the table
        row.agreement = f"FAILED: {type(error).__name__}: {error}"
        return row
    differ = []
    if outputs[0] != outputs[1]:
        differ.append("forward output")
    if gradients[0][0] != gradients[1][0]:
        differ.append("input gradient")
    weights_differ = sum(left != right for left, right in zip(gradients[0][1:], gradients[1][1:]))
    if weights_differ:
        differ.append(f"{weights_differ} of {len(gradients[0]) - 1} weight gradients")
    row.agreement = f"MISMATCH: {', '.join(differ)}" if differ else "ok"
    row.notes.append("forward output and sites, backward input and weight gradients, each of two runs")
    return row
