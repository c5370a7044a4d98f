"""sparsecore.torch._op_table: a custom op declared from one table entry, and the library's op tables.

A test op declared from one `OpSpec` (in its own namespace) must compute what
a NumPy loop computes, pass ``torch.library.opcheck`` (schema, fake kernel,
autograd registration) and ``gradcheck`` (its backward against finite
differences). The library's thirteen ops keep the schemas they were published
with (written out here, not read from the tables): the feature passes carry a
rulebook as its neighbour tables (issue 28), the export ops, which saved
``.pt2`` programs hold, their pair tensors. Each op converts to core views
only the arguments its computation reads (`_op_table.CoreArguments`).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
spconv = pytest.importorskip("sparsecore.torch")
from sparsecore.torch import _op_table  # noqa: E402
from sparsecore.torch.exportable import EXPORT_OPS  # noqa: E402
from sparsecore.torch.ops import OPS  # noqa: E402

try:
    from . import dense_oracle as do
except ImportError:
    import dense_oracle as do

NAMESPACE = "sparsecore_op_table_test"


def _group_sums(a):
    """Row ``g`` of the first output: the sum of the feature rows whose group is ``g``; the second: their count."""
    sums = np.zeros((a.num_groups, a.features.shape[1]), dtype=a.features.dtype)
    np.add.at(sums, a.groups, a.features)
    return sums, np.bincount(a.groups, minlength=a.num_groups).astype(np.int32)


def _group_sum_gradients(saved, grad_output):
    return {"features": grad_output[saved.groups.long()]}


GROUP_SUM = _op_table.OpSpec(
    "group_sum", "(Tensor features, Tensor groups, SymInt num_groups) -> (Tensor, Tensor)",
    (_op_table.Output("sums", "features"), _op_table.Output("counts", torch.int32)),
    _group_sums,
    lambda a: [(a.num_groups, a.features.shape[1]), (a.num_groups,)],
    _op_table.Backward(("groups",), _group_sum_gradients))


def _group_sums_backward(a):
    """The gradient of the group sums (no backward of its own): ``grad_output`` gathered by group."""
    return a.grad_output[a.groups]


GROUP_SUM_BACKWARD = _op_table.OpSpec(
    "group_sum_backward", "(Tensor grad_output, Tensor groups) -> Tensor",
    (_op_table.Output("grad", "grad_output"),), _group_sums_backward,
    lambda a: [(a.groups.shape[0], a.grad_output.shape[1])])

DECLARED = _op_table.declare_ops([GROUP_SUM, GROUP_SUM_BACKWARD], namespace=NAMESPACE)
group_sum = getattr(torch.ops, NAMESPACE).group_sum


def _inputs(seed, rows=11, channels=3, num_groups=4):
    rng = do.make_rng(99500, seed)
    features = torch.tensor(do.random_features(rng, rows, channels), requires_grad=True)
    groups = torch.from_numpy(rng.integers(0, num_groups, rows).astype(np.int64))
    return features, groups, num_groups


def test_a_declared_op_computes_what_a_loop_computes():
    features, groups, num_groups = _inputs(1)
    sums, counts = group_sum(features, groups, num_groups)
    expected = np.zeros((num_groups, 3))
    expected_counts = np.zeros(num_groups, dtype=np.int32)
    for row, group in enumerate(groups.tolist()):
        expected[group] += features.detach().numpy()[row]
        expected_counts[group] += 1
    assert sums.dtype == torch.float64 and counts.dtype == torch.int32
    np.testing.assert_allclose(sums.detach().numpy(), expected, rtol=1e-14, atol=1e-14)
    np.testing.assert_array_equal(counts.numpy(), expected_counts)


def test_core_arguments_convert_a_tensor_when_first_read(monkeypatch):
    features, groups, _ = _inputs(7)
    viewed = []
    view = _op_table.core_float_view
    monkeypatch.setattr(_op_table, "core_float_view", lambda tensor, name: viewed.append(name) or view(tensor, name))
    arguments = _op_table.CoreArguments({"features": features, "groups": groups, "num_groups": 4})
    assert arguments.num_groups == 4 and viewed == []
    np.testing.assert_array_equal(arguments.groups, groups.numpy())
    assert arguments.groups is arguments.groups and viewed == ["groups"]  # made once, the other left alone
    assert arguments.torch_arguments["features"] is features
    with pytest.raises(AttributeError, match="no argument 'weight'"):
        _ = arguments.weight


def test_a_declared_op_passes_opcheck_and_gradcheck():
    features, groups, num_groups = _inputs(2)
    torch.library.opcheck(group_sum.default, (features, groups, num_groups))
    assert torch.autograd.gradcheck(lambda f: group_sum(f, groups, num_groups)[0], (features,), eps=1e-6,
                                    atol=1e-7, rtol=1e-5)
    empty = torch.zeros((0, 3), dtype=torch.float64, requires_grad=True)
    sums, counts = group_sum(empty, torch.zeros(0, dtype=torch.int64), 2)
    assert sums.shape == (2, 3) and not sums.detach().any() and counts.tolist() == [0, 0]


def test_a_declared_op_compiles_with_fullgraph():
    features, groups, num_groups = _inputs(3)

    def loss(f):
        sums, _ = group_sum(f, groups, num_groups)
        return sums.square().sum()

    expected = torch.autograd.grad(loss(features), features)[0]
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    actual = torch.autograd.grad(compiled(features), features)[0]
    # d/df sum_g (sum_{r in g} f_r)^2 = 2 * sums[group of the row]
    sums = np.zeros((num_groups, 3))
    np.add.at(sums, groups.numpy(), features.detach().numpy())
    np.testing.assert_allclose(expected.numpy(), 2 * sums[groups.numpy()], rtol=1e-12)
    torch.testing.assert_close(actual, expected)


def _expected_group_sums(features, groups, num_groups):
    sums = np.zeros((num_groups, features.shape[1]))
    np.add.at(sums, groups.numpy(), features.detach().numpy())
    return sums


def test_eager_calls_run_the_twin_with_the_same_results_and_gradients():
    features, groups, num_groups = _inputs(4, rows=17)
    declared = DECLARED["group_sum"]
    twin_sums, twin_counts = declared(features, groups, num_groups)
    op_sums, op_counts = group_sum(features, groups, num_groups)
    assert type(twin_sums.grad_fn).__name__ == "group_sum_eagerBackward"  # the twin ran, not the dispatcher
    assert type(op_sums.grad_fn).__name__ != type(twin_sums.grad_fn).__name__
    np.testing.assert_allclose(twin_sums.detach().numpy(), _expected_group_sums(features, groups, num_groups),
                               rtol=1e-14, atol=1e-14)
    assert torch.equal(twin_sums, op_sums) and torch.equal(twin_counts, op_counts)
    weights = torch.from_numpy(do.make_rng(99501, 0).standard_normal((num_groups, 3)))
    twin_grad = torch.autograd.grad((twin_sums * weights).sum(), features)[0]
    op_grad = torch.autograd.grad((op_sums * weights).sum(), features)[0]
    assert torch.equal(twin_grad, op_grad)
    np.testing.assert_allclose(twin_grad.numpy(), weights.numpy()[groups.numpy()], rtol=1e-14)
    assert torch.autograd.gradcheck(lambda f: declared(f, groups, num_groups)[0], (features,), eps=1e-6,
                                    atol=1e-7, rtol=1e-5)
    with torch.no_grad():
        assert declared(features, groups, num_groups)[0].grad_fn is None


def test_traced_calls_run_the_custom_op():
    features, groups, num_groups = _inputs(5)
    declared = DECLARED["group_sum"]
    with torch.device("cpu"):  # a torch function mode: the twin steps aside
        sums, _ = declared(features, groups, num_groups)
    assert type(sums.grad_fn).__name__ != "group_sum_eagerBackward"
    np.testing.assert_allclose(sums.detach().numpy(), _expected_group_sums(features, groups, num_groups),
                               rtol=1e-14, atol=1e-14)

    def loss(f):
        return declared(f, groups, num_groups)[0].square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    expected = 2 * _expected_group_sums(features, groups, num_groups)[groups.numpy()]
    np.testing.assert_allclose(torch.autograd.grad(compiled(features), features)[0].numpy(), expected,
                               rtol=1e-12)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake_sums, fake_counts = declared(mode.from_tensor(features), mode.from_tensor(groups), num_groups)
    assert fake_sums.shape == (num_groups, 3) and fake_counts.dtype == torch.int32


def test_an_op_without_backward_still_refuses_to_differentiate():
    features, groups, num_groups = _inputs(6)
    grad_output = torch.from_numpy(do.make_rng(99502, 0).standard_normal((num_groups, 3))).requires_grad_()
    declared = DECLARED["group_sum_backward"]
    with torch.no_grad():
        np.testing.assert_array_equal(declared(grad_output, groups).numpy(),
                                      grad_output.detach().numpy()[groups.numpy()])
    through_op = declared(grad_output, groups)  # requires grad with grad mode on: the custom op
    with pytest.raises(RuntimeError):
        through_op.sum().backward()


def test_table_errors_name_what_is_wrong():
    bad_save = _op_table.OpSpec("bad", "(Tensor x) -> Tensor", (_op_table.Output("y", "x"),), lambda a: a.x,
                                lambda a: [a.x.shape], _op_table.Backward(("z",), lambda saved, grad: {}))
    with pytest.raises(ValueError, match=r"op bad: the backward saves \['z'\].*arguments \['x'\]"):
        _op_table.declare_ops([bad_save], namespace=NAMESPACE)
    no_arrow = _op_table.OpSpec("bad2", "(Tensor x)", (_op_table.Output("y", "x"),), lambda a: a.x,
                                lambda a: [a.x.shape])
    with pytest.raises(ValueError, match="must read"):
        _op_table.declare_ops([no_arrow], namespace=NAMESPACE)
    nameless = _op_table.OpSpec("bad3", "(Tensor) -> Tensor", (_op_table.Output("y", "x"),), lambda a: a.x,
                                lambda a: [a.x.shape])
    with pytest.raises(ValueError, match="write 'Type name'"):
        _op_table.declare_ops([nameless], namespace=NAMESPACE)


_MAP = "Tensor output_neighbours, Tensor? input_neighbours, SymInt[] kernel_size, SymInt identity_offset"
PUBLISHED_SCHEMAS = {
    "conv_forward": f"(Tensor features, Tensor weight, Tensor? bias, {_MAP}, SymInt groups) -> Tensor",
    "conv_backward": f"(Tensor grad_output, Tensor features, Tensor weight, {_MAP}, SymInt groups) "
                     "-> (Tensor, Tensor)",
    "max_pool_forward": f"(Tensor features, {_MAP}) -> (Tensor, Tensor)",
    "max_pool_backward": "(Tensor grad_output, Tensor argmax, SymInt num_input) -> Tensor",
    "max_pool_window_backward": f"(Tensor grad_output, Tensor argmax, {_MAP}) -> Tensor",
    "avg_pool_forward": f"(Tensor features, {_MAP}) -> Tensor",
    "avg_pool_backward": f"(Tensor grad_output, {_MAP}) -> Tensor",
    "global_max_pool": "(Tensor features, Tensor indices, SymInt batch_size) -> (Tensor, Tensor)",
    "global_avg_pool": "(Tensor features, Tensor indices, SymInt batch_size) -> Tensor",
    "global_avg_pool_backward": "(Tensor grad_output, Tensor indices, SymInt batch_size) -> Tensor",
    "export_rulebook": "(Tensor indices, SymInt[] spatial_shape, SymInt batch_size, str kind, SymInt[] kernel_size, "
                       "SymInt[] stride, SymInt[] padding, SymInt[] dilation, SymInt[] output_padding) "
                       "-> (Tensor, Tensor, Tensor, Tensor)",
    "export_pool": "(Tensor features, Tensor pair_input, Tensor pair_output, Tensor offset_counts, "
                   "Tensor out_indices, SymInt[] kernel_size, str mode) -> Tensor",
    "export_conv": "(Tensor features, Tensor weight, Tensor? bias, Tensor pair_input, Tensor pair_output, "
                   "Tensor offset_counts, Tensor out_indices, SymInt[] kernel_size, SymInt groups) -> Tensor",
}


def test_the_library_ops_keep_their_published_schemas():
    assert sorted(spec.name for spec in OPS + EXPORT_OPS) == sorted(PUBLISHED_SCHEMAS)
    for name, schema in PUBLISHED_SCHEMAS.items():
        assert str(getattr(torch.ops.sparsecore, name).default._schema) == f"sparsecore::{name}{schema}"
