"""sparsecore.torch on CUDA tensors (skipped without a GPU and CuPy).

The CPU results (tested against dense torch and spconv elsewhere) are the
oracle: every layer kind on CUDA must give them, forward and backward, also
on a non-default stream; tensors reach the core as zero-copy CuPy views;
CuPy's allocations inside an op come from torch's caching allocator; autocast
float16 / bfloat16 runs with float32 accumulation. The ops run on the
rulebooks' kernel-built neighbour maps as they are: each op recognises the
library's tensors (nothing rebuilt), no op synchronises the device (CuPy's
``cupyx.allow_synchronize(False)`` guard), no pair list is derived, and memory
stays steady over 100 training steps.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
spconv = pytest.importorskip("sparsecore.torch")
from torch import nn  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

SHAPE = [10, 12, 9]


def _input(device, seed=0, channels=4, dtype=torch.float32):
    rng = do.make_rng(99000, seed)
    indices = do.random_indices(rng, SHAPE, 2, 0.2)
    features = torch.tensor(do.random_features(rng, indices.shape[0], channels), dtype=dtype, device=device,
                            requires_grad=True)
    return spconv.SparseConvTensor(features, torch.from_numpy(indices).to(device), SHAPE, 2)


def _model():
    torch.manual_seed(0)
    return spconv.SparseSequential(
        spconv.SubMConv3d(4, 8, 3, indice_key="subm1"), nn.BatchNorm1d(8), nn.ReLU(),
        spconv.SparseConv3d(8, 16, 3, 2, 1, indice_key="down1", groups=2), nn.ReLU(),
        spconv.SubMConv3d(16, 16, 3, indice_key="subm2"),
        spconv.SparseInverseConv3d(16, 8, 3, indice_key="down1"),
        spconv.SparseConvTranspose3d(8, 4, 2, 2),
        spconv.SparseMaxPool3d(2), spconv.SparseAvgPool3d(2, 1),
    )


def _run(model, x):
    out = model(x)
    loss = out.dense().square().sum() + spconv.SparseGlobalAvgPool()(out).sum() + spconv.SparseGlobalMaxPool()(
        out).sum()
    loss.backward()
    return out, {name: p.grad for name, p in model.named_parameters()}


def _compare(cuda_out, cpu_out, cuda_grads, cpu_grads, rtol=1e-4, atol=1e-5):
    torch.testing.assert_close(cuda_out.dense().cpu(), cpu_out.dense(), rtol=rtol, atol=atol)
    for name, grad in cpu_grads.items():
        torch.testing.assert_close(cuda_grads[name].cpu(), grad, rtol=rtol, atol=atol, msg=name)


def test_cuda_matches_cpu():
    cpu_model = _model()
    cuda_model = copy.deepcopy(cpu_model).cuda()
    x_cpu, x_cuda = _input("cpu"), _input("cuda")
    cpu_out, cpu_grads = _run(cpu_model, x_cpu)
    cuda_out, cuda_grads = _run(cuda_model, x_cuda)
    assert cuda_out.features.is_cuda and cuda_out.indices.is_cuda
    _compare(cuda_out, cpu_out, cuda_grads, cpu_grads)
    torch.testing.assert_close(x_cuda.features.grad.cpu(), x_cpu.features.grad, rtol=1e-4, atol=1e-5)


def test_cuda_on_a_side_stream():
    cpu_model = _model()
    cuda_model = copy.deepcopy(cpu_model).cuda()
    cpu_out, cpu_grads = _run(cpu_model, _input("cpu", 1))
    stream = torch.cuda.Stream()
    x = _input("cuda", 1)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cuda_out, cuda_grads = _run(cuda_model, x)
        dense = cuda_out.dense()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    torch.testing.assert_close(dense.cpu(), cpu_out.dense(), rtol=1e-4, atol=1e-5)
    _compare(cuda_out, cpu_out, cuda_grads, cpu_grads)


def test_zero_copy_and_torch_allocator():
    import cupy

    from sparsecore.torch import _convert

    t = torch.randn(100, 8, device="cuda")
    with _convert.core_context(t.device):
        view = _convert.core_view(t, "t")
        assert isinstance(view, cupy.ndarray) and view.data.ptr == t.data_ptr()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        scratch = cupy.empty(1 << 20, dtype=cupy.float32)
        after = torch.cuda.memory_stats()["allocation.all.allocated"]
        back = _convert.to_torch(scratch)
    assert after > before, "CuPy allocated from torch's caching allocator"
    assert back.data_ptr() == scratch.data.ptr


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast(dtype):
    model = spconv.SparseSequential(spconv.SubMConv3d(4, 16, 3, indice_key="s"), nn.ReLU(),
                                    spconv.SparseConv3d(16, 8, 3, 2, 1)).cuda()
    x = _input("cuda", 2)
    reference = model(x).features
    with torch.autocast("cuda", dtype=dtype):
        out = model(x)
    assert out.features.dtype == dtype
    torch.testing.assert_close(out.features.float(), reference, rtol=3e-2, atol=3e-2)
    out.features.float().sum().backward()
    assert all(torch.isfinite(p.grad).all() and p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_gpu():
    cpu_model = _model()
    cuda_model = copy.deepcopy(cpu_model).to("cuda:1")
    cpu_out, cpu_grads = _run(cpu_model, _input("cpu", 3))
    cuda_out, cuda_grads = _run(cuda_model, _input("cuda:1", 3))
    assert cuda_out.features.device == torch.device("cuda:1")
    _compare(cuda_out, cpu_out, cuda_grads, cpu_grads)


def test_memory_is_steady_over_100_training_steps():
    """Training steps on fresh inputs (new rulebooks each step) leave no memory behind."""
    model = _model().cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    allocated = []
    for step in range(100):
        x = _input("cuda", step % 4)
        loss = model(x).features.square().sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del x, loss
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert max(allocated[20:]) <= allocated[20] + 2**20, (allocated[20], max(allocated[20:]), allocated[-1])


def test_mixed_devices_error():
    x = _input("cuda")
    with pytest.raises(ValueError, match="different devices"):
        spconv.SubMConv3d(4, 4, 3)(x)
    with pytest.raises(ValueError, match="features is on cuda"):
        spconv.SparseConvTensor(x.features.detach(), x.indices.cpu(), SHAPE, 2)


def test_cuda_point_to_voxel_and_hash_table():
    rng = np.random.default_rng(5)
    points = torch.tensor(rng.random((500, 4)) * 2, dtype=torch.float32)
    cpu = spconv.utils.PointToVoxel([0.2, 0.2, 0.2], [0, 0, 0, 2, 2, 2], 4, 1000, 5)
    gpu = spconv.utils.PointToVoxel([0.2, 0.2, 0.2], [0, 0, 0, 2, 2, 2], 4, 1000, 5, device=torch.device("cuda"))
    for a, b in zip(cpu.generate_voxel_with_id(points), gpu.generate_voxel_with_id(points.cuda())):
        assert torch.equal(a, b.cpu())
    table = spconv.HashTable(torch.device("cuda"), torch.int32, torch.int64, max_size=64)
    table.insert(torch.tensor([5, 3, 7], dtype=torch.int32, device="cuda"),
                 torch.tensor([1, 2, 3], device="cuda"))
    values, empty = table.query(torch.tensor([7, 4], dtype=torch.int32, device="cuda"))
    assert values[0].item() == 3 and empty.tolist() == [False, True]


def test_the_ops_run_on_the_kernel_built_maps_without_a_synchronisation(monkeypatch):
    """A layer reusing a saved rulebook runs its ops on the rulebook's own map: no op rebuilds or checks
    it, none reads the device back (the guard raises on any synchronising CuPy call), no pair list is
    derived, and the results are the CPU's."""
    import cupyx

    from sparsecore.torch import ops

    checked = []
    rebuild = ops.checked_rulebook
    monkeypatch.setattr(ops, "checked_rulebook", lambda *args: checked.append(args) or rebuild(*args))
    torch.manual_seed(0)
    first, second = spconv.SubMConv3d(4, 8, 3, indice_key="s"), spconv.SubMConv3d(8, 8, 3, indice_key="s")
    down = spconv.SparseConv3d(8, 8, 3, 2, 1, indice_key="d")
    up = spconv.SparseInverseConv3d(8, 4, 3, indice_key="d")
    layers = nn.ModuleList([first, second, down, up])
    cpu_x, cuda_x = _input("cpu", 4), _input("cuda", 4)
    results = []
    for model, x in ((layers, cpu_x), (copy.deepcopy(layers).cuda(), cuda_x)):
        y = model[0](x)  # builds the submanifold map (the first layer's site checks read back once)
        low = model[2](y)  # builds the strided map (one read: the output count)
        torch.cuda.synchronize()
        with cupyx.allow_synchronize(False):
            z = model[1](y)  # reuses "s": the ops alone
            restored = model[3](low)  # reverses "d": the swapped map, nothing built
            loss = z.features.square().sum() + restored.features.square().sum()
            if x.features.is_cuda:  # the backward ops, called directly under the guard
                data = z.indice_dict["s"]
                grads = ops.DECLARED["conv_backward"](torch.ones_like(z.features), y.features.detach(),
                                                      model[1].weight.detach(), *data.op_arguments(), 1)
                assert data.rulebook.stored_map is not None and "pair_map" not in data.rulebook.stored_map.derived
        loss.backward()
        results.append((z.features.detach().cpu(), restored.features.detach().cpu(), x.features.grad.cpu()))
    assert not checked
    assert torch.isfinite(grads[0]).all() and grads[1].shape == second.weight.shape
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
