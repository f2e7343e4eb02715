"""Views of the policy's state (its ``Fleet``) for queries (``marduk monitor status``) and
gauges: read-only, pure."""

from __future__ import annotations

from typing import Any

from marduk.core import grow as rule
from marduk.core.drmap import WorkerKey
from marduk.core.fleet import Fleet
from marduk.core.records import EpochKey
from marduk.wire.protocol import DeviceInfo, WorkerInfo

# --- views for queries -----------------------------------------------------------------------


def worker_infos(
    fleet: Fleet, job: str | None = None, now: float | None = None
) -> list[WorkerInfo]:
    """The workers (``job``: of that one only), sorted. With ``now``, a free worker that will
    grow its job has part "joining" (as ``JobInfo.joining`` lists it); without, "spare"."""
    grows: dict[str, set[WorkerKey]] = {}
    infos = []
    for key in sorted(fleet.workers):
        if job is not None and key.job != job:
            continue
        rec = fleet.workers[key]
        reg = rec.registration
        ekey = fleet.epoch_key_of(rec)
        scope = fleet.epochs.get(ekey)
        infos.append(
            WorkerInfo(
                job=reg.job,
                replica=reg.replica,
                worker=reg.worker,
                host=reg.host,
                state="stale" if key in fleet.stale else "live",
                last_seen=fleet.last_seen.get(key, 0.0),
                devices=sorted(reg.devices),
                scope=reg.scope,
                role=reg.role,
                pid=reg.pid,
                incarnation=reg.incarnation,
                applied_epoch=rec.applied_epoch,
                seen_epoch=reg.seen_epoch,
                epoch=fleet.epoch_of(ekey),
                checkpoints=scope.checkpoints if scope is not None else 0,
                registered_at=rec.registered_at,
                updated_at=rec.updated_at,
                **_report_fields(fleet, key),
                **_part(fleet, key, joining(fleet, key.job, now, grows)),
            )
        )
    return infos


def spares_by_job(fleet: Fleet, now: float) -> dict[str, int]:
    """Live hot spares per job (``marduk_spares``): only workers that brought a rendezvous,
    not those that will grow their job."""
    out: dict[str, int] = {}
    grows: dict[str, set[WorkerKey]] = {}
    for key, rec in fleet.workers.items():
        live = rec.registration.rendezvous is not None and key not in fleet.stale
        if live and _part(fleet, key, joining(fleet, key.job, now, grows)).get("part") == "spare":
            out[key.job] = out.get(key.job, 0) + 1
    return out


def joining(
    fleet: Fleet, job: str, now: float | None, memo: dict[str, set[WorkerKey]] | None = None
) -> set[WorkerKey]:
    """The free workers that will grow ``job`` (``JobInfo.joining``): live, usable, not
    --spare, of the members' shape, while the job has a membership below MAX. Empty without
    ``now``. ``memo`` keeps each job's answer for a caller asking worker by worker."""
    if now is None:
        return set()
    if memo is not None and job in memo:
        return memo[job]
    state = fleet.epochs.get(EpochKey(job, None))
    m = state.membership if state is not None else None
    grows: set[WorkerKey] = set()
    if m is not None and len(m.members) < fleet.nnodes(job)[1]:
        grows = {c.key for c in rule.free_workers(m, job, fleet.usable(job, now))}
    if memo is not None:
        memo[job] = grows
    return grows


def _part(fleet: Fleet, key: WorkerKey, grows: set[WorkerKey]) -> dict[str, Any]:
    """Member (at which node rank), joining (will grow the job), spare, retired, or unhealthy
    (its node failed its checks before a start: why), in a job with a membership."""
    rec = fleet.workers[key]
    if rec.registration.rendezvous is None:
        return {}
    if rec.retired:
        return {"part": "retired"}
    if unhealthy := rec.registration.rendezvous.unhealthy:
        return {"part": "unhealthy", "unhealthy": unhealthy}  # no rank, no spare (unfit)
    state = fleet.epochs.get(fleet.epoch_key_of(rec))
    m = state.membership if state is not None else None
    me = m.member(key.replica, key.worker) if m is not None else None
    spare = rec.registration.rendezvous.spare
    if me is not None:
        return {"part": "member", "node_rank": me.node_rank, "spare": spare}
    if key in grows:
        return {"part": "joining", "spare": spare}
    return {"part": "spare" if m is not None or spare else "", "spare": spare}


def _report_fields(fleet: Fleet, key: WorkerKey) -> dict[str, Any]:
    r = fleet.reports.get(key)
    if r is None:
        return {}
    return {
        "status": r.status,
        "step": r.step,
        "step_at": r.step_at,
        "failure_class": r.failure_class,
        "timeouts": r.timeouts,
    }


def device_infos(fleet: Fleet, job: str | None = None) -> list[DeviceInfo]:
    names = set(fleet.drmap.devices()) | set(fleet.devices)
    infos = []
    for name in sorted(names):
        replicas = sorted(
            str(r) for r in fleet.drmap.replicas_for_device(name) if job is None or r.job == job
        )
        if job is not None and not replicas:
            continue
        rec = fleet.devices.get(name)
        domains = (
            fleet.workers[w].registration.nvlink_domain
            for w in fleet.drmap.workers_for_device(name)
            if w in fleet.workers
        )
        domain = next((d for d in domains if d), "")
        infos.append(
            DeviceInfo(
                device=name,
                state=rec.state if rec else "healthy",
                reason=rec.reason if rec else "",
                since=rec.since if rec else 0.0,
                failures=len(rec.failures) if rec else 0,
                replicas=replicas,
                quarantined=rec.quarantined if rec else False,
                drained=rec.drained if rec else False,
                out_reason=rec.out_reason if rec else "",
                nvlink_domain=domain,
            )
        )
    return infos
