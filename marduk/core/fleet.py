"""What the policy knows: the workers, their devices and restart scopes, and the questions every
rule set asks of them. Pure: no I/O, no clock (``now`` is an argument).

``Policy`` makes one ``Fleet`` and hands it to each of its rule sets (docs/architecture.md, *The
core is pure*); they read and change it, and nothing else is shared between them: a rule set
that needs another's decision is given that one (the issuer, the membership's replacement).
"""

from __future__ import annotations

from collections.abc import Iterable

from marduk.core import membership as rdzv
from marduk.core.command_size import MembershipSizes
from marduk.core.decisions import Outcome, PolicyConfig, epoch_key_for, worker_key
from marduk.core.drmap import DRMap, ReplicaKey, WorkerKey
from marduk.core.records import DeviceRecord, EpochKey, EpochRecord, JobShape, WorkerRecord
from marduk.core.scopes import Scopes
from marduk.wire.protocol import ControllerEvent, Membership, Report, WorkerRef

# The events of a membership change (MembershipRules and GrowRules announce them through
# ``Fleet.changed``): what status shows as a job's last resize.
RESIZE_EVENTS = frozenset(
    {"membership_formed", "member_replaced", "job_shrunk", "job_held", "member_added"}
)


def takes_part(state: EpochRecord | None, key: WorkerKey) -> bool:
    """Whether ``key`` runs trainers at the scope's epoch: every worker, unless the job has a
    membership and ``key`` is not in it (a worker beyond MAX starts nothing, so it never
    confirms a restart and must not hold one in flight)."""
    if state is None or state.membership is None:
        return True
    return state.membership.member(key.replica, key.worker) is not None


def awaited(state: EpochRecord) -> bool:
    """Does the scope's current command wait for its workers to confirm it (a restart or a
    fail does; a checkpoint request does not: nobody restarts for it)?"""
    return state.command is None or state.command.kind != "checkpoint"


def out_of_service(device: DeviceRecord) -> bool:
    """Quarantined (flapping) or drained by an operator (marduk/core/service_policy.py)."""
    return device.quarantined or device.drained


