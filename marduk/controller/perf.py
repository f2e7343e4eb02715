"""The controller's performance view (decisions.md 19): each rank's window summary in
(``<prefix>.*.perf``), the pure detector (marduk/core/stragglers.py) asked, stragglers announced
by their devices, devices' slowness records kept (marduk/store/slowness.py), ``ctl.perf_query``
answered, job-level series for /metrics.

Every controller subscribes; only the leader looks at a summary (a standby counts and drops it,
so a takeover starts with an empty view and rebuilds it within the warm-up). A summary is
decoded strictly and checked against the map before the detector sees it: its job must be its
subject's, its worker registered (the devices named are the map's, never the sender's), its
numbers plausible; each refusal is counted by reason (``marduk_errors_total``-style counters
``perf.rejected.<reason>``) and logged a few times a minute. Nothing here raises into NATS's
callbacks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from prometheus_client.core import GaugeMetricFamily, Metric

from marduk.controller.commit import Commit
from marduk.controller.context import Context
from marduk.core.decisions import Outcome
from marduk.core.drmap import WorkerKey
from marduk.core.policy import Policy
from marduk.core.straggler_policy import (
    ActionConfig,
    JobRoom,
    Straggler,
    StragglerActions,
    Verdict,
)
from marduk.core.stragglers import (
    Finding,
    RankKey,
    StragglerConfig,
    StragglerDetector,
    note_slow,
    rank_devices,
    repeat_offenders,
)
from marduk.errors import ProtocolError
from marduk.store.kv import Fenced
from marduk.store.slowness import SlownessStore
from marduk.wire.perf import MAX_PERF_BYTES, PerfQuery, PerfReply, PerfSummary, StragglerInfo
from marduk.wire.protocol import ControllerEvent, decode, encode

log = logging.getLogger("marduk.controller")

BLOCKING_RESIZES = frozenset({"forming", "held", "checkpoint", "applying"})
"""A job in one of these resizes is not touched ("joining": a grow waits, which a drain may
overtake)."""

SWEEP_S = 2.0
"""How often silent ranks are forgotten (a straggler that went silent is cleared)."""


class PerfMonitor:
    """Summaries in, straggler events out; the job's view for status and /metrics."""

    def __init__(
        self,
        ctx: Context,
        *,
        policy: Callable[[], Policy],
        announce: Callable[[ControllerEvent], Coroutine[Any, Any, None]],
        submit: Callable[[Outcome], Commit] | None = None,
        term: Callable[[], int] = lambda: 0,
        config: StragglerConfig | None = None,
        actions: ActionConfig | None = None,
    ) -> None:
        self._ctx = ctx
        self._policy = policy
        self._announce = announce
        self._submit = submit
        self._term = term
        self.detector = StragglerDetector(config)
        self.actions = StragglerActions(actions)
        self.store: SlownessStore | None = None
        self._subs: list[Subscription] = []
        self._was_leading = False
        # What each rank's latest summary said of its devices (``devices_of``); the detector's
        # ranks only (pruned with them).
        self._where: dict[RankKey, tuple[list[str], int | None, int | None]] = {}
        # Records are read, changed and written: one at a time, or two detections of one
        # device in the same window (two sections of a rank) would count once.
        self._record_lock = asyncio.Lock()

    async def open(self, nc: NATS, *, replicas: int = 1) -> None:
        """Bind the slowness bucket (with the controller's other state: a JetStream that is
        not ready yet is waited for there, ``Controller.start``)."""
        self.store = await SlownessStore.open(nc, self._ctx.settings.prefix, replicas=replicas)

    async def start(self, nc: NATS) -> None:
        s = self._ctx.subjects
        self._subs = [
            await nc.subscribe(s.any_job("perf"), cb=self._on_summary),
            await nc.subscribe(s.perf_query, cb=self._on_query),
        ]

    async def stop(self) -> None:
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception as e:  # closed already: nothing more will come
                log.debug("perf: unsubscribe: %s", e)
        self._subs = []

    # --- summaries -------------------------------------------------------------------------------

    async def _on_summary(self, msg: Msg) -> None:
        stats = self._ctx.stats
        if not self._leading():
            stats["perf.not_leading"] += 1
            return
        try:
            self.take(msg.subject, msg.data, time.time())
        except Exception:  # never into NATS's callback
            self._ctx.logs.internal("perf summary")

    def take(self, subject: str, data: bytes, now: float) -> None:
        """One summary: decoded, checked, observed; what changed is announced."""
        stats, logs = self._ctx.stats, self._ctx.logs
        try:
            s = decode(data, PerfSummary, max_bytes=MAX_PERF_BYTES)
        except ProtocolError as e:
            self._reject(e.reason, str(e), subject)
            return
        if s.job != self._ctx.subjects.job_of(subject):
            self._reject("misdirected", f"job {s.job!r} on another job's subject", subject)
            return
        policy = self._policy()
        if WorkerKey(s.job, s.replica, s.worker) not in policy.workers:
            self._reject(
                "unknown_worker", f"{s.job}/{s.replica}/{s.worker} not registered", subject
            )
            return
        observed = self.detector.observe(s, now)
        if observed.dropped is not None:
            stats[f"perf.dropped.{observed.dropped}"] += 1
            logs.limited(
                f"perf.{observed.dropped}",
                f"dropped a perf summary of {s.job}/{s.replica}/{s.worker} rank {s.rank}: "
                f"{observed.dropped}",
            )
            return
        stats["perf.summaries"] += 1
        key = RankKey(s.job, s.replica, s.worker, s.rank)
        self._where[key] = (s.devices, s.local_rank, s.local_world_size)
        self._emit(observed.findings, now)

    def _reject(self, reason: str, message: str, subject: str) -> None:
        self._ctx.stats[f"perf.rejected.{reason}"] += 1
        self._ctx.logs.limited(f"perf.{reason}", f"rejected perf summary on {subject}: {message}")

    def sweep(self, now: float) -> None:
        if not self._leading():
            return
        self._emit(self.detector.sweep(now), now)
        for key in [k for k in self._where if not self.detector.tracked(k)]:
            del self._where[key]
        if self.actions.config.ever_acts and self._submit is not None:
            self._act(now)

    async def sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            self.sweep(time.time())

    def _leading(self) -> bool:
        leading = self._ctx.leading()
        if leading != self._was_leading:
            # A new term starts from nothing: what a lapsed term saw may be old, and the
            # warm-up rebuilds the view within a few windows.
            self.detector = StragglerDetector(self.detector.config)
            self.actions = StragglerActions(self.actions.config)
            self._where.clear()
            self._was_leading = leading
            if leading:  # claim the records' term now: a lapsed leader's late write is refused
                self._ctx.spawn(self._claim(), "perf-claim")
        return leading

    # --- events and records ----------------------------------------------------------------------

    def devices_of(self, key: RankKey) -> list[str]:
        """The rank's devices: its worker's, as registered (the map's), narrowed to the rank's
        own by what its summaries said (``rank_devices``)."""
        record = self._policy().workers.get(WorkerKey(key.job, key.replica, key.worker))
        if record is None:
            return []
        said, local_rank, local_size = self._where.get(key, ([], None, None))
        return rank_devices(list(record.registration.devices), said, local_rank, local_size)

    def _emit(self, findings: list[Finding], now: float) -> None:
        for f in findings:
            devices = self.devices_of(f.key)
            info = StragglerInfo(
                rank=f.key.rank,
                section=f.section,
                relative=round(f.relative, 4),
                individual=round(f.individual, 4),
                ratio=round(f.ratio, 4),
                p50=f.p50,
                reference=f.reference,
                windows=f.windows,
                devices=devices,
                incarnation=f.incarnation,
            )
            kind = "straggler_detected" if f.kind == "detected" else "straggler_cleared"
            self._ctx.stats[f"perf.{kind}"] += 1
            where = ", ".join(devices) or "no devices"
            detail = (
                f"rank {f.key.rank} ({where}) section {f.section}: relative {f.relative:.2f}, "
                f"individual {f.individual:.2f}; {f.why}"
            )
            event = ControllerEvent(
                kind=kind,
                ts=now,
                job=f.key.job,
                replica=f.key.replica,
                worker=f.key.worker,
                device=devices[0] if len(devices) == 1 else None,
                detail=detail,
                straggler=info,
            )
            self._ctx.spawn(self._announce(event), "perf-event")
            if f.kind == "detected":
                for device in devices:
                    self._ctx.spawn(self._note_slow(device, f, now), "perf-record")

    # --- acting on them (marduk/core/straggler_policy.py) ---------------------------------------

    def _act(self, now: float) -> None:
        """The policy's verdicts on the stragglers now: a drain (the path of ``marduk monitor
        drain``: the devices out of service, the job restarted with a spare in the node's
        place or without it) submitted like an operator's, or why not, as an event."""
        stragglers = [
            Straggler(key, section, g.since, g.relative, tuple(self.devices_of(key)))
            for key, section, g in self.detector.stragglers()
        ]
        if not stragglers:
            return
        policy = self._policy()
        infos = {i.job: i for i in policy.job_infos(now)}
        rooms: dict[str, JobRoom | None] = {}
        for job in {s.key.job for s in stragglers}:
            info = infos.get(job)
            if info is None or info.is_pool:
                rooms[job] = None
                continue
            pool = infos.get(info.pool) if info.pool else None
            rooms[job] = JobRoom(
                members=info.nodes,
                min_nodes=info.min_nodes,
                spares=len(info.spares) + (len(pool.spares) if pool is not None else 0),
                resizing=info.resize if info.resize in BLOCKING_RESIZES else "",
                last_resize_at=info.last_resize_at,
            )
        for verdict in self.actions.decide(stragglers, rooms, now):
            self._carry_out(verdict, now)

    def _carry_out(self, v: Verdict, now: float) -> None:
        k, stats = v.key, self._ctx.stats
        who = f"rank {k.rank} of {k.job}/{k.replica}/{k.worker} ({', '.join(v.devices)})"
        if not v.act:
            stats["perf.actions_withheld"] += 1
            kind = "straggler_not_acted"
            detail = f"{who}, section {v.section}: {v.why}"
        else:
            assert self._submit is not None
            policy = self._policy()
            reason = f"straggler on {v.section}, {v.why}"
            by = "the straggler policy"
            result = policy.drain(list(v.devices), "", False, reason, now, by=by)
            self._ctx.spawn(self._durable(self._submit(result.outcome)), "perf-action")
            if result.devices:
                stats[f"perf.actions.{v.how}"] += 1
                kind = "straggler_acted"
                detail = f"{who} drained, section {v.section}: {v.why}"
            else:  # an operator (or an earlier term) drained them already
                stats["perf.actions_withheld"] += 1
                kind = "straggler_not_acted"
                detail = f"{who}, section {v.section}: its devices are out of service already"
        event = ControllerEvent(
            kind=kind,
            ts=now,
            job=k.job,
            replica=k.replica,
            worker=k.worker,
            device=v.devices[0] if len(v.devices) == 1 else None,
            detail=detail,
        )
        self._ctx.spawn(self._announce(event), "perf-event")

    async def _durable(self, commit: Commit) -> None:
        try:
            await commit.durable
        except Exception as e:  # the commit pipeline says why; the drain is not in force
            self._ctx.stats["errors.perf_action"] += 1
            self._ctx.logs.limited("perf.action", f"straggler action not stored: {e}")

    async def _claim(self) -> None:
        await self._claimed()

    async def _claimed(self) -> SlownessStore | None:
        """The store, with this term claimed in it (None: no store, or another term began)."""
        store, term = self.store, self._term()
        if store is None or term <= 0:
            return None
        async with self._record_lock:
            if store.term != term:
                try:
                    await store.claim_term(term, self._ctx.controller_id)
                except Fenced:
                    self._ctx.stats["perf.record_fenced"] += 1
                    return None
                except Exception as e:
                    self._ctx.stats["errors.perf_record"] += 1
                    self._ctx.logs.limited("perf.record", f"slowness records' term: {e}")
                    return None
        return store

    async def _note_slow(self, device: str, f: Finding, now: float) -> None:
        store = await self._claimed()
        if store is None:
            return
        try:
            async with self._record_lock:
                await store.put(note_slow(await store.get(device), device, f, now))
            self._ctx.stats["perf.records_written"] += 1
        except Fenced:  # a successor's term began: its word counts, not ours
            self._ctx.stats["perf.record_fenced"] += 1
        except Exception as e:  # JetStream busy or gone: the event went out; counted
            self._ctx.stats["errors.perf_record"] += 1
            self._ctx.logs.limited("perf.record", f"slowness record of {device} not saved: {e}")

    # --- views -----------------------------------------------------------------------------------

    async def _on_query(self, msg: Msg) -> None:
        if not self._leading() or not msg.reply:
            return  # the leader answers
        if not msg.reply.startswith("_INBOX."):
            # Never a confused deputy: a reply subject that is a KV or stream subject would have
            # the leader write its answer into a Marduk bucket (the edge's rule, docs/protocol.md).
            self._ctx.stats["rejected.reply_subject"] += 1
            self._reject("reply_subject", f"not an inbox: {msg.reply[:100]}", msg.subject)
            return
        try:
            q = decode(msg.data, PerfQuery)
        except ProtocolError as e:
            self._reject(e.reason, str(e), msg.subject)
            return
        try:
            reply = await self.reply(q.job)
            await msg.respond(encode(reply))
        except Exception:
            self._ctx.logs.internal("perf query")

    async def reply(self, job: str | None) -> PerfReply:
        now = time.time()
        jobs = [job] if job is not None else self.detector.jobs()
        views = []
        for j in jobs:
            devices = {k: self.devices_of(k) for k in self.detector.rank_keys(j)}
            view = self.detector.job_perf(j, now, devices)
            if view is not None:
                views.append(view)
        slow = []
        if self.store is not None:
            try:
                slow = repeat_offenders(await self.store.load())[:50]
            except Exception as e:
                self._ctx.logs.limited("perf.load", f"slowness records not read: {e}")
        counts = {k: v for k, v in self._ctx.stats.items() if k.startswith("perf.")}
        return PerfReply(jobs=views, devices=slow, stats=counts)

    def metrics(self) -> Iterator[Metric]:
        """Job-level series, and a per-rank score only for current stragglers: at 100k devices
        the series are the jobs' count plus the stragglers', never the ranks'."""
        if not self._ctx.leading():
            return
        now = time.time()
        rate = GaugeMetricFamily(
            "marduk_job_steps_per_second", "The job's step rate (its median rank's)", labels=["job"]
        )
        p50 = GaugeMetricFamily(
            "marduk_job_step_seconds_p50", "The job's median rank's p50 step time", labels=["job"]
        )
        count = GaugeMetricFamily(
            "marduk_job_stragglers", "Ranks of the job that are stragglers now", labels=["job"]
        )
        score = GaugeMetricFamily(
            "marduk_straggler_relative_score",
            "A current straggler's relative score (best rank's p50 / its own; 0..1)",
            labels=["job", "replica", "worker", "rank", "section"],
        )
        for j in self.detector.jobs():
            view = self.detector.job_perf(j, now)
            if view is None:
                continue
            rate.add_metric([j], view.steps_per_s)
            p50.add_metric([j], view.step_p50)
            count.add_metric([j], len(view.stragglers))
        for key, section, g in self.detector.stragglers():
            score.add_metric(
                [key.job, key.replica, str(key.worker), str(key.rank), section], g.relative
            )
        yield from (rate, p50, count, score)
