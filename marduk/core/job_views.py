"""Views of jobs whose node ranks the controller assigns (``--nnodes MIN:MAX``), for queries
(``marduk monitor status``, ``top``) and the metrics: read-only, pure (``now`` passed in).

Per job: its size against MIN:MAX, its spares (free, or holding a lost member's ranks), the
workers that will grow it, the resize under way and the last one. ``JobViews`` reads the
policy's ``Fleet`` and what the rule sets keep beside it: the ``Issuer``'s restarts in flight,
the ``MembershipRules``' join timeout, the ``GrowRules``' live times, confirmations and last
resizes (``Policy.job_infos`` asks it).
"""

from __future__ import annotations

from dataclasses import dataclass

from marduk.core import grow as rule
from marduk.core import views
from marduk.core.drmap import WorkerKey
from marduk.core.fleet import Fleet
from marduk.core.grow_policy import GrowRules, warm
from marduk.core.issuer import Issuer
from marduk.core.membership_policy import MembershipRules
from marduk.core.records import EpochKey, EpochRecord
from marduk.wire.protocol import JobInfo, Membership


@dataclass(frozen=True, slots=True)
class JobViews:
    """What status shows of each job with a rendezvous (see the module): read-only over the
    objects the policy hands it."""

    fleet: Fleet
    issuer: Issuer
    membership: MembershipRules
    grow: GrowRules

    def infos(self, now: float, job: str | None = None) -> list[JobInfo]:
        """One JobInfo per job with a rendezvous (``job``: that one only), sorted by name."""
        jobs = {
            key.job
            for key, rec in self.fleet.workers.items()
            if rec.registration.rendezvous is not None and (job is None or key.job == job)
        }
        # A pool whose spares jobs all claimed is still shown; so is a job held below MIN
        # with none of its workers left (its shape is on its epoch record).
        jobs |= {key.job for key in self.fleet.claims if job is None or key.job == job}
        jobs |= {
            key.job
            for key, state in self.fleet.epochs.items()
            if key.replica is None and state.shape is not None and (job is None or key.job == job)
        }
        return [self.info(name, now) for name in sorted(jobs)]

    def info(self, job: str, now: float) -> JobInfo:
        if self._is_pool(job):
            return self._pool(job, now)
        ekey = EpochKey(job, None)
        state = self.fleet.epochs.get(ekey)
        m = state.membership if state is not None else None
        lo, hi = self.fleet.nnodes(job)
        spares, holding, joining = self._parts(job, m, now)
        resize, detail, since = self._resize(ekey, state, joining, now)
        last = self.fleet.last_change.get(job)
        return JobInfo(
            job=job,
            min_nodes=lo,
            max_nodes=hi,
            nodes=len(m.members) if m is not None else 0,
            world_size=m.world_size if m is not None else 0,
            epoch=state.epoch if state is not None else 0,
            spares=spares,
            holding=holding,
            joining=[_name(k) for k in joining],
            resize=resize,
            resize_detail=detail,
            resize_since=since,
            last_resize=last.kind if last is not None else "",
            last_resize_epoch=(last.epoch or 0) if last is not None else 0,
            last_resize_at=last.ts if last is not None else 0.0,
            last_resize_detail=last.detail if last is not None else "",
            pool=self._pool_of(job),
            claimed=[f"{c.replica}/{c.worker}" for c in state.claims] if state else [],
        )

    def _is_pool(self, job: str) -> bool:
        """Is ``job`` a pool of spares (its workers register under the pool's name)?"""
        fleet = self.fleet
        if any(fleet.pool_spare(key) for key in fleet.job_workers.get(job, ())):
            return True
        return any(key.job == job for key in fleet.claims)

    def _pool_of(self, job: str) -> str:
        """As ``PoolRules.pool_of``: a live non-spare's ``--spare-pool``, else the held job's
        record's."""
        for c in self.fleet.candidates(job):
            if not c.rendezvous.spare:
                return c.rendezvous.pool or ""
        state = self.fleet.epochs.get(EpochKey(job, None))
        return (state.shape.pool or "") if state is not None and state.shape is not None else ""

    def _pool(self, pool: str, now: float) -> JobInfo:
        """A pool: its free spares (an unusable one says why) and the ones jobs claimed."""
        fleet = self.fleet
        free = []
        for c in fleet.candidates(pool):
            why = fleet.unfit(c.key, now)
            free.append(_name(c.key) + (f" (unusable: {why})" if why else ""))
        claimed = sorted(
            f"{_name(key)} by {job}" for key, job in fleet.claims.items() if key.job == pool
        )
        return JobInfo(
            job=pool,
            min_nodes=0,
            max_nodes=0,
            pool=pool,
            is_pool=True,
            spares=free,
            claimed=claimed,
        )

    def _parts(
        self, job: str, m: Membership | None, now: float
    ) -> tuple[list[str], list[str], list[WorkerKey]]:
        """The job's free spares (unusable ones say why), the spares holding a lost member's
        ranks, and the free workers that will grow it (live, usable, not --spare, below MAX)."""
        fleet = self.fleet
        spares: list[str] = []
        holding: list[str] = []
        members = {WorkerKey(job, x.replica, x.worker) for x in m.members} if m else set()
        grows = views.joining(fleet, job, now)
        for key in sorted(fleet.job_workers.get(job, ())):
            rec = fleet.workers[key]
            r = rec.registration.rendezvous
            if r is None or rec.retired or key in fleet.stale or key in grows:
                continue
            if key in members:
                if r.spare:
                    holding.append(_name(key))
            elif r.spare or m is not None:  # declared, or beyond MAX, or of another shape
                why = fleet.unfit(key, now)
                spares.append(_name(key) + (f" (unusable: {why})" if why else ""))
        return spares, holding, sorted(grows)

    def _resize(
        self, ekey: EpochKey, state: EpochRecord | None, joining: list[WorkerKey], now: float
    ) -> tuple[str, str, float]:
        """The resize under way (phase, what it waits for, since when), or ("", "", 0)."""
        fleet, grow = self.fleet, self.grow
        cfg = fleet.config
        m = state.membership if state is not None else None
        if m is None:
            return self._forming(ekey, state, now)
        assert state is not None
        n = len(m.members)
        if state.grow is not None:
            names = ", ".join(f"{w.replica}/{w.worker}" for w in state.grow.joining)
            saved = len(grow.confirmed.get(ekey.job, ()))
            bound = max(0.0, state.grow.started_at + cfg.grow_checkpoint_timeout_s - now)
            detail = (
                f"grow {n} -> {n + len(state.grow.joining)} node(s) ({names} joining): checkpoint "
                f"saved by {saved} of {n} member(s), restarts within {bound:.0f}s"
            )
            return "checkpoint", detail, state.grow.started_at
        last = fleet.last_change.get(ekey.job)
        in_flight = self.issuer.pending(ekey, now)
        if last is not None and last.epoch == state.epoch and in_flight:
            waiting = len(fleet.scopes.awaiting(ekey))
            detail = f"epoch {state.epoch}: {n - waiting} of {n} member(s) run it"
            return "applying", detail, state.issued_at
        if joining:
            who = ", ".join(_name(k) for k in joining)
            first = min(grow.live_since.get(k, now) for k in joining)
            ready = [
                max(grow.live_since.get(k, now), grow.ready_since.get(k, 0.0)) for k in joining
            ]
            live = now - max(ready)
            warming = [_name(k) for k in joining if not warm(fleet.workers[k])]
            if warming:
                why = f"{', '.join(warming)} warming (fork server importing)"
            elif live < cfg.grow_settle_s:
                why = f"ready {live:.0f}s of --grow-settle {cfg.grow_settle_s:g}s"
            else:
                last_resize = grow.last_resize.get(ekey.job)
                why = rule.wait_reason(now, last_resize, cfg.resize_interval_s, in_flight)
            return "joining", f"{who} joining{': ' + why if why else ''}", first
        return "", "", 0.0

    def _forming(
        self, ekey: EpochKey, state: EpochRecord | None, now: float
    ) -> tuple[str, str, float]:
        """A job without a membership: held below MIN, or forming its first one."""
        lo, hi = self.fleet.nnodes(ekey.job)
        n = len(self.fleet.usable(ekey.job, now))
        since = self.membership.quorum_since.get(ekey.job, 0.0)
        timeout = self.fleet.config.join_timeout_s
        left = f", forms within {max(0.0, since + timeout - now):.0f}s" if since else ""
        if state is not None and state.command is not None:
            if n < lo:
                return (
                    "held",
                    f"below MIN: {n} of {lo} usable worker(s) registered",
                    state.issued_at,
                )
            # MIN is back: it waits out --join-timeout (for more) before it forms again.
            detail = f"{n} of {lo}:{hi} usable worker(s) registered (MIN again){left}"
            return "held", detail, state.issued_at
        return "forming", f"{n} of {lo}:{hi} worker(s) registered{left}", since


def _name(key: WorkerKey) -> str:
    return f"{key.replica}/{key.worker}"
