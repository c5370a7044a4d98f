"""`sparsecore._conv_products`: the per-offset products and the chunk layouts the NumPy backend keeps per rulebook.

The NumPy backend runs grouped layers with large per-group matrices through
the per-offset dataflow (`sparsecore.cpu_dataflow.dataflow_on_cpu`); here the
limits are lowered so a small grouped layer takes it. Its layouts are built
once per rulebook and pass direction, and the passes equal a float64
reference computed pair by pair.
"""

from __future__ import annotations

import numpy as np
import pytest

import sparsecore as sc
from sparsecore import _conv_products, conv, cpu_dataflow
from sparsecore.backends import NUMPY_BACKEND

try:
    from kernel_targets import random_sites, rng_for
except ImportError:  # tests/ imported as a package
    from tests.kernel_targets import random_sites, rng_for


def _layer(count: int, in_channels: int, out_channels: int, groups: int, seed: int = 0):
    rng = rng_for(71, count, in_channels, out_channels, groups, seed)
    shape = (9, 10, 11)
    indices = random_sites(rng, count, shape, 1)
    rulebook = sc.build_rulebook(indices, shape, 1, sc.ConvGeometry.create(3, 3, kind="subm"), backend=NUMPY_BACKEND)
    features = rng.standard_normal((count, in_channels))
    weight = rng.standard_normal((out_channels, 3, 3, 3, in_channels // groups))
    grad_output = rng.standard_normal((count, out_channels))
    return rulebook, features, weight, grad_output


def _reference(features, weight, grad_output, rulebook, groups):
    """Forward and both gradients pair by pair in float64 (no GEMM batching, no chunks)."""
    out_channels, in_per_group = weight.shape[0], weight.shape[-1]
    matrices = weight.reshape(out_channels, -1, in_per_group)  # [out, K, in/g]
    out = np.zeros((rulebook.num_output, out_channels))
    grad_features = np.zeros_like(features)
    grad_matrices = np.zeros_like(matrices)
    starts = list(rulebook.offset_starts)
    per_out = out_channels // groups
    for offset in range(len(starts) - 1):
        inputs = rulebook.pair_input[starts[offset]:starts[offset + 1]]
        outputs = rulebook.pair_output[starts[offset]:starts[offset + 1]]
        for group in range(groups):
            o_slice = slice(group * per_out, (group + 1) * per_out)
            i_slice = slice(group * in_per_group, (group + 1) * in_per_group)
            w = matrices[o_slice, offset, :]  # [out/g, in/g]
            np.add.at(out[:, o_slice], outputs, features[inputs][:, i_slice] @ w.T)
            np.add.at(grad_features[:, i_slice], inputs, grad_output[outputs][:, o_slice] @ w)
            grad_matrices[o_slice, offset, :] += grad_output[outputs][:, o_slice].T @ features[inputs][:, i_slice]
    return out, grad_features, grad_matrices.reshape(weight.shape)


@pytest.fixture
def per_offset(monkeypatch):
    """Grouped layers take the per-offset dataflow whatever their size."""
    monkeypatch.setattr(cpu_dataflow, "FUSED_MAX_MATRIX", 0)
    monkeypatch.setattr(cpu_dataflow, "FUSED_GROUPED_BACKWARD_MAX_MATRIX", 0)


def _layouts(rulebook) -> dict:
    return {key: value for key, value in rulebook.pair_map.derived.items() if key[0] == "chunk layout"}


def test_layouts_are_built_once_per_rulebook_and_direction(per_offset, monkeypatch):
    rulebook, features, weight, grad_output = _layer(200, 4, 6, 2, seed=1)
    assert cpu_dataflow.dataflow_on_cpu(NUMPY_BACKEND, 4, 6, 2) == "per_offset"
    built = []
    plan = type(NUMPY_BACKEND).scatter_plan

    def counted(self, *args):
        built.append(args[-1])
        return plan(self, *args)

    monkeypatch.setattr(type(NUMPY_BACKEND), "scatter_plan", counted)
    outputs = [conv.conv_forward(features, weight, rulebook, groups=2) for _ in range(3)]
    forward_plans = len(built)
    grads = [conv.conv_backward(grad_output, features, weight, rulebook, 2) for _ in range(3)]
    chunks = _conv_products.offset_chunks(NUMPY_BACKEND, rulebook, 4, 6)
    assert forward_plans == len(chunks) and len(built) == 2 * len(chunks), built
    assert {key[3] for key in _layouts(rulebook)} == {"forward", "backward"}
    expected = _reference(features, weight, grad_output, rulebook, 2)
    for output in outputs:
        np.testing.assert_allclose(output, expected[0], rtol=1e-12, atol=1e-12)
    for pair in grads:
        for got, want in zip(pair, expected[1:]):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_chunk_layout_rejects_a_bad_direction():
    rulebook, *_ = _layer(20, 2, 2, 1)
    chunk = _conv_products.offset_chunks(NUMPY_BACKEND, rulebook, 2, 2)[0]
    with pytest.raises(ValueError, match="direction must be 'forward' or 'backward', got 'sideways'"):
        _conv_products.chunk_layout(NUMPY_BACKEND, rulebook, chunk, "sideways")
