"""sparsecore.torch.op_allowlist: every allowed operator resolves in torch and is pure by torch's own schema (no
argument written, not mutable, no RNG tag); the project's exports call only allowed operators; anything else is
refused naming the node, before torch reads the graph."""

from __future__ import annotations

import operator

import pytest

torch = pytest.importorskip("torch")

import sparsecore.torch  # noqa: E402,F401  (registers the sparsecore ops)
from sparsecore.torch.op_allowlist import ALLOWED, check_targets  # noqa: E402


def _resolve(target: str):
    if target.startswith("torch.ops."):
        _, _, namespace, name, overload = target.split(".")
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)
    module, name = target.split(".")
    assert module == "_operator"
    return getattr(operator, name)


@pytest.mark.parametrize("target", sorted(ALLOWED))
def test_every_allowed_operator_is_pure_by_its_schema(target: str) -> None:
    op = _resolve(target)
    if isinstance(op, torch._ops.OpOverload):
        schema = op._schema
        assert not schema.is_mutable, target
        assert not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments), target
        assert torch.Tag.nondeterministic_seeded not in op.tags, target
    else:
        assert op.__module__ == "_operator"


@pytest.mark.parametrize("target, reason", [
    ("torch.ops.aten.from_file.default", "reads or writes files"),
    ("torch.ops.aten.fill_.Scalar", "writes in place"),
    ("torch.ops.aten.add_.Tensor", "writes in place"),
    ("torch.ops.aten.add.out", "writes in place"),
    ("torch.ops.aten.bernoulli.default", "random number generator"),
    ("torch.ops.aten.save.default", "reads or writes files"),
    ("builtins.exec", "not one of the pure operators"),
])
def test_an_operator_outside_the_list_is_refused_naming_the_node(target: str, reason: str) -> None:
    nodes = [{"target": "torch.ops.aten.relu.default", "name": "relu", "inputs": []},
             {"target": target, "name": "hostile", "inputs": []}]
    with pytest.raises(ValueError, match=f"model.json: node 'hostile' calls '{target}', which .*{reason}"):
        check_targets("model.json", nodes)


def test_a_node_holding_a_subgraph_is_refused() -> None:
    node = {"target": "torch.ops.aten.relu.default", "name": "cond", "inputs": [
        {"name": "true_fn", "arg": {"as_graph": {"graph": {}}}}]}
    with pytest.raises(ValueError, match="node 'cond' .* holds a subgraph"):
        check_targets("model.json", [node])
    check_targets("model.json", [])  # an empty graph passes
