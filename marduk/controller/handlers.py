"""The controller's handlers: each decoded request asks the policy, commits, and replies.

See docs/architecture.md, *The controller*.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
from prometheus_client import CollectorRegistry, Histogram

from marduk.controller.commit import Commit, NotServing
from marduk.controller.context import Context, Route
from marduk.core.decisions import Outcome
from marduk.core.drmap import WorkerKey
from marduk.core.paging import ENVELOPE_BYTES, SnapshotCache
from marduk.core.policy import Policy, PolicyError
from marduk.errors import ProtocolError
from marduk.shell.metrics import histogram
from marduk.wire.protocol import (
    MAX_MESSAGE_BYTES,
    Ack,
    AckReply,
    ControllerEvent,
    ControllerInfo,
    DeregisterReply,
    Deregistration,
    DeviceHealth,
    Drain,
    DrainReply,
    Forget,
    ForgetReply,
    HealthReply,
    JobParams,
    Member,
    MemberOut,
    Membership,
    Query,
    QueryReply,
    RegisterReply,
    Registration,
    Report,
    ReportReply,
    WorkerRef,
    WorkloadReply,
    WorkloadRequest,
)

log = logging.getLogger("marduk.controller")


@dataclass(slots=True)
class HealthDecided:
    """A health event decided: the reply, and its commit on its way out. ``started``: when its
    decision began (``perf_counter``), for the notice latency; None if it sent no command."""

    reply: HealthReply
    commit: Commit
    started: float | None
    latency: Histogram

    async def committed(self) -> None:
        """Back once the decision's commands are out (timed) and its records are durable."""
        await self.commit.published
        if self.started is not None:
            self.latency.observe(time.perf_counter() - self.started)
        await self.commit.durable


