"""The torch.library custom ops: opcheck, gradcheck in float64 for every op type, fullgraph compile.

``torch.autograd.gradcheck`` compares the registered backward passes with
finite differences of the forward, through the layers users call (conv subm,
regular, transposed, inverse; max and average pool; global pools), so the
oracle is independent of the backward code. ``torch.library.opcheck`` checks
the schema, fake (meta) kernels, autograd registration and AOT dispatch of
each op.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
spconv = pytest.importorskip("sparsecore.torch")

import sparsecore as sc  # noqa: E402

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

# torch's own compile machinery warns about torch.jit internals it still uses
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")

SHAPE = (5, 4, 6)
BATCH = 2


def _sites(seed, shape=SHAPE, density=0.25):
    rng = do.make_rng(81000, seed)
    indices = do.random_indices(rng, shape, BATCH, density)
    return rng, indices


def _tensor(features, indices, shape=SHAPE):
    return spconv.SparseConvTensor(features, torch.from_numpy(indices), list(shape), BATCH)


def _leaf(rng, *shape):
    return torch.tensor(rng.standard_normal(shape), requires_grad=True)


def _gradcheck_layer(layer, x_features, indices, shape=SHAPE, prepare=None):
    params = dict(layer.named_parameters())
    names = list(params)

    def fn(features, *values):
        x = _tensor(features, indices, shape) if prepare is None else prepare(features)
        out = torch.func.functional_call(layer, dict(zip(names, values)), (x,))
        return out if isinstance(out, torch.Tensor) else out.features

    leaves = [p.detach().clone().requires_grad_() for p in params.values()]
    assert torch.autograd.gradcheck(fn, (x_features, *leaves), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("layer_factory", [
    lambda: spconv.SubMConv3d(3, 2, 3, dilation=(1, 2, 1)),
    lambda: spconv.SparseConv3d(3, 4, (3, 2, 3), stride=2, padding=1),
    lambda: spconv.SparseConv3d(4, 4, 3, stride=1, padding=(0, 1, 2), groups=2, bias=False),
    lambda: spconv.SparseConvolution(3, 3, 2, 3, stride=2, padding=1, transposed=True, output_padding=1),
    lambda: spconv.SparseConvTranspose3d(2, 2, 2, 2, groups=2),
], ids=["subm", "regular", "regular-grouped", "transposed-outpad", "transposed-grouped"])
def test_gradcheck_conv(layer_factory):
    layer = layer_factory().double()
    rng, indices = _sites(1)
    _gradcheck_layer(layer, _leaf(rng, indices.shape[0], layer.in_channels), indices)


def test_gradcheck_inverse_conv():
    rng, indices = _sites(2)
    down = spconv.SparseConv3d(2, 3, 3, 2, 1, indice_key="d").double()
    y = down(_tensor(torch.tensor(rng.standard_normal((indices.shape[0], 2))), indices))
    layer = spconv.SparseInverseConv3d(3, 2, 3, indice_key="d").double()
    _gradcheck_layer(layer, _leaf(rng, y.indices.shape[0], 3), indices, prepare=y.replace_feature)


@pytest.mark.parametrize("layer_factory", [
    lambda: spconv.SparseMaxPool3d(2),
    lambda: spconv.SparseMaxPool(3, 3, 2, 1, dilation=(1, 1, 2)),
    lambda: spconv.SparseAvgPool3d(3, 2, 1),
    lambda: spconv.SparseAvgPool(3, 3, subm=True),
    lambda: spconv.SparseGlobalMaxPool(),
    lambda: spconv.SparseGlobalAvgPool(),
], ids=["max", "max-dilated", "avg", "avg-subm", "global-max", "global-avg"])
def test_gradcheck_pool(layer_factory):
    rng, indices = _sites(3)
    _gradcheck_layer(layer_factory(), _leaf(rng, indices.shape[0], 3), indices)


# --------------------------------------------------------------------------- opcheck


def _rulebook(seed, kind="regular"):
    rng, indices = _sites(seed)
    geometry = sc.ConvGeometry.create(3, 3, 1 if kind == "subm" else 2, 1, kind=kind)
    rb = sc.build_rulebook(indices, SHAPE, BATCH, geometry)
    return rng, indices, rb


def _pairs(rb):
    return (torch.from_numpy(rb.pair_input), torch.from_numpy(rb.pair_output), list(rb.offset_starts))


@pytest.mark.parametrize("kind", ["subm", "regular"])
def test_opcheck_conv(kind):
    rng, _, rb = _rulebook(4, kind)
    pair_input, pair_output, starts = _pairs(rb)
    features = _leaf(rng, rb.num_input, 4)
    weight = _leaf(rng, 2, 3, 3, 3, 2)
    bias = _leaf(rng, 2)
    args = (features, weight, bias, pair_input, pair_output, starts, rb.num_output, [3, 3, 3],
            rb.identity_offset, 2)
    torch.library.opcheck(torch.ops.sparsecore.conv_forward.default, args)
    torch.library.opcheck(torch.ops.sparsecore.conv_forward.default, args[:2] + (None,) + args[3:])
    grad = torch.tensor(rng.standard_normal((rb.num_output, 2)))
    torch.library.opcheck(torch.ops.sparsecore.conv_backward.default,
                          (grad, features.detach(), weight.detach(), pair_input, pair_output, starts, [3, 3, 3],
                           rb.identity_offset, 2))


def test_opcheck_pools():
    rng, indices, rb = _rulebook(5)
    pair_input, pair_output, starts = _pairs(rb)
    features = _leaf(rng, rb.num_input, 3)
    for op in (torch.ops.sparsecore.max_pool_forward, torch.ops.sparsecore.avg_pool_forward):
        torch.library.opcheck(op.default, (features, pair_input, pair_output, starts, rb.num_output, [3, 3, 3]))
    grad = torch.tensor(rng.standard_normal((rb.num_output, 3)))
    torch.library.opcheck(torch.ops.sparsecore.avg_pool_backward.default,
                          (grad, pair_input, pair_output, starts, rb.num_input, [3, 3, 3]))
    _, argmax = torch.ops.sparsecore.max_pool_forward(features, pair_input, pair_output, starts, rb.num_output,
                                                      [3, 3, 3])
    torch.library.opcheck(torch.ops.sparsecore.max_pool_backward.default, (grad, argmax, rb.num_input))
    torch.library.opcheck(torch.ops.sparsecore.max_pool_pairs_backward.default,
                          (grad, argmax, pair_input, pair_output, starts, rb.num_input, [3, 3, 3]))
    # the two backward ops are two ways to the same gradient
    torch.testing.assert_close(
        torch.ops.sparsecore.max_pool_pairs_backward(grad, argmax, pair_input, pair_output, starts, rb.num_input,
                                                     [3, 3, 3]),
        torch.ops.sparsecore.max_pool_backward(grad, argmax, rb.num_input), rtol=1e-14, atol=1e-14)
    index = torch.from_numpy(indices)
    for op in (torch.ops.sparsecore.global_max_pool, torch.ops.sparsecore.global_avg_pool):
        torch.library.opcheck(op.default, (features, index, BATCH))
    torch.library.opcheck(torch.ops.sparsecore.global_avg_pool_backward.default,
                          (torch.tensor(rng.standard_normal((BATCH, 3))), index, BATCH))


def test_ops_accept_empty_rulebooks():
    empty = torch.zeros(0, dtype=torch.int32)
    features = torch.zeros((0, 3), dtype=torch.float64, requires_grad=True)
    weight = torch.ones((2, 3, 3, 3, 3), dtype=torch.float64, requires_grad=True)
    out = torch.ops.sparsecore.conv_forward(features, weight, None, empty, empty, [0] * 28, 0, [3, 3, 3], -1, 1)
    assert out.shape == (0, 2)
    out.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_bfloat16_features_compute_in_float32():
    rng, _, rb = _rulebook(6, "subm")
    pair_input, pair_output, starts = _pairs(rb)
    features = torch.tensor(rng.standard_normal((rb.num_input, 4)), dtype=torch.float32)
    weight = torch.tensor(rng.standard_normal((3, 3, 3, 3, 4)), dtype=torch.float32)
    args = (pair_input, pair_output, starts, rb.num_output, [3, 3, 3], rb.identity_offset, 1)
    ref = torch.ops.sparsecore.conv_forward(features.bfloat16().double(), weight.bfloat16().double(), None, *args)
    out = torch.ops.sparsecore.conv_forward(features.bfloat16(), weight.bfloat16(), None, *args)
    assert out.dtype == torch.bfloat16
    # float32 accumulation: only the final rounding to bfloat16 differs
    assert torch.allclose(out.double(), ref, rtol=2 ** -7, atol=1e-6)


def test_single_op_compiles_with_fullgraph():
    """The conv custom op and its backward trace into one inductor graph."""
    rng, _, rb = _rulebook(7)
    pair_input, pair_output, starts = _pairs(rb)
    features = torch.tensor(rng.standard_normal((rb.num_input, 3)), requires_grad=True)
    weight = torch.tensor(rng.standard_normal((4, 3, 3, 3, 3)), requires_grad=True)

    def f(features, weight, pair_input, pair_output):
        out = torch.ops.sparsecore.conv_forward(features, weight, None, pair_input, pair_output, starts,
                                                rb.num_output, [3, 3, 3], -1, 1)
        return torch.relu(out).sum()

    compiled = torch.compile(f, fullgraph=True)
    eager = f(features, weight, pair_input, pair_output)
    grads = torch.autograd.grad(eager, (features, weight))
    value = compiled(features, weight, pair_input, pair_output)
    compiled_grads = torch.autograd.grad(value, (features, weight))
    assert torch.allclose(value, eager)
    for a, b in zip(compiled_grads, grads):
        assert torch.allclose(a, b)


def test_conv_output_size_helpers():
    assert spconv.ops.get_conv_output_size([10, 12, 14], 3, 2, 1, 1) == [5, 6, 7]
    assert spconv.ops.get_conv_output_size([10, 12, 14], [3, 1, 1], [2, 1, 1], [1, 0, 0], 1) == [5, 12, 14]
    assert spconv.ops.get_deconv_output_size([10, 12, 14], 3, 2, 1, 1) == [19, 23, 27]
    assert np.all(np.asarray(spconv.ops.get_deconv_output_size([10, 12, 14], 2, 2, 0, 1)) == [20, 24, 28])


def test_ops_reuse_the_library_pair_map_and_its_layouts(monkeypatch):
    from sparsecore.backends import _cpu_kernels
    from sparsecore.torch import ops
    from sparsecore.torch.indice_data import library_pair_map

    rng, indices = _sites(7, shape=(8, 9, 10), density=0.4)
    features = torch.from_numpy(do.random_features(rng, indices.shape[0], 16))
    layers = [spconv.SubMConv3d(16, 16, 3, indice_key="k", bias=False).double() for _ in range(2)]

    def run():
        x = _tensor(features.clone().requires_grad_(), indices, (8, 9, 10))
        y = layers[1](layers[0](x))
        y.features.square().sum().backward()
        return y, x.features.grad, [layer.weight.grad.clone() for layer in layers]

    built = []
    build = _cpu_kernels.tile_plan  # 16 -> 16 runs the tiled dataflow, over tile plans
    monkeypatch.setattr(_cpu_kernels, "tile_plan", lambda *a: built.append(a[-1]) or build(*a))
    y, grad, weight_grads = run()
    assert len(built) == 2  # one forward and one backward plan for both layers' four passes
    data = y.indice_dict["k"]
    assert library_pair_map(data.pair_input, data.pair_output) is data.rulebook.pair_map
    for layer in layers:
        layer.weight.grad = None
    # the op's own checked map gives the same values (same dataflow, same order)
    monkeypatch.setattr(ops, "library_pair_map", lambda *a: None)
    y_checked, grad_checked, weight_grads_checked = run()
    assert torch.equal(y.features, y_checked.features) and torch.equal(grad, grad_checked)
    assert all(torch.equal(a, b) for a, b in zip(weight_grads, weight_grads_checked))
    assert len(built) == 2 + 4  # without the shared map every pass builds its plan


def test_ops_check_pair_tensors_written_in_place_or_mismatched():
    from sparsecore.torch.indice_data import library_pair_map

    rng, indices = _sites(8)
    features = torch.from_numpy(do.random_features(rng, indices.shape[0], 4))
    layer = spconv.SubMConv3d(4, 4, 3, indice_key="k").double()
    data = layer(_tensor(features, indices)).indice_dict["k"]
    weight, bias = layer.weight.detach(), layer.bias.detach()
    arguments = (data.offset_starts, data.num_output, data.kernel_size, data.identity_offset, 1)
    # another sizes than the map's: a fresh map, checked (its rows do not fit one output row)
    with pytest.raises(ValueError, match="pair_output holds row"):
        torch.ops.sparsecore.conv_forward(features, weight, bias, data.pair_input, data.pair_output,
                                          data.offset_starts, 1, *arguments[2:])
    pair_output = data.pair_output
    pair_output[0] = data.num_output + 5  # written in place: no longer the map's view
    assert library_pair_map(data.pair_input, pair_output) is None
    with pytest.raises(ValueError, match="pair_output holds row"):
        torch.ops.sparsecore.conv_forward(features, weight, bias, data.pair_input, pair_output, *arguments)


def test_pair_tensor_copies_and_pickles_carry_no_pair_map():
    import copy
    import pickle

    from sparsecore.torch.indice_data import library_pair_map

    rng, indices = _sites(9)
    features = torch.from_numpy(do.random_features(rng, indices.shape[0], 16))
    data = spconv.SubMConv3d(16, 16, 3, indice_key="k").double()(_tensor(features, indices)).indice_dict["k"]
    data.rulebook.pair_map.derived["probe"] = np.zeros(3)
    assert library_pair_map(data.pair_input, data.pair_output) is data.rulebook.pair_map
    for clone in (copy.deepcopy, lambda tensor: pickle.loads(pickle.dumps(tensor))):
        pair_input, pair_output = clone(data.pair_input), clone(data.pair_output)
        assert torch.equal(pair_input, data.pair_input)
        assert library_pair_map(pair_input, pair_output) is None
    restored = pickle.loads(pickle.dumps(data.rulebook.pair_map))
    assert restored.derived == {} and np.array_equal(restored.pair_input, data.rulebook.pair_input)
