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
from sparsecore.neighbour_map import neighbour_map_of  # noqa: E402

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


def _map(rb):
    """The op arguments of a core rulebook: its neighbour tables as fresh torch tensors (not the library's)."""
    neighbours = neighbour_map_of(rb, np)
    side = neighbours.input_neighbours
    return (torch.from_numpy(neighbours.output_neighbours.copy()),
            None if side is None else torch.from_numpy(side.copy()), [3, 3, 3], rb.identity_offset)


@pytest.mark.parametrize("kind", ["subm", "regular"])
def test_opcheck_conv(kind):
    rng, _, rb = _rulebook(4, kind)
    rulebook = _map(rb)
    assert (rulebook[1] is None) == (kind == "subm")  # a submanifold map is symmetric: one side carried
    features = _leaf(rng, rb.num_input, 4)
    weight = _leaf(rng, 2, 3, 3, 3, 2)
    bias = _leaf(rng, 2)
    args = (features, weight, bias, *rulebook, 2)
    torch.library.opcheck(torch.ops.sparsecore.conv_forward.default, args)
    torch.library.opcheck(torch.ops.sparsecore.conv_forward.default, args[:2] + (None,) + args[3:])
    grad = torch.tensor(rng.standard_normal((rb.num_output, 2)))
    torch.library.opcheck(torch.ops.sparsecore.conv_backward.default,
                          (grad, features.detach(), weight.detach(), *rulebook, 2))


@pytest.mark.parametrize("kind", ["subm", "regular"])
def test_opcheck_pools(kind):
    rng, indices, rb = _rulebook(5, kind)
    rulebook = _map(rb)
    features = _leaf(rng, rb.num_input, 3)
    for op in (torch.ops.sparsecore.max_pool_forward, torch.ops.sparsecore.avg_pool_forward):
        torch.library.opcheck(op.default, (features, *rulebook))
    grad = torch.tensor(rng.standard_normal((rb.num_output, 3)))
    torch.library.opcheck(torch.ops.sparsecore.avg_pool_backward.default, (grad, *rulebook))
    _, argmax = torch.ops.sparsecore.max_pool_forward(features, *rulebook)
    torch.library.opcheck(torch.ops.sparsecore.max_pool_backward.default, (grad, argmax, rb.num_input))
    torch.library.opcheck(torch.ops.sparsecore.max_pool_window_backward.default, (grad, argmax, *rulebook))
    # the two backward ops are two ways to the same gradient
    torch.testing.assert_close(torch.ops.sparsecore.max_pool_window_backward(grad, argmax, *rulebook),
                               torch.ops.sparsecore.max_pool_backward(grad, argmax, rb.num_input),
                               rtol=1e-14, atol=1e-14)
    index = torch.from_numpy(indices)
    for op in (torch.ops.sparsecore.global_max_pool, torch.ops.sparsecore.global_avg_pool):
        torch.library.opcheck(op.default, (features, index, BATCH))
    torch.library.opcheck(torch.ops.sparsecore.global_avg_pool_backward.default,
                          (torch.tensor(rng.standard_normal((BATCH, 3))), index, BATCH))


def test_ops_accept_empty_rulebooks():
    empty = torch.zeros((0, 27), dtype=torch.int32)
    features = torch.zeros((0, 3), dtype=torch.float64, requires_grad=True)
    weight = torch.ones((2, 3, 3, 3, 3), dtype=torch.float64, requires_grad=True)
    out = torch.ops.sparsecore.conv_forward(features, weight, None, empty, empty, [3, 3, 3], -1, 1)
    assert out.shape == (0, 2)
    out.sum().backward()
    assert torch.equal(weight.grad, torch.zeros_like(weight))
    symmetric = torch.ops.sparsecore.conv_forward(features, weight, None, empty, None, [3, 3, 3], 13, 1)
    assert symmetric.shape == (0, 2)


def test_bfloat16_features_compute_in_float32():
    rng, _, rb = _rulebook(6, "subm")
    features = torch.tensor(rng.standard_normal((rb.num_input, 4)), dtype=torch.float32)
    weight = torch.tensor(rng.standard_normal((3, 3, 3, 3, 4)), dtype=torch.float32)
    args = (*_map(rb), 1)
    ref = torch.ops.sparsecore.conv_forward(features.bfloat16().double(), weight.bfloat16().double(), None, *args)
    out = torch.ops.sparsecore.conv_forward(features.bfloat16(), weight.bfloat16(), None, *args)
    assert out.dtype == torch.bfloat16
    # float32 accumulation: only the final rounding to bfloat16 differs
    assert torch.allclose(out.double(), ref, rtol=2 ** -7, atol=1e-6)


