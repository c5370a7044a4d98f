"""``--plot`` of the benchmark: the PNGs are written from the rows the tables print.

No timing is asserted; the plots are only checked to exist as non-empty PNG
files. The command line's ``--plot`` is run by the benchmarks' smoke runs
(tests/test_benchmark.py, tests/test_benchmark_network.py), which also replot
their JSON; here the plots are drawn from rows made in the test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sparsecore.benchmark import cases, report
from sparsecore.benchmark.cases import Row
from sparsecore.benchmark.network_suite import case_row_keys
from sparsecore.benchmark.plots import load_rows, plot_rows

pytest.importorskip("matplotlib")

REPOSITORY = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.parametrize("suite", ["cpu", "network"])
def test_rows_read_back_from_json_plot_as_a_png(tmp_path: Path, suite: str) -> None:
    """``load_rows`` reads what ``report.write_json`` wrote; ``plot_rows`` draws it (a missing folder is made).

    The command line's ``--plot`` and a replot of a real run's JSON are exercised by the smoke runs of
    tests/test_benchmark.py (cpu) and tests/test_benchmark_network.py (network).
    """
    if suite == "cpu":
        keys = cases.expected_row_keys()
    else:
        keys = case_row_keys("synthetic float32", ("native",), layers=True)
    rows = [Row(case, stage, 1.0 + index, None if index % 3 == 0 else 2.0 + index, "ok", [f"note {index}"])
            for index, (case, stage) in enumerate(keys)]
    header = {"date": "2026-12-05T00:00:00+00:00", "cpu": "test", "spconv": "compared"}
    json_path = tmp_path / "rows.json"
    report.write_json(json_path, header, rows)
    loaded_header, loaded = load_rows(json_path)
    assert loaded_header == header and [row.as_dict() for row in loaded] == [row.as_dict() for row in rows]
    _assert_png(plot_rows(suite, loaded_header, loaded, tmp_path / "figures" / f"{suite}.png"))


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
