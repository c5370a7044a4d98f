"""sparsecore.runtime.Session's weight cache (session.py): a weight shared by several nodes is converted once, and
the converted weights a session keeps are held, together, to its memory budget (the node that would pass it named).
The oracle: the chain of 1x1 subm convs is a chain of matrix products in float64 on the same sites."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

from onnx import helper  # noqa: E402

import sparsecore.runtime as runtime  # noqa: E402
from sparsecore.memory_budget import MemoryBudgetError  # noqa: E402
from tests.dense_oracle import make_rng  # noqa: E402

FP16 = helper.TensorProto.FLOAT16
CHANNELS = 400  # a float32 copy of one [400, 1, 1, 1, 400] weight: 640 kB; three: 1.9 MB


def _model(shared: bool, weights: list, bias: np.ndarray):
    initializers = [helper.make_tensor("b", FP16, [CHANNELS], bias.tobytes(), raw=True)]
    for index, weight in enumerate(weights[:1] if shared else weights):
        initializers.append(helper.make_tensor(f"w{index}", FP16, list(weight.shape), weight.tobytes(), raw=True))
    nodes = [helper.make_node("SparseConvolution", [str(i), "w0" if shared else f"w{i}", "b"], [str(i + 1)],
                              f"conv{i}", ndim=3, in_channels=CHANNELS, out_channels=CHANNELS,
                              kernel_size=[1, 1, 1], subm=1, rulebook="one") for i in range(len(weights))]
    graph = helper.make_graph(nodes, "cache", [helper.make_tensor_value_info("0", FP16, [None, CHANNELS])],
                              [helper.make_tensor_value_info(str(len(weights)), FP16, [])], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_operatorsetid("ai.onnx", 11)])


def test_a_shared_weight_is_converted_once_and_the_cache_is_held_to_the_budget() -> None:
    rng = make_rng(3980)
    weight = (rng.standard_normal((CHANNELS, 1, 1, 1, CHANNELS)) / np.sqrt(CHANNELS)).astype(np.float16)
    bias = rng.uniform(-0.5, 0.5, CHANNELS).astype(np.float16)
    sites = np.array([[0, 1, 2, 3], [0, 4, 4, 4], [0, 7, 1, 0], [1, 2, 6, 5], [1, 0, 0, 0]], np.int32)
    features = rng.uniform(-1, 1, (len(sites), CHANNELS)).astype(np.float32)
    expected = features.astype(np.float64)
    matrix = weight[:, 0, 0, 0, :].astype(np.float64)
    for _ in range(3):
        expected = expected @ matrix.T + bias.astype(np.float64)
    # shared: one 640 kB copy, within a 1.5 MiB budget, and the oracle's answer
    session = runtime.load_model(_model(True, [weight] * 3, bias), memory_budget="1.5M")
    out = session.run(features, sites, 2, (8, 8, 8)).sparse
    np.testing.assert_array_equal(out.indices, sites)
    np.testing.assert_allclose(out.features, expected, rtol=1e-4, atol=1e-4)
    assert np.abs(expected).max() > 0.5
    # the same values in three initializers: three copies, the third beyond the budget, named
    session = runtime.load_model(_model(False, [weight] * 3, bias), memory_budget="1.5M")
    with pytest.raises(MemoryBudgetError, match="node 'conv2' \\(SparseConvolution\\): keeping the session's "
                                                "converted weights \\([0-9]+ bytes, [0-9]+ arrays\\)"):
        session.run(features, sites, 2, (8, 8, 8))
    # without a budget of its own, the process-wide one (far larger): all three run
    unbounded = runtime.load_model(_model(False, [weight] * 3, bias)).run(features, sites, 2, (8, 8, 8)).sparse
    np.testing.assert_allclose(unbounded.features, expected, rtol=1e-4, atol=1e-4)
