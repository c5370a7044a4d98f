"""PNG plots of the benchmark's rows: ``--plot PATH`` of ``cpu``, ``network`` and ``gpu``.

The plots read the same `Row` objects the text table and the JSON file are
made of (`load_rows` reads them back from such a JSON file), so nothing here
measures anything. matplotlib is imported only when a plot is drawn, with the
non-interactive Agg backend; it is part of the ``dev`` extra.

- `plot_cpu`: one horizontal bar pair per case and stage, sparsecore beside
  spconv where spconv was measured, with the ratio ``spconv / sparsecore``.
- `plot_network`: per scene and dtype, the whole network's forward and
  backward, and per layer the forward and backward times, sparsecore beside
  spconv wherever a row carries a spconv time.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

from sparsecore.benchmark.cases import Row

__all__ = ["load_rows", "title_from_header", "plot_cpu", "plot_network", "plot_rows"]

SPARSECORE_COLOR = "#1f77b4"
SPCONV_COLOR = "#ff7f0e"
_LAYER_CASE = re.compile(r"^(?P<prefix>.*?) ?(?P<layer>L\d\d .*)$")
_NETWORK_SUFFIX = " network"
_DPI = 100


def load_rows(path: str | Path) -> tuple[dict[str, str], list[Row]]:
    """The header and rows of a JSON file written by `report.write_json`.

    Args:
        path: the JSON file (``--json`` of any suite).

    Returns:
        The header lines and the rows, as the suite produced them.
    """
    from sparsecore.benchmark.network_suite import rows_from_json

    return rows_from_json(path)


def title_from_header(header: dict[str, str], heading: str) -> str:
    """A two-line figure title: what was run, then date, machine and versions.

    Args:
        header: the table's header lines (as printed above the table).
        heading: the first line.

    Returns:
        The title text.
    """
    spconv = header.get("spconv", "-")
    parts = [
        header.get("date", "")[:16].replace("T", " ") + (" UTC" if "date" in header else ""),
        header.get("cpu", ""),
        header.get("device", ""),
        f"numpy {header['numpy']}" if "numpy" in header else "",
        f"spconv {spconv.split(',')[0]}" if spconv and not spconv.startswith("not") else "spconv not compared",
        f"BLAS threads {header['blas threads']}" if "blas threads" in header else "",
    ]
    return heading + "\n" + " | ".join(part for part in parts if part)


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (imported here, on demand)."""
    try:
        import matplotlib
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise SystemExit("error: --plot needs matplotlib (pip install 'sparsecore-conv[dev]')") from error
    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def _value(milliseconds: float | None) -> float:
    return 0.0 if milliseconds is None else float(milliseconds)


def _bar_pairs(axes: Any, labels: Sequence[str], ours: Sequence[float | None],
               theirs: Sequence[float | None], horizontal: bool, annotate_ratio: bool) -> None:
    """Draws sparsecore's bars, and spconv's beside them when any were measured."""
    with_spconv = any(value is not None for value in theirs)
    width = 0.4 if with_spconv else 0.7
    positions = list(range(len(labels)))
    offset = width / 2 if with_spconv else 0.0
    bar = axes.barh if horizontal else axes.bar
    ours_positions = [position - offset for position in positions]
    bar(ours_positions, [_value(value) for value in ours], width, label="sparsecore", color=SPARSECORE_COLOR)
    if with_spconv:
        theirs_positions = [position + offset for position in positions]
        bar(theirs_positions, [_value(value) for value in theirs], width, label="spconv", color=SPCONV_COLOR)
    if horizontal:
        axes.set_yticks(positions)
        axes.set_yticklabels(labels, fontsize=8)
        axes.invert_yaxis()
        axes.set_xlabel("ms (lower is faster)")
        axes.grid(axis="x", alpha=0.3)
    else:
        axes.set_xticks(positions)
        axes.set_xticklabels(labels, fontsize=7, rotation=60, ha="right")
        axes.set_ylabel("ms")
        axes.grid(axis="y", alpha=0.3)
    axes.set_axisbelow(True)
    if annotate_ratio and with_spconv:
        for position, mine, peer in zip(positions, ours, theirs):
            if mine and peer is not None:
                top = max(_value(mine), _value(peer))
                text = f"{peer / mine:.2f}x"
                if horizontal:
                    axes.text(top, position, " " + text, va="center", fontsize=7)
                else:
                    axes.text(position, top, text, ha="center", va="bottom", fontsize=7)
        if not horizontal:
            axes.margins(y=0.3)
    axes.legend(fontsize=8, loc="best")


