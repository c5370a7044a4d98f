"""sparsecore.benchmark.device_targets: issue 28's device targets judged on made-up benchmark tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sparsecore.benchmark import report
from sparsecore.benchmark.cases import Row
from sparsecore.benchmark.cli import main
from sparsecore.benchmark.device_targets import DTYPES, SCENES, format_verdicts, judge

MEMORY = "memory SubMConv3d 64->64 basic (125562 voxels)"


def _speed_rows(sparsecore_ms: float, implicit_ms: float) -> list[Row]:
    """Every case's main rows (spconv native) and implicit-GEMM rows, as the gpu suite writes them."""
    rows = []
    for scene in SCENES:
        for dtype in DTYPES:
            case = f"{scene} {dtype} network"
            rows += [Row(case, "forward", sparsecore_ms, 3 * sparsecore_ms, "ok (rel 1e-7)", ["spconv native; ..."]),
                     Row(case, "backward", sparsecore_ms, 3 * sparsecore_ms, "ok"),
                     Row(case, "forward, spconv implicit_gemm", sparsecore_ms, implicit_ms),
                     Row(case, "backward, spconv implicit_gemm", sparsecore_ms, implicit_ms),
                     Row(case, "two runs bitwise equal", agreement="ok")]
    return rows


def _memory_rows(sparsecore_mib: float, native_mib: float, implicit_mib: float) -> list[Row]:
    return [Row(MEMORY, f"{dtype} peak MiB (not ms)", sparsecore_mib, native_mib) for dtype in ("float32", "float16")] \
        + [Row(MEMORY, f"{dtype} peak MiB (not ms), spconv implicit_gemm", sparsecore_mib, implicit_mib)
           for dtype in ("float32", "float16")]


def _by_target(rows: list[Row]) -> dict[str, tuple[str, str]]:
    return {verdict.target: (verdict.outcome, verdict.measured) for verdict in judge(rows)}


def test_every_target_passes_on_a_fast_small_deterministic_table() -> None:
    verdicts = judge(_speed_rows(4.0, 6.0) + _memory_rows(80.0, 88.6, 95.0))
    assert [verdict.outcome for verdict in verdicts] == ["PASS"] * 15
    assert len([verdict for verdict in verdicts if "spconv implicit GEMM" in verdict.target]) == 12
    assert verdicts[0].target == "basic float32 forward with rulebook builds: >= 1.5x spconv implicit GEMM"
    assert verdicts[0].measured == "1.50x (sparsecore 4 ms, spconv 6 ms)"
    assert verdicts[-1].measured.startswith("6 cases: basic float32, basic float16, basic tf32, large float32")


def test_speed_is_judged_against_implicit_gemm_not_native() -> None:
    outcomes = _by_target(_speed_rows(4.0, 5.9))  # native is 3x slower, implicit GEMM only 1.475x
    speed = {target: outcome for target, (outcome, _) in outcomes.items() if "implicit GEMM" in target}
    assert set(speed.values()) == {"FAIL"} and len(speed) == 12
    assert outcomes["large tf32 backward: >= 1.5x spconv implicit GEMM"] == (
        "FAIL", "1.48x (sparsecore 4 ms, spconv 5.9 ms)")


def test_implicit_gemm_as_the_main_algorithm_is_found_in_the_notes() -> None:
    rows = [Row("basic float16 network", "forward", 2.0, 3.2, "ok", ["spconv implicit_gemm; checked with ..."]),
            Row("basic float16 network", "backward", 2.0, 2.8, "ok")]
    outcomes = _by_target(rows)
    assert outcomes["basic float16 forward with rulebook builds: >= 1.5x spconv implicit GEMM"][0] == "PASS"
    # the backward row carries no note naming its algorithm: not taken for implicit GEMM
    assert outcomes["basic float16 backward: >= 1.5x spconv implicit GEMM"][0] == "NOT MEASURED"


def test_missing_failed_and_wrong_rows_do_not_pass() -> None:
    rows = _speed_rows(4.0, 8.0)
    rows = [row for row in rows if row.case != "large float16 network"]
    rows.append(Row("large float16 network", "forward", agreement="FAILED", notes=["sparsecore failed: boom"]))
    rows.append(Row("large float16 network", "backward", agreement="FAILED"))
    rows[0].agreement = "MISMATCH: outputs rel 3e-2"  # basic float32 forward: fast, but wrong
    outcomes = _by_target(rows)
    assert outcomes["large float16 forward with rulebook builds: >= 1.5x spconv implicit GEMM"] == (
        "NOT MEASURED", "FAILED: sparsecore failed: boom")
    outcome, measured = outcomes["basic float32 forward with rulebook builds: >= 1.5x spconv implicit GEMM"]
    assert outcome == "FAIL" and "results differ from spconv's: MISMATCH" in measured
    assert outcomes["basic float32 backward: >= 1.5x spconv implicit GEMM"][0] == "PASS"
    assert outcomes["SubMConv3d 64->64 peak memory <= spconv's"] == ("NOT MEASURED", "no memory row")


def test_memory_must_be_at_most_every_spconv_algorithm() -> None:
    outcomes = _by_target(_memory_rows(90.0, 88.6, 120.0))
    outcome, measured = outcomes["SubMConv3d 64->64 float32 peak memory <= spconv's (every algorithm measured)"]
    assert outcome == "FAIL"
    assert measured == "sparsecore 90.0 MiB; spconv first algorithm 88.6, implicit_gemm 120.0 MiB"
    no_spconv = [Row(MEMORY, "float32 peak MiB (not ms)", 90.0, None, notes=["spconv native failed: no GPU"])]
    assert _by_target(no_spconv)["SubMConv3d 64->64 float32 peak memory <= spconv's (every algorithm measured)"] \
        == ("NOT MEASURED", "spconv native failed: no GPU")


def test_a_bitwise_mismatch_fails_and_names_the_case() -> None:
    rows = _speed_rows(4.0, 8.0)
    next(row for row in rows if row.case == "large float16 network"
         and row.stage == "two runs bitwise equal").agreement = "MISMATCH: input gradient"
    outcome, measured = _by_target(rows)["two runs bitwise equal (forward output, backward gradients)"]
    assert (outcome, measured) == ("FAIL", "large float16: MISMATCH: input gradient")


def test_targets_command_reads_json_and_exits_by_outcome(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    report.write_json(good, {"device": "made up"}, _speed_rows(4.0, 8.0) + _memory_rows(50.0, 60.0, 70.0))
    assert main(["targets", str(good)]) == 0
    text = capsys.readouterr().out
    assert text.count("\nPASS ") + text.startswith("PASS ") == 15 and "device targets: 15 PASS, 0 FAIL" in text
    report.write_json(bad, {"device": "made up"}, _speed_rows(4.0, 5.0))
    assert main(["targets", str(bad)]) == 1
    assert json.loads(bad.read_text())["rows"][0]["case"] == "basic float32 network"
    assert "0 PASS" not in format_verdicts(judge(_speed_rows(4.0, 8.0)))
