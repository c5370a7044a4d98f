"""The house rules of docs/architecture.md, read from the source: no import cycles,
frontends use only public core modules, every library module under 400 lines.

The import graph is read with `ast` from every ``.py`` file the wheel installs
(imports inside functions included: a lazy import that breaks a cycle is still
a cycle of responsibilities). A module importing a package it lives in (its own
``__init__``) is not counted as an edge: package ``__init__`` files aggregate.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
# Installed package name -> the source folder it is installed from (setup.cfg package_dir).
PACKAGES = {
    "sparsecore": REPOSITORY / "sparsecore",
    "sparsecore.torch": REPOSITORY / "frontends" / "torch",
    "sparsecore.jax": REPOSITORY / "frontends" / "jax",
    "sparsecore.kernels_cu": REPOSITORY / "kernels_cu",
}
FRONTENDS = ("sparsecore.torch", "sparsecore.jax")
MAX_LINES = 400


def _library_modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _imported_names(name: str, path: Path) -> set[str]:
    """Every absolute module name an ``import`` statement anywhere in the file names."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package_parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package_parts[: len(package_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _import_graph() -> dict[str, set[str]]:
    modules = _library_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for imported in _imported_names(name, path):
            while imported and imported not in modules:  # `from pkg import function` -> pkg
                imported = imported.rpartition(".")[0]
            if imported and imported != name and not name.startswith(imported + "."):
                targets.add(imported)
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            advanced = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    advanced = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_the_cycle_finder_finds_a_planted_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_and_relative_imports() -> None:
    graph = _import_graph()
    # sparsecore/__init__.py imports its submodules with relative imports
    assert "sparsecore.rulebook" in graph["sparsecore"]
    assert len(graph) > 60


def test_no_import_cycles_among_library_modules() -> None:
    cycles = _cycles(_import_graph())
    assert cycles == [], "import cycles (each a responsibility in the wrong module): " + "; ".join(
        " <-> ".join(component) for component in cycles)


def test_frontends_import_no_private_core_module() -> None:
    offenders = []
    for module, targets in _import_graph().items():
        if not module.startswith(FRONTENDS):
            continue
        for target in targets:
            if target.startswith(FRONTENDS) or not target.startswith("sparsecore."):
                continue
            if any(part.startswith("_") for part in target.split(".")[1:]):
                offenders.append(f"{module} -> {target}")
    assert offenders == [], "frontends must use public core modules (sparsecore.interop): " + ", ".join(sorted(offenders))


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_every_library_module_is_under_the_size_limit(package: str) -> None:
    folder = PACKAGES[package]
    too_long = {
        str(path.relative_to(REPOSITORY)): count
        for path in sorted(folder.rglob("*.py"))
        if (count := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert too_long == {}, f"modules over {MAX_LINES} lines (split them by concern): {too_long}"
