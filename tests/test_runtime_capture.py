"""``sparsecore.runtime.load(..., capture=True)`` (sparsecore/runtime/capture.py).

Oracle: the same graph in an exact-mode session (itself checked against dense float64 convolutions in
tests/test_runtime.py), on fresh seeded clouds of varying size: capacity mode gives the same sparse sites
and bitwise the same features and dense outputs, and learns each layer's count. The CuPy graph capture
(record once per input capacity, replay) is a gpu-marked test, skipped without a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("torch")

import sparsecore.runtime as runtime  # noqa: E402
from tests.runtime_graphs import GraphBuilder, case_input  # noqa: E402

SHAPE, BATCH = (9, 11, 7), 2


def _graph(rng: np.random.Generator, dense: bool):
    builder = GraphBuilder(rng)
    builder.conv("conv0", "0", "1", 4, 8, kind="subm", rulebook="a", activation="ReLU")
    builder.conv("conv1", "1", "2", 8, 6, kind="regular", stride=2, padding=1, rulebook="down")
    builder.conv("conv2", "2", "3", 6, 6, kind="subm", rulebook="b", activation="ReLU")
    builder.conv("conv3", "3", "4", 6, 5, kind="inverse", rulebook="down")
    if not dense:
        return builder.model(4, "4")
    builder.conv("conv4", "4", "5", 5, 3, kind="regular", stride=2, padding=1, rulebook="down2")
    builder.op("ScatterDense", ["5"], "6", "scatter0", input_spatial_shape=[5, 6, 4], format="zyx",
               output_shape=[BATCH, 3, 5, 6, 4], output_layout="NCHW")
    return builder.model(4, "6")


@pytest.mark.parametrize("dense", [False, True])
def test_capture_runs_give_exact_mode_outputs_and_learn_the_capacities(dense):
    rng, _, _ = case_input(3700)
    model = _graph(rng, dense)
    exact = runtime.load_model(model)
    captured = runtime.load_model(model, capture=True)
    for seed, count in ((3701, 120), (3702, 90), (3703, 120), (3704, 0)):
        _, indices, features = case_input(seed, num=count) if count else (None, np.zeros((0, 4), np.int32),
                                                                          np.zeros((0, 4)))
        want = exact.run(features.astype(np.float32), indices, BATCH, SHAPE)
        got = captured.run(features.astype(np.float32), indices, BATCH, SHAPE)
        if dense:
            assert got.dense.tobytes() == want.dense.tobytes()
            continue
        np.testing.assert_array_equal(got.sparse.indices, want.sparse.indices)
        assert got.sparse.features.tobytes() == want.sparse.features.tobytes()
    observed = captured.captured.policy.observed
    assert any("[down]" in name for name in observed), observed
    assert captured.captured.recorded  # static input buffers per input capacity


def test_capture_refuses_per_node_finite_checks():
    rng, _, _ = case_input(3705)
    with pytest.raises(ValueError, match="check_finite"):
        runtime.load_model(_graph(rng, False), capture=True, check_finite=True)


@pytest.mark.gpu
def test_cupy_graph_is_recorded_once_per_capacity_and_replayed():  # pragma: no cover - needs a GPU
    import cupy

    rng, _, _ = case_input(3706)
    model = _graph(rng, False)
    exact = runtime.load_model(model)
    captured = runtime.load_model(model, capture=True)
    for seed in (3707, 3708, 3709, 3710):
        _, indices, features = case_input(seed, num=120)
        want = exact.run(cupy.asarray(features.astype(np.float32)), cupy.asarray(indices), BATCH, SHAPE)
        got = captured.run(cupy.asarray(features.astype(np.float32)), cupy.asarray(indices), BATCH, SHAPE)
        np.testing.assert_array_equal(cupy.asnumpy(got.sparse.indices), cupy.asnumpy(want.sparse.indices))
        np.testing.assert_allclose(cupy.asnumpy(got.sparse.features), cupy.asnumpy(want.sparse.features),
                                   rtol=1e-5, atol=1e-5)
    graphs = [entry.graph for entry in captured.captured.recorded.values()]
    assert graphs and all(graph is not None for graph in graphs)
