"""Issue 28's device targets, judged on a benchmark table: one PASS / FAIL / NOT MEASURED line each.

The targets (measured only on a lent GPU, never estimated):

- spconv's basic and large networks, forward with rulebook builds and
  backward, float32 / float16 / TF32: sparsecore at least `SPEED_TARGET` times
  as fast as spconv's implicit-GEMM algorithm (MaskImplicitGemm) in the same
  process on the same card: the row's ``spconv ms / sparsecore ms``;
- the peak memory of a SubMConv3d 64->64 (rulebook, forward and backward)
  at most spconv's, for every spconv algorithm measured beside it;
- two runs bitwise equal (the benchmark's ``two runs bitwise equal`` rows).

`judge` is a pure function of the rows (`cases.Row`, as the ``network`` and
``gpu`` suites write them, or as read back from their JSON), so it is tested on
made-up tables. A target whose row is missing, failed or has no spconv time
is NOT MEASURED, which is not a pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from sparsecore.benchmark.cases import Row

__all__ = ["SPEED_TARGET", "SCENES", "DTYPES", "DIRECTIONS", "IMPLICIT_GEMM", "Verdict", "judge", "format_verdicts"]

SPEED_TARGET = 1.5
SCENES = ("basic", "large")
DTYPES = ("float32", "float16", "tf32")
DIRECTIONS = ("forward", "backward")
IMPLICIT_GEMM = "implicit_gemm"
_MEMORY_PREFIX = "memory SubMConv3d 64->64"
_MEMORY_STAGE = " peak MiB (not ms)"
_BITWISE_STAGE = "two runs bitwise equal"


@dataclass(frozen=True)
class Verdict:
    """One target's outcome.

    Attributes:
        target: what is required, in words.
        outcome: ``"PASS"``, ``"FAIL"`` or ``"NOT MEASURED"``.
        measured: the numbers it was judged on (or why there are none).
    """

    target: str
    outcome: str
    measured: str


def _speed_row(rows: Sequence[Row], case: str, direction: str) -> Row | None:
    """The row timing sparsecore against spconv's implicit GEMM for one case and direction."""
    for row in rows:
        if row.case == case and row.stage == f"{direction}, spconv {IMPLICIT_GEMM}":
            return row
    for row in rows:  # implicit GEMM as the first (main-row) algorithm
        if row.case == case and row.stage == direction and any(
                note.startswith(f"spconv {IMPLICIT_GEMM}") for note in row.notes):
            return row
    return None


def _speed_verdicts(rows: Sequence[Row]) -> list[Verdict]:
    verdicts = []
    for scene in SCENES:
        for dtype in DTYPES:
            for direction in DIRECTIONS:
                title = "forward with rulebook builds" if direction == "forward" else "backward"
                target = f"{scene} {dtype} {title}: >= {SPEED_TARGET:g}x spconv implicit GEMM"
                row = _speed_row(rows, f"{scene} {dtype} network", direction)
                if row is None or row.ratio is None:
                    failed = next((r for r in rows if r.case == f"{scene} {dtype} network" and r.stage == direction
                                   and r.agreement.startswith(("FAILED", "SKIPPED"))), None)
                    why = (f"{failed.agreement}: {'; '.join(failed.notes)}" if failed is not None
                           else "no row with both times")
                    verdicts.append(Verdict(target, "NOT MEASURED", why))
                    continue
                outcome = "PASS" if row.ratio >= SPEED_TARGET else "FAIL"
                measured = f"{row.ratio:.2f}x (sparsecore {row.sparsecore_ms:.3g} ms, spconv {row.spconv_ms:.3g} ms)"
                main = next((r for r in rows if r.case == row.case and r.stage == direction), row)
                if main.agreement.startswith("MISMATCH"):  # a fast wrong answer passes nothing
                    outcome, measured = "FAIL", f"{measured}; results differ from spconv's: {main.agreement}"
                verdicts.append(Verdict(target, outcome, measured))
    return verdicts


def _memory_verdicts(rows: Sequence[Row]) -> list[Verdict]:
    memory = [row for row in rows if row.case.startswith(_MEMORY_PREFIX) and _MEMORY_STAGE in row.stage]
    dtypes = sorted({row.stage.split(_MEMORY_STAGE)[0] for row in memory}, key=lambda name: (
        DTYPES.index(name) if name in DTYPES else len(DTYPES), name))
    if not dtypes:
        return [Verdict("SubMConv3d 64->64 peak memory <= spconv's", "NOT MEASURED", "no memory row")]
    verdicts = []
    for dtype in dtypes:
        mine = [row for row in memory if row.stage.split(_MEMORY_STAGE)[0] == dtype]
        target = f"SubMConv3d 64->64 {dtype} peak memory <= spconv's (every algorithm measured)"
        peers = [row for row in mine if row.sparsecore_ms is not None and row.spconv_ms is not None]
        if not peers:
            verdicts.append(Verdict(target, "NOT MEASURED", "; ".join(note for row in mine for note in row.notes
                                                                      if "failed" in note) or "no spconv peak"))
            continue
        worst = max(peers, key=lambda row: row.sparsecore_ms / row.spconv_ms)
        outcome = "PASS" if all(row.sparsecore_ms <= row.spconv_ms for row in peers) else "FAIL"
        spconv = ", ".join(f"{row.stage.split('spconv ')[-1] if 'spconv ' in row.stage else 'first algorithm'} "
                           f"{row.spconv_ms:.1f}" for row in peers)
        verdicts.append(Verdict(target, outcome, f"sparsecore {worst.sparsecore_ms:.1f} MiB; spconv {spconv} MiB"))
    return verdicts


def _bitwise_verdict(rows: Sequence[Row]) -> Verdict:
    checked = [row for row in rows if row.stage == _BITWISE_STAGE]
    target = "two runs bitwise equal (forward output, backward gradients)"
    if not checked:
        return Verdict(target, "NOT MEASURED", "no bitwise row")
    bad = [f"{row.case.removesuffix(' network')}: {row.agreement}" for row in checked if row.agreement != "ok"]
    cases = ", ".join(row.case.removesuffix(" network") for row in checked)
    if bad:
        return Verdict(target, "FAIL", "; ".join(bad))
    return Verdict(target, "PASS", f"{len(checked)} cases: {cases}")


def judge(rows: Sequence[Row]) -> list[Verdict]:
    """Every device target judged on the rows: 12 speed lines, one memory line per dtype, one bitwise line."""
    return _speed_verdicts(rows) + _memory_verdicts(rows) + [_bitwise_verdict(rows)]


def format_verdicts(verdicts: Sequence[Verdict]) -> str:
    """One line per verdict, and a count of each outcome."""
    width = max((len(verdict.target) for verdict in verdicts), default=0)
    lines = [f"{verdict.outcome:<12} {verdict.target:<{width}}  {verdict.measured}" for verdict in verdicts]
    counts = {outcome: sum(verdict.outcome == outcome for verdict in verdicts)
              for outcome in ("PASS", "FAIL", "NOT MEASURED")}
    lines.append("device targets: " + ", ".join(f"{count} {outcome}" for outcome, count in counts.items()))
    return "\n".join(lines) + "\n"
