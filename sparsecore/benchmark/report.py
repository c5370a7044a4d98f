"""The benchmark's output: a plain-text table with a header, and a JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from sparsecore.benchmark.cases import Row

__all__ = ["format_milliseconds", "format_table", "write_json"]

COLUMNS = ("case", "stage", "sparsecore ms", "spconv ms", "spconv/sparsecore", "agree", "notes")


def format_milliseconds(value: float | None) -> str:
    """A time in milliseconds with three significant digits, or ``-``."""
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def format_table(header: dict[str, str], rows: Sequence[Row]) -> str:
    """Renders the header lines and the rows as aligned text.

    Args:
        header: label-to-value lines printed above the table.
        rows: the table's rows.

    Returns:
        The text, ending in a newline.
    """
    label_width = max((len(label) for label in header), default=0)
    lines = [f"{label.ljust(label_width)} : {value}" for label, value in header.items()]
    cells = [
        (
            row.case,
            row.stage,
            format_milliseconds(row.sparsecore_ms),
            format_milliseconds(row.spconv_ms),
            "-" if row.ratio is None else f"{row.ratio:.2f}x",
            row.agreement,
            "; ".join(row.notes),
        )
        for row in rows
    ]
    widths = [max([len(title)] + [len(cell[column]) for cell in cells]) for column, title in enumerate(COLUMNS)]
    numeric = {2, 3, 4}

    def render(values: Sequence[str]) -> str:
        parts = [
            value.rjust(widths[column]) if column in numeric else value.ljust(widths[column])
            for column, value in enumerate(values)
        ]
        return "  ".join(parts).rstrip()

    lines.append("")
    lines.append(render(COLUMNS))
    lines.append(render(["-" * width for width in widths]))
    lines.extend(render(cell) for cell in cells)
    return "\n".join(lines) + "\n"


def write_json(path: str | Path, header: dict[str, str], rows: Sequence[Row]) -> None:
    """Writes the header and rows as JSON.

    Args:
        path: the file to write (its directory must exist).
        header: the table's header lines.
        rows: the table's rows.
    """
    document = {"header": dict(header), "rows": [row.as_dict() for row in rows]}
    Path(path).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
