"""``--plot`` of the benchmark: the PNGs are written from the rows the tables print.

No timing is asserted; the plots are only checked to exist as non-empty PNG
files. The command-line runs are the small synthetic scenes (seconds each).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sparsecore.benchmark.cases import Row

pytest.importorskip("matplotlib")

REPOSITORY = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run_benchmark(arguments: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparsecore.benchmark", *arguments], capture_output=True,
                          text=True, timeout=120, cwd=REPOSITORY)


def _assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.parametrize(
    "arguments",
    [
        ["network", "--device", "cpu", "--scale", "small"],
        ["cpu", "--synthetic", "--scale", "small", "--repeat", "1"],
    ],
    ids=["network", "cpu"],
)
def test_plot_option_writes_a_png(tmp_path: Path, arguments: list[str]) -> None:
    plot_path = tmp_path / "figures" / "tmp.png"  # a missing directory is created
    json_path = tmp_path / "rows.json"
    completed = _run_benchmark([*arguments, "--plot", str(plot_path), "--json", str(json_path)])
    assert completed.returncode == 0, completed.stdout + completed.stderr
    _assert_png(plot_path)

    from sparsecore.benchmark.plots import load_rows, plot_rows

    header, rows = load_rows(json_path)
    replot = tmp_path / "replot.png"
    plot_rows(arguments[0], header, rows, replot)
    _assert_png(replot)


def test_network_plot_of_several_cases_and_spconv_layer_times(tmp_path: Path) -> None:
    from sparsecore.benchmark.plots import plot_network

    rows = []
    for prefix in ("basic float32", "basic float16"):
        rows += [Row(f"{prefix} network", "forward", 10.0, 12.0), Row(f"{prefix} network", "backward", 20.0, None),
                 Row(f"{prefix} forward stages", "GEMM", 5.0)]
        for index in range(3):
            rows += [Row(f"{prefix} L{index:02d} SubMConv3d 64->64 [c0]", "forward", 1.0 + index, 2.0),
                     Row(f"{prefix} L{index:02d} SubMConv3d 64->64 [c0]", "backward", None)]
    path = plot_network({"date": "2026-12-02T00:00:00+00:00", "spconv": "not available"}, rows,
                        tmp_path / "network.png")
    _assert_png(path)


def test_matplotlib_is_imported_only_for_a_plot() -> None:
    code = ("import sys; import sparsecore.benchmark.cli, sparsecore.benchmark.plots, "
            "sparsecore.benchmark.network_command; print('matplotlib' in sys.modules)")
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                               cwd=REPOSITORY)
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.strip() == "False"
