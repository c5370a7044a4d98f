"""The report of tools/host_operations.py: per-layer counts, the targets, comparisons and the printed tables.

Pure functions of a counts document (the JSON that ``host_operations.py --json`` writes: its
``counts`` records, one per pass, layer, stage and kind of operation, and its ``layers``); nothing
here runs the network. `tools/host_operations.py` re-exports them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from host_counting import OUTSIDE

__all__ = ["PASSES", "PASS_TITLES", "LayerCount", "layer_counts", "pass_counts", "stage_counts", "TargetResult",
           "target_results", "compare_documents", "format_report", "format_capacity"]

PASSES = ("forward", "backward")
PASS_TITLES = {"forward": "forward with rulebook builds", "backward": "backward"}


@dataclass(frozen=True)
class LayerCount:
    """One layer's operations in one pass (or the operations outside every layer: ``index`` None).

    Attributes:
        index: the layer's index, None for operations outside the layers.
        name: its label (``"L03 SubMConv3d 64->96 [c1]"``).
        kind: ``"subm"``, ``"maxpool"`` or ``""``.
        operations: host operations, reads included.
        launches: kernel launches.
        matmuls: backend GEMMs (cuBLAS calls on the GPU).
        reads: reads back to the host.
        per_stage: ``stage -> (operations, launches, matmuls, reads)``.
        kinds: ``kind -> operations``.
    """

    index: int | None
    name: str
    kind: str
    operations: int
    launches: int
    matmuls: int
    reads: int
    per_stage: dict[str, tuple[int, int, int, int]]
    kinds: dict[str, int]


def _summary(records: list[dict[str, Any]]) -> tuple[int, int, int, int]:
    by_kind = Counter()
    for record in records:
        by_kind[record["kind"]] += record["count"]
    return sum(by_kind.values()), by_kind["launch"], by_kind["matmul"], by_kind["read"]


def layer_counts(document: dict[str, Any], pass_name: str) -> list[LayerCount]:
    """Per layer of the network (in order), then the operations outside the layers, for one pass."""
    records = [record for record in document["counts"] if record["pass"] == pass_name]
    rows = []
    entries = [(layer["index"], layer["name"], layer["kind"]) for layer in document["layers"]]
    for index, name, kind in entries + [(None, OUTSIDE, "")]:
        mine = [record for record in records if record["layer"] == index]
        per_stage = {stage: _summary([record for record in mine if record["stage"] == stage])
                     for stage in sorted({record["stage"] for record in mine})}
        kinds = Counter()
        for record in mine:
            kinds[record["kind"]] += record["count"]
        operations, launches, matmuls, reads = _summary(mine)
        rows.append(LayerCount(index, name, kind, operations, launches, matmuls, reads, per_stage, dict(kinds)))
    return rows


def pass_counts(document: dict[str, Any], pass_name: str) -> tuple[int, int, int, int]:
    """``(host operations, launches, matmuls, reads)`` of a whole pass."""
    return _summary([record for record in document["counts"] if record["pass"] == pass_name])


def stage_counts(document: dict[str, Any], pass_name: str) -> dict[str, dict[str, int]]:
    """``stage -> kind -> operations`` of a whole pass."""
    stages: dict[str, Counter] = {}
    for record in document["counts"]:
        if record["pass"] == pass_name:
            stages.setdefault(record["stage"], Counter())[record["kind"]] += record["count"]
    return {stage: dict(kinds) for stage, kinds in sorted(stages.items())}


@dataclass(frozen=True)
class TargetResult:
    """One of issue 28's targets for the emulation, against the counts.

    Attributes:
        name: what is counted.
        value: the count (for a per-layer target: the worst layer's).
        limit: the target, e.g. ``"<= 200"``.
        met: whether the count meets it.
        detail: which layer, where it applies.
    """

    name: str
    value: int
    limit: str
    met: bool
    detail: str = ""


def target_results(document: dict[str, Any]) -> list[TargetResult]:
    """Issue 28's CPU-emulation targets evaluated on a document (no target is asserted here)."""
    results = []
    for pass_name, operations_limit, reads_limit in (("forward", 200, 6), ("backward", 100, 0)):
        operations, _, _, reads = pass_counts(document, pass_name)
        title = PASS_TITLES[pass_name]
        results.append(TargetResult(f"{title}: host operations", operations, f"<= {operations_limit}",
                                    operations <= operations_limit))
        results.append(TargetResult(f"{title}: reads back", reads, f"<= {reads_limit}", reads <= reads_limit))
    for entry in document.get("scratch", []):
        ratio = entry["scratch_bytes"] / max(entry["reference_bytes"], 1)
        what = "output" if entry["direction"] == "forward" else "input gradient"
        results.append(TargetResult(f"SubMConv3d {entry['channels']}->{entry['channels']} {entry['direction']}: "
                                    f"scratch beyond the results, % of the {what}", round(100 * ratio),
                                    "<= 25", ratio <= 0.25,
                                    f"{entry['scratch_bytes'] / 2**20:.1f} MiB beyond "
                                    f"{entry['result_bytes'] / 2**20:.1f} MiB of results"))
    for pass_name, field, limit, label in (("forward", 1, 1, "kernel launches"), ("forward", 2, 0, "cuBLAS calls"),
                                           ("backward", 1, 2, "kernel launches")):
        convs = [row for row in layer_counts(document, pass_name) if row.kind == "subm"]
        if not convs:
            continue
        values = [(row.per_stage.get("convolution", (0, 0, 0, 0))[field], row.name) for row in convs]
        worst, where = max(values)
        least = min(value for value, _ in values)
        if pass_name == "forward" and field == 1:
            met, limit_text = all(value == limit for value, _ in values), f"== {limit}"
        else:
            met, limit_text = worst <= limit, f"<= {limit}"
        results.append(TargetResult(f"per conv layer, {PASS_TITLES[pass_name].split(' with')[0]} convolution: "
                                    f"{label}", worst, limit_text, met,
                                    f"most {worst} ({where}), fewest {least}, over {len(convs)} layers"))
    return results


def compare_documents(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Where two documents' per-layer counts differ (host operations, launches, matmuls, reads per stage).

    Returns:
        One line per difference (empty when they agree), with the call sites
        whose counts differ in that layer and stage.
    """
    differences = []
    if [layer["name"] for layer in ours["layers"]] != [layer["name"] for layer in theirs["layers"]]:
        return [f"the networks differ: {len(ours['layers'])} layers vs {len(theirs['layers'])}"]
    names = ("host operations", "launches", "matmuls", "reads")
    for pass_name in PASSES:
        for mine, other in zip(layer_counts(ours, pass_name), layer_counts(theirs, pass_name)):
            for stage in sorted(set(mine.per_stage) | set(other.per_stage)):
                left = mine.per_stage.get(stage, (0, 0, 0, 0))
                right = other.per_stage.get(stage, (0, 0, 0, 0))
                if left == right:
                    continue
                changed = ", ".join(f"{name} {a} vs {b}" for name, a, b in zip(names, left, right) if a != b)
                differences.append(f"{pass_name} {mine.name} {stage}: {changed}")
                differences += [f"    {line}" for line in _site_differences(ours, theirs, pass_name, mine.index,
                                                                             stage)]
    return differences


def _site_differences(ours: dict[str, Any], theirs: dict[str, Any], pass_name: str, index: int | None,
                      stage: str) -> list[str]:
    def sites(document: dict[str, Any]) -> Counter:
        return Counter({record["site"]: record["count"] for record in document.get("call_sites", [])
                        if (record["pass"], record["layer"], record["stage"]) == (pass_name, index, stage)})

    mine, other = sites(ours), sites(theirs)
    return [f"{site}: {mine[site]} vs {other[site]}" for site in sorted(set(mine) | set(other))
            if mine[site] != other[site]][:12]


def format_report(document: dict[str, Any], sites: int = 0) -> str:
    """The per-layer table of both passes, the per-stage totals, the top call sites and the targets."""
    lines = [f"scene {document['scene']}: {document['sites']} sites; spconv's basic network "
             f"({sum(layer['kind'] == 'subm' for layer in document['layers'])} convolutions, "
             f"{sum(layer['kind'] == 'maxpool' for layer in document['layers'])} pools) on the "
             f"{'emulated kernel backend' if document['device'] == 'emulation' else 'GPU (CuPy)'}, "
             f"{document['mode']}; commit {document['commit']}; counted in {document['seconds']} s"]
    for pass_name in PASSES:
        operations, launches, matmuls, reads = pass_counts(document, pass_name)
        lines.append(f"{PASS_TITLES[pass_name]}: {operations} host operations ({launches} kernel launches, "
                     f"{matmuls} cuBLAS calls, {reads} reads back)")
        lines.append(f"  {'layer':<36} {'ops':>5} {'launch':>6} {'cuBLAS':>6} {'read':>4}   per stage "
                     "(ops/launches/cuBLAS/reads)")
        for row in layer_counts(document, pass_name):
            if row.index is None and row.operations == 0:
                continue
            stages = "  ".join(f"{stage} {'/'.join(str(value) for value in counts)}"
                               for stage, counts in row.per_stage.items())
            lines.append(f"  {row.name:<36} {row.operations:>5} {row.launches:>6} {row.matmuls:>6} "
                         f"{row.reads:>4}   {stages}")
        lines.append("  per stage:")
        for stage, kinds in stage_counts(document, pass_name).items():
            described = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
            lines.append(f"    {stage}: {sum(kinds.values())} ({described})")
        if sites:
            lines.append("  top call sites:")
            totals = Counter()
            for record in document.get("call_sites", []):
                if record["pass"] == pass_name:
                    totals[f"{record['stage']}: {record['site']}"] += record["count"]
            lines += [f"    {count:5d}  {site}" for site, count in totals.most_common(sites)]
    lines.append("issue 28's targets for the CPU emulation (a measurement here, not a test):")
    for result in target_results(document):
        detail = f"  [{result.detail}]" if result.detail else ""
        lines.append(f"  {'met    ' if result.met else 'NOT MET'}  {result.name}: {result.value} "
                     f"(target {result.limit}){detail}")
    return "\n".join(lines)


def format_capacity(document: dict[str, Any]) -> str:
    """The capacity section of a report: per pool its rows needed and allocated, and the memory ratio."""
    entries = document.get("capacity")
    if not entries:
        return ""
    lines = ["capacity mode: rows needed (exact mode) and allocated per pool, after one warm-up step"]
    lines += [f"  {entry['layer']:<36} {entry['needed']:>8} {entry['capacity']:>8}"
              for entry in entries if entry["needed"] != entry["capacity"] or "Pool" in entry["layer"]]
    exact = sum(entry["exact_bytes"] for entry in entries)
    allocated = sum(entry["capacity_bytes"] for entry in entries)
    lines.append(f"  layer outputs and tables: {allocated / 2**20:.2f} MiB in capacity mode vs {exact / 2**20:.2f} MiB "
                 f"exact: {allocated / max(exact, 1):.3f}x (target <= 1.5x)")
    return "\n".join(lines)