def test_single_op_compiles_with_fullgraph():
    """The conv custom op and its backward trace into one inductor graph."""
    rng, _, rb = _rulebook(7)
    output_neighbours, input_neighbours, kernel_size, identity = _map(rb)
    features = torch.tensor(rng.standard_normal((rb.num_input, 3)), requires_grad=True)
    weight = torch.tensor(rng.standard_normal((4, 3, 3, 3, 3)), requires_grad=True)

    def f(features, weight, output_neighbours, input_neighbours):
        out = torch.ops.sparsecore.conv_forward(features, weight, None, output_neighbours, input_neighbours,
                                                kernel_size, identity, 1)
        return torch.relu(out).sum()

    compiled = torch.compile(f, fullgraph=True)
    eager = f(features, weight, output_neighbours, input_neighbours)
    grads = torch.autograd.grad(eager, (features, weight))
    value = compiled(features, weight, output_neighbours, input_neighbours)
    compiled_grads = torch.autograd.grad(value, (features, weight))
    assert torch.allclose(value, eager)
    for a, b in zip(compiled_grads, grads):
        assert torch.allclose(a, b)


def test_conv_output_size_helpers():
    assert spconv.ops.get_conv_output_size([10, 12, 14], 3, 2, 1, 1) == [5, 6, 7]
    assert spconv.ops.get_conv_output_size([10, 12, 14], [3, 1, 1], [2, 1, 1], [1, 0, 0], 1) == [5, 12, 14]
    assert spconv.ops.get_deconv_output_size([10, 12, 14], 3, 2, 1, 1) == [19, 23, 27]
    assert np.all(np.asarray(spconv.ops.get_deconv_output_size([10, 12, 14], 2, 2, 0, 1)) == [20, 24, 28])


# --------------------------------------------------------------------------- the library's rulebook, by identity


def test_ops_reuse_the_library_rulebook_and_its_layouts(monkeypatch):
    from sparsecore.backends import _cpu_kernels
    from sparsecore.torch import ops
    from sparsecore.torch.indice_data import library_rulebook

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
    assert data.input_neighbours is None  # submanifold: the symmetric map carries one side
    assert library_rulebook(data.output_neighbours, data.input_neighbours) is data.rulebook
    for layer in layers:
        layer.weight.grad = None
    # the op's own checked map gives the same values (the same pairs, listed by output row within each
    # offset rather than in the builder's order: equal up to the rounding of the GEMMs' row blocking)
    monkeypatch.setattr(ops, "library_rulebook", lambda *a: None)
    y_checked, grad_checked, weight_grads_checked = run()
    for got, want in zip([y_checked.features, grad_checked, *weight_grads_checked], [y.features, grad, *weight_grads]):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert len(built) == 2 + 4  # without the library's rulebook every pass builds its plan


def test_ops_convert_no_neighbour_tensor_of_the_library(monkeypatch):
    """Handed an IndiceData's own tensors, an op converts only the features and weights to core views."""
    from sparsecore.torch import _op_table

    rng, indices = _sites(10)
    features = torch.from_numpy(do.random_features(rng, indices.shape[0], 4))
    down = spconv.SparseConv3d(4, 4, 3, 2, 1, indice_key="d").double()
    viewed = []
    view = _op_table.core_float_view
    monkeypatch.setattr(_op_table, "core_float_view", lambda tensor, name: viewed.append(name) or view(tensor, name))
    x = _tensor(features.clone().requires_grad_(), indices)
    inverse = spconv.SparseInverseConv3d(4, 2, 3, indice_key="d").double()
    y = inverse(spconv.SparseMaxPool(3, 3, subm=True)(down(x)))
    y.features.sum().backward()
    assert viewed and not {"output_neighbours", "input_neighbours"} & set(viewed), viewed


