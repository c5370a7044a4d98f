"""DistributedDataParallel with sparse layers: 2 CPU processes (gloo) vs one process on the whole batch.

Each rank gets one batch element (re-indexed as batch 0 of its own tensor);
the loss is a sum of per-element terms (no BatchNorm, which couples elements),
so the full-batch gradient is the sum of the per-element gradients, and DDP's
averaged gradient times the world size must equal it. Both ranks must also
hold identical gradients after the all-reduce.
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import pytest

torch = pytest.importorskip("torch")
spconv = pytest.importorskip("sparsecore.torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

SHAPE = [6, 7, 8]
WORLD_SIZE = 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = spconv.SparseSequential(
            spconv.SubMConv3d(3, 8, 3, indice_key="subm1"), nn.ReLU(),
            spconv.SparseConv3d(8, 16, 3, 2, 1, indice_key="down"), nn.ReLU(),
            spconv.SubMConv3d(16, 16, 3, indice_key="subm2"), nn.ReLU(),
        )
        self.pool = spconv.SparseGlobalAvgPool()
        self.fc = nn.Linear(16, 2)

    def forward(self, x):
        return self.fc(self.pool(self.body(x)))


def _element(b):
    """Sites and features of batch element ``b`` (as batch 0)."""
    rng = do.make_rng(98000, b)
    indices = do.random_indices(rng, SHAPE, 1, 0.3)
    features = do.random_features(rng, indices.shape[0], 3, dtype="float64")
    return torch.from_numpy(indices), torch.from_numpy(features)


def _batch(elements):
    indices, features = [], []
    for b in elements:
        i, f = _element(b)
        i = i.clone()
        i[:, 0] = len(indices)
        indices.append(i)
        features.append(f)
    return spconv.SparseConvTensor(torch.cat(features), torch.cat(indices), SHAPE, len(elements))


def _loss(output):
    return (output.square().sum(1) + output[:, 0]).sum()  # one independent term per batch element


def _worker(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(Net().double())
        _loss(model(_batch([rank]))).backward()
        grads = {name: p.grad for name, p in model.module.named_parameters()}
        torch.save(grads, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # rank 0 hosts the store: no rank leaves while another still needs it
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(out_dir, deadline_s: float = 240.0) -> None:
    """Runs the ranks; fails (instead of hanging the suite) if they have not finished by the deadline."""
    context = mp.start_processes(_worker, args=(_free_port(), out_dir), nprocs=WORLD_SIZE, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"the {WORLD_SIZE} DDP ranks did not finish within {deadline_s:.0f} s")


def test_ddp_gradients_equal_single_process(tmp_path):
    _run_workers(str(tmp_path))
    torch.manual_seed(0)
    model = Net().double()
    _loss(model(_batch(list(range(WORLD_SIZE))))).backward()
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD_SIZE)]
    for name, parameter in model.named_parameters():
        for grads in ranks:
            torch.testing.assert_close(grads[name] * WORLD_SIZE, parameter.grad, rtol=1e-10, atol=1e-12,
                                       msg=name)
        assert torch.equal(ranks[0][name], ranks[1][name]), f"ranks disagree on {name}"
