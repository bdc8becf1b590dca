"""Plain-text tables and number formatting for the command line."""

from __future__ import annotations

import json
from typing import Any, Sequence


def format_number(value: Any) -> str:
    """Numbers as a person reads them: floats to 4 significant digits, ints and text as they are."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A left-aligned text table with a header rule."""
    cells = [[format_number(value) for value in row] for row in rows]
    widths = [max([len(header)] + [len(row[i]) for row in cells]) for i, header in enumerate(headers)]
    lines = ["  ".join(header.ljust(width) for header, width in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * width for width in widths))
    lines.extend("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells)
    return "\n".join(lines)


def print_json(payload: Any) -> None:
    """One JSON document on one line (the last line a script reads)."""
    print(json.dumps(payload, sort_keys=True), flush=True)
