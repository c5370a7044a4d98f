"""sparsecore.benchmark.network_layers: per-layer arithmetic and rates, launch marks, the bitwise check."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from sparsecore.backends import NUMPY_BACKEND
from sparsecore.backends.kernel_backend import KernelBackend
from sparsecore.benchmark import network
from sparsecore.benchmark.clocks import HostClock, StageRecorder
from sparsecore.benchmark.network import REFERENCE_NETWORK
from sparsecore.benchmark.network_layers import (BITWISE_STAGE, LayerStack, bitwise_row, kernel_timed, layer_flops,
                                                 layer_rows)


@dataclass
class _CountingClock:
    """A clock whose marks are 1, 2, 3, ... (milliseconds): each interval's length is known."""

    ticks: Any = field(default_factory=lambda: itertools.count(1))

    def mark(self) -> float:
        return float(next(self.ticks))

    def synchronize(self) -> None:
        return None

    def elapsed_ms(self, start: float, stop: float) -> float:
        return stop - start


@dataclass
class _Launches:
    names: list[str] = field(default_factory=list)

    def launch(self, expression: str, grid: int, block: int, args: tuple[Any, ...]) -> None:
        self.names.append(expression)


def test_flops_count_every_pair_of_a_convolution() -> None:
    conv, pool = REFERENCE_NETWORK[3], REFERENCE_NETWORK[2]
    assert (conv.in_channels, conv.out_channels, pool.kind) == (64, 96, "maxpool")
    assert layer_flops(conv, 1000) == 2 * 1000 * 64 * 96
    assert layer_flops(pool, 1000) == 0.0


def test_layer_rows_report_time_arithmetic_and_rates() -> None:
    layers = REFERENCE_NETWORK[:3]
    rulebooks = (SimpleNamespace(num_pairs=10**6, num_input=5000, num_output=5000),) * 2 + (
        SimpleNamespace(num_pairs=9000, num_input=5000, num_output=1200),)
    forward = {"forward 0": 0.5, "kernels forward 0": 0.25, "forward 1": 2.0, "forward 2": 0.1}
    backward = {"backward 0": 1.0, "backward 1": 4.0, "kernels backward 1": 2.0, "backward 2": 0.2}
    rows = layer_rows("basic float32", rulebooks, forward, backward, layers)
    assert [(row.case, row.stage, row.sparsecore_ms) for row in rows] == [
        ("basic float32 L00 SubMConv3d 3->64 [c0]", "forward", 0.5),
        ("basic float32 L00 SubMConv3d 3->64 [c0]", "backward", 1.0),
        ("basic float32 L01 SubMConv3d 64->64 [c0]", "forward", 2.0),
        ("basic float32 L01 SubMConv3d 64->64 [c0]", "backward", 4.0),
        ("basic float32 L02 SparseMaxPool3d(2, 2) 64", "forward", 0.1),
        ("basic float32 L02 SparseMaxPool3d(2, 2) 64", "backward", 0.2)]
    # 2 * 1e6 * 3 * 64 = 0.384 GFLOP in 0.5 ms (0.768 TFLOP/s); its kernels in 0.25 ms
    assert rows[0].notes == ["5000 -> 5000 sites, 1000000 pairs, builds its rulebook",
                             "0.384 GFLOP; layer 0.768 TFLOP/s", "kernels 0.25 ms, 1.54 TFLOP/s"]
    # backward: twice the work (input and weight gradients), no kernel marks for this layer
    assert rows[1].notes == ["0.768 GFLOP; layer 0.768 TFLOP/s"]
    assert rows[2].notes == ["5000 -> 5000 sites, 1000000 pairs", "8.19 GFLOP; layer 4.1 TFLOP/s"]
    assert rows[3].notes == ["16.4 GFLOP; layer 4.1 TFLOP/s", "kernels 2 ms, 8.19 TFLOP/s"]
    assert rows[4].notes == ["5000 -> 1200 sites, 9000 pairs, builds its rulebook"] and rows[5].notes == []


def test_launches_are_marked_under_the_open_layer() -> None:
    recorder = StageRecorder(_CountingClock())
    stack = LayerStack(recorder)
    launches = _Launches()
    backend = kernel_timed(KernelBackend(np, launches), stack)
    with stack.interval("forward 3"):
        with stack.interval("convolution"):
            backend.launcher.launch("sc_a<float>", 1, 32, ())
            backend.launcher.launch("sc_b<float>", 1, 32, ())
    backend.launcher.launch("sc_c", 1, 32, ())
    assert launches.names == ["sc_a<float>", "sc_b<float>", "sc_c"]
    assert stack.labels == []
    # marks: forward 3 opens at 1, convolution at 2, the launches 3-4 and 5-6, then 7 and 8 close, 9-10 outside
    assert recorder.totals_ms() == {"kernels forward 3": 2.0, "convolution": 5.0, "forward 3": 7.0,
                                    "kernels outside the layers": 1.0}
    assert kernel_timed(NUMPY_BACKEND, stack) is NUMPY_BACKEND


def _state(output: np.ndarray) -> SimpleNamespace:
    return SimpleNamespace(output=output, output_indices=np.arange(6, dtype=np.int32).reshape(3, 2))


def test_bitwise_row_compares_two_runs_bit_for_bit() -> None:
    rng = np.random.default_rng(3)
    output, grad, weight_grad = rng.standard_normal((3, 4)), rng.standard_normal((5, 2)), rng.standard_normal(7)
    same = bitwise_row("basic float32", np.asarray, lambda: _state(output.copy()),
                       lambda state: (grad.copy(), (None, weight_grad.copy())))
    assert (same.case, same.stage, same.agreement) == ("basic float32 network", BITWISE_STAGE, "ok")
    outputs = iter([output, output + np.finfo(np.float64).eps * np.abs(output)])  # one ulp apart
    grads = iter([(grad, (weight_grad, weight_grad)), (grad, (weight_grad, -weight_grad))])
    differ = bitwise_row("basic float32", np.asarray, lambda: _state(next(outputs)), lambda state: next(grads))
    assert differ.agreement == "MISMATCH: forward output, 1 of 2 weight gradients"

    def broken(state: Any) -> Any:
        raise RuntimeError("device lost")

    failed = bitwise_row("basic float32", np.asarray, lambda: _state(output), broken)
    assert failed.agreement == "FAILED: RuntimeError: device lost"


def test_bitwise_row_on_the_network_on_the_cpu() -> None:
    scene = network.network_scene("synthetic", "small", seed=2)
    keep = scene.indices[:, 2] < 60
    features, indices = scene.features[keep], np.ascontiguousarray(scene.indices[keep])
    layers = REFERENCE_NETWORK[:3]
    weights = network.network_weights(layers, seed=2)
    grad = np.random.default_rng(4).standard_normal((1, layers[-1].out_channels)).astype(np.float32)

    def forward() -> Any:
        return network.core_forward(features, indices, scene.spatial_shape, weights, layers)

    def backward(state: Any) -> Any:
        return network.core_backward(state, np.broadcast_to(grad, state.output.shape).copy(), weights, layers)

    row = bitwise_row("synthetic float32", np.asarray, forward, backward)
    assert row.agreement == "ok", row
