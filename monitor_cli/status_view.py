"""What ``marduk monitor status`` and ``top`` show, as text.

Pure: a QueryReply and the time in, blocks (lines and grids) out; no I/O, no clock. So it is
tested at 1,000 replicas without a server. A grid renders two ways: a rich table on a terminal,
plain aligned lines in a pipe, because rich cuts cells to the console width (``def…``) and a
pipe must get every character.

At scale the summary comes first, one line per job; the per-worker rows come only when asked
for (a filter, ``--all``) or when there are few of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from marduk.wire.protocol import ControllerEvent, ControllerInfo, DeviceInfo, QueryReply, WorkerInfo

ELLIPSIS = "…"
WORKER_STATES = ("live", "stale")
DEVICE_STATES = ("failed", "degraded", "preempting", "healthy")
StateFilter = Literal["live", "stale", "failed", "degraded", "preempting", "healthy"]
# Above this many workers, status shows the summary and says how to list them.
DETAIL_LIMIT = 50
STATE_STYLE = {
    "failed": "red",
    "degraded": "yellow",
    "preempting": "magenta",
    "healthy": "green",
    "stale": "yellow",
}
# Controller events ``top`` keeps as recent failures and restarts.
RECENT_KINDS = frozenset(
    {
        "device_failed",
        "device_degraded",
        "device_preempting",
        "restart_issued",
        "fail_issued",
        "stop_issued",
        "unknown_device",
        "worker_stale",
        "worker_expired",
        "trainer_crashed",
        "trainer_hung",
        "trainer_gave_up",
        "trainer_preempted",
    }
)

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


def _clean(text: str) -> str:
    # A cell is one line: newlines or tabs in a reason would cut or shift the row.
    return " ".join(text.split()) if any(c in text for c in "\n\r\t") else text


# --- the summary ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobSummary:
    job: str
    replicas: int
    live: int
    stale: int
    devices: int
    unhealthy: int  # devices failed or degraded
    epoch: int  # the highest restart epoch of its scopes
    # The sum of its restart scopes' epochs (each replica once, or the job once with scope
    # job): every restart the controller issued raised one epoch by one. An upper bound:
    # after a controller restart epochs continue above a reserved block, so they can skip.
    restarts: int
    last_failure: str
    last_failure_at: float
    spares: int = 0  # live hot spares (a job whose ranks the controller assigns)


def summarize(reply: QueryReply) -> list[JobSummary]:
    """One summary per job, sorted by job name."""
    by_job: dict[str, list[WorkerInfo]] = {}
    for w in reply.workers:
        by_job.setdefault(w.job, []).append(w)
    devices_of_job: dict[str, list[DeviceInfo]] = {}
    for d in reply.devices:
        for job in {r.split("/", 1)[0] for r in d.replicas}:
            devices_of_job.setdefault(job, []).append(d)
    out = []
    for job in sorted(set(by_job) | set(devices_of_job)):
        workers = by_job.get(job, [])
        scopes: dict[str | None, int] = {}
        for w in workers:
            key = w.replica if w.scope == "replica" else None
            scopes[key] = max(scopes.get(key, 0), w.epoch)
        known = {d.device: d for d in devices_of_job.get(job, [])}
        names = {name for w in workers for name in w.devices} | set(known)
        unhealthy = [d for d in known.values() if d.state != "healthy"]
        when, what = _last_failure(workers, unhealthy)
        out.append(
            JobSummary(
                job=job,
                replicas=len({w.replica for w in workers}),
                live=sum(w.state == "live" for w in workers),
                stale=sum(w.state == "stale" for w in workers),
                devices=len(names),
                unhealthy=len(unhealthy),
                epoch=max(scopes.values(), default=0),
                restarts=sum(scopes.values()),
                last_failure=what,
                last_failure_at=when,
                spares=sum(w.part == "spare" and w.state == "live" for w in workers),
            )
        )
    return out


def _last_failure(
    workers: Iterable[WorkerInfo], devices: Iterable[DeviceInfo]
) -> tuple[float, str]:
    found: list[tuple[float, str]] = []
    for d in devices:
        reason = f": {d.reason}" if d.reason else ""
        found.append((d.since, f"device {abbreviate(d.device)} {d.state}{reason}"))
    for w in workers:
        if w.failure_class or w.status in ("crashed", "hung", "gave_up", "preempted"):
            what = w.status if w.status not in ("", "running") else "failed"
            cls = f" ({w.failure_class})" if w.failure_class else ""
            found.append((w.updated_at, f"{w.replica}/{w.worker} {what}{cls}"))
    if not found:
        return 0.0, ""
    return max(found, key=lambda f: f[0])


def summary_grid(summaries: Sequence[JobSummary], now: float) -> Grid:
    rows: list[tuple[Cell, ...]] = []
    for s in summaries:
        failure = "-"
        if s.last_failure:
            when = age(s.last_failure_at, now)
            failure = s.last_failure + (f", {when}" if s.last_failure_at else "")
        rows.append(
            (
                s.job,
                f"{s.replicas:,}",
                f"{s.live:,}" + (f" ({s.spares:,} spare)" if s.spares else ""),
                (f"{s.stale:,}", "yellow") if s.stale else "0",
                f"{s.devices:,}",
                (f"{s.unhealthy:,}", "red") if s.unhealthy else "0",
                f"{s.epoch:,}",
                f"{s.restarts:,}",
                _clean(failure),
            )
        )
    columns = ("job", "replicas", "live", "stale", "devices", "unhealthy", "epoch", "restarts")
    return Grid("jobs", (*columns, "last failure"), rows, right=frozenset(range(1, 8)), wrap=8)


# --- details -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Filters:
    """``status``'s detail filters (``--job`` is applied by the controller)."""

    replica: str | None = None
    state: StateFilter | None = None
    device: str | None = None
    host: str | None = None
    everything: bool = False  # --all: list every worker however many

    @property
    def narrowing(self) -> bool:
        return any(v is not None for v in (self.replica, self.state, self.device, self.host))


