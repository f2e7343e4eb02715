"""The restart policy: registrations and health events in, commands and state changes out.

Pure: no I/O, no clock (``now`` is an argument, unix seconds). The controller shell decodes
messages, calls these methods, persists the records they return and publishes the commands.

Epochs (docs/decisions.md #3). Each restart scope has a monotonically increasing epoch: the
replica for scope ``replica``, the whole job for scope ``job``. A restart bumps the epoch and
records the command that did it. While the workers of a scope have not confirmed the new epoch
(by an ack, or by registering as a fresh process), further failures for that scope are
*coalesced* into the restart already in flight, so a storm of events yields one command per
scope. A restart unconfirmed after ``pending_timeout_s`` no longer holds events back.

Delivery. A failure that joins a restart in flight is still told to every scope it
touches: the command in flight is sent again with the device merged into it (same epoch, so an
agent acts once). A worker that had already acted when the device was merged (its ack, on its
way, lists the devices it knew) is restarted again at a new epoch for it: a merge covers only a
worker that has not restarted yet. Commands of scopes still awaiting confirmation are resent by
``tick`` about once a second, so a worker that missed one (dropped message, failover) has it
soon after it can receive again. Epochs of a scope are kept when its workers leave: they never
go backwards. After ``epoch_retention_s`` with no worker the record is deleted (a worker that
returns later has the epoch it saw adopted at registration).

Liveness. Workers renew their registration every ``renew_interval`` (told in the reply); one
silent for ``worker_ttl_s`` is ``stale`` (it no longer holds a restart pending) and is removed
after ``worker_expiry_s``. Devices no worker uses are forgotten. A second live process claiming a
worker identity is refused (``duplicate_worker``).

Escalation (docs/decisions.md #6). Each device has a failure budget: past
``device_max_failures`` restarts caused by one device within ``device_failure_window_s``, the
replicas get ``fail`` instead of ``restart``: restarting on that device does not help; the pod
should go back to the scheduler. A ``healthy`` event for the device clears its history.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec

from marduk.core.decisions import (
    HealthResult,
    Outcome,
    PolicyConfig,
    PolicyError,
    Registered,
    ReportResult,
    epoch_key_for,
    event_at,
    worker_event,
    worker_key,
)
from marduk.core.device_policy import DevicePolicy
from marduk.core.drmap import DRMap, ReplicaKey, WorkerKey
from marduk.core.grow_policy import GrowPolicy
from marduk.core.notices import failed_peers, peer_notices
from marduk.core.records import DeviceRecord, EpochKey, EpochRecord, WorkerRecord
from marduk.core.registration import (
    check_adoptable,
    check_duplicate,
    check_scope,
    is_fresh_process,
    registration_events,
)
from marduk.core.scopes import Scopes
from marduk.wire.protocol import (
    Action,
    Command,
    CommandKind,
    ControllerEvent,
    DeviceInfo,
    HealthReply,
    Membership,
    Registration,
    Report,
    WorkerInfo,
    same_process,
)


def _takes_part(state: EpochRecord | None, key: WorkerKey) -> bool:
    """Whether ``key`` runs trainers at the scope's epoch: every worker, unless the job has a
    membership and ``key`` is not in it (a worker beyond MAX starts nothing, so it never
    confirms a restart and must not hold one in flight)."""
    if state is None or state.membership is None:
        return True
    return state.membership.member(key.replica, key.worker) is not None


def _awaited(state: EpochRecord) -> bool:
    """Does the scope's current command wait for its workers to confirm it (a restart or a
    fail does; a checkpoint request does not: nobody restarts for it)?"""
    return state.command is None or state.command.kind != "checkpoint"


__all__ = [
    "FAILURE_STATUSES",
    "HealthResult",
    "Outcome",
    "Policy",
    "PolicyConfig",
    "PolicyError",
    "Registered",
    "ReportResult",
]

# Reports that make the controller restart the worker's restart scope.
FAILURE_STATUSES = frozenset({"crashed", "hung", "gave_up", "preempted"})


class Policy(GrowPolicy, DevicePolicy):
    """Controller state and decisions. One instance per controller."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self.drmap = DRMap()
        self.workers: dict[WorkerKey, WorkerRecord] = {}
        # Each restart scope's epoch record, and what is derived from it (marduk/core/scopes.py).
        self.scopes = Scopes()
        self.devices: dict[str, DeviceRecord] = {}
        self._job_workers: dict[str, set[WorkerKey]] = {}
        # The latest report of each worker (status, step, failure): shown, not persisted.
        self.reports: dict[WorkerKey, Report] = {}
        self._recent_events: OrderedDict[str, HealthReply] = OrderedDict()
        # Liveness: when each worker was last heard from (registration, renewal, ack, report),
        # oldest first (``_heard`` moves a worker to the end), so ``tick`` looks only at the
        # workers that have been silent for a TTL, not at all 25k of them four times a second.
        self.last_seen: dict[WorkerKey, float] = {}
        self.stale: set[WorkerKey] = set()
        self._quorum_since: dict[str, float] = {}  # marduk/core/membership_policy.py
        self._last_resize: dict[str, float] = {}  # and marduk/core/grow_policy.py:
        self._grow_watch: set[str] = set()
        self._grow_confirmed: dict[str, set[WorkerKey]] = {}
        self._live_since: dict[WorkerKey, float] = {}

    # --- restore ---------------------------------------------------------------------------------

    @classmethod
    def restore(
        cls,
        config: PolicyConfig,
        workers: list[WorkerRecord],
        epochs: list[EpochRecord],
        devices: list[DeviceRecord],
        handled: Iterable[HealthReply] = (),
        now: float = 0.0,
    ) -> Policy:
        """Rebuild from persisted records. Every worker counts as seen at ``now``: renewals are
        not written, so a restored controller gives each one a full TTL to renew."""
        policy = cls.from_records(config, workers, epochs, devices)
        policy.resume(handled, now)
        return policy

    def resume(self, handled: Iterable[HealthReply], now: float) -> None:
        """Start leading with a policy built from the records (perhaps a while ago, by a hot
        standby, and untouched since): the handled events are remembered, and every worker
        counts as seen at ``now``."""
        for reply in handled:
            self._remember(reply)
        for key in self.last_seen:
            self.last_seen[key] = now  # in place: the order (last heard) stays
        # Vacant scopes' retention counts from now: when they were vacated was not stored.
        self.scopes.vacant_all({self._epoch_key(k) for k in self.workers}, now)
        self._grow_resume(now)

    @classmethod
    def from_records(
        cls,
        config: PolicyConfig,
        workers: list[WorkerRecord],
        epochs: list[EpochRecord],
        devices: list[DeviceRecord],
    ) -> Policy:
        """The map, epochs and devices the records describe; ``resume`` before leading."""
        policy = cls(config)
        for epoch in epochs:
            # Commands up to the ceiling may have gone out after the last exact write.
            policy.scopes.restore(epoch)
        for device in devices:
            policy.devices[device.device] = device
        for rec in workers:
            key = worker_key(rec.registration)
            policy.workers[key] = rec
            policy.last_seen[key] = 0.0  # resume() says when
            policy._job_workers.setdefault(key.job, set()).add(key)
            policy.drmap.set_worker(key, rec.registration.devices)
            ekey = policy._epoch_key(key)
            state = policy.epochs.get(ekey)
            if (
                state is not None
                and rec.applied_epoch < state.epoch
                and _awaited(state)
                and _takes_part(state, key)
            ):
                policy.scopes.inherit(ekey, key)
        return policy

    # --- registration ----------------------------------------------------------------------------

    def register(self, reg: Registration, now: float) -> Registered:
        key = worker_key(reg)
        check_scope(reg, (self.workers[k] for k in self._job_workers.get(reg.job, ())))
        self.check_claims(reg, now)
        out = Outcome()
        old = self.workers.get(key)
        if old is not None:
            check_duplicate(
                key, old, reg, now - self.last_seen.get(key, 0.0), key in self.stale, self.config
            )
        ekey = epoch_key_for(reg.job, reg.replica, reg.scope)
        state = self.epochs.get(ekey)
        # Every check before the first change: a refused registration leaves no trace (a
        # worker heard from but never recorded would expire, and fail, forever).
        check_adoptable(max(reg.epoch, reg.seen_epoch), state, self.config.epoch_block)
        self._check_rendezvous(reg, state)
        was_stale = key in self.stale
        self._heard(key, now)
        self.stale.discard(key)
        fresh_process = old is None or is_fresh_process(old.registration, reg)
        state = self._scope_state(ekey, state, max(reg.epoch, reg.seen_epoch), out)
        current = state.epoch
        if fresh_process:
            # A new process starts after every restart commanded so far: it is current.
            applied = max(reg.epoch, current)
        else:
            assert old is not None
            applied = max(reg.epoch, old.applied_epoch)

        result: Literal["new", "updated", "unchanged"] = (
            "new"
            if old is None
            else "unchanged"
            if old.registration == reg and applied == old.applied_epoch
            else "updated"
        )
        rec = WorkerRecord(
            registration=reg,
            registered_at=old.registered_at if old else now,
            updated_at=now,
            applied_epoch=applied,
            # Retired stays retired; a new process under its name starts afresh.
            retired=old.retired if old and same_process(old.registration, reg) else "",
        )
        self.workers[key] = rec
        self._job_workers.setdefault(key.job, set()).add(key)
        self.scopes.occupied(ekey)
        dropped = self.drmap.set_worker(key, reg.devices)
        self._forget_unused(dropped, out)
        if applied >= current or not _awaited(state) or not _takes_part(state, key):
            self.scopes.confirm(ekey, key)
        else:
            self.scopes.wait_for(ekey, key)
        if result != "unchanged":
            # Agents re-register every 30 s to converge; an unchanged one is neither written
            # nor announced.
            out.put_workers.append(rec)
        out.events.extend(registration_events(reg, result, was_stale, current, now))
        if reg.rendezvous is not None:
            self._rendezvous(ekey, now, out)
            self._grow_registered(key, fresh_process or was_stale, now, out)
        unusable = self.unusable(reg.devices)
        if unusable and result != "unchanged":
            out.events.append(
                event_at(
                    reg,
                    "worker_on_unusable_device",
                    now,
                    detail=f"registered with out-of-service device(s) {', '.join(unusable)}",
                )
            )
        return Registered(
            out, result, state.epoch, state.command, self.config.renew_interval_s, unusable
        )

    def _scope_state(
        self, ekey: EpochKey, state: EpochRecord | None, seen: int, out: Outcome
    ) -> EpochRecord:
        """The scope's epoch record, made on its first worker's registration, and ahead of any
        epoch the registering agent has seen."""
        if state is None:
            # Reserve the first block now, off the failure path. Written ahead: a command under
            # this ceiling needs no write of its own, so the ceiling must be durable first.
            state = EpochRecord(job=ekey.job, replica=ekey.replica, ceiling=self.config.epoch_block)
            self.scopes.put(ekey, state)
            out.write_ahead.append(state)
        if seen > state.epoch:
            # The agent saw an epoch we do not know (a lost write, state restored from an older
            # copy): adopt it, so the next command is above anything agents have seen.
            state.epoch = seen
            state.ceiling = max(state.ceiling, seen + self.config.epoch_block)
            if state not in out.write_ahead:
                out.write_ahead.append(state)
        return state

    def deregister(self, key: WorkerKey, reason: str, now: float) -> tuple[Outcome, bool]:
        out = Outcome()
        if not self._remove_worker(key, out, now):
            return out, False
        out.events.append(
            ControllerEvent(
                kind="deregistered",
                ts=now,
                job=key.job,
                replica=key.replica,
                worker=key.worker,
                detail=reason,
            )
        )
        return out, True

    def _remove_worker(self, key: WorkerKey, out: Outcome, now: float) -> bool:
        rec = self.workers.pop(key, None)
        if rec is None:
            return False
        self._forget_unused(self.drmap.remove_worker(key), out)
        job_workers = self._job_workers[key.job]
        job_workers.discard(key)
        if not job_workers:
            del self._job_workers[key.job]
        self.last_seen.pop(key, None)
        self.stale.discard(key)
        self.reports.pop(key, None)
        out.deleted_workers.append(key)
        ekey = self._epoch_key_of(rec)
        self._confirm(ekey, key)
        # The scope's epoch record stays with nobody left in it, for ``epoch_retention_s``: a
        # replica id that comes back continues above every epoch its agents may have seen.
        if not self._scope_workers(ekey):
            self.scopes.vacated(ekey, now)
        return True

    def _forget_unused(self, devices: frozenset[str], out: Outcome) -> None:
        """Devices no worker uses any more are forgotten (state, failure history)."""
        for device in devices:
            rec = self.devices.get(device)
            if self.drmap.has_device(device) or rec is None or self.out_of_service(rec):
                continue  # still used, never known, or out of service (kept on purpose)
            del self.devices[device]
            out.deleted_devices.append(device)

    def forget(self, job: str, replica: str | None, worker: int | None, now: float) -> Outcome:
        """An operator removes a job, a replica or one worker (``marduk monitor forget``)."""
        out = Outcome()
        keys = sorted(
            k
            for k in self._job_workers.get(job, ())
            if (replica is None or k.replica == replica) and (worker is None or k.worker == worker)
        )
        for key in keys:
            self._remove_worker(key, out, now)
            out.events.append(
                ControllerEvent(
                    kind="forgotten",
                    ts=now,
                    job=key.job,
                    replica=key.replica,
                    worker=key.worker,
                    detail="removed by an operator",
                )
            )
        # The scopes' epoch records stay, as after a deregistration: a forgotten worker still
        # alive, or an id that comes back, must never see an epoch it has seen issued again
        # (its agent would drop it as stale, and an old command could be replayed to it).
        return out

    def ack(
        self, key: WorkerKey, epoch: int, now: float, *, devices: Sequence[str] | None = None
    ) -> Outcome:
        """A worker acted on ``epoch``, knowing its command's ``devices`` (None: not said)."""
        out = Outcome()
        rec = self.workers.get(key)
        if rec is not None:
            self._seen(key, now)
        if rec is None or epoch <= rec.applied_epoch:
            return out
        rec.applied_epoch = epoch
        rec.updated_at = now
        # Not persisted: after a controller restart agents re-register (on its hello) with the
        # epoch they acknowledged, which rebuilds this. Acks of a job-wide restart arrive by the
        # thousand at once; they must not queue a write each.
        ekey = self._epoch_key_of(rec)
        state = self.epochs.get(ekey)
        if state is not None and epoch >= state.epoch:
            self._confirm(ekey, key)
        if state is not None and devices is not None and epoch == state.epoch:
            self._restart_if_acted_too_early(ekey, state, rec, devices, now, out)
        return out

    def _restart_if_acted_too_early(
        self,
        ekey: EpochKey,
        state: EpochRecord,
        rec: WorkerRecord,
        acted_on: Sequence[str],
        now: float,
        out: Outcome,
    ) -> None:
        """A failure of one of this worker's devices was merged into the restart in flight
        after the worker had acted on it (its ack was on its way): its trainer may have
        started before that failure, so the merge did not cover it. A new epoch does."""
        command = state.command
        if command is None or command.kind != "restart":
            return
        mine = set(rec.registration.devices)
        late = [d for d in command.devices if d in mine and d not in acted_on]
        if not late:
            return
        reg = rec.registration
        worker = WorkerKey(reg.job, reg.replica, reg.worker)
        reason = (
            f"device(s) {', '.join(late)} failed while {worker} was restarting for epoch "
            f"{state.epoch}"
        )
        issued = self._issue(ekey, "restart", reason, late, "", now, out)
        out.events.append(
            ControllerEvent(
                kind="restart_issued",
                ts=now,
                job=ekey.job,
                replica=ekey.replica,
                worker=reg.worker,
                device=late[0],
                epoch=issued.epoch,
                detail=reason + " (merged after it acted)",
            )
        )

    def _seen(self, key: WorkerKey, now: float) -> None:
        self._heard(key, now)
        # A stale worker heard from again becomes live at its next renewal (which answers it).

    def _heard(self, key: WorkerKey, now: float) -> None:
        self.last_seen.pop(key, None)  # to the end: the dict stays in order of last heard
        self.last_seen[key] = now

    def _confirm(self, ekey: EpochKey, key: WorkerKey) -> None:
        self.scopes.confirm(ekey, key)

    # --- agent reports ---------------------------------------------------------------------------

    def on_report(self, report: Report, now: float) -> ReportResult:
        """A supervisor reports its trainer's status; a failure restarts the worker's scope."""
        key = WorkerKey(report.job, report.replica, report.worker)
        rec = self.workers.get(key)
        if rec is None:
            raise PolicyError("unknown_worker", f"worker {key} is not registered; register first")
        self._seen(key, now)
        previous = self.reports.get(key)
        started = report.status == "running" and (
            previous is None
            or previous.incarnation != report.incarnation
            or previous.status != "running"
        )
        if previous is not None and previous.failure_class and not report.failure_class:
            # Keep the last failure's class visible in status while the trainer runs again.
            report = msgspec.structs.replace(report, failure_class=previous.failure_class)
        self.reports[key] = report
        out = Outcome()
        if report.status == "running":
            out = self.ack(key, report.epoch, now)
            if started:  # not a progress update of a trainer already announced
                out.events.append(worker_event("trainer_started", key, report, now))
            return ReportResult(out, [])
        if report.status not in FAILURE_STATUSES:
            out.events.append(worker_event(f"trainer_{report.status}", key, report, now))
            if report.status == "checkpointed":
                self._grow_checkpointed(key, now, out)
            return ReportResult(out, [])

        out.events.append(worker_event(f"worker_{report.status}", key, report, now))
        ekey = self._epoch_key_of(rec)
        state = self.epochs.get(ekey)
        current = state.epoch if state else 0
        if report.epoch < current or (self._pending(ekey, now) and not self.scopes.inherited(ekey)):
            # A restart that covers this failure is already under way (one inherited from an
            # earlier term may have been applied already: the crash may come after it).
            assert state is not None
            kind = state.command.kind if state.command else "restart"
            return ReportResult(
                out,
                [
                    Action(
                        job=key.job, replica=ekey.replica, kind=kind, epoch=current, coalesced=True
                    )
                ],
            )
        what = report.failure_class or report.status
        reason = f"worker {key} {report.status}"
        if report.summary:
            reason += f" ({what}: {report.summary})"
        command = self._issue(ekey, "restart", reason, [], f"report:{key}", now, out)
        out.events.append(
            ControllerEvent(
                kind="restart_issued",
                ts=now,
                job=key.job,
                replica=ekey.replica,
                epoch=command.epoch,
                detail=reason,
            )
        )
        action = Action(job=key.job, replica=ekey.replica, kind="restart", epoch=command.epoch)
        return ReportResult(out, [action])

    def _issue(
        self,
        ekey: EpochKey,
        kind: CommandKind,
        reason: str,
        devices: list[str],
        cause: str,
        now: float,
        out: Outcome,
        *,
        pending: bool = True,
        membership: Membership | None = None,
    ) -> Command:
        """A new epoch for ``ekey`` and its command. ``pending``: a restart the scope's workers
        must confirm (coalescing further failures, resent until then); a checkpoint is not.
        ``membership``: the job's first (else a restart renews the one in force)."""
        epoch = self.scopes.next_epoch(ekey)
        state = self.epochs.get(ekey) or EpochRecord(job=ekey.job, replica=ekey.replica)
        if epoch > state.ceiling:
            state.ceiling = epoch + self.config.epoch_block - 1
            out.write_ahead.append(state)
        membership = membership or self._next_membership(ekey, state, kind, epoch)
        if membership is not state.membership:
            # Who takes part at this epoch must be durable before anyone is told: a leader
            # taking over mid-change starts from it, never from a membership nobody saw.
            state.membership = membership
            if state not in out.write_ahead:
                out.write_ahead.append(state)
        command = Command(
            command_id=f"{ekey.job}/{ekey.replica or '*'}/{epoch}",
            job=ekey.job,
            replica=ekey.replica,
            scope="job" if ekey.replica is None else "replica",
            kind=kind,
            epoch=epoch,
            reason=reason,
            devices=devices,
            event_id=cause,
            issued_at=now,
            membership=state.membership,
            retired=self._retired(ekey),
        )
        state.epoch, state.issued_at, state.command = epoch, now, command
        self.scopes.put(ekey, state)
        live = [
            w for w in self._scope_workers(ekey) if w not in self.stale and _takes_part(state, w)
        ]
        self.scopes.issued(ekey, live if pending else None, now)
        out.commands.append(command)
        if state not in out.write_ahead:
            out.put_epochs.append(state)
        if kind in ("restart", "fail") and ekey.replica is not None:
            self._notify_peers(ekey.job, now, out)
        return command

    def _notify_peers(self, job: str, now: float, out: Outcome) -> None:
        """The notices of ``out`` for ``job``, made again from all of its commands so far (a
        decision may restart several replicas of the job: each notice names them all)."""
        recipients = self.notice_replicas(job)
        if not recipients:
            return
        peers = failed_peers(job, out.commands)
        reason = "; ".join(
            f"{c.replica} {c.kind} at epoch {c.epoch}: {c.reason}"
            for c in out.commands
            if c.job == job and c.replica is not None and c.kind in ("restart", "fail")
        )
        out.notices = [n for n in out.notices if n.job != job]
        out.notices.extend(peer_notices(job, recipients, peers, reason, now))

    def notice_replicas(self, job: str) -> set[str]:
        """Replicas of ``job`` with a live worker that asked for peer notices."""
        return {
            k.replica
            for k in self._job_workers.get(job, ())
            if k not in self.stale and self.workers[k].registration.peer_notices
        }

    def _pending(self, ekey: EpochKey, now: float) -> bool:
        state = self.epochs.get(ekey)
        if state is None or not self.scopes.in_flight(ekey):
            return False
        return now - state.issued_at < self.config.pending_timeout_s

    # --- time ------------------------------------------------------------------------------------

    def tick(self, now: float) -> Outcome:
        """Time passes: silent workers go stale, then expire; unconfirmed commands are resent."""
        out = Outcome()
        ttl, expiry = self.config.worker_ttl_s, self.config.worker_expiry_s
        silent_ones = []
        for key, seen in self.last_seen.items():  # oldest first
            if now - seen < ttl:
                # Everyone after was heard from later. (Should the wall clock step back, a
                # worker heard from just after is found silent when those ahead of it are.)
                break
            silent_ones.append((key, seen))
        newly_stale: list[WorkerKey] = []
        for key, seen in silent_ones:
            silent = now - seen
            if silent >= expiry:
                self._remove_worker(key, out, now)
                out.events.append(
                    ControllerEvent(
                        kind="worker_expired",
                        ts=now,
                        job=key.job,
                        replica=key.replica,
                        worker=key.worker,
                        detail=f"silent for {silent:.0f}s; removed from the map",
                    )
                )
            elif silent >= ttl and key not in self.stale:
                self.stale.add(key)
                # A silent worker must not hold a restart of its scope pending.
                self._confirm(self._epoch_key(key), key)
                out.events.append(
                    ControllerEvent(
                        kind="worker_stale",
                        ts=now,
                        job=key.job,
                        replica=key.replica,
                        worker=key.worker,
                        detail=f"no renewal for {silent:.0f}s (TTL {ttl:g}s)",
                    )
                )
                newly_stale.append(key)
        self._lose_silent(newly_stale, now, out)
        self._drop_vacant_epochs(now, out)
        self._rendezvous_tick(now, out)
        self._grow_tick(newly_stale, now, out)
        for ekey in self.scopes.due(now, self.config.resend_interval_s):
            state = self.epochs.get(ekey)
            if state is None or state.command is None or not self._pending(ekey, now):
                continue
            out.resent.append(state.command)
            self.scopes.sent(ekey, now)
        return out

    def _drop_vacant_epochs(self, now: float, out: Outcome) -> None:
        """Epoch records of scopes vacant for ``epoch_retention_s`` are deleted, so the state
        bucket does not keep every job ever run. Safe: a worker that comes back later with an
        epoch it saw has it adopted at registration (the next command is above it), and a new
        process starts after every command of the old ones."""
        retention = self.config.epoch_retention_s
        for ekey in self.scopes.vacant_for(retention, now):
            if self._scope_workers(ekey) or not self.scopes.drop(ekey):
                continue
            out.deleted_epochs.append(ekey)
            out.events.append(
                ControllerEvent(
                    kind="epochs_dropped",
                    ts=now,
                    job=ekey.job,
                    replica=ekey.replica,
                    detail=f"no worker for {retention:g}s: the scope's epoch record is deleted",
                )
            )

    def _remember(self, reply: HealthReply) -> None:
        self._recent_events[reply.event_id] = reply
        while len(self._recent_events) > self.config.dedup_capacity:
            self._recent_events.popitem(last=False)

    # --- helpers ---------------------------------------------------------------------------------

    def _epoch_key(self, key: WorkerKey) -> EpochKey:
        return self._epoch_key_of(self.workers[key])

    @staticmethod
    def _epoch_key_of(rec: WorkerRecord) -> EpochKey:
        reg = rec.registration
        return epoch_key_for(reg.job, reg.replica, reg.scope)

    def _scope_workers(self, ekey: EpochKey) -> list[WorkerKey]:
        if ekey.replica is None:
            return sorted(self._job_workers.get(ekey.job, ()))
        return sorted(self.drmap.workers_of_replica(ReplicaKey(ekey.job, ekey.replica)))

    def epoch_of(self, ekey: EpochKey) -> int:
        state = self.epochs.get(ekey)
        return state.epoch if state else 0

    def epoch_of_worker(self, key: WorkerKey) -> int:
        rec = self.workers.get(key)
        return self.epoch_of(self._epoch_key_of(rec)) if rec else 0

    def awaiting(self, ekey: EpochKey) -> frozenset[WorkerKey]:
        return self.scopes.awaiting(ekey)

    # --- views for queries (marduk.core.views) ---------------------------------------------------

    def worker_infos(self, job: str | None = None) -> list[WorkerInfo]:
        from marduk.core.views import worker_infos

        return worker_infos(self, job)

    def device_infos(self, job: str | None = None) -> list[DeviceInfo]:
        from marduk.core.views import device_infos

        return device_infos(self, job)
