"""Text grid of a schedule: one row per rank, one column per time step or program slot.

Shared by `render` (pictures) and `validate` (error messages that point at a cell). The layout
follows the schedule printer of ``torch.distributed.pipelining``, transposed: rows are ranks.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

__all__ = ["IDLE", "format_grid"]

IDLE = "."
"""How an empty cell (an idle step or a ``None`` slot) is drawn."""


def format_grid(
    rows: Mapping[int, Sequence[object]],
    *,
    axis: str,
    marks: Collection[tuple[int, int]] = (),
    mark_rows: Collection[int] = (),
) -> str:
    """Draw ``rows`` (rank -> cells) as a grid with a header of column numbers.

    ``axis`` names the columns (``"step"`` for simulated time, ``"slot"`` for program order).
    A cell ``(rank, column)`` in ``marks`` is drawn with a leading ``!``, and a rank in
    ``mark_rows`` (or owning a marked cell) starts with ``>>``.
    """
    ranks = sorted(rows)
    num_columns = max((len(rows[rank]) for rank in ranks), default=0)
    texts = {rank: [IDLE if cell is None else str(cell) for cell in rows[rank]] for rank in ranks}
    width = max([len(str(num_columns - 1))] + [len(text) for rank in ranks for text in texts[rank]])
    flagged = set(mark_rows) | {rank for rank, _ in marks}
    labels = {rank: f"rank {rank}" for rank in ranks}
    label_width = max([len(axis)] + [len(label) for label in labels.values()])

    gutter = " " if marks else ""  # room for "!" only when something is marked
    header = "   " + axis.ljust(label_width) + "  "
    header += " ".join(gutter + str(column).ljust(width) for column in range(num_columns))
    lines = [header.rstrip()]
    for rank in ranks:
        cells = [
            ("!" if (rank, column) in marks else gutter) + text.ljust(width)
            for column, text in enumerate(texts[rank])
        ]
        prefix = ">> " if rank in flagged else "   "
        lines.append((prefix + labels[rank].ljust(label_width) + "  " + " ".join(cells)).rstrip())
    return "\n".join(lines)
