"""``sparsecore.benchmark.runtime_int8``: the benchmark backbone converted to int8, in torch and in the runtime.

Oracle: the converted torch int8 model; the runtime's int8 file must give its
output (the dequantized BEV map) up to the few one-step differences FP16
biases and the dropped requantization before the view cause (see
docs/deployment.md), and the int8 model must stay close to the float one.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")

import sparsecore.torch as spconv  # noqa: E402
from sparsecore.benchmark.backbones import second_backbone  # noqa: E402
from sparsecore.benchmark.runtime_int8 import int8_variants  # noqa: E402
from tests.dense_oracle import make_rng, random_features, random_indices  # noqa: E402


def test_int8_rows_run_the_converted_backbone_and_agree() -> None:
    rng = make_rng(50)
    shape = [41, 40, 40]
    indices = random_indices(rng, shape, 1, num=3000)
    features = random_features(rng, indices.shape[0], 4, np.float32)
    model = second_backbone(4)
    x = spconv.SparseConvTensor(torch.from_numpy(features), torch.from_numpy(indices), shape, 1)
    functions = int8_variants(model, x, lambda: spconv.SparseConvTensor(x.features, x.indices, shape, 1),
                              features, indices, 1, shape)
    assert sorted(functions) == ["sparsecore.runtime int8", "sparsecore.torch int8"]
    torch_int8 = functions["sparsecore.torch int8"]().numpy()
    runtime_int8 = functions["sparsecore.runtime int8"]()
    with torch.no_grad():
        reference = model(x).numpy()
    assert runtime_int8.shape == torch_int8.shape == reference.shape and np.abs(torch_int8).max() > 0
    levels = np.unique(np.abs(torch_int8[torch_int8 != 0]))
    step = float(np.min(np.diff(np.concatenate([[0.0], levels]))))  # the output's quantization step
    difference = np.abs(runtime_int8 - torch_int8)
    assert difference.max() <= 2.01 * step and (difference == 0).mean() > 0.95
    assert float(np.abs(torch_int8 - reference).max()) < 0.1 * float(np.abs(reference).max())
