"""tools/gpu_layer_times.py without a GPU: launches attributed to their pass, the side-by-side table and its
totals on made-up timings, the old kernels' name expressions, and the command's refusals."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> Any:
    if name not in sys.modules:
        sys.path.insert(0, str(ROOT / "tools"))
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


times = _load("gpu_layer_times")


def test_launches_go_to_their_pass() -> None:
    assert times.pass_of("sc_implicit_gemm<__half, sc::Wmma>", "forward") == "forward"
    assert times.pass_of("sc_implicit_gemm<__half, sc::Wmma>", "backward") == "input gradient"
    assert times.pass_of("sc_weight_gradient<float, sc::Simt>", "backward") == "weight gradient"


def test_the_table_puts_measured_beside_modelled() -> None:
    timing = times.PassTiming
    rows = [timing("L01 SubMConv3d 64->64 [c0]", "float16", "forward", 0.5, 2.0, 0.25, 1.0),
            timing("L01 SubMConv3d 64->64 [c0]", "float16", "input gradient", 0.6, None, 0.3, 1.5),
            timing("L01 SubMConv3d 64->64 [c0]", "float16", "weight gradient", 0.8, 4.0, None, 2.0),
            timing("L03 SubMConv3d 64->96 [c1]", "float16", "forward", 1.5, 3.0, 1.0, 3.0)]
    text = times.format_times(rows)
    lines = text.splitlines()
    first = next(line for line in lines if line.startswith("L01") and " fwd " in line)
    assert re.search(r"0\.500 +0\.250 +2\.00 \| +2\.000 +1\.000 +2\.00 \| +4\.00$", first), first
    dgrad = next(line for line in lines if " dgrad " in line)
    assert dgrad.endswith("| " + "-".rjust(7)) and " - " in dgrad  # no old time: no ratio
    total = next(line for line in lines if line.startswith("total forward"))
    assert re.search(r"2\.000 +1\.250 +1\.60 \| +5\.000 +4\.000 +1\.25 \| +2\.50$", total), total
    weight_total = next(line for line in lines if line.startswith("total weight gradient"))
    assert re.search(r"0\.800 +- +- \|", weight_total), weight_total  # an estimate is missing: no total
    assert "== float16" in text


def test_the_old_kernels_are_issue_28s_ten_instantiations() -> None:
    assert len(times.OLD_EXPRESSIONS) == 10
    assert "sc_implicit_gemm<__half, sc::Wmma>" in times.OLD_EXPRESSIONS
    assert "sc_weight_gradient<double, sc::Simt>" in times.OLD_EXPRESSIONS


def test_without_a_gpu_it_says_so(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    if times._gpu_visible():
        pytest.skip("a GPU is visible")
    assert times.main(["--scene", "synthetic"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
    for arguments, message in ((["--dtypes", "bfloat16"], "--dtypes takes"), (["--repeats", "0"], "--repeats"),
                               (["--old-kernels", str(tmp_path)], "--old-kernels must be")):
        with pytest.raises(SystemExit):
            times.main(arguments)
        assert message in capsys.readouterr().err
