"""tools/gpu_layer_times.py without a GPU: launches attributed to their pass, the side-by-side table and its
totals on made-up timings, the old kernels' name expressions, and the command's refusals."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.tool_modules import load_tool

ROOT = Path(__file__).resolve().parents[1]


times = load_tool("gpu_layer_times")


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
    if load_tool("gpu_kernel_report").gpu_visible():
        pytest.skip("a GPU is visible")
    assert times.main(["--scene", "synthetic"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err
    for arguments, message in ((["--dtypes", "bfloat16"], "--dtypes takes"), (["--repeats", "0"], "--repeats"),
                               (["--old-kernels", str(tmp_path)], "--old-kernels must be")):
        with pytest.raises(SystemExit):
            times.main(arguments)
        assert message in capsys.readouterr().err


class _HostMarker:
    """A host-clock stand-in for a CUDA event (the emulation runs each launch to its end)."""

    def record(self) -> None:
        import time

        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass


def test_every_pass_of_a_layer_is_timed_on_the_emulation() -> None:
    import numpy as np

    from sparsecore.backends.kernel_backend import KernelBackend
    from sparsecore.benchmark import scenes
    from tests.cuda_emulation import harness
    from tests.cuda_emulation.emulated_launcher import EmulatedLauncher

    if harness.compiler_path() is None:
        pytest.skip("the emulation needs g++")
    rng = np.random.default_rng(5)
    blob = np.unique(rng.integers(0, 4, size=(40, 3)) + 20, axis=0)
    sites = np.column_stack([np.zeros(len(blob), np.int64), blob]).astype(np.int32)
    scene = scenes.VoxelScene(np.ones((len(sites), 3), np.float32), sites, (64, 64, 64), 1, "one blob")
    launches: list[str] = []

    class Recording(EmulatedLauncher):
        def launch(self, expression: str, grid: int, block: int, args: tuple) -> None:
            launches.append(expression)
            super().launch(expression, grid, block, args)

    device = times.MeasureDevice(np, KernelBackend(np, Recording(), name="emulated"), _HostMarker,
                                 lambda start, stop: (stop.at - start.at) * 1e3)
    result = times.measure(scene, ("float32",), 1, device, layer_count=1, log=sys.stdout)
    assert set(result) == {("L00 SubMConv3d 3->64 [c0]", "float32", name) for name in times.PASSES}
    assert all(value["new"] > 0 and "old" not in value for value in result.values())
    # a warm-up and one timed run, each a forward launch and the backward's two; the map's row plan is built
    # once, by the warm-up's first pass, and kept
    features = [name for name in launches if name.startswith(("sc_implicit_gemm", "sc_weight_gradient"))]
    assert len(features) == 2 * 3 and sum("weight_gradient" in name for name in features) == 2
    assert [name for name in launches if name not in features] == ["sc_map_row_plan"]