class Fleet:
    """The policy's state: workers, devices, the map between them and the restart scopes."""

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.drmap = DRMap()
        self.workers: dict[WorkerKey, WorkerRecord] = {}
        self.job_workers: dict[str, set[WorkerKey]] = {}
        # The workers of each job that asked for peer notices: ``notice_replicas`` looks at
        # these on every restart, not at all of the job's workers (1k of them: ~50 us a restart).
        self.notice_workers: dict[str, set[WorkerKey]] = {}
        # Each restart scope's epoch record, and what is derived from it (marduk/core/scopes.py).
        self.scopes = Scopes()
        # The size of each job's membership entries, for admission (marduk/core/command_size.py).
        self.sizes = MembershipSizes()
        self.devices: dict[str, DeviceRecord] = {}
        # The latest report of each worker (status, step, failure): shown, not persisted.
        self.reports: dict[WorkerKey, Report] = {}
        # Liveness: when each worker was last heard from (registration, renewal, ack, report),
        # oldest first (``heard`` moves a worker to the end), so ``tick`` looks only at the
        # workers that have been silent for a TTL, not at all 25k of them four times a second.
        self.last_seen: dict[WorkerKey, float] = {}
        self.stale: set[WorkerKey] = set()
        # Each job's last membership change (one of ``RESIZE_EVENTS``), for status. Derived
        # from the jobs' epoch records (``EpochRecord.last_change``): a new leader shows it too.
        self.last_change: dict[str, ControllerEvent] = {}
        # Pool spares claimed by a job (marduk/core/pools.py): the spare's key in its pool ->
        # the job. Derived from the jobs' epoch records (``EpochRecord.claims``).
        self.claims: dict[WorkerKey, str] = {}
        # Claims a new leader finished on reading them (job key, pool key): saved by its first
        # tick (``PoolRules.flush``).
        self.unsaved_moves: list[tuple[WorkerKey, WorkerKey]] = []

    @property
    def epochs(self) -> dict[EpochKey, EpochRecord]:
        """Every scope's epoch record (read it; the rules change it through ``scopes``)."""
        return self.scopes.records

    # --- workers ---------------------------------------------------------------------------------

    def epoch_key(self, key: WorkerKey) -> EpochKey:
        return self.epoch_key_of(self.workers[key])

    @staticmethod
    def epoch_key_of(rec: WorkerRecord) -> EpochKey:
        reg = rec.registration
        return epoch_key_for(reg.job, reg.replica, reg.scope)

    def epoch_of(self, ekey: EpochKey) -> int:
        state = self.epochs.get(ekey)
        return state.epoch if state else 0

    def scope_workers(self, ekey: EpochKey) -> list[WorkerKey]:
        if ekey.replica is None:
            return sorted(self.job_workers.get(ekey.job, ()))
        return sorted(self.drmap.workers_of_replica(ReplicaKey(ekey.job, ekey.replica)))

    def heard(self, key: WorkerKey, now: float) -> None:
        """``key`` was heard from (a stale one becomes live at its next renewal, which answers
        it)."""
        self.last_seen.pop(key, None)  # to the end: the dict stays in order of last heard
        self.last_seen[key] = now

    def put_worker(self, rec: WorkerRecord) -> frozenset[str]:
        """Record a worker and its devices; the devices it no longer uses are returned."""
        key = worker_key(rec.registration)
        self.workers[key] = rec
        self.job_workers.setdefault(key.job, set()).add(key)
        r = rec.registration.rendezvous
        if r is not None and not (r.spare and r.pool == key.job):  # a pool forms nothing
            self.sizes.put(key, r)
        if rec.registration.peer_notices:
            self.notice_workers.setdefault(key.job, set()).add(key)
        else:
            self._no_notices(key)
        return self.drmap.set_worker(key, rec.registration.devices)

    def _no_notices(self, key: WorkerKey) -> None:
        notice = self.notice_workers.get(key.job)
        if notice is not None:
            notice.discard(key)
            if not notice:
                del self.notice_workers[key.job]

    def remove_worker(self, key: WorkerKey, out: Outcome, now: float) -> bool:
        """Forget a worker (deregistered, expired, forgotten); False if it was unknown."""
        rec = self.workers.pop(key, None)
        if rec is None:
            return False
        self._no_notices(key)
        self.sizes.remove(key)
        self.forget_unused(self.drmap.remove_worker(key), out)
        job_workers = self.job_workers[key.job]
        job_workers.discard(key)
        if not job_workers:
            del self.job_workers[key.job]
        self.last_seen.pop(key, None)
        self.stale.discard(key)
        self.reports.pop(key, None)
        out.deleted_workers.append(key)
        self._release(key, out)
        ekey = self.epoch_key_of(rec)
        self.scopes.confirm(ekey, key)
        # The scope's epoch record stays with nobody left in it, for ``epoch_retention_s``: a
        # replica id that comes back continues above every epoch its agents may have seen.
        if not self.scope_workers(ekey):
            self.scopes.vacated(ekey, now)
        return True

    def _release(self, key: WorkerKey, out: Outcome) -> None:
        """The job lets go of worker ``key``: a pool's claim of it ends (the spare does not go
        back to the pool: marduk/core/pools.py)."""
        state = self.epochs.get(EpochKey(key.job, None))
        if state is None or not state.claims:
            return
        mine = [c for c in state.claims if (c.replica, c.worker) == (key.replica, key.worker)]
        if not mine:
            return
        for c in mine:
            self.claims.pop(WorkerKey(c.pool, c.replica, c.worker), None)
        state.claims = [c for c in state.claims if c not in mine]
        if state not in out.write_ahead and state not in out.put_epochs:
            out.put_epochs.append(state)

    def live_takers(self, ekey: EpochKey, state: EpochRecord) -> list[WorkerKey]:
        """The scope's live workers that run trainers at its epoch: those that must confirm it."""
        return [w for w in self.scope_workers(ekey) if w not in self.stale and takes_part(state, w)]

    def notice_replicas(self, job: str) -> set[str]:
        """Replicas of ``job`` with a live worker that asked for peer notices."""
        return {k.replica for k in self.notice_workers.get(job, ()) if k not in self.stale}

    # --- devices ---------------------------------------------------------------------------------

    def forget_unused(self, devices: frozenset[str], out: Outcome) -> None:
        """Devices no worker uses any more are forgotten (state, failure history)."""
        for device in devices:
            rec = self.devices.get(device)
            if self.drmap.has_device(device) or rec is None or out_of_service(rec):
                continue  # still used, never known, or out of service (kept on purpose)
            del self.devices[device]
            out.deleted_devices.append(device)

    def unusable(self, devices: list[str]) -> list[str]:
        """The devices of a registration that are out of service."""
        return [d for d in devices if (r := self.devices.get(d)) and out_of_service(r)]

    # --- jobs whose ranks the controller assigns (marduk/core/membership_policy.py) -----------

    def candidates(self, job: str) -> list[rdzv.Candidate]:
        """The live workers of ``job`` that brought a rendezvous and were not retired."""
        return self.candidates_of(sorted(self.job_workers.get(job, ())))

    def candidates_of(self, keys: Iterable[WorkerKey]) -> list[rdzv.Candidate]:
        """Those of ``keys`` that ``candidates`` would list, in their order."""
        out = []
        for key in keys:
            if self.is_candidate(key):
                rec = self.workers[key]
                reg = rec.registration
                assert reg.rendezvous is not None
                out.append(
                    rdzv.Candidate(key, reg.rendezvous, rec.registered_at, domain=reg.nvlink_domain)
                )
        return out

    def is_candidate(self, key: WorkerKey) -> bool:
        """Would ``candidates`` list ``key``? (Registered with a rendezvous, live, not retired.)"""
        rec = self.workers.get(key)
        return (
            rec is not None
            and rec.registration.rendezvous is not None
            and key not in self.stale
            and not rec.retired
        )

    def member_keys(self, job: str, membership: Membership) -> list[WorkerKey]:
        """The registered workers of ``membership``."""
        keys = (WorkerKey(job, m.replica, m.worker) for m in membership.members)
        return [k for k in keys if k in self.workers]

    def nnodes(self, job: str) -> tuple[int, int]:
        """The job's MIN:MAX: a live non-spare's ``--nnodes``, else what its epoch record kept
        (``shape``: a job held, or formed again from a pool's spares), else the lowest MIN and
        the highest MAX any registered worker brought."""
        for c in self.candidates(job):
            if not c.rendezvous.spare:
                return c.rendezvous.min_nodes, c.rendezvous.max_nodes
        state = self.epochs.get(EpochKey(job, None))
        if state is not None and state.shape is not None:
            return state.shape.min_nodes, state.shape.max_nodes
        keys = sorted(self.job_workers.get(job, ()))
        found = [r for k in keys if (r := self.workers[k].registration.rendezvous) is not None]
        lo = min((r.min_nodes for r in found), default=1)
        return lo, max((r.max_nodes for r in found), default=lo)

    def shape(self, job: str) -> JobShape | None:
        """The job's shape as a registered non-spare of it gives it (a live one's first; the
        workers of a job agree on it, ``membership.check``), else as its epoch record kept it;
        None if neither says."""
        found = None
        for key in self.job_workers.get(job, ()):
            reg = self.workers[key].registration
            r = reg.rendezvous
            if r is None or r.spare:
                continue
            pool = r.pool if r.pool != job else None
            found = JobShape(
                min_nodes=r.min_nodes,
                max_nodes=r.max_nodes,
                nproc=r.nproc,
                devices=len(reg.devices),
                pool=pool,
            )
            if self.is_candidate(key):
                return found
        if found is not None:
            return found
        state = self.epochs.get(EpochKey(job, None))
        return state.shape if state is not None else None

    def unfit(self, key: WorkerKey, now: float) -> str:
        """Why the worker may not take a rank ("" if it may): its node failed its checks before
        a start (``Rendezvous.unhealthy``), or a device of it is out of service or past its
        failure budget."""
        window, budget = self.config.device_failure_window_s, self.config.device_max_failures
        reg = self.workers[key].registration
        if reg.rendezvous is not None and reg.rendezvous.unhealthy:
            return f"node unhealthy: {reg.rendezvous.unhealthy}"
        for device in reg.devices:
            rec = self.devices.get(device)
            if rec is None:
                continue
            if rec.quarantined or rec.drained:
                return f"device {device} out of service"
            if rec.state == "failed":
                return f"device {device} failed"
            if sum(now - t < window for t in rec.failures) > budget:
                return f"device {device} failed past its budget"
        return ""

    def usable(self, job: str, now: float) -> list[rdzv.Candidate]:
        """The job's candidates that may take a rank (``unfit`` says none of theirs is bad)."""
        return [c for c in self.candidates(job) if not self.unfit(c.key, now)]

    def in_play(self, workers: Iterable[WorkerKey]) -> frozenset[WorkerKey]:
        """Of ``workers``, those whose failure concerns their scope: all of them with static
        ranks; in a job whose ranks the controller assigns, only the members of its membership
        (spares and retired workers run nothing to restart, and while the job forms or is held
        below MIN nobody runs anything); in a pool of spares, nobody."""
        out = set()
        for w in workers:
            if self.workers[w].registration.rendezvous is None:
                out.add(w)
                continue
            state = self.epochs.get(self.epoch_key(w))
            m = state.membership if state is not None else None
            if m is not None and m.member(w.replica, w.worker):
                out.add(w)
        return frozenset(out)

    def pool_spare(self, key: WorkerKey) -> bool:
        """Is ``key`` a spare of a pool, registered under it (marduk/core/pools.py)? It runs
        nothing: no failure of it restarts anything."""
        r = self.workers[key].registration.rendezvous
        return r is not None and r.spare and r.pool == key.job

    def changed(self, event: ControllerEvent, out: Outcome) -> None:
        """Announce a change of a job's membership (``event``, one of ``RESIZE_EVENTS``): the
        job's last change from now on (``marduk.core.job_views``)."""
        assert event.kind in RESIZE_EVENTS and event.job is not None
        out.events.append(event)
        self.last_change[event.job] = event
        state = self.epochs.get(EpochKey(event.job, None))
        if state is not None:  # kept with the membership it changed (written ahead with it)
            state.last_change = event
            if state not in out.write_ahead and state not in out.put_epochs:
                out.put_epochs.append(state)

    def retired(self, ekey: EpochKey) -> list[WorkerRef]:
        """The job's retired workers still registered (``Command.retired``)."""
        if ekey.replica is not None:
            return []
        keys = sorted(self.job_workers.get(ekey.job, ()))
        return [
            WorkerRef(replica=k.replica, worker=k.worker) for k in keys if self.workers[k].retired
        ]