def test_ops_check_neighbour_tensors_that_are_not_the_librarys():
    from sparsecore.torch.indice_data import library_rulebook

    rng, indices = _sites(8)
    features = torch.from_numpy(do.random_features(rng, indices.shape[0], 4))
    layer = spconv.SubMConv3d(4, 4, 3, indice_key="k").double()
    data = layer(_tensor(features, indices)).indice_dict["k"]
    weight, bias = layer.weight.detach(), layer.bias.detach()
    # other sizes than the map's: the tables are checked, and do not fit
    with pytest.raises(ValueError, match=r"output_neighbours holds \d+, outside \[-1, 3\)"):
        torch.ops.sparsecore.conv_forward(features[:3], weight, bias, data.output_neighbours, None, [3, 3, 3], -1, 1)
    output_neighbours = data.output_neighbours
    output_neighbours[0, 0] = data.num_input + 5  # written in place: no longer the library's table
    assert library_rulebook(output_neighbours, None) is None
    with pytest.raises(ValueError, match="output_neighbours holds"):
        torch.ops.sparsecore.conv_forward(features, weight, bias, output_neighbours, None, [3, 3, 3], 13, 1)


def _regular_map(seed):
    rng, _, rb = _rulebook(seed)
    return rng, rb, _map(rb)


def test_checked_maps_refuse_inconsistent_tables():
    rng, rb, (outputs, inputs, kernel_size, _) = _regular_map(11)
    features = torch.tensor(rng.standard_normal((rb.num_input, 2)))
    weight = torch.tensor(rng.standard_normal((2, 3, 3, 3, 2)))
    expected = torch.ops.sparsecore.conv_forward(features, weight, None, outputs, inputs, kernel_size, -1, 1)
    oracle = torch.from_numpy(sc.conv_forward(features.numpy(), weight.numpy(), rb))
    torch.testing.assert_close(expected, oracle, rtol=0, atol=0)  # a checked map computes what the rulebook does
    row, offset = [int(v) for v in torch.nonzero(inputs >= 0)[0]]
    broken = inputs.clone()
    broken[row, offset] = -1  # the input side no longer the output side read backwards
    with pytest.raises(ValueError, match="does not match input_neighbours"):
        torch.ops.sparsecore.conv_forward(features, weight, None, outputs, broken, kernel_size, -1, 1)
    with pytest.raises(ValueError, match="input_neighbours is None"):
        torch.ops.sparsecore.conv_forward(features, weight, None, outputs, None, kernel_size, -1, 1)
    with pytest.raises(ValueError, match="identity_offset 13 is not an offset"):
        torch.ops.sparsecore.conv_forward(features, weight, None, outputs, inputs, kernel_size, 13, 1)
    twice = outputs.clone()
    column = twice[:, offset]
    used = torch.nonzero(column >= 0).flatten()
    if used.numel() >= 2:  # one input row paired with two outputs through one offset
        twice[used[1], offset] = twice[used[0], offset]
        with pytest.raises(ValueError, match="pairs an input row with two output rows"):
            torch.ops.sparsecore.conv_forward(features, weight, None, twice, inputs, kernel_size, -1, 1)
    with pytest.raises(TypeError, match="output_neighbours must be an int32"):
        torch.ops.sparsecore.conv_forward(features, weight, None, outputs.double(), inputs, kernel_size, -1, 1)


def test_a_symmetric_map_must_be_symmetric():
    rng, _, rb = _rulebook(12, "subm")
    outputs, _, kernel_size, identity = _map(rb)
    features = torch.tensor(rng.standard_normal((rb.num_input, 2)))
    weight = torch.tensor(rng.standard_normal((2, 3, 3, 3, 2)))
    row, offset = [int(v) for v in torch.nonzero((outputs >= 0) & (torch.arange(27) != identity))[0]]
    lopsided = outputs.clone()
    lopsided[row, offset] = -1  # its mirror pair stays: no longer a submanifold map
    with pytest.raises(ValueError, match="itself read backwards"):
        torch.ops.sparsecore.conv_forward(features, weight, None, lopsided, None, kernel_size, identity, 1)


def test_neighbour_tensor_copies_and_pickles_carry_no_rulebook():
    import copy
    import pickle

    from sparsecore.torch.indice_data import library_rulebook

    rng, indices = _sites(9)
    features = torch.from_numpy(do.random_features(rng, indices.shape[0], 16))
    data = spconv.SparseConv3d(16, 16, 3, 2, 1, indice_key="k").double()(_tensor(features, indices)).indice_dict["k"]
    assert library_rulebook(data.output_neighbours, data.input_neighbours) is data.rulebook
    assert library_rulebook(data.input_neighbours, data.output_neighbours) is None  # sides swapped
    for clone in (copy.deepcopy, lambda tensor: pickle.loads(pickle.dumps(tensor))):
        outputs, inputs = clone(data.output_neighbours), clone(data.input_neighbours)
        assert torch.equal(outputs, data.output_neighbours)
        assert library_rulebook(outputs, inputs) is None
        assert library_rulebook(outputs, data.input_neighbours) is None
