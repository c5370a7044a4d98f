"""tools/capture_check.py without a GPU: it says so and exits 0, measuring nothing (never a CPU timing)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "capture_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("capture_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_measures_nothing_and_exits_cleanly(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    module = _module()
    if module.gpu_missing() is None:
        pytest.skip("a GPU is here: the check would measure")
    assert module.main(["--json", str(tmp_path / "out.json")]) == 0
    printed = capsys.readouterr().out
    assert "no GPU here" in printed and "nothing measured" in printed
    assert not (tmp_path / "out.json").exists()