def select(reply: QueryReply, f: Filters) -> tuple[list[WorkerInfo], list[DeviceInfo]]:
    """The workers and devices that match ``f``: a device filter keeps the workers using the
    devices it matched; a worker filter keeps the devices those workers use."""
    workers = list(reply.workers)
    devices = list(reply.devices)
    if f.replica is not None:
        workers = [w for w in workers if w.replica == f.replica]
    if f.host is not None:
        workers = [w for w in workers if w.host == f.host]
    if f.state in WORKER_STATES:
        workers = [w for w in workers if w.state == f.state]
    if f.device is not None:
        device = f.device
        devices = [d for d in devices if matches_device(d.device, device)]
    if f.state in DEVICE_STATES:
        devices = [d for d in devices if d.state == f.state]
    if f.device is not None or f.state in DEVICE_STATES:
        names = {d.device for d in devices}
        workers = [w for w in workers if names.intersection(w.devices)]
    if f.replica is not None or f.host is not None or f.state in WORKER_STATES:
        used = {name for w in workers for name in w.devices}
        devices = [d for d in devices if d.device in used]
    return workers, devices


def workers_grid(workers: Sequence[WorkerInfo], now: float) -> Grid:
    rows: list[tuple[Cell, ...]] = []
    for w in workers:
        epoch = str(w.epoch) if w.applied_epoch >= w.epoch else f"{w.applied_epoch}->{w.epoch}"
        # A library-only worker sends no reports: it is registered, nothing more is known.
        status = (w.status or "registered") + (f" ({w.failure_class})" if w.failure_class else "")
        if w.part == "member":
            status += f", node {w.node_rank}"
        elif w.part:  # spare (runs nothing) or retired (told to exit 71)
            status = w.part
        rows.append(
            (
                w.job,
                w.replica,
                str(w.worker),
                w.host or "-",
                (w.state, STATE_STYLE["stale"]) if w.state == "stale" else w.state,
                age(w.last_seen, now),
                device_list(w.devices),
                w.scope,
                epoch,
                _clean(status),
                "-" if w.step is None else f"{w.step} ({age(w.step_at, now)})",
            )
        )
    columns = (
        "job",
        "replica",
        "worker",
        "host",
        "state",
        "seen",
        "devices",
        "scope",
        "epoch",
        "status",
        "step",
    )
    return Grid("workers", columns, rows, right=frozenset({2, 8}), wrap=9)


def devices_grid(devices: Sequence[DeviceInfo], now: float, title: str = "devices") -> Grid:
    rows: list[tuple[Cell, ...]] = []
    for d in devices:
        shown = d.replicas[:3]
        replicas = ",".join(shown) + (f" +{len(d.replicas) - 3}" if len(d.replicas) > 3 else "")
        rows.append(
            (
                d.device,  # in full: the one place to copy an id from
                (d.state, STATE_STYLE.get(d.state, "magenta")),
                age(d.since, now),
                str(d.failures),
                replicas or "-",
                _clean(d.reason) or "-",
            )
        )
    columns = ("device", "state", "since", "failures", "replicas", "reason")
    return Grid(title, columns, rows, right=frozenset({3}), wrap=5)


