"""What the controller shows of itself: gauges for /metrics and the log line of each event."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

from marduk.core.policy import Policy
from marduk.core.views import spares_by_job
from marduk.shell.metrics import gauge
from marduk.wire.protocol import ControllerEvent, JobInfo

log = logging.getLogger("marduk.controller")

_WARN_EVENTS = frozenset(
    {
        "unknown_device",
        "fail_issued",
        "worker_crashed",
        "worker_hung",
        "worker_gave_up",
        "worker_stale",
        "worker_expired",
        "duplicate_worker",
        "membership_too_large",
        "member_replaced",
        "job_shrunk",
        "job_held",
        "grow_abandoned",
        "spare_claimed",
        "spare_skipped",
        "command_oversized",
        "straggler_detected",
        "straggler_acted",
    }
)


def gauges(leading: bool, p: Policy, standbys: Callable[[], int]) -> Iterator[Metric]:
    """The gauges of a scrape: whether we lead and, if we do, what the policy ``p`` holds and
    how many ``standbys`` we heard from (asked only then)."""
    yield gauge("marduk_leader", "1 if this controller leads.", {"leader": float(leading)}, "role")
    if not leading:
        return
    workers = {"live": float(len(p.workers) - len(p.stale)), "stale": float(len(p.stale))}
    yield gauge("marduk_workers", "Registered workers, by state.", workers, "state")
    devices: Counter[str] = Counter({"healthy": 0, "degraded": 0, "failed": 0})
    for name in p.drmap.devices():
        rec = p.devices.get(name)
        devices[rec.state if rec else "healthy"] += 1
    yield gauge(
        "marduk_devices",
        "Devices in use, by health state.",
        {k: float(v) for k, v in devices.items()},
        "state",
    )
    spares = {job: float(n) for job, n in spares_by_job(p.fleet, time.time()).items()}
    yield gauge(
        "marduk_spares",
        "Live hot spares of jobs whose ranks the controller assigns.",
        spares,
        "job",
    )
    infos = p.job_infos(time.time())
    yield from job_gauges([j for j in infos if not j.is_pool])
    yield from pool_gauges([j for j in infos if j.is_pool])
    heard = float(standbys())
    yield gauge("marduk_standbys", "Hot standbys heard from.", {"all": heard}, "scope")


def job_gauges(jobs: list[JobInfo]) -> Iterator[Metric]:
    """Jobs whose ranks the controller assigns: size against MIN:MAX, spares, resizes."""

    def per_job(value: Callable[[JobInfo], float]) -> dict[str, float]:
        return {j.job: float(value(j)) for j in jobs}

    yield gauge("marduk_job_nodes", "Members in force.", per_job(lambda j: j.nodes), "job")
    yield gauge("marduk_job_nodes_min", "MIN (--nnodes).", per_job(lambda j: j.min_nodes), "job")
    yield gauge("marduk_job_nodes_max", "MAX (--nnodes).", per_job(lambda j: j.max_nodes), "job")
    yield gauge(
        "marduk_job_world_size", "Ranks in the membership.", per_job(lambda j: j.world_size), "job"
    )
    yield gauge(
        "marduk_spares_holding",
        "Spares holding a lost member's ranks.",
        per_job(lambda j: len(j.holding)),
        "job",
    )
    resizing = GaugeMetricFamily(
        "marduk_job_resize",
        "1 while a resize is under way, by phase (forming, held, joining, checkpoint, applying).",
        labels=["job", "phase"],
    )
    for j in jobs:
        if j.resize:
            resizing.add_metric([j.job, j.resize], 1.0)
    yield resizing
    yield gauge(
        "marduk_job_last_resize_timestamp_seconds",
        "When the job's membership last changed (Unix time, from its epoch record; 0: never).",
        per_job(lambda j: j.last_resize_at),
        "job",
    )


def pool_gauges(pools: list[JobInfo]) -> Iterator[Metric]:
    """Pools of spares (``--spare-pool``): free spares, and those claimed, by job."""
    free = {j.job: float(sum("(unusable" not in s for s in j.spares)) for j in pools}
    yield gauge("marduk_pool_spares_free", "Free, usable spares of each pool.", free, "pool")
    claimed = GaugeMetricFamily(
        "marduk_pool_spares_claimed",
        "Spares of each pool that a job claimed and still holds.",
        labels=["pool", "job"],
    )
    for j in pools:
        for job, n in Counter(c.rpartition(" by ")[2] for c in j.claimed).items():
            claimed.add_metric([j.job, job], float(n))
    yield claimed


def log_event(event: ControllerEvent, limited: Callable[[str, str, int], None]) -> None:
    where = "/".join(str(p) for p in (event.job, event.replica, event.worker) if p is not None)
    parts = [event.kind, where, event.device and f"device {event.device}"]
    if event.epoch is not None and event.kind.endswith("_issued"):
        parts.append(f"epoch {event.epoch}")
    line = " ".join(p for p in parts if p)
    if event.detail:
        line += f" - {event.detail}"
    level = logging.WARNING if event.kind in _WARN_EVENTS else logging.INFO
    if event.kind == "unknown_device":
        limited("unknown_device", line, level)
    else:
        # As fields too, for JSON logs: job, replica, worker, epoch, device, event.
        fields = {
            "event": event.kind,
            "job": event.job,
            "replica": event.replica,
            "worker": event.worker,
            "epoch": event.epoch,
            "device": event.device,
            "event_id": event.event_id or None,
        }
        log.log(level, "%s", line, extra={k: v for k, v in fields.items() if v is not None})
