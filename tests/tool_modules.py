"""Loads a script of tools/ as a module for its tests (tools/ is no package; its scripts import each other)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def load_tool(name: str) -> Any:
    """``tools/<name>.py`` as the module ``name`` (loaded once; tools/ put on ``sys.path`` for its own imports)."""
    if name not in sys.modules:
        if str(TOOLS) not in sys.path:
            sys.path.insert(0, str(TOOLS))
        spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
