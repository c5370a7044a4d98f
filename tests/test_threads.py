"""Results must be correct at every BLAS thread count.

spconv's CPU build races in its scatter-add with more than one thread; the
NumPy backend has no shared writes across threads, so forward and gradients
must match the dense float64 oracle whatever OPENBLAS/OMP threads are set to.
Each thread count runs in its own process (BLAS reads the variables at load).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import sparsecore as sc

    rng = np.random.default_rng(20261202)
    shape, batch, channels = (12, 40, 40), 2, 32
    cells = rng.choice(batch * int(np.prod(shape)), 3000, replace=False)
    indices = np.stack(np.unravel_index(cells, (batch,) + shape), 1).astype(np.int32)
    features = rng.standard_normal((len(indices), channels)).astype(np.float32)
    out = {"indices": indices.tolist(), "features": features.tolist()}
    for name, kind, stride in (("subm", "subm", 1), ("regular", "regular", 2)):
        weight = rng.standard_normal((channels, 3, 3, 3, channels)).astype(np.float32)
        geometry = sc.ConvGeometry.create(3, 3, stride=stride, padding=1, kind=kind)
        rulebook = sc.build_rulebook(indices, shape, batch, geometry)
        y = sc.conv_forward(features, weight, rulebook)
        grad = rng.standard_normal(y.shape).astype(np.float32)
        grad_features, grad_weight = sc.conv_backward(grad, features, weight, rulebook)
        out[name] = {
            "weight": weight.tolist(), "grad": grad.tolist(),
            "sites": rulebook.output_indices.tolist(), "y": y.tolist(),
            "grad_features": grad_features.tolist(), "grad_weight": grad_weight.tolist(),
        }
    json.dump(out, sys.stdout)
    """
)


def _run(threads: int) -> dict:
    environment = dict(os.environ)
    for variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        environment[variable] = str(threads)
    environment["PYTHONPATH"] = str(REPO) + os.pathsep + environment.get("PYTHONPATH", "")
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                            env=environment, check=True, timeout=300)
    return json.loads(result.stdout)


def _dense_oracle(run: dict, name: str, stride: int, padding: int) -> tuple:
    shape, batch = (12, 40, 40), 2
    indices = torch.tensor(run["indices"], dtype=torch.long)
    features = torch.tensor(run["features"], dtype=torch.float64, requires_grad=True)
    weight = torch.tensor(run[name]["weight"], dtype=torch.float64, requires_grad=True)
    dense = torch.zeros((batch,) + shape + (features.shape[1],), dtype=torch.float64)
    dense = dense.index_put(tuple(indices.T), features).permute(0, 4, 1, 2, 3)
    result = torch.nn.functional.conv3d(dense, weight.permute(0, 4, 1, 2, 3), stride=stride,
                                        padding=padding)
    sites = torch.tensor(run[name]["sites"], dtype=torch.long)
    picked = result.permute(0, 2, 3, 4, 1)[tuple(sites.T)]
    (picked * torch.tensor(run[name]["grad"], dtype=torch.float64)).sum().backward()
    return picked.detach().numpy(), features.grad.numpy(), weight.grad.numpy()


@pytest.mark.parametrize("threads", [1, 2])
def test_conv_correct_at_thread_count(threads: int) -> None:
    run = _run(threads)
    for name, stride in (("subm", 1), ("regular", 2)):
        expected_y, expected_grad_features, expected_grad_weight = _dense_oracle(run, name, stride, 1)
        np.testing.assert_allclose(run[name]["y"], expected_y, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(run[name]["grad_features"], expected_grad_features, rtol=1e-4, atol=1e-3)
        np.testing.assert_allclose(run[name]["grad_weight"], expected_grad_weight, rtol=1e-4, atol=2e-3)
