"""The strings of a ``.pt2`` graph that torch turns into code, held to grammars that cannot run anything.

Deserializing and running a ``torch.export`` program evaluates some of the
graph's strings as Python: every symbolic size (``"expr_str": "Symbol('s0',
integer=True)"``) goes through ``sympy.sympify``, which calls ``eval``;
``guards_code`` (``"L['x'].features.size()[1] == 4"``) is pasted into a function
that ``program.module()`` compiles with ``exec``; the forward's argument names
and a constant input's value are pasted into generated source too. A file can so
run any code at load or at its first call (torch 2.13). `check_program_strings`
reads the graph JSON before torch does and refuses, naming the string:

- an ``expr_str`` that is not a sympy ``srepr`` of integers, booleans and
  symbols: calls of the constructors in `SYMPY_CALLS` only, keyword assumptions
  with boolean values (or a Float's precision), integer literals below 2**63,
  symbol names that are identifiers, a Float's decimal digits, exponents of at
  most 64;
- a guard that is not a comparison of sizes: ``L[...]`` subscripts with
  identifier keys or ints, public attributes, ``.size()`` / ``.stride()`` /
  ``.dim()`` / ``.numel()`` / ``.storage_offset()`` calls, ``math.isnan`` /
  ``math.isinf``, numbers, arithmetic, comparisons, ``and`` / ``or`` / ``not``;
- a forward argument name, node name, tensor name or symbol name (of
  ``range_constraints``) that is not an identifier;
- a graph input that is not a tensor or a symbolic int (a constant string input
  would be pasted into the guards), or an input spec of another kind than a
  parameter, buffer, tensor constant or user input.
"""

from __future__ import annotations

import ast
import keyword
import re
from typing import Any, Iterator

__all__ = ["SYMPY_CALLS", "check_program_strings", "check_expression", "check_guard"]

#: The constructors a symbolic size's ``srepr`` may call (sympy's and torch.utils._sympy.functions').
SYMPY_CALLS = frozenset((
    "Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Pow", "Mod", "Max", "Min", "Abs", "floor", "ceiling",
    "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "Equality", "Unequality", "StrictLessThan", "StrictGreaterThan",
    "LessThan", "GreaterThan", "And", "Or", "Not", "Piecewise", "ExprCondPair",
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv",
    "LShift", "RShift", "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv", "TruncToFloat", "TruncToInt",
    "RoundToInt", "RoundDecimal", "ToFloat", "Identity", "IsNonOverlappingAndDenseIndicator",
))
_SYMPY_NAMES = frozenset(("oo", "zoo", "nan", "true", "false", "S"))
_POWERS = frozenset(("Pow", "PowByNatural", "FloatPow"))
_GUARD_METHODS = frozenset(("size", "stride", "dim", "numel", "storage_offset"))
_MATH = frozenset(("isnan", "isinf", "inf"))
_INPUT_KINDS = frozenset(("parameter", "buffer", "tensor_constant", "user_input"))
_USER_INPUTS = frozenset(("as_tensor", "as_sym_int"))
_NUMBER = re.compile(r"[-+]?[0-9]*\.?[0-9]+(e[-+]?[0-9]+)?")  # a Float's digits, as srepr writes them
_MAX_TEXT = 4096
_MAX_INT = 2**63


class _Refused(ValueError):
    pass


def _identifier(text: Any) -> bool:
    return isinstance(text, str) and text.isidentifier() and text.isascii() and not keyword.iskeyword(text)


def _parse(text: Any, what: str) -> ast.AST:
    if not isinstance(text, str) or len(text) > _MAX_TEXT or any(c in text for c in "\r\n\\\"\x00"):
        raise _Refused(f"{what} is not a one-line expression of at most {_MAX_TEXT} characters without quotes "
                       "or backslashes")
    try:
        return ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise _Refused(f"{what} is not a Python expression") from None


def _constant(node: ast.AST, what: str) -> None:
    value = node.value if isinstance(node, ast.Constant) else None
    if isinstance(node, ast.Constant) and (value is None or isinstance(value, (bool, float))
                                           or (isinstance(value, int) and abs(value) < _MAX_INT)
                                           or (isinstance(value, str) and (value == "" or _identifier(value)
                                                                           or _NUMBER.fullmatch(value)))):
        return
    raise _Refused(f"{what} holds {ast.unparse(node)[:80]!r}, which is not a small number, a boolean or a name")


def _sympy(node: ast.AST, what: str) -> None:
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in SYMPY_CALLS:
            raise _Refused(f"{what} calls {ast.unparse(node.func)[:80]!r}, not one of the sympy constructors a "
                           "symbolic size is written with")
        for keyword_argument in node.keywords:
            value = keyword_argument.value.value if isinstance(keyword_argument.value, ast.Constant) else None
            if not _identifier(keyword_argument.arg) or not (
                    isinstance(value, bool) or (isinstance(value, int) and abs(value) <= 4096)):
                raise _Refused(f"{what} passes {ast.unparse(keyword_argument)[:80]!r}; only assumptions such as "
                               "integer=True or a float's precision")
        if node.func.id in _POWERS and len(node.args) == 2:
            exponent = node.args[1]
            number = exponent.args[0] if isinstance(exponent, ast.Call) and exponent.args else exponent
            if isinstance(number, ast.Constant) and isinstance(number.value, int) and abs(number.value) > 64:
                raise _Refused(f"{what} raises to the power {number.value}; at most 64")
        for argument in node.args:
            _sympy(argument, what)
    elif isinstance(node, ast.Name):
        if node.id not in _SYMPY_NAMES:
            raise _Refused(f"{what} names {node.id!r}, which is not a sympy constant")
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        _constant(node.operand, what)
    else:
        _constant(node, what)