class Handlers:
    """One method per request kind (and health events): ask the policy, commit, reply.

    Handed the policy of the term (``policy``: a takeover makes a new one), the pipeline's
    ``submit`` (a reply waits for its commit's ``durable``), ``announce`` for an event outside
    any commit, the standbys heard from and the controller's ``info`` (for queries), and the
    registry of its latency histogram."""

    def __init__(
        self,
        ctx: Context,
        *,
        policy: Callable[[], Policy],
        submit: Callable[[Outcome], Commit],
        announce: Callable[[ControllerEvent], Awaitable[None]],
        standbys: Callable[[], list[ControllerInfo]],
        info: Callable[[], ControllerInfo],
        registry: CollectorRegistry,
        params_for: Callable[[str, str, int, Callable[[], int]], Awaitable[JobParams | None]]
        | None = None,
        more_routes: Callable[[], list[Route]] = list,
    ) -> None:
        self._ctx = ctx
        self._policy = policy
        self._submit = submit
        self._announce = announce
        self._standbys = standbys
        self._info = info
        self._params_for = params_for  # the job's live parameters, for a registration's reply
        self._more_routes = more_routes  # the parameters desk's endpoints
        self._snapshots = SnapshotCache()
        self._notice_latency = histogram(
            registry,
            "marduk_event_to_command_seconds",
            "From a health event's delivery to its commands being published.",
        )

    def routes(self) -> list[Route]:
        """The micro endpoints; the agents' are concurrent (they come in storms)."""
        s, h = self._ctx.subjects, self
        return [
            Route("register", s.any_job("register"), Registration, h.register, True),
            Route("deregister", s.any_job("deregister"), Deregistration, h.deregister, True),
            Route("ack", s.any_job("ack"), Ack, h.ack, True),
            Route("report", s.any_job("report"), Report, h.report, True),
            Route("request", s.any_job("request"), WorkloadRequest, h.workload_request, True),
            Route("query", s.query, Query, h.query, False),
            Route("forget", s.forget, Forget, h.forget, False),
            Route("drain", s.drain, Drain, h.drain, False),
            *self._more_routes(),
        ]

    def _check_subject_job(self, job: str, subject: str) -> None:
        if self._ctx.subjects.job_of(subject) != job:
            raise ProtocolError("subject_mismatch", f"message for job {job!r} sent on {subject}")

    async def register(self, reg: Registration, subject: str) -> RegisterReply:
        self._check_subject_job(reg.job, subject)
        try:
            result = self._policy().register(reg, time.time())
        except PolicyError as e:
            if e.code in ("duplicate_worker", "membership_too_large"):
                # Who was refused: the worker's identity, for watchers and alerts (a worker
                # refused for its job's size exits: only its own log would say why).
                await self._announce(
                    ControllerEvent(
                        kind="duplicate_worker"
                        if e.code == "duplicate_worker"
                        else "membership_too_large",
                        ts=time.time(),
                        job=reg.job,
                        replica=reg.replica,
                        worker=reg.worker,
                        detail=str(e),
                    )
                )
            raise
        await self._submit(result.outcome).durable
        params = None
        if self._params_for is not None and result.claimed_by is None:
            command = result.command

            def room() -> int:  # what the reply leaves the parameters (asked only if large)
                used = len(msgspec.json.encode(command)) if command is not None else 0
                return MAX_MESSAGE_BYTES - 2048 - used

            params = await self._params_for(reg.job, reg.replica, reg.worker, room)
        return RegisterReply(
            job=reg.job,
            replica=reg.replica,
            worker=reg.worker,
            outcome=result.result,  # type: ignore[arg-type]
            epoch=result.epoch,
            command=result.command,
            renew_interval=result.renew_interval,
            unusable_devices=result.unusable,
            claimed_by=result.claimed_by,
            params=params,
        )

    async def deregister(self, req: Deregistration, subject: str) -> DeregisterReply:
        self._check_subject_job(req.job, subject)
        key = WorkerKey(req.job, req.replica, req.worker)
        outcome, known = self._policy().deregister(key, req.reason, time.time())
        await self._submit(outcome).durable
        return DeregisterReply(known=known)

    async def ack(self, ack: Ack, subject: str) -> AckReply:
        self._check_subject_job(ack.job, subject)
        key = WorkerKey(ack.job, ack.replica, ack.worker)
        outcome = self._policy().ack(
            key, ack.epoch, time.time(), devices=ack.devices, revision=ack.revision
        )
        await self._submit(outcome).durable
        return AckReply(epoch=self._policy().epoch_of_worker(key))

    async def report(self, report: Report, subject: str) -> ReportReply:
        self._check_subject_job(report.job, subject)
        result = self._policy().on_report(report, time.time())
        self._ctx.stats[f"reports.{report.status}"] += 1
        if any(not a.coalesced for a in result.actions):
            what = report.failure_class or "unclassified"
            self.count_bounded("restarts", f"{report.status}/{what}")
        await self._submit(result.outcome).durable
        return ReportReply(actions=result.actions)

    async def workload_request(self, req: WorkloadRequest, subject: str) -> WorkloadReply:
        """A trainer's request, relayed by its agent (marduk/core/workload_requests.py)."""
        self._check_subject_job(req.job, subject)
        result = self._policy().on_workload_request(req, time.time())
        self._ctx.stats[f"requests.{req.kind}"] += 1
        await self._submit(result.outcome).durable
        log.warning(
            "%s/%s/%d asks %s: %s", req.job, req.replica, req.worker, req.kind, result.detail
        )
        return WorkloadReply(
            kind=req.kind, detail=result.detail, devices=result.devices, actions=result.actions
        )

    async def forget(self, req: Forget, subject: str) -> ForgetReply:
        outcome = self._policy().forget(req.job, req.replica, req.worker, time.time())
        await self._submit(outcome).durable
        return ForgetReply(removed=[str(k) for k in outcome.deleted_workers])

    async def drain(self, req: Drain, subject: str) -> DrainReply:
        # The memberships before, to say which member each restart took out and who took its
        # ranks (an operator's request: the scan over the scopes costs nothing that matters).
        policy = self._policy()
        before = {
            ekey.job: state.membership
            for ekey, state in policy.fleet.epochs.items()
            if ekey.replica is None and state.membership is not None
        }
        result = policy.drain(req.devices, req.host, req.undrain, req.reason, time.time())
        await self._submit(result.outcome).durable
        for conflict in result.conflicts:
            log.warning("drain --host %s: conflicting claim: %s", req.host, conflict)
        return DrainReply(
            devices=result.devices,
            actions=result.actions,
            conflicts=result.conflicts,
            members_out=members_out(before, result.outcome),
        )

    def decide_health(self, event: DeviceHealth) -> HealthDecided:
        """Decide a health event and queue its commit, without yielding: called in delivery
        order, the decisions (and their commands) keep it."""
        now = time.time()
        if not event.timestamp:
            event.timestamp = now
        t0 = time.perf_counter()
        result = self._policy().on_health(event, now)
        reply, stats = result.reply, self._ctx.stats
        if reply.duplicate:
            stats["health.duplicates"] += 1
        elif not reply.known:
            stats["health.unknown_device"] += 1
        else:
            stats[f"events.{event.state}"] += 1
            self.count_source(event.source)
            for action in reply.actions:
                if action.coalesced:
                    stats["health.coalesced"] += 1
                else:
                    stats[f"restarts.device/{action.kind}"] += 1
        commit = self._submit(result.outcome)
        started = t0 if result.outcome.commands else None
        return HealthDecided(reply, commit, started, self._notice_latency)

    def count_source(self, source: str) -> None:
        self.count_bounded("sources", source or "unknown")

    def count_bounded(self, family: str, label: str, limit: int = 100) -> None:
        """Count under a label chosen by a peer: at most ``limit`` labels, then "other"."""
        key, stats = f"{family}.{label[:100]}", self._ctx.stats
        if key not in stats and sum(k.startswith(family + ".") for k in stats) >= limit:
            key = f"{family}.other"
        stats[key] += 1

    async def query(self, query: Query, subject: str) -> QueryReply:
        """Answer a query, one page at a time: every reply fits the server's max payload.

        The jobs and the counters describe the whole answer: they come with the page at
        offset 0 only, and that page's budget counts them."""
        now, wall = time.monotonic(), time.time()
        standbys = self._standbys()
        job, policy = query.job, self._policy()
        snap = self._snapshots.get(
            query.snapshot,
            now,
            lambda: (
                # With the time: a worker that will grow its job shows as joining.
                policy.worker_infos(job, wall) if query.what == "map" else [],
                policy.device_infos(job) if query.what in ("map", "devices") else [],
                policy.job_infos(wall, job) if query.what == "map" else [],
            ),
        )
        first = min(query.offset, len(snap.sizes)) == 0
        stats = dict(self._ctx.stats) if first else {}
        budget = _max_payload(self._ctx) - ENVELOPE_BYTES
        page, next_offset = snap.page(query.offset, budget - len(msgspec.json.encode(stats)))
        self._ctx.stats["queries.pages"] += 1
        return QueryReply(
            controller=self._info(),
            standbys=standbys,
            stats=stats,
            jobs=page.jobs,
            workers=page.workers,
            devices=page.devices,
            snapshot=snap.id,
            offset=page.offset,
            next_offset=next_offset,
            total_workers=len(snap.workers),
            total_devices=len(snap.devices),
        )


