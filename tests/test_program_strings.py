"""sparsecore.torch.program_strings: what sympy's own srepr and torch's guard writer produce passes (sympy is the
oracle: each accepted expression sympifies back to itself), and every string that would run code, or hang sympy, is
refused naming where it is."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
sympy = pytest.importorskip("sympy")

from sparsecore.torch.program_strings import check_expression, check_guard, check_program_strings  # noqa: E402


def _expressions() -> list:
    from torch.utils._sympy.functions import FloorDiv, Mod

    s0, s1 = sympy.Symbol("s0", integer=True, positive=True), sympy.Symbol("u1", integer=True)
    return [s0, sympy.Integer(7), 2 * s0 + 1, FloorDiv(s0, 2) + s1, sympy.Max(s0, 3), sympy.Ge(s1, 0),
            sympy.Eq(Mod(s0, 4), 0), s0 ** 2, sympy.And(sympy.Ge(s0, 2), sympy.Le(s1, 10**6)),
            sympy.Rational(1, 3) * s0, sympy.oo, sympy.Float(1.5)]


@pytest.mark.parametrize("expression", _expressions(), ids=str)
def test_what_sympy_writes_passes_and_reads_back(expression) -> None:
    from torch.utils._sympy.functions import FloorDiv, Mod

    text = sympy.srepr(expression)
    check_expression(text, "e")
    assert sympy.sympify(text, locals={"FloorDiv": FloorDiv, "Mod": Mod}) == expression


@pytest.mark.parametrize("text", [
    "__import__('os').system('true')",
    "Symbol('s0').__class__",
    "(lambda: 1)()",
    "Pow(Integer(10), Integer(1000000000))",
    "Integer(99999999999999999999999999)",
    "Symbol('s0; import os')",
    "Symbol('s0', integer=exec)",
    "Symbol(\"s0\")",
    "Symbol('s0')\nimport os",
    "[x for x in ()]",
    "eval('1')",
])
def test_an_expression_that_could_run_code_or_hang_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="^where"):
        check_expression(text, "where")


def test_guards_torch_writes_pass_and_others_are_refused() -> None:
    for guard in ("L['x'].indices.size()[0] == L['x'].features.size()[0]", "L['x'].size()[1] == 4",
                  "L['y'] >= 2 and not math.isnan(L['z'])", "L['x'].size()[0] * 2 + 1 == L['y'].stride()[0]"):
        check_guard(guard, "g")
    for guard in ("__import__('os').system('true') is None", "L['x'].__class__", "L['x'].numpy()",
                  "L['x'].size(print)", "open('f')", "L[\"x\"] == 1", "L['x'] == 'a b'"):
        with pytest.raises(ValueError, match="^g"):
            check_guard(guard, "g")


def _document(**changes) -> dict:
    document = {"guards_code": [], "range_constraints": {"s0": {"min_val": 2, "max_val": None}}, "graph_module": {
        "module_call_graph": [{"fqn": "", "signature": {"forward_arg_names": ["x"]}}],
        "signature": {"input_specs": [{"user_input": {"arg": {"as_tensor": {"name": "x"}}}}]},
        "graph": {"inputs": [{"as_tensor": {"name": "x"}}], "nodes": [
            {"name": "relu", "target": "torch.ops.aten.relu.default",
             "inputs": [{"name": "self", "arg": {"as_tensor": {"name": "x"}}}], "outputs": [{"as_tensor": {
                 "name": "relu"}}]}],
            "sym_int_values": {"s": {"as_expr": {"expr_str": "Symbol('s0', integer=True)"}}}}}}
    for path, value in changes.items():
        target = document
        keys = path.split("/")
        for key in keys[:-1]:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[int(keys[-1]) if isinstance(target, list) else keys[-1]] = value
    return document


@pytest.mark.parametrize("path, value, message", [
    ("graph_module/graph/nodes/0/name", "relu; import os", "node 0 is named 'relu; import os', not an identifier"),
    ("graph_module/graph/inputs/0", {"as_string": "x'); import os; ('"}, "graph input 0 is .*tensors and symbolic"),
    ("graph_module/signature/input_specs/0", {"constant_input": {}}, "input spec 0 is of kind 'constant_input'"),
    ("graph_module/module_call_graph/0/signature/forward_arg_names", ["x=1"], "forward argument name 'x=1'"),
    ("range_constraints", {"u²": {}}, "range_constraints names the symbol 'u²'"),
    ("graph_module/graph/sym_int_values/s/as_expr/expr_str", "exec('1')", "sym_int_values.s.as_expr.expr_str"),
])
def test_a_program_document_is_refused_naming_the_string(path: str, value, message: str) -> None:
    check_program_strings("m.json", _document())  # the document as torch writes it passes
    with pytest.raises(ValueError, match=f"^m.json: .*{message}.*torch would run it as Python"):
        check_program_strings("m.json", _document(**{path: value}))