def check_expression(text: Any, what: str) -> None:
    """Refuses a symbolic-size string that is not a plain sympy ``srepr`` (module docstring).

    Raises:
        ValueError: naming ``what``.
    """
    _sympy(_parse(text, what), what)


def _guard(node: ast.AST, what: str) -> None:
    if isinstance(node, ast.Compare):
        for part in (node.left, *node.comparators):
            _guard(part, what)
    elif isinstance(node, ast.BoolOp):
        for part in node.values:
            _guard(part, what)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod)):
        _guard(node.left, what)
        _guard(node.right, what)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        _guard(node.operand, what)
    elif isinstance(node, ast.Subscript):
        _guard(node.value, what)
        _constant(node.slice, what)
    elif isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "math" and node.attr in _MATH:
            return
        if node.attr.startswith("_"):
            raise _Refused(f"{what} reads the private attribute {node.attr!r}")
        _guard(node.value, what)
    elif isinstance(node, ast.Call):
        func = node.func
        method = isinstance(func, ast.Attribute) and func.attr in _GUARD_METHODS and not node.args
        maths = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "math" \
            and func.attr in _MATH and len(node.args) == 1
        if not (method or maths) or node.keywords:
            raise _Refused(f"{what} calls {ast.unparse(func)[:80]!r}; a guard calls only "
                           f"{sorted(_GUARD_METHODS)} without arguments or math.isnan / math.isinf")
        _guard(func.value, what)
        for argument in node.args:
            _guard(argument, what)
    elif isinstance(node, ast.Name):
        if node.id not in ("L", "math"):
            raise _Refused(f"{what} names {node.id!r}; a guard reads the inputs through L[...] only")
    else:
        _constant(node, what)


def check_guard(text: Any, what: str) -> None:
    """Refuses a guard that is not a comparison of input sizes (module docstring).

    Raises:
        ValueError: naming ``what``.
    """
    _guard(_parse(text, what), what)


def _expressions(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                if key == "expr_str":
                    yield f"{where}.expr_str", child
                else:
                    stack.append((child, f"{where}.{key}"))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{index}]") for index, child in enumerate(item))


def _names(graph: dict) -> Iterator[tuple[str, Any]]:
    for position, node in enumerate(graph.get("nodes", [])):
        yield f"node {position}", node.get("name")
        for argument in node.get("inputs", []):
            yield f"node {node.get('name')!r} argument", argument.get("name")
        for output in node.get("outputs", []):
            tensor = output.get("as_tensor") if isinstance(output, dict) else None
            if isinstance(tensor, dict):
                yield f"node {node.get('name')!r} output", tensor.get("name")
    for position, entry in enumerate(graph.get("inputs", [])):
        if not isinstance(entry, dict) or len(entry) != 1 or next(iter(entry)) not in _USER_INPUTS:
            raise _Refused(f"graph input {position} is {str(entry)[:80]}; a program from elsewhere takes tensors "
                           "and symbolic ints only (a constant is pasted into generated code)")
        name = next(iter(entry.values()))
        yield f"graph input {position}", name.get("name") if isinstance(name, dict) else name


def check_program_strings(where: str, program: dict) -> None:
    """Checks every string of a ``models/model.json`` document that torch evaluates (module docstring).

    Args:
        where: the file and member, for the messages.
        program: the parsed JSON document.

    Raises:
        ValueError: naming the string (its path in the document) and what it may hold.
    """
    fix = ("torch would run it as Python; export the program again with sparsecore.torch, or load only files you "
           "trust with torch.export.load")
    try:
        for path, text in _expressions(program, "models/model.json"):
            check_expression(text, path)
        for index, text in enumerate(program.get("guards_code") or []):
            check_guard(text, f"guards_code[{index}] {str(text)[:120]!r}")
        module = program["graph_module"]
        for index, call in enumerate(module.get("module_call_graph") or []):
            for name in ((call.get("signature") or {}).get("forward_arg_names") or []):
                if not _identifier(name):
                    raise _Refused(f"module_call_graph[{index}] has the forward argument name {str(name)[:80]!r}, "
                                   "not an identifier")
        for position, spec in enumerate(module["signature"]["input_specs"]):
            kind = next(iter(spec)) if isinstance(spec, dict) and len(spec) == 1 else None
            if kind not in _INPUT_KINDS:
                raise _Refused(f"input spec {position} is of kind {kind!r}; expected one of {sorted(_INPUT_KINDS)}")
        for name in (program.get("range_constraints") or {}):
            if not _identifier(name):
                raise _Refused(f"range_constraints names the symbol {str(name)[:80]!r}, not an identifier")
        for what, name in _names(module["graph"]):
            if not _identifier(name):
                raise _Refused(f"{what} is named {str(name)[:80]!r}, not an identifier")
    except _Refused as error:
        raise ValueError(f"{where}: {error}; {fix}") from None
    except (KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{where}: is not laid out as torch.export.save writes it ({type(error).__name__}: "
                         f"{str(error)[:120]}); {fix}") from None
