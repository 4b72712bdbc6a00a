"""Plain-text tables that fit a width (80 columns by default): figures right-aligned, labels
left, the widest label column shortened with an ellipsis when the table would not fit."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

WIDTH = 80


@dataclass(frozen=True)
class TextColumn:
    header: str
    left: bool = False  # labels left, figures right


def text_table(columns: Sequence[TextColumn], rows: Sequence[Sequence[str]], width: int = WIDTH,
               indent: int = 0) -> list[str]:
    """The lines of a table: a header line, then one line per row, columns one space apart.

    A left-aligned column is cut (its cells end in '…') by as much as the lines exceed
    ``width``, widest column first; figures are never cut."""
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"{len(row)} cells for {len(columns)} columns: {list(row)}")
    widths = [max([len(c.header), *(len(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    excess = indent + sum(widths) + len(columns) - 1 - width
    while excess > 0:
        labels = [i for i, c in enumerate(columns) if c.left and widths[i] > max(4, len(c.header))]
        if not labels:
            break
        widest = max(labels, key=lambda i: widths[i])
        widths[widest] -= 1
        excess -= 1

    def line(cells: Sequence[str]) -> str:
        out = []
        for cell, column, w in zip(cells, columns, widths):
            text = cell if len(cell) <= w else cell[: w - 1] + "…"
            out.append(text.ljust(w) if column.left else text.rjust(w))
        return (" " * indent + " ".join(out)).rstrip()

    return [line([c.header for c in columns]), *(line(r) for r in rows)]
