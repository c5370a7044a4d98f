"""Counts how often a call path moves between the modules of a package (a test helper and a tool).

`module_transitions` runs a function under ``sys.setprofile`` and follows the
innermost frame that belongs to ``package`` (frames of other code, torch or the
core, are seen through): each time that frame's module changes, by a call or
by a return, is one transition; a transition into a module the path had
already left earlier is a return to it (``returns``). A layer whose forward
is owned by one module crosses few boundaries and returns to none it left.

Run as a script it prints the counts of one SubMConv3d forward::

    python tests/module_transitions.py
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Transitions:
    """The module path of one call.

    Attributes:
        path: the modules in the order the innermost package frame visited them
            (consecutive repeats collapsed).
        transitions: ``len(path) - 1``: module boundaries crossed.
        returns: transitions into a module already left earlier.
    """

    path: tuple[str, ...]
    transitions: int
    returns: int


def module_transitions(function: Callable[[], Any], package: str = "sparsecore.torch",
                       opaque: tuple[str, ...] = ()) -> Transitions:
    """Runs ``function()`` and counts the module transitions of its ``package`` frames.

    Args:
        function: what to run.
        package: whose modules count (others are seen through).
        opaque: modules counted as one box: from a call into one of them until that
            frame returns, every frame inside counts as that module (e.g. the op table,
            to count a layer's own path apart from an op's machinery).
    """
    prefix = package + "."
    stack: list[str] = []  # the package module of each live frame, or "" for other code
    path: list[str] = []

    def current() -> str:
        for module in reversed(stack):
            if module:
                return module
        return ""

    def note() -> None:
        module = current()
        if module and (not path or path[-1] != module):
            path.append(module)

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_globals.get("__name__", "")
            inside = next((module for module in reversed(stack) if module), "")
            if inside in opaque:
                name = inside
            stack.append(name if name == package or name.startswith(prefix) else "")
            note()
        elif event == "return" and stack:
            stack.pop()
            note()

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        function()
    finally:
        sys.setprofile(previous)
    seen: set[str] = set()
    returns = 0
    for before, module in zip(path, path[1:]):
        seen.add(before)
        returns += module in seen
    return Transitions(tuple(path), max(0, len(path) - 1), returns)


def _main() -> None:
    import torch

    import sparsecore.torch as st

    generator = torch.Generator().manual_seed(0)
    coordinates = torch.randint(0, 16, (400, 3), generator=generator)
    coordinates = torch.unique(coordinates, dim=0)
    indices = torch.cat([torch.zeros((coordinates.shape[0], 1), dtype=torch.int64), coordinates], 1).int()
    features = torch.randn(indices.shape[0], 8, generator=generator)
    layer = st.SubMConv3d(8, 8, 3)
    x = st.SparseConvTensor(features, indices, [16, 16, 16], 1)
    layer(x)  # first call: lazy imports and compilation out of the count
    fresh = st.SparseConvTensor(features, indices, [16, 16, 16], 1)  # made outside the count
    for name, opaque in (("SubMConv3d forward", ()),
                         ("SubMConv3d forward, the op as one box", ("sparsecore.torch._op_table",))):
        counted = module_transitions(lambda: layer(fresh), opaque=opaque)
        short = [module.rsplit(".", 1)[-1] for module in counted.path]
        print(f"{name}: {counted.transitions} module transitions, {counted.returns} returns to a module left; "
              f"path {' > '.join(short)}")


if __name__ == "__main__":
    _main()
