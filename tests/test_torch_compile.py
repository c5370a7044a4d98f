"""torch.compile: a model of sparsecore layers gives the eager results, forward and backward.

Rulebooks are built outside the graph (``layer_indice_data`` is
``torch.compiler.disable``\\ d: one graph break per sparse layer); the feature
passes are custom ops with fake kernels, so the graph fragments between the
breaks hold them. The eager model is the oracle here (its own correctness is
tested against dense torch elsewhere); the fresh inputs differ in size from
call to call, which exercises dynamic shapes.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
spconv = pytest.importorskip("sparsecore.torch")
from torch import nn  # noqa: E402

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

# torch's own compile machinery warns about torch.jit internals it still uses
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

SHAPE = [6, 8, 8]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = spconv.SparseSequential(
            spconv.SubMConv3d(3, 8, 3, indice_key="subm1", bias=False), nn.BatchNorm1d(8), nn.ReLU())
        self.down = spconv.SparseSequential(
            spconv.SparseConv3d(8, 16, 3, 2, 1, indice_key="down1"), nn.ReLU(),
            spconv.SubMConv3d(16, 16, 3, indice_key="subm2", groups=4), nn.ReLU())
        self.up = spconv.SparseSequential(spconv.SparseInverseConv3d(16, 8, 3, indice_key="down1"), nn.ReLU())
        self.head = spconv.SubMConv3d(16, 4, 3, indice_key="subm1")
        self.pool = spconv.SparseAvgPool3d(2)
        self.global_pool = spconv.SparseGlobalMaxPool()

    def forward(self, x):
        skip = self.stem(x)
        up = self.up(self.down(skip))
        out = self.head(up.replace_feature(torch.cat([up.features, skip.features], 1)))
        return self.pool(out).dense(), self.global_pool(out)


def _input(seed):
    rng = do.make_rng(97000, seed)
    indices = do.random_indices(rng, SHAPE, 2, rng.uniform(0.1, 0.3))
    features = torch.tensor(do.random_features(rng, indices.shape[0], 3), dtype=torch.float32,
                            requires_grad=True)
    return spconv.SparseConvTensor(features, torch.from_numpy(indices), SHAPE, 2)


def _run(model, x, parameters_of):
    dense, pooled = model(x)
    loss = dense.square().sum() + pooled.sum()
    loss.backward()
    return dense.detach(), pooled.detach(), x.features.grad.clone(), {
        name: p.grad.clone() for name, p in parameters_of.named_parameters()}


def test_compiled_model_matches_eager():
    torch.manual_seed(0)
    eager = Net()
    compiled_net = copy.deepcopy(eager)
    compiled = torch.compile(compiled_net, fullgraph=False, backend="aot_eager")
    for seed in range(3):
        expected = _run(eager, _input(seed), eager)
        actual = _run(compiled, _input(seed), compiled_net)
        for a, b in zip(actual[:3], expected[:3]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for name in expected[3]:
            torch.testing.assert_close(actual[3][name], expected[3][name], rtol=1e-4, atol=1e-5, msg=name)
        eager.zero_grad()
        compiled_net.zero_grad()