def plot_cpu(header: dict[str, str], rows: Sequence[Row], path: str | Path) -> Path:
    """Grouped bars of the ``cpu`` suite: per case and stage, sparsecore vs spconv.

    Args:
        header: the table's header lines.
        rows: the ``cpu`` rows (rulebook, forward, backward per layer; voxelize).
        path: the PNG to write (its directory is created).

    Returns:
        The path written.
    """
    pyplot = _pyplot()
    timed = [row for row in rows if row.sparsecore_ms is not None]
    labels = [f"{row.case}: {row.stage}" for row in timed]
    figure, axes = pyplot.subplots(figsize=(9, 1.2 + 0.42 * max(len(timed), 1)))
    _bar_pairs(axes, labels, [row.sparsecore_ms for row in timed], [row.spconv_ms for row in timed],
               horizontal=True, annotate_ratio=True)
    axes.margins(x=0.12)
    axes.set_title(title_from_header(header, "sparsecore cpu benchmark (ratio: spconv / sparsecore)"),
                   fontsize=9)
    return _save(pyplot, figure, path)


def _network_cases(rows: Sequence[Row]) -> dict[str, dict[str, list[Row]]]:
    """Groups the network rows by ``"<scene> <dtype>"``: their totals and their layers."""
    cases: dict[str, dict[str, list[Row]]] = {}
    for row in rows:
        if row.case.endswith(_NETWORK_SUFFIX):
            prefix = row.case[: -len(_NETWORK_SUFFIX)]
            cases.setdefault(prefix, {"totals": [], "layers": []})["totals"].append(row)
            continue
        match = _LAYER_CASE.match(row.case)
        if match and not row.case.startswith("memory"):
            cases.setdefault(match["prefix"], {"totals": [], "layers": []})["layers"].append(row)
    return cases


def _layer_series(layer_rows: Sequence[Row], stage: str, prefix: str) -> tuple[list[str], list[Row]]:
    chosen = [row for row in layer_rows if row.stage == stage]
    return [row.case[len(prefix):].strip() for row in chosen], chosen


def plot_network(header: dict[str, str], rows: Sequence[Row], path: str | Path) -> Path:
    """Per-layer forward and backward times of the ``network`` / ``gpu`` suites.

    One row of panels per scene and dtype: the network's totals (forward with
    its rulebook builds, backward; and any further spconv algorithm), then the
    forward and the backward time of every layer. spconv's bars appear
    wherever its time is in the rows (the suites time spconv for the whole
    network, not per layer).

    Args:
        header: the table's header lines.
        rows: the suite's rows.
        path: the PNG to write (its directory is created).

    Returns:
        The path written.
    """
    pyplot = _pyplot()
    cases = _network_cases(rows)
    if not cases:
        cases = {"(no network rows)": {"totals": [], "layers": []}}
    figure, grid = pyplot.subplots(len(cases), 3, squeeze=False, figsize=(15, 4.6 * len(cases)),
                                   gridspec_kw={"width_ratios": [1, 3, 3]})
    for axes_row, (prefix, parts) in zip(grid, cases.items()):
        totals = [row for row in parts["totals"] if row.sparsecore_ms is not None or row.spconv_ms is not None]
        _bar_pairs(axes_row[0], [row.stage for row in totals], [row.sparsecore_ms for row in totals],
                   [row.spconv_ms for row in totals], horizontal=False, annotate_ratio=True)
        axes_row[0].set_title(f"{prefix}: whole network", fontsize=9)
        for axes, stage in zip(axes_row[1:], ("forward", "backward")):
            labels, chosen = _layer_series(parts["layers"], stage, prefix)
            if chosen:
                _bar_pairs(axes, labels, [row.sparsecore_ms for row in chosen], [row.spconv_ms for row in chosen],
                           horizontal=False, annotate_ratio=False)
            else:
                axes.text(0.5, 0.5, "no per-layer rows (--no-layers)", ha="center", va="center",
                          transform=axes.transAxes)
            peer_note = "" if any(row.spconv_ms is not None for row in chosen) else "; spconv: whole network only"
            axes.set_title(f"{prefix}: {stage} per layer (instrumented run{peer_note})", fontsize=9)
    figure.suptitle(title_from_header(header, "sparsecore network benchmark (ratio: spconv / sparsecore)"),
                    fontsize=10)
    return _save(pyplot, figure, path)


def plot_rows(suite: str, header: dict[str, str], rows: Sequence[Row], path: str | Path) -> Path:
    """The plot of one suite's rows: `plot_cpu` for ``cpu``, else `plot_network`.

    Args:
        suite: ``"cpu"``, ``"network"`` or ``"gpu"``.
        header: the table's header lines.
        rows: the rows.
        path: the PNG to write.

    Returns:
        The path written.
    """
    plotter = plot_cpu if suite == "cpu" else plot_network
    return plotter(header, rows, path)


def _save(pyplot: Any, figure: Any, path: str | Path) -> Path:
    """Writes the figure as a PNG and closes it."""
    target = Path(path)
    if target.parent and not target.parent.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(target, format="png", dpi=_DPI)
    pyplot.close(figure)
    return target


if __name__ == "__main__":  # python -m sparsecore.benchmark.plots SUITE RESULTS.json OUT.png
    import sys

    if len(sys.argv) != 4:
        raise SystemExit("usage: python -m sparsecore.benchmark.plots {cpu,network,gpu} RESULTS.json OUT.png")
    loaded_header, loaded_rows = load_rows(sys.argv[2])
    print(plot_rows(sys.argv[1], loaded_header, loaded_rows, sys.argv[3]))
