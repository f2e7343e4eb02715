"""What ``marduk monitor status`` and ``top`` show, as text.

Pure: a QueryReply and the time in, blocks (lines and grids) out; no I/O, no clock. So it is
tested at 1,000 replicas without a server. A grid renders two ways (monitor_cli/status_format.py):
a rich table on a terminal, plain aligned lines in a pipe.

At scale the summary comes first, one line per job (monitor_cli/status_jobs.py, with the
membership of jobs whose ranks the controller assigns); the per-worker rows come only when
asked for (a filter, ``--all``) or when there are few of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from marduk.wire.protocol import (
    ControllerEvent,
    ControllerInfo,
    DeviceInfo,
    EventKind,
    QueryReply,
    WorkerInfo,
)
from monitor_cli.status_format import (
    ELLIPSIS,
    Block,
    Cell,
    Grid,
    abbreviate,
    age,
    clean,
    device_list,
    in_state,
    matches_device,
    out_of_service,
    plain_lines,
    plural,
    rich_renderables,
)
from monitor_cli.status_jobs import (
    JobSummary,
    membership_grid,
    spares_cell,
    summarize,
    summary_grid,
)

__all__ = [
    "DETAIL_LIMIT",
    "ELLIPSIS",
    "Block",
    "Cell",
    "Filters",
    "Grid",
    "JobSummary",
    "StateFilter",
    "abbreviate",
    "age",
    "current_failures",
    "device_list",
    "in_state",
    "matches_device",
    "membership_grid",
    "out_of_service",
    "plain_lines",
    "plural",
    "rich_renderables",
    "select",
    "spares_cell",
    "status_blocks",
    "summarize",
    "top_blocks",
]

WORKER_STATES = ("live", "stale")
# A device's health, then out of service (``marduk monitor drain``, or quarantined for flapping):
# ``healthy`` selects only devices in service.
DEVICE_STATES = ("failed", "degraded", "preempting", "healthy", "drained", "quarantined")
StateFilter = Literal[
    "live", "stale", "failed", "degraded", "preempting", "healthy", "drained", "quarantined"
]
# Above this many workers, status shows the summary and says how to list them.
DETAIL_LIMIT = 50
STATE_STYLE = {
    "failed": "red",
    "degraded": "yellow",
    "preempting": "magenta",
    "healthy": "green",
    "stale": "yellow",
    "drained": "red",
    "quarantined": "red",
}
# Controller events ``top`` keeps as recent failures and restarts.
RECENT_KINDS = frozenset(
    {
        "device_failed",
        "device_degraded",
        "device_preempting",
        "device_drained",
        "device_quarantined",
        "straggler_detected",
        "straggler_acted",
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
) | {  # membership changes: swap, shrink, held, grow (jobs whose ranks the controller assigns)
    k for k in get_args(EventKind) if k.startswith(("member_", "job_", "grow_"))
}


# --- details -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Filters:
    """``status``'s detail filters. ``--job`` is applied by the controller: ``job`` and where it
    came from (``job_source``: "--job" or "from MARDUK_JOB") only head the output."""

    replica: str | None = None
    state: StateFilter | None = None
    device: str | None = None
    host: str | None = None
    everything: bool = False  # --all: list every worker however many
    job: str | None = None
    job_source: str = ""

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
        devices = [d for d in devices if in_state(d, f.state)]
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
            status += f", node {w.node_rank}" + (" (spare, holding)" if w.spare else "")
        elif w.part == "unhealthy":  # its node failed its checks: why
            status = f"unhealthy: {w.unhealthy}"
        elif w.part:  # joining (will grow the job), spare (runs nothing) or retired (exit 71)
            status = w.part
        if w.timeouts:  # learned by its agent (--hang-timeout auto)
            status += f"; {w.timeouts}"
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
                clean(status),
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
        out = out_of_service(d)
        # Out of service: that first (its health after, when not healthy), and why it is out.
        state = (out if d.state == "healthy" else f"{d.state}, {out}") if out else d.state
        reason = d.out_reason if out else d.reason
        rows.append(
            (
                d.device,  # in full: the one place to copy an id from
                (state, STATE_STYLE.get(out or d.state, "magenta")),
                age(d.since, now),
                str(d.failures),
                replicas or "-",
                clean(reason) or "-",
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


def job_line(job: str | None, source: str) -> list[str]:
    """``job: lin (from MARDUK_JOB)``: the job filter in effect, if any (say it: a variable
    left set in the shell would hide every other job without a word)."""
    return [f"job: {job} ({source})" if source else f"job: {job}"] if job is not None else []


def nothing_registered(job: str | None, elsewhere: tuple[int, int] | None) -> str:
    """No worker in the answer: none at all, or none of ``job`` (``elsewhere``: the workers and
    jobs the whole map has, when asked)."""
    if job is None:
        return "no worker has registered"
    line = f"no worker of job {job} has registered"
    if elsewhere is None:
        return line
    workers, jobs = elsewhere
    if not workers:
        return line + " (nor has any other worker)"
    return line + f" ({plural(workers, 'worker')} in {plural(jobs, 'other job')})"


def status_blocks(
    reply: QueryReply,
    f: Filters,
    now: float,
    *,
    limit: int = DETAIL_LIMIT,
    elsewhere: tuple[int, int] | None = None,
) -> list[Block]:
    """Everything ``marduk monitor status`` prints, in order. ``elsewhere``: with a job filter
    that matched nothing, the workers and jobs of the whole map."""
    blocks: list[Block] = [*controller_lines(reply, now), *job_line(f.job, f.job_source)]
    n_workers, n_devices = len(reply.workers), len(reply.devices)
    if not n_workers and not n_devices:
        blocks.append(nothing_registered(f.job, elsewhere))
    else:
        blocks.append(
            f"{plural(len({(w.job, w.replica) for w in reply.workers}), 'replica')}, "
            f"{plural(n_workers, 'worker')}, {plural(n_devices, 'device')}"
        )
        blocks.append(summary_grid(summarize(reply), now))
    if reply.jobs:
        blocks.append(membership_grid(reply.jobs, now))
    if f.narrowing or f.everything or n_workers <= limit:
        workers, devices = select(reply, f)
        if f.narrowing and not workers and not devices:
            blocks.append("nothing matches these filters")
        if workers:
            blocks.append(workers_grid(workers, now))
        if devices:
            blocks.append(devices_grid(devices, now))
    else:
        unusable = [d for d in reply.devices if not in_state(d, "healthy")]
        if unusable and len(unusable) <= limit:
            blocks.append(
                devices_grid(unusable, now, title="devices not healthy or out of service")
            )
        elif unusable:
            blocks.append(
                f"{plural(len(unusable), 'device')} not healthy or out of service: --state "
                "failed, degraded, preempting, drained or quarantined lists them"
            )
        blocks.append(
            f"{plural(n_workers, 'worker')} are too many to list: narrow with --replica, "
            f"--host, --device or --state ({', '.join(WORKER_STATES + DEVICE_STATES)}), or "
            "list every one with --all; --json prints everything"
        )
    rejected = {k: v for k, v in reply.stats.items() if k.startswith("rejected.")}
    if rejected:
        blocks.append(
            "rejected messages: " + ", ".join(f"{k[9:]}={v}" for k, v in rejected.items())
        )
    return blocks


def current_failures(reply: QueryReply) -> list[ControllerEvent]:
    """The devices not healthy or out of service now, as the events that made them so (newest
    first): ``top`` shows them before any new event arrives."""
    return [
        ControllerEvent(
            kind=f"device_{out_of_service(d) or d.state}",
            ts=d.since,
            device=d.device,
            detail=d.out_reason if out_of_service(d) else d.reason,
        )
        for d in sorted(reply.devices, key=lambda d: d.since, reverse=True)
        if not in_state(d, "healthy")
    ]


def top_blocks(
    reply: QueryReply | None,
    recent: Sequence[ControllerEvent],
    now: float,
    *,
    problem: str = "",
    job: str | None = None,
    job_source: str = "",
    perf: Sequence[Block] = (),
) -> list[Block]:
    """``marduk monitor top``: the controller, the jobs, their performance (``perf``: the
    blocks of monitor_cli/perf_view.py), and recent failures and restarts (``job``: the job
    filter in effect, and where it came from)."""
    blocks: list[Block] = []
    if reply is not None:
        blocks += controller_lines(reply, now)[:1]
        blocks += job_line(job, job_source)
        blocks.append(summary_grid(summarize(reply), now))
        if reply.jobs:
            blocks.append(membership_grid(reply.jobs, now))
        blocks += perf
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
        rows.append((age(e.ts, now), (e.kind, style), clean(what) or "-"))
    blocks.append(Grid("recent failures and restarts", ("when", "event", "what"), rows, wrap=2))
    return blocks
