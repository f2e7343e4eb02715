"""Grids and text for ``marduk monitor status`` and ``top``: the cell helpers (ages, plurals,
device ids shortened) and the two renderings of a grid, a rich table on a terminal and plain
aligned lines in a pipe (rich cuts cells to the console width, a pipe must get every character).
Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from marduk.wire.protocol import DeviceInfo

ELLIPSIS = "…"

if TYPE_CHECKING:
    from rich.console import RenderableType

Cell = str | tuple[str, str]  # text, or (text, rich style)


@dataclass(frozen=True)
class Grid:
    """A table: a title, column names and rows of cells (text, or text and a style)."""

    title: str
    columns: tuple[str, ...]
    rows: list[tuple[Cell, ...]] = field(default_factory=list)
    right: frozenset[int] = frozenset()  # columns aligned right (numbers)
    # The free-text column a terminal may fold onto several lines; the others stay whole.
    wrap: int | None = None

    def widths(self) -> list[int]:
        """Each column's natural width: its longest cell or its name."""
        table = [self.columns, *[tuple(_text(c) for c in row) for row in self.rows]]
        return [max(len(row[i]) for row in table) for i in range(len(self.columns))]


Block = str | Grid


# --- small formatting helpers --------------------------------------------------------------------


def plural(n: int, word: str, many: str = "") -> str:
    """``1 worker``, ``2 workers``, ``1,000 replicas``."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def abbreviate(device: str) -> str:
    """A long device id shortened, both ends kept: ``GPU-8e1a4c2b…8b31``; short ids unchanged.

    NVML UUIDs (``GPU-`` and 36 characters) share no structure worth more than the first group
    and the last digits, which is what an operator compares and types.
    """
    if len(device) <= 20:
        return device
    return f"{device[:12]}{ELLIPSIS}{device[-4:]}"


def matches_device(device: str, pattern: str) -> bool:
    """``--device``: the full id, a prefix of it, or its abbreviation as status shows it."""
    if ELLIPSIS in pattern:
        head, _, tail = pattern.partition(ELLIPSIS)
        return (
            len(device) >= len(head) + len(tail)
            and device.startswith(head)
            and device.endswith(tail)
        )
    return device.startswith(pattern)


def out_of_service(d: DeviceInfo) -> str:
    """``drained`` (an operator's ``marduk monitor drain``), ``quarantined`` (flapping: the
    controller's decision) or "" (in service). Whatever its health, such a device runs nothing."""
    return "drained" if d.drained else "quarantined" if d.quarantined else ""


def in_state(d: DeviceInfo, state: str) -> bool:
    """``--state``: ``drained`` and ``quarantined`` select devices out of service, ``healthy``
    only the healthy ones in service; the other states a device's health, in service or not."""
    if state in ("drained", "quarantined"):
        return out_of_service(d) == state
    return d.state == state and not (state == "healthy" and out_of_service(d))


def device_list(devices: Sequence[str]) -> str:
    """Devices of one worker: all of them when short, else the count and the first."""
    if not devices:
        return "-"
    short = [abbreviate(d) for d in devices]
    joined = ",".join(short)
    if len(joined) <= 24:
        return joined
    return f"{len(devices)}: {short[0]} +{len(devices) - 1}"


def age(t: float, now: float) -> str:
    """``12 s ago``, ``4 min ago``, ``3 h ago``, ``2 d ago``; ``-`` for never (0)."""
    if not t:
        return "-"
    d = max(0.0, now - t)
    if d < 60:
        return f"{int(d)} s ago"
    if d < 3600:
        return f"{int(d // 60)} min ago"
    if d < 86400:
        return f"{int(d // 3600)} h ago"
    return f"{int(d // 86400)} d ago"


def clean(text: str) -> str:
    # A cell is one line: newlines or tabs in a reason would cut or shift the row.
    return " ".join(text.split()) if any(c in text for c in "\n\r\t") else text


# --- rendering -----------------------------------------------------------------------------------


def _text(cell: Cell) -> str:
    return cell if isinstance(cell, str) else cell[0]


def plain_lines(blocks: Iterable[Block]) -> list[str]:
    """Blocks as plain lines for a pipe: aligned columns, every cell whole, nothing cut."""
    lines: list[str] = []
    for block in blocks:
        if isinstance(block, str):
            lines.append(block)
        elif not block.rows:
            lines.append(f"{block.title or 'rows'}: none")
        else:
            if block.title:
                lines.append(f"{block.title}:")
            lines += _aligned(block)
    return lines


def _aligned(grid: Grid) -> list[str]:
    widths = grid.widths()
    lines = []
    for row in [grid.columns, *[tuple(_text(c) for c in row) for row in grid.rows]]:
        cells = [
            cell.rjust(w) if i in grid.right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines


# A folded free-text column keeps at least this many characters a line.
_MIN_WRAP = 16


def rich_renderables(blocks: Iterable[Block], width: int) -> list[RenderableType]:
    """Blocks as rich renderables for a terminal ``width`` columns wide.

    No cell is ever cut: a table whose columns fit (its free-text column folded if need be) is
    drawn as a table; one that cannot fit is printed as plain aligned lines, which the terminal
    wraps whole.
    """
    from rich import box
    from rich.table import Table
    from rich.text import Text

    out: list[RenderableType] = []
    for block in blocks:
        if isinstance(block, str):
            out.append(Text(block))
            continue
        if not block.rows:
            out.append(Text(f"{block.title or 'rows'}: none"))
            continue
        widths = block.widths()
        if block.wrap is not None:
            widths[block.wrap] = min(widths[block.wrap], _MIN_WRAP)
        if sum(widths) + 2 * len(widths) > width:  # two spaces between columns
            out.append(
                Text("\n".join(([f"{block.title}:"] if block.title else []) + _aligned(block)))
            )
            continue
        table = Table(
            title=block.title or None,
            title_justify="left",
            box=box.SIMPLE_HEAD,
            show_edge=False,
            pad_edge=False,
            padding=(0, 1, 0, 0),
        )
        for i, name in enumerate(block.columns):
            folds = i == block.wrap
            table.add_column(
                name,
                justify="right" if i in block.right else "left",
                no_wrap=not folds,
                overflow="fold" if folds else "ellipsis",
                min_width=None if folds else widths[i],
            )
        for row in block.rows:
            table.add_row(*(Text(c) if isinstance(c, str) else Text(c[0], style=c[1]) for c in row))
        out.append(table)
    return out
