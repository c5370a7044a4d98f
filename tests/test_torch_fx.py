"""torch.fx tracing of sparsecore.torch models (frontends/torch/fx.py).

Oracles: the eager model (the traced GraphModule must compute the same tensors),
and, for the eager model itself, the dense float64 convolution of the densified
input read at the active sites (tests/dense_oracle.py).
"""

from __future__ import annotations

import operator
import warnings

import numpy as np
import pytest
import torch
import torch.fx
from torch import nn

import sparsecore.torch as spconv
from sparsecore.torch.fx import SparseTracer, sparse_symbolic_trace
from tests.dense_oracle import densify, dense_conv, read_sites
from tests.torch_networks import FusableResidualBlock, randomize_batch_norms, sparse_input

warnings.filterwarnings("ignore", message="is_fx_tracing will return true")

SHAPE = [12, 11]
BATCH = 2


def _sparse_input(seed: int, channels: int):
    return sparse_input(seed, SHAPE, BATCH, channels)


def _randomize_bn(model: nn.Module, seed: int) -> None:
    randomize_batch_norms(model, seed, mean_std=0.3, variance_low=0.5, variance_width=1.0)


class Net(nn.Module):
    """Builds the SparseConvTensor inside forward; conv, block, pool, features, replace_feature, dense."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.stem = spconv.SubMConv2d(3, channels, 3, indice_key="stem")
        self.block = FusableResidualBlock(channels, spconv.SubMConv2d)
        self.down = spconv.SparseConv2d(channels, channels, 3, stride=2, padding=1, indice_key="down")
        self.pool = spconv.SparseMaxPool2d(2, 2)
        self.to_dense = spconv.ToDense()

    def forward(self, features, indices):
        x = spconv.SparseConvTensor(features, indices, SHAPE, BATCH)
        x = self.block(self.stem(x))
        y = self.down(x)
        y = y.replace_feature(torch.tanh(y.features))
        return self.to_dense(self.pool(y)), x.dense()


def _model(seed: int) -> Net:
    torch.manual_seed(seed)
    model = Net().double().eval()
    _randomize_bn(model, seed)
    return model


def test_symbolic_trace_of_a_sparse_sequential_equals_eager():
    features, indices = _sparse_input(1, 3)
    torch.manual_seed(1)
    seq = spconv.SparseSequential(spconv.SubMConv2d(3, 5, 3), nn.BatchNorm1d(5), nn.ReLU(),
                                  spconv.SparseConv2d(5, 6, 2, 2), spconv.SparseReLU()).double().eval()
    _randomize_bn(seq, 1)
    traced = torch.fx.symbolic_trace(seq)
    x = spconv.SparseConvTensor(features, indices, SHAPE, BATCH)
    got, want = traced(x), seq(x)
    assert isinstance(got, spconv.SparseConvTensor)
    assert torch.equal(got.indices, want.indices)
    torch.testing.assert_close(got.features, want.features, rtol=0, atol=0)
    # each layer is one call_module node (leaf), applied to the SparseConvTensor
    targets = [node.target for node in traced.graph.nodes if node.op == "call_module"]
    assert targets == ["0", "1", "2", "3", "4"]


def test_first_layer_of_traced_model_matches_dense_oracle():
    features, indices = _sparse_input(2, 3)
    model = _model(2)
    traced = torch.fx.symbolic_trace(model)
    x = spconv.SparseConvTensor(features, indices, SHAPE, BATCH)
    stem_out = model.stem(x)
    dense = dense_conv(densify(features, indices.numpy(), SHAPE, BATCH), model.stem.weight.detach(), 1, 1, 1)
    want = read_sites(dense, indices.numpy()) + model.stem.bias.detach()
    torch.testing.assert_close(stem_out.features, want, rtol=1e-9, atol=1e-9)
    for got, eager in zip(traced(features, indices), model(features, indices)):
        torch.testing.assert_close(got, eager, rtol=0, atol=0)


@pytest.mark.parametrize("trace", ["plain", "sparse_tracer", "sequential_traced"])
def test_traced_model_equals_eager_model(trace):
    features, indices = _sparse_input(3, 3)
    model = _model(3)
    if trace == "plain":
        traced = torch.fx.symbolic_trace(model)
    else:
        traced = sparse_symbolic_trace(model, trace_sequential=trace == "sequential_traced")
    for got, eager in zip(traced(features, indices), model(features, indices)):
        torch.testing.assert_close(got, eager, rtol=0, atol=0)


def test_graph_holds_construction_add_features_replace_feature_dense():
    traced = torch.fx.symbolic_trace(_model(4))
    nodes = list(traced.graph.nodes)
    functions = {node.target for node in nodes if node.op == "call_function"}
    methods = {node.target for node in nodes if node.op == "call_method"}
    modules = {node.target for node in nodes if node.op == "call_module"}
    assert spconv.SparseConvTensor in functions
    assert operator.add in functions
    assert getattr in functions  # .features
    assert {"replace_feature", "dense"} <= methods
    # the user block is traced through; its sparse layers and containers are leaves
    assert {"stem", "block.conv1_bn_relu", "block.conv2_bn", "block.relu", "block.iden_for_fx_match",
            "down", "pool", "to_dense"} == modules


def test_quantization_style_tracer_enters_sparse_sequential():
    traced = sparse_symbolic_trace(_model(5), trace_sequential=True)
    modules = [node.target for node in traced.graph.nodes if node.op == "call_module"]
    assert "block.conv1_bn_relu.conv" in modules and "block.conv1_bn_relu.bn" in modules
    assert "block.conv1_bn_relu.relu" in modules and "block.conv2_bn.bn" in modules
    # nn.BatchNorm1d / nn.ReLU are recorded as applied to the SparseConvTensor itself
    bn = next(node for node in traced.graph.nodes if node.target == "block.conv1_bn_relu.bn")
    assert bn.args[0].target == "block.conv1_bn_relu.conv"


def test_traced_graph_on_empty_input():
    model = _model(6)
    features = torch.zeros((0, 3), dtype=torch.float64)
    indices = torch.zeros((0, 3), dtype=torch.int32)
    for traced in (torch.fx.symbolic_trace(model), sparse_symbolic_trace(model, trace_sequential=True)):
        for got, eager in zip(traced(features, indices), model(features, indices)):
            assert got.shape == eager.shape
            assert torch.equal(got, eager)


def test_traced_graph_is_differentiable():
    features, indices = _sparse_input(7, 3)
    model = _model(7)
    traced = sparse_symbolic_trace(model, trace_sequential=True)
    grads = []
    for module in (model, traced):
        inputs = features.clone().requires_grad_(True)
        dense, other = module(inputs, indices)
        (dense.square().sum() + other.sum()).backward()
        grads.append(inputs.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)


def test_fusable_block_fuses_with_torch_ao():
    from torch.ao.quantization.quantize_fx import fuse_fx

    import sparsecore.torch.quantization as spconvq

    features, indices = _sparse_input(8, 4)
    torch.manual_seed(8)
    block = FusableResidualBlock(4, spconv.SubMConv2d).double().eval()
    _randomize_bn(block, 8)
    # fuse_fx traces with torch's plain tracer, for which a SparseSequential is a leaf:
    # trace into the containers first
    traced = sparse_symbolic_trace(block, trace_sequential=True)
    fused = fuse_fx(traced, backend_config=spconvq.get_spconv_backend_config())
    kinds = [type(m).__name__ for m in fused.modules()]
    # eval-mode fusion folds the batch norms (QAT's keep them: tests/test_torch_quantization.py)
    assert kinds.count("SpconvReLUNd") == 1 and kinds.count("SpconvAddReLUNd") == 1
    assert "BatchNorm1d" not in kinds
    x = spconv.SparseConvTensor(features, indices, SHAPE, BATCH)
    torch.testing.assert_close(fused(x).features, block(x).features, rtol=1e-10, atol=1e-10)


def test_runtime_applies_torch_modules_to_features():
    features, indices = _sparse_input(9, 3)
    x = spconv.SparseConvTensor(features, indices, SHAPE, BATCH)
    bn = nn.BatchNorm1d(3).double().eval()
    _randomize_bn(bn, 9)
    torch.testing.assert_close(bn(x).features, bn(features))
    torch.testing.assert_close(nn.ReLU()(x).features, torch.relu(features))
    with pytest.raises(TypeError):
        torch.sum(x)  # not a row-wise function: no silent meaning


def test_sparse_tracer_extra_leaves():
    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = FusableResidualBlock(3, spconv.SubMConv2d)

        def forward(self, x):
            return self.inner(x)

    tracer = SparseTracer(leaf_module_classes=(FusableResidualBlock,))
    graph = tracer.trace(Wrapper())
    assert [n.target for n in graph.nodes if n.op == "call_module"] == ["inner"]
