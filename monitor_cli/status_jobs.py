"""The per-job lines of ``marduk monitor status`` and ``top``: one summary row per job, and for
jobs whose ranks the controller assigns (``--nnodes MIN:MAX``) their size against MIN:MAX, their
spares and their resizes (the controller's ``QueryReply.jobs``). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from marduk.wire.protocol import DeviceInfo, JobInfo, QueryReply, WorkerInfo
from monitor_cli.status_format import Cell, Grid, abbreviate, age, clean, in_state

# --- the summary ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class JobSummary:
    job: str
    replicas: int
    live: int
    stale: int
    devices: int
    unhealthy: int  # devices not usable: not healthy, or out of service (drained, quarantined)
    epoch: int  # the highest restart epoch of its scopes
    # The sum of its restart scopes' epochs (each replica once, or the job once with scope
    # job) less those that were a checkpoint command: every restart (or fail) the controller
    # issued raised one epoch by one. An upper bound: after a controller restart epochs
    # continue above a reserved block, so they can skip.
    restarts: int
    last_failure: str
    last_failure_at: float
    spares: int = 0  # live hot spares (a job whose ranks the controller assigns)
    joining: int = 0  # live free workers that will grow it


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
        restarts: dict[str | None, int] = {}
        for w in workers:
            key = w.replica if w.scope == "replica" else None
            scopes[key] = max(scopes.get(key, 0), w.epoch)
            restarts[key] = max(restarts.get(key, 0), w.epoch - w.checkpoints)
        known = {d.device: d for d in devices_of_job.get(job, [])}
        names = {name for w in workers for name in w.devices} | set(known)
        unhealthy = [d for d in known.values() if not in_state(d, "healthy")]
        when, what = _last_failure(workers, [d for d in unhealthy if d.state != "healthy"])
        out.append(
            JobSummary(
                job=job,
                replicas=len({w.replica for w in workers}),
                live=sum(w.state == "live" for w in workers),
                stale=sum(w.state == "stale" for w in workers),
                devices=len(names),
                unhealthy=len(unhealthy),
                epoch=max(scopes.values(), default=0),
                restarts=sum(restarts.values()),
                last_failure=what,
                last_failure_at=when,
                spares=sum(w.part == "spare" and w.state == "live" for w in workers),
                joining=sum(w.part == "joining" and w.state == "live" for w in workers),
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
                f"{s.live:,}" + _parts(s),
                (f"{s.stale:,}", "yellow") if s.stale else "0",
                f"{s.devices:,}",
                (f"{s.unhealthy:,}", "red") if s.unhealthy else "0",
                f"{s.epoch:,}",
                f"{s.restarts:,}",
                clean(failure),
            )
        )
    columns = ("job", "replicas", "live", "stale", "devices", "unusable", "epoch", "restarts")
    return Grid("jobs", (*columns, "last failure"), rows, right=frozenset(range(1, 8)), wrap=8)


def _parts(s: JobSummary) -> str:
    """`` (2 spare, 1 joining)``: the live workers that are not members, in a job that has them."""
    parts = [f"{n:,} {what}" for n, what in ((s.spares, "spare"), (s.joining, "joining")) if n]
    return f" ({', '.join(parts)})" if parts else ""


# --- jobs whose ranks the controller assigns -----------------------------------------------------

# A membership change as status names it (the controller's event kinds).
RESIZE_NAMES = {
    "membership_formed": "formed",
    "member_replaced": "swap",
    "job_shrunk": "shrink",
    "job_held": "held",
    "member_added": "grow",
}


def spares_cell(j: JobInfo) -> str:
    """``r9/0 free, r8/0 holding``; a count and the first of each when there are many."""
    parts = []
    held = (j.claimed, "claimed") if j.is_pool else (j.holding, "holding")
    for names, what in ((j.spares, "free"), held):
        if len(names) > 2:
            parts.append(f"{len(names)} {what} ({names[0]} +{len(names) - 1})")
        else:
            parts += [f"{n} {what}" for n in names]
    return ", ".join(parts) or "-"


def membership_grid(jobs: Sequence[JobInfo], now: float) -> Grid:
    """One row per job with a membership: members against MIN:MAX, the world size, the
    spares, the resize under way and the last one."""
    rows: list[tuple[Cell, ...]] = []
    for j in jobs:
        if j.is_pool:  # a pool of spares: runs nothing, only its spares
            rows.append((f"{j.job} (pool)", "-", "-", "-", spares_cell(j), "-", "-"))
            continue
        resize: Cell = "-"
        if j.resize:
            since = f" {age(j.resize_since, now)}" if j.resize_since else ""
            text = clean(f"{j.resize}{since}: {j.resize_detail}")
            resize = (text, "red" if j.resize == "held" else "yellow")
        last = "-"
        if j.last_resize:
            name = RESIZE_NAMES.get(j.last_resize, j.last_resize)
            last = clean(
                f"{name} at epoch {j.last_resize_epoch}, {age(j.last_resize_at, now)}: "
                f"{j.last_resize_detail}"
            )
        nodes = f"{j.nodes:,}"
        rows.append(
            (
                f"{j.job} (pool {j.pool})" if j.pool else j.job,
                (nodes, "red") if j.nodes < j.min_nodes else nodes,
                f"{j.min_nodes}:{j.max_nodes}",
                f"{j.world_size:,}",
                spares_cell(j),
                resize,
                last,
            )
        )
    columns = ("job", "nodes", "min:max", "world", "spares", "resize", "last resize")
    return Grid("membership", columns, rows, right=frozenset({1, 3}), wrap=6)
