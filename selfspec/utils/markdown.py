"""Markdown tables: the one renderer behind every table selfspec writes (evaluation and sweep reports, step
costs, the training summary and comparison)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

LEFT, RIGHT = "---", "---:"


def cell(value: Any) -> str:
    """A value as one table cell: a pipe would split the cell and a newline would end the row."""
    return str(value).replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def table(header: Sequence[Any], rows: Sequence[Sequence[Any]], align: Sequence[str] | None = None) -> list[str]:
    """The lines of a table: header, alignment row (`---` left, `---:` right per column; default all left),
    one line per row."""
    align = list(align) if align is not None else [LEFT] * len(header)
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return lines