def _max_payload(ctx: Context) -> int:
    """The server's max payload (1 MiB, its default, when not connected)."""
    try:
        return ctx.connection().max_payload
    except NotServing:
        return 1 << 20


def members_out(before: dict[str, Membership], outcome: Outcome) -> list[MemberOut]:
    """The members each of ``outcome``'s job restarts took out of the membership ``before``
    (``DrainReply.members_out``): a spare took the ranks of those its ``member_replaced`` events
    name; the others were dropped. Dropping renumbers the node ranks in their previous order
    (``marduk.core.membership.replace``), so the n-th member kept or replaced holds the n-th
    node rank of the new membership."""
    replaced = {(e.job, e.replica, e.worker) for e in outcome.events if e.kind == "member_replaced"}
    found: list[MemberOut] = []
    for command in outcome.commands:
        old = before.get(command.job)
        if command.replica is not None or old is None:
            continue
        new = command.membership
        staying = {(m.replica, m.worker) for m in new.members} if new is not None else set()
        ranked = sorted(new.members, key=lambda m: m.node_rank) if new is not None else []
        holders: list[Member] = list(ranked)
        for m in sorted(old.members, key=lambda m: m.node_rank):
            key = (m.replica, m.worker)
            if key in staying:
                del holders[:1]  # it keeps its ranks (renumbered if some were dropped)
                continue
            out = MemberOut(
                job=command.job,
                member=WorkerRef(replica=m.replica, worker=m.worker),
                node_rank=m.node_rank,
                epoch=command.epoch,
                nodes=len(ranked),
                world_size=new.world_size if new is not None else 0,
            )
            if (command.job, *key) in replaced and holders:
                spare = holders.pop(0)
                out.spare = WorkerRef(replica=spare.replica, worker=spare.worker)
                out.spare_node_rank = spare.node_rank
            found.append(out)
    return found
