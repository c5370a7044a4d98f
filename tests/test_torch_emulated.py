"""sparsecore.torch on the GPU backend's code path: the core forced onto the emulated CUDA kernels.

A model written for spconv (submanifold, strided, pooling, inverse and
transposed layers, batch norm, ReLU, ``.dense()``) runs forward and backward
twice through the torch frontend's ops: once on the NumPy backend, once with
every rulebook build and feature pass routed to ``KernelBackend`` over the CPU
emulation of the ``kernels_cu`` sources (what CUDA tensors get, minus the
stream and allocator plumbing, which needs a GPU). Outputs and every gradient
must agree; the NumPy path is itself checked against dense torch elsewhere.
Every op must recognise its neighbour tensors as the library's (the
kernel-built map goes to the core as it is, never rebuilt from the tensors).
"""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
spconv = pytest.importorskip("sparsecore.torch")
from torch import nn  # noqa: E402

from sparsecore import conv, pool, rulebook  # noqa: E402
from sparsecore.torch import ops  # noqa: E402

try:
    from . import dense_oracle as do
    from .cuda_emulation.emulated_launcher import RecordingLauncher
    from .kernel_targets import emulated_backend
except ImportError:
    import dense_oracle as do
    from cuda_emulation.emulated_launcher import RecordingLauncher
    from kernel_targets import emulated_backend

SHAPE = [7, 6, 5]  # ~125 sites (2 row tiles of the fused kernels); every layer keeps a non-empty output


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.down = spconv.SparseSequential(
            spconv.SubMConv3d(3, 8, 3, indice_key="subm1"), nn.BatchNorm1d(8), nn.ReLU(),
            spconv.SparseConv3d(8, 16, 3, 2, 1, indice_key="down1"), nn.ReLU(),
            spconv.SubMConv3d(16, 16, 3, indice_key="subm2", groups=2),
        )
        self.pool = spconv.SparseMaxPool3d(2, 2)
        self.up = spconv.SparseInverseConv3d(16, 8, 3, indice_key="down1")
        self.transposed = spconv.SparseConvTranspose3d(16, 4, 2, 2)
        self.avg = spconv.SparseAvgPool3d(2, 2)

    def forward(self, x):
        low = self.down(x)
        pooled = self.pool(low)
        restored = self.up(low)
        grown = self.transposed(pooled)
        return (restored.dense().square().sum() + grown.features.sum() * 0.5
                + self.avg(restored).features.square().sum())


def _run(model, dtype):
    rng = do.make_rng(97000, 1)
    indices = torch.from_numpy(do.random_indices(rng, SHAPE, 2, 0.3))
    features = torch.tensor(do.random_features(rng, indices.shape[0], 3, dtype="float64"), dtype=dtype,
                            requires_grad=True)
    loss = model(spconv.SparseConvTensor(features, indices, SHAPE, 2))
    loss.backward()
    grads = [features.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return loss.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_torch_model_on_the_emulated_kernels_equals_numpy(monkeypatch, dtype):
    torch.manual_seed(0)
    model = Net().to(dtype)
    expected_loss, expected_grads = _run(model, dtype)
    base = emulated_backend()
    launcher = RecordingLauncher(base.launcher)
    backend = dataclasses.replace(base, launcher=launcher)
    for module in (conv, pool, rulebook):
        monkeypatch.setattr(module, "backend_for", lambda array: backend)
    checked = []
    rebuild = ops.checked_rulebook
    monkeypatch.setattr(ops, "checked_rulebook", lambda *args: checked.append(args) or rebuild(*args))
    loss, grads = _run(model, dtype)
    assert not checked  # every op was handed the library's rulebook (its kernel-built map), none rebuilt one
    tolerance = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(loss, expected_loss, **tolerance)
    assert len(grads) == len(expected_grads)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, **tolerance)
    builds = {"sc_map_insert_sites", "sc_map_submanifold", "sc_map_candidates", "sc_map_strided"}
    assert builds <= launcher.kernel_names(), launcher.kernel_names()  # the rulebooks: neighbour maps, built
    assert launcher.kernel_names() - builds - {"sc_map_mark_outputs"}, "and the feature passes ran on kernels"