def controller_lines(reply: QueryReply, now: float) -> list[str]:
    c = reply.controller
    lines = [f"controller {_controller(c)}, v{c.version}, started {age(c.started_at, now)}"]
    if reply.standbys:
        lines.append("standbys: " + ", ".join(_controller(s, role=False) for s in reply.standbys))
    else:
        lines.append("standbys: none")
    return lines


def _controller(c: ControllerInfo, *, role: bool = True) -> str:
    where = f"pid {c.pid} on {c.host or '?'}"
    return (
        f"{c.controller_id} ({c.role}, term {c.term}, {where})"
        if role
        else (f"{c.controller_id} ({where})")
    )


def status_blocks(
    reply: QueryReply, f: Filters, now: float, *, limit: int = DETAIL_LIMIT
) -> list[Block]:
    """Everything ``marduk monitor status`` prints, in order."""
    blocks: list[Block] = [*controller_lines(reply, now)]
    n_workers, n_devices = len(reply.workers), len(reply.devices)
    if not n_workers and not n_devices:
        blocks.append("no worker has registered")
    else:
        blocks.append(
            f"{plural(len({(w.job, w.replica) for w in reply.workers}), 'replica')}, "
            f"{plural(n_workers, 'worker')}, {plural(n_devices, 'device')}"
        )
        blocks.append(summary_grid(summarize(reply), now))
    if f.narrowing or f.everything or n_workers <= limit:
        workers, devices = select(reply, f)
        if f.narrowing and not workers and not devices:
            blocks.append("nothing matches these filters")
        if workers:
            blocks.append(workers_grid(workers, now))
        if devices:
            blocks.append(devices_grid(devices, now))
    else:
        unhealthy = [d for d in reply.devices if d.state != "healthy"]
        if unhealthy and len(unhealthy) <= limit:
            blocks.append(devices_grid(unhealthy, now, title="devices not healthy"))
        elif unhealthy:
            blocks.append(
                f"{plural(len(unhealthy), 'device')} not healthy: --state failed or "
                "--state degraded lists them"
            )
        blocks.append(
            f"{plural(n_workers, 'worker')} are too many to list: narrow with --replica, "
            "--host, --device or --state (live, stale, failed, degraded, healthy), or list "
            "every one with --all; --json prints everything"
        )
    rejected = {k: v for k, v in reply.stats.items() if k.startswith("rejected.")}
    if rejected:
        blocks.append(
            "rejected messages: " + ", ".join(f"{k[9:]}={v}" for k, v in rejected.items())
        )
    return blocks


def current_failures(reply: QueryReply) -> list[ControllerEvent]:
    """The devices not healthy now, as the events that made them so (newest first): ``top``
    shows them before any new event arrives."""
    return [
        ControllerEvent(kind=f"device_{d.state}", ts=d.since, device=d.device, detail=d.reason)
        for d in sorted(reply.devices, key=lambda d: d.since, reverse=True)
        if d.state != "healthy"
    ]


def top_blocks(
    reply: QueryReply | None,
    recent: Sequence[ControllerEvent],
    now: float,
    *,
    problem: str = "",
) -> list[Block]:
    """``marduk monitor top``: the controller, the jobs, and recent failures and restarts."""
    blocks: list[Block] = []
    if reply is not None:
        blocks += controller_lines(reply, now)[:1]
        blocks.append(summary_grid(summarize(reply), now))
    if problem:
        blocks.append(problem)
    rows: list[tuple[Cell, ...]] = []
    for e in recent:
        where = "/".join(str(p) for p in (e.job, e.replica, e.worker) if p is not None)
        style = "red" if "fail" in e.kind or e.kind.startswith("trainer_") else "yellow"
        what = " ".join(
            p
            for p in (
                where,
                f"device {abbreviate(e.device)}" if e.device else "",
                f"epoch {e.epoch}" if e.epoch is not None and e.kind.endswith("_issued") else "",
                e.detail,
            )
            if p
        )
        rows.append((age(e.ts, now), (e.kind, style), _clean(what) or "-"))
    blocks.append(Grid("recent failures and restarts", ("when", "event", "what"), rows, wrap=2))
    return blocks


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
