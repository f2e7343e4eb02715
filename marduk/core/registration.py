"""Registrations: the checks a registration passes before it changes anything (a refused one
leaves no trace), whether it comes from a fresh process, the events it announces, and
``RegistrationRules``, which applies them (``register``, ``deregister``, an operator's
``forget``) over the policy's ``Fleet``, with the membership's, the grow's and the device
service's rules. Pure: no I/O, no clock (``now`` is an argument).

A new process starts after every restart commanded so far: it is current. An agent that saw an
epoch the controller does not know (a lost write, state restored from an older copy) has it
adopted, so the next command is above anything agents have seen; within ``MAX_ADOPTED_JUMP``
of what was reserved, no more.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from marduk.core.acks import AckRules
from marduk.core.decisions import (
    Outcome,
    PolicyConfig,
    PolicyError,
    Registered,
    epoch_key_for,
    event_at,
    worker_key,
)
from marduk.core.drmap import WorkerKey
from marduk.core.fleet import Fleet, awaited, takes_part
from marduk.core.grow_policy import GrowRules
from marduk.core.membership_policy import MembershipRules
from marduk.core.pools import PoolRules, is_pool_spare
from marduk.core.records import EpochKey, EpochRecord, WorkerRecord
from marduk.core.service_policy import ServiceRules
from marduk.wire.protocol import (
    MAX_EPOCH,
    ControllerEvent,
    Registration,
    Rendezvous,
    same_process,
)

# An agent may have seen epochs a lost write never recorded; it may not claim more than this
# above what was reserved (the agents' own MAX_EPOCH_JUMP is the same bound).
MAX_ADOPTED_JUMP = 10_000


def check_adoptable(seen: int, state: EpochRecord | None, epoch_block: int) -> None:
    """Refuse an epoch no controller of ours could have issued."""
    reserved = max(state.ceiling, state.epoch) if state else epoch_block
    if seen > reserved + MAX_ADOPTED_JUMP:
        # A forged or corrupted claim that would push the scope's epochs towards 2**53.
        raise PolicyError(
            "invalid",
            f"epoch {seen} is far beyond this scope's (reserved up to {reserved}); "
            "refusing to adopt it",
        )
    if seen > MAX_EPOCH - epoch_block:
        # Adopting it would leave no epoch to issue that JSON peers can read.
        raise PolicyError(
            "invalid", f"epoch {seen} is beyond what this controller could have issued"
        )


def check_duplicate(
    key: WorkerKey,
    old: WorkerRecord,
    reg: Registration,
    silent_for: float,
    stale: bool,
    config: PolicyConfig,
) -> None:
    """Refuse a second live process claiming a worker identity another live process holds.

    Two live processes never share a host and pid, so the same (host, pid) takes over
    whatever its instance (the holder is gone: a container restarted as PID 1); a higher
    incarnation is a supervisor's next trainer. A holder silent for the worker TTL (or stale)
    is presumed dead and may be replaced.
    """
    prev = old.registration
    if (prev.host, prev.pid) == (reg.host, reg.pid) or reg.incarnation > prev.incarnation:
        return
    if stale or silent_for >= config.worker_ttl_s:
        return
    raise PolicyError(
        "duplicate_worker",
        f"worker {key} is held by pid {prev.pid} on {prev.host or '?'}, which renewed "
        f"{silent_for:.0f}s ago; pid {reg.pid} on {reg.host or '?'} "
        f"may take it over once that one deregisters or is silent for "
        f"{config.worker_ttl_s:g}s",
    )


def check_scope(reg: Registration, job_workers: Iterable[WorkerRecord]) -> None:
    """All workers of a job agree on its restart scope."""
    for rec in job_workers:
        if worker_key(rec.registration) == worker_key(reg):
            continue
        if rec.registration.scope != reg.scope:
            raise PolicyError(
                "scope_conflict",
                f"job {reg.job!r} is registered with scope {rec.registration.scope!r} "
                f"(worker {worker_key(rec.registration)}); this worker asked for {reg.scope!r}",
            )
        return


def is_fresh_process(old: Registration, reg: Registration) -> bool:
    """Another process (host, pid, instance) or its supervisor's next trainer: it starts after
    every restart commanded so far."""
    return not same_process(old, reg) or old.incarnation != reg.incarnation


def registration_events(
    reg: Registration,
    result: Literal["new", "updated", "unchanged"],
    was_stale: bool,
    epoch: int,
    now: float,
) -> list[ControllerEvent]:
    """What a registration announces: a new or changed worker, or one live again."""
    if result != "unchanged":
        detail = (
            f"{reg.role} pid {reg.pid} on {reg.host or '?'}: "
            f"{len(reg.devices)} device(s), scope {reg.scope}"
        )
        new = result == "new"
        return [
            event_at(reg, "registered" if new else "reregistered", now, epoch=epoch, detail=detail)
        ]
    if was_stale:
        return [event_at(reg, "worker_live", now, detail="renewed again after being stale")]
    return []


class RegistrationRules:
    """Workers coming and going: registrations, deregistrations, an operator's forget."""

    def __init__(
        self,
        fleet: Fleet,
        membership: MembershipRules,
        grow: GrowRules,
        service: ServiceRules,
        pools: PoolRules,
        acks: AckRules,
    ) -> None:
        self.fleet = fleet
        self.membership = membership
        self.grow = grow
        self.service = service
        self.pools = pools
        self.acks = acks

    def register(self, reg: Registration, now: float) -> Registered:
        """Check, then record the worker: its scope's epoch (adopting one it saw), whether it
        must still confirm it, and what the registration announces or starts (a membership
        forming, a grow)."""
        fleet, key = self.fleet, worker_key(reg)
        claimed = self.pools.claimed_by(reg)
        if claimed is not None:  # a job took this pool spare: it registers there now
            interval = fleet.config.renew_interval_s
            return Registered(Outcome(), "unchanged", 0, None, interval, claimed_by=claimed)
        check_scope(reg, (fleet.workers[k] for k in fleet.job_workers.get(reg.job, ())))
        self.service.check_claims(reg, now)
        out = Outcome()
        old = fleet.workers.get(key)
        was_stale = key in fleet.stale
        if old is not None:
            silent_for = now - fleet.last_seen.get(key, 0.0)
            check_duplicate(key, old, reg, silent_for, was_stale, fleet.config)
        ekey = epoch_key_for(reg.job, reg.replica, reg.scope)
        state = fleet.epochs.get(ekey)
        # Every check before the first change: a refused registration leaves no trace (a
        # worker heard from but never recorded would expire, and fail, forever).
        check_adoptable(max(reg.epoch, reg.seen_epoch), state, fleet.config.epoch_block)
        renewal = old is not None and old.registration == reg and not was_stale
        self.membership.check(reg, state, renewal=renewal)
        if old is None:  # a worker registered is never refused for the size (nor evicted)
            self.membership.check_size(reg)
        fleet.heard(key, now)
        fleet.stale.discard(key)
        fresh_process = old is None or is_fresh_process(old.registration, reg)
        state = self._scope_state(ekey, state, max(reg.epoch, reg.seen_epoch), out)
        if fresh_process:
            # A new process starts after every restart commanded so far: it is current.
            applied = max(reg.epoch, state.epoch)
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
            # Back from stale, it arrives again: the join timeout (MIN here since the MIN-th
            # registration) and the order of arrival count from its return, not from a
            # presence that broke off.
            registered_at=old.registered_at if old and not was_stale else now,
            updated_at=now,
            applied_epoch=applied,
            # Retired stays retired; a new process under its name starts afresh.
            retired=old.retired if old and same_process(old.registration, reg) else "",
        )
        self._record(ekey, state, rec, out)
        if not fresh_process and reg.revision is not None and reg.epoch == state.epoch:
            # The ack of this epoch may never have reached this leader (acks are not
            # persisted): the revision it started with is checked as the ack's would be.
            self.acks.restart_uncovered(ekey, rec, now, out, revision=reg.revision)
        if result != "unchanged" or was_stale:
            # Agents re-register every 30 s to converge; an unchanged one is neither written
            # nor announced (one back from stale is written: its new registration time).
            out.put_workers.append(rec)
        out.events.extend(registration_events(reg, result, was_stale, state.epoch, now))
        if reg.rendezvous is not None and not is_pool_spare(reg):  # a pool forms nothing
            self.membership.registered(ekey, reg.rendezvous, now, out)
            self.grow.registered(key, fresh_process or was_stale, now, out)
        if reg.rendezvous is not None and (old is None or old.registration != reg):
            self._health_changed(ekey, key, old, reg.rendezvous, now, out)
        unusable = fleet.unusable(reg.devices)
        if unusable and result != "unchanged":
            detail = f"registered with out-of-service device(s) {', '.join(unusable)}"
            out.events.append(event_at(reg, "worker_on_unusable_device", now, detail=detail))
        interval = fleet.config.renew_interval_s
        return Registered(out, result, state.epoch, state.command, interval, unusable)

    def _health_changed(
        self,
        ekey: EpochKey,
        key: WorkerKey,
        old: WorkerRecord | None,
        r: Rendezvous,
        now: float,
        out: Outcome,
    ) -> None:
        """The node says it failed its checks before a start (or passes them again): an event
        with why; a member saying so is retired at once, as a drained one is (a spare takes its
        ranks, or the job shrinks, or it is held: ``replace_members``). A non-member is left
        out by ``Fleet.unfit``: no rank, no spare."""
        was = old.registration.rendezvous.unhealthy if old and old.registration.rendezvous else ""
        if r.unhealthy == was:
            return
        if not r.unhealthy:
            out.events.append(event_at(key, "worker_healthy", now, detail=f"was: {was}"))
            return
        out.events.append(event_at(key, "worker_unhealthy", now, detail=r.unhealthy))
        state = self.fleet.epochs.get(ekey)
        m = state.membership if state is not None else None
        rec = self.fleet.workers[key]
        if state is None or m is None or rec.retired or m.member(key.replica, key.worker) is None:
            return
        why = f"member {key.replica}/{key.worker} unhealthy: {r.unhealthy}"
        self.membership.replace_members(ekey, state, {key: why}, [], "unhealthy", now, out)

    def _scope_state(
        self, ekey: EpochKey, state: EpochRecord | None, seen: int, out: Outcome
    ) -> EpochRecord:
        """The scope's epoch record, made on its first worker's registration, and ahead of any
        epoch the registering agent has seen."""
        block = self.fleet.config.epoch_block
        if state is None:
            # Reserve the first block now, off the failure path. Written ahead: a command under
            # this ceiling needs no write of its own, so the ceiling must be durable first.
            state = EpochRecord(job=ekey.job, replica=ekey.replica, ceiling=block)
            self.fleet.scopes.put(ekey, state)
            out.write_ahead.append(state)
        if seen > state.epoch:
            # The agent saw an epoch we do not know (a lost write, state restored from an older
            # copy): adopt it, so the next command is above anything agents have seen.
            state.epoch = seen
            state.ceiling = max(state.ceiling, seen + block)
            if state not in out.write_ahead:
                out.write_ahead.append(state)
        return state

    def _record(self, ekey: EpochKey, state: EpochRecord, rec: WorkerRecord, out: Outcome) -> None:
        """Keep the worker's record; it waits to confirm the scope's epoch unless it applied
        it (or need not: a checkpoint, or not a member)."""
        fleet, key = self.fleet, worker_key(rec.registration)
        dropped = fleet.put_worker(rec)
        fleet.scopes.occupied(ekey)
        fleet.forget_unused(dropped, out)
        if rec.applied_epoch >= state.epoch or not awaited(state) or not takes_part(state, key):
            fleet.scopes.confirm(ekey, key)
        else:
            fleet.scopes.wait_for(ekey, key)

    def deregister(self, key: WorkerKey, reason: str, now: float) -> tuple[Outcome, bool]:
        """The worker leaves (its scope's epoch record stays); False if it was unknown."""
        out = Outcome()
        if not self.fleet.remove_worker(key, out, now):
            return out, False
        self.grow.left(key)
        out.events.append(event_at(key, "deregistered", now, detail=reason))
        return out, True

    def forget(self, job: str, replica: str | None, worker: int | None, now: float) -> Outcome:
        """An operator removes a job, a replica or one worker (``marduk monitor forget``)."""
        out = Outcome()
        keys = sorted(
            k
            for k in self.fleet.job_workers.get(job, ())
            if (replica is None or k.replica == replica) and (worker is None or k.worker == worker)
        )
        for key in keys:
            self.fleet.remove_worker(key, out, now)
            self.grow.left(key)
            out.events.append(event_at(key, "forgotten", now, detail="removed by an operator"))
        # The scopes' epoch records stay, as after a deregistration: a forgotten worker still
        # alive, or an id that comes back, must never see an epoch it has seen issued again
        # (its agent would drop it as stale, and an old command could be replayed to it).
        return out
