"""Capacity mode in sparsecore.torch (`SparseConvTensor.capacity_mode(...)`, frontends/torch/capacity.py).

Oracle: exact mode on the same model, weights and inputs. Without batch norm the true rows of the output
and every gradient are bitwise equal (the core runs the exact passes on the true rows), but the biases'
(torch sums the output gradient over all rows, the padding's zeros included: equal to rounding); with a training-mode
batch norm (statistics over the true rows, frontends/torch/capacity.py) they agree to float rounding, and
the running statistics too. The GPU tests (marked ``gpu``, skipped here) capture a model and a training step
in a CUDA graph, with `torch.cuda.make_graphed_callables` and with ``torch.compile(mode="reduce-overhead")``.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import sparsecore as sc
import sparsecore.torch as spconv
from sparsecore.torch.capacity import masked_features

try:
    from .kernel_targets import random_sites, rng_for
except ImportError:
    from kernel_targets import random_sites, rng_for

SHAPE = (12, 11, 10)


def _model(batch_norm: bool) -> nn.Module:
    torch.manual_seed(36)

    def norm(channels: int) -> list[nn.Module]:
        return [nn.BatchNorm1d(channels, momentum=0.3), nn.ReLU()] if batch_norm else [nn.ReLU()]

    return spconv.SparseSequential(
        spconv.SubMConv3d(3, 8, 3, indice_key="s0"), *norm(8),
        spconv.SparseConv3d(8, 8, 3, stride=2, padding=1, indice_key="d0"), *norm(8),
        spconv.SubMConv3d(8, 8, 3, dilation=2, indice_key="s1"),
        spconv.SparseMaxPool3d(2, 2, indice_key="p0"),
        spconv.SubMConv3d(8, 8, 3, groups=2, indice_key="s2"), *norm(8),
        spconv.SparseInverseConv3d(8, 8, 2, indice_key="p0"),
        spconv.SparseConvTranspose3d(8, 4, 2, stride=2),
    ).double()


def _input(seed: int, count: int = 70, padding: int = 0, capacity=None) -> spconv.SparseConvTensor:
    rng = rng_for(3601, seed)
    indices = random_sites(rng, count, SHAPE, 2)
    features = rng.uniform(-1, 1, (count, 3))
    indices = np.concatenate([indices, np.full((padding, 4), -1, np.int32)])
    features = np.concatenate([features, np.zeros((padding, 3))])
    values, sites = torch.from_numpy(features).requires_grad_(), torch.from_numpy(indices)
    if capacity is None:
        return spconv.SparseConvTensor(values, sites, SHAPE, 2)
    return spconv.SparseConvTensor.capacity_mode(values, sites, SHAPE, 2, capacity)


def _step(model: nn.Module, x: spconv.SparseConvTensor, grad_seed: int):
    out = model(x)
    rows = int(out.device_count.item())  # the test reads the count; a captured step would not
    generator = torch.Generator().manual_seed(grad_seed)
    weight = torch.randn(rows, out.features.shape[1], generator=generator, dtype=out.features.dtype)
    loss = (masked_features(out)[:rows] * weight).sum()
    loss.backward()
    return out, rows


@pytest.mark.parametrize("padding", [0, 13])
def test_capacity_mode_gives_exact_mode_bitwise_without_batch_norm(padding):
    exact_model = _model(False)
    policy = sc.LearnedCapacity()
    for step in range(2):  # the bound, then the capacities learned
        model = copy.deepcopy(exact_model)
        x_exact, x_capacity = _input(step), _input(step, padding=padding, capacity=policy)
        exact, rows = _step(exact_model, x_exact, step)
        out, rows_capacity = _step(model, x_capacity, step)
        assert rows_capacity == rows == exact.features.shape[0]
        assert out.features.shape[0] >= rows and out.capacity is policy
        assert torch.equal(out.features[:rows], exact.features) and torch.equal(out.indices[:rows], exact.indices)
        assert (out.indices[rows:] == -1).all()
        assert torch.equal(x_capacity.features.grad[:70], x_exact.features.grad)
        assert not x_capacity.features.grad[70:].any()
        for (name, a), (_, b) in zip(exact_model.named_parameters(), model.named_parameters()):
            if name.endswith("bias"):  # torch sums grad_output over the rows: more rows (zeros), another order
                torch.testing.assert_close(b.grad, a.grad, rtol=1e-13, atol=1e-15, msg=name)
            else:
                assert torch.equal(a.grad, b.grad), name
        exact_model.zero_grad()
        assert torch.equal(out.dense(), exact.dense())
        needed = out.check_capacity()
        assert needed and all(count >= 1 for count in needed.values())
    assert policy.observed


def test_a_training_step_with_batch_norm_matches_exact_mode():
    exact_model, model = _model(True), _model(True)
    exact_optimizer = torch.optim.SGD(exact_model.parameters(), lr=0.1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    policy = sc.LearnedCapacity()
    for step in range(2):
        x_exact, x_capacity = _input(10 + step), _input(10 + step, padding=9, capacity=policy)
        exact, rows = _step(exact_model, x_exact, step)
        out, _ = _step(model, x_capacity, step)
        torch.testing.assert_close(out.features[:rows], exact.features, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(x_capacity.features.grad[:70], x_exact.features.grad, rtol=1e-9, atol=1e-9)
        for (name, a), (_, b) in zip(exact_model.named_parameters(), model.named_parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-9, msg=name)
        exact_optimizer.step()
        optimizer.step()
        exact_optimizer.zero_grad()
        optimizer.zero_grad()
        out.check_capacity()
    for a, b in zip(exact_model.modules(), model.modules()):
        if isinstance(a, nn.BatchNorm1d):
            torch.testing.assert_close(b.running_mean, a.running_mean, rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(b.running_var, a.running_var, rtol=1e-9, atol=1e-12)
            assert int(a.num_batches_tracked) == int(b.num_batches_tracked) == 2
    model.eval()
    exact_model.eval()
    with torch.no_grad():
        rows = model(_input(20, padding=5, capacity=policy)).device_count.item()
        torch.testing.assert_close(model(_input(20, padding=5, capacity=policy)).features[:rows],
                                   exact_model(_input(20)).features, rtol=1e-9, atol=1e-9)


def test_overflow_and_site_problems_are_reported_by_check_capacity():
    model = _model(False)
    out = model(_input(30, capacity=sc.FixedCapacity(4)))
    with pytest.raises(sc.CapacityOverflowError, match="capacity was 4"):
        out.check_capacity()
    x = _input(31, capacity=True)
    assert x.device_count.tolist() == [70]
    with pytest.raises(ValueError, match="needs a capacity policy"):
        spconv.SparseConvTensor.capacity_mode(x.features, x.indices, SHAPE, 2, None)
    indices = x.indices.clone()
    indices[5] = indices[9]
    with pytest.raises(ValueError, match="duplicate"):  # the CPU's exact builders check at once
        model(spconv.SparseConvTensor.capacity_mode(x.features, indices, SHAPE, 2, True))


@pytest.mark.gpu
def test_cuda_graph_captures_a_forward_and_a_training_step():  # pragma: no cover - needs a GPU
    device = torch.device("cuda")
    model = _model(True).float().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    policy = sc.LearnedCapacity()
    source = _input(40, padding=30)
    static_features = source.features.detach().float().to(device)
    static_indices = source.indices.to(device)

    def step():
        out = model(spconv.SparseConvTensor.capacity_mode(static_features, static_indices, SHAPE, 2, policy))
        loss = masked_features(out).square().sum()
        loss.backward()
        optimizer.step()
        return out, loss

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up, and the policy learns
            optimizer.zero_grad(set_to_none=False)
            out, _ = step()
            out.check_capacity()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        captured, static_loss = step()
    for seed in (41, 42):
        fresh = _input(seed, padding=30)
        static_features.copy_(fresh.features.detach().float())
        static_indices.copy_(fresh.indices)
        graph.replay()
        torch.cuda.synchronize()
        captured.check_capacity()
        assert torch.isfinite(static_loss).item()


@pytest.mark.gpu
def test_make_graphed_callables_and_reduce_overhead_run_an_inference_model():  # pragma: no cover - needs a GPU
    device = torch.device("cuda")
    model = _model(False).float().to(device).eval()
    policy = sc.LearnedCapacity()
    source = _input(50, padding=20)
    features, indices = source.features.detach().float().to(device), source.indices.to(device)

    def forward(values: torch.Tensor, sites: torch.Tensor) -> torch.Tensor:
        return masked_features(model(spconv.SparseConvTensor.capacity_mode(values, sites, SHAPE, 2, policy)))

    with torch.no_grad():
        expected = forward(features, indices)
    graphed = torch.cuda.make_graphed_callables(forward, (features, indices))
    torch.testing.assert_close(graphed(features, indices), expected)
    compiled = torch.compile(forward, mode="reduce-overhead")
    for _ in range(3):
        torch.testing.assert_close(compiled(features, indices), expected)


def test_capacity_mode_on_the_emulated_kernels_matches_exact_mode(monkeypatch):
    """The torch frontend on the GPU backend's code path (every build and pass on the emulated kernels, as
    tests/test_torch_emulated.py routes them): capacity mode's true rows and gradients equal exact mode's."""
    import dataclasses

    from sparsecore import conv, pool, rulebook

    try:
        from .cuda_emulation.emulated_launcher import RecordingLauncher
        from .kernel_targets import emulated_backend
    except ImportError:
        from cuda_emulation.emulated_launcher import RecordingLauncher
        from kernel_targets import emulated_backend

    base = emulated_backend()
    launcher = RecordingLauncher(base.launcher)
    backend = dataclasses.replace(base, launcher=launcher)
    for module in (conv, pool, rulebook):
        monkeypatch.setattr(module, "backend_for", lambda array: backend)
    exact_model = _model(True)
    model = copy.deepcopy(exact_model)
    exact, rows = _step(exact_model, _input(60, count=30), 0)
    x = _input(60, count=30, padding=11, capacity=True)
    out, _ = _step(model, x, 0)
    assert "sc_map_strided_capacity" in launcher.kernel_names()
    torch.testing.assert_close(out.features[:rows], exact.features, rtol=1e-10, atol=1e-10)
    for (name, a), (_, b) in zip(exact_model.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-10, msg=name)
    assert out.features.shape[0] > rows and (out.indices[rows:] == -1).all()


@pytest.mark.parametrize("pool", ["SparseGlobalMaxPool", "SparseGlobalAvgPool"])
def test_global_pools_leave_the_padding_out(pool):
    model = _model(False)
    head = getattr(spconv, pool)()
    exact_input, capacity_input = _input(70), _input(70, padding=12, capacity=True)
    exact = head(model(exact_input))
    out = head(model(capacity_input))
    assert out.shape == exact.shape == (2, 4)
    torch.testing.assert_close(out, exact, rtol=1e-12, atol=1e-12)  # the max bitwise, the mean to rounding
    if pool == "SparseGlobalMaxPool":
        assert torch.equal(out, exact)
    weight = torch.randn(2, 4, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    (exact * weight).sum().backward()
    (out * weight).sum().backward()
    torch.testing.assert_close(capacity_input.features.grad[:70], exact_input.features.grad, rtol=1e-10, atol=1e-12)


def test_sparse_add_of_other_sites_is_refused_in_capacity_mode():
    first, second = _input(80, capacity=True), _input(81, capacity=True)
    assert torch.equal(spconv.functional.sparse_add(first, first).features, first.features * 2)
    with pytest.raises(ValueError, match="not available in capacity mode"):
        spconv.functional.sparse_add(first, second)
