"""Growing a job back towards MAX at a safe point (docs/decisions.md #17). Part of the pure
policy (no I/O, ``now`` passed in): ``GrowRules``, over the policy's ``Fleet`` and its ``Issuer``.
Who may join and when is ``marduk.core.grow``'s rule; the membership it makes is
``marduk.core.membership``'s.

* **Start.** A job with a membership below MAX, a worker that may join it (live long enough,
  not a declared spare), no restart in flight and the resize interval past: the job gets a
  ``checkpoint`` command (its trainers save at their next step and keep training), event
  ``grow_started``. The grow is written with the epoch record (``EpochRecord.grow``: the
  checkpoint's epoch, when, who joins), so a new leader finishes it.
* **Wait.** Each member confirms with a ``checkpointed`` report; the wait ends when every live
  member has, or after ``grow_checkpoint_timeout_s`` (a new leader, which never saw the
  reports, waits out the rest of it).
* **Finish.** One ``restart`` at a new epoch with the larger membership (the members keep
  their node ranks, the new workers take the next ones), written ahead with its epoch as every
  membership; event ``member_added`` for each. Joining workers gone stale meanwhile are left
  out; none left: ``grow_abandoned``, nothing restarts.
* **Superseded.** Any other command of the job meanwhile (a crash's restart, a preemption's
  checkpoint) voids the grow (``grow_abandoned``); it starts again once that settles. A member
  lost meanwhile takes the shrink or swap path, where the joining workers are free workers like
  any other (``MembershipRules``, which tells ``abandon`` and ``resized``).
"""

from __future__ import annotations

from collections.abc import Iterable

from marduk.core import grow as rule
from marduk.core import membership as rdzv
from marduk.core.decisions import Outcome, event_at
from marduk.core.drmap import WorkerKey
from marduk.core.fleet import Fleet
from marduk.core.issuer import Issuer
from marduk.core.records import EpochKey, EpochRecord, GrowRecord, WorkerRecord
from marduk.wire.protocol import WorkerRef


class GrowRules:
    """Grows of jobs with a membership: what the rest of the policy tells them, and the
    decision (see the module)."""

    def __init__(self, fleet: Fleet, issuer: Issuer) -> None:
        self.fleet = fleet
        self.issuer = issuer
        # Jobs that may grow (a free worker, or a grow waiting): looked at on every tick.
        self.watch: set[str] = set()
        # Members that confirmed the checkpoint of their job's grow (in memory: a new leader
        # waits out the bound instead).
        self.confirmed: dict[str, set[WorkerKey]] = {}
        # Since when each worker of a rendezvous job has been live without going stale.
        self.live_since: dict[WorkerKey, float] = {}
        # Since when each worker that registered warming (``Rendezvous.ready`` false) has been
        # ready; ``warming``: those not ready yet. Neither: ready since live.
        self.ready_since: dict[WorkerKey, float] = {}
        self.warming: set[WorkerKey] = set()
        # A new leader's: since when each worker's record says it has been here and ready
        # (``resume``), credited to its live time once it is heard from on time (``registered``).
        self.recorded_since: dict[WorkerKey, float] = {}
        self.resumed_at = 0.0
        # When each job's membership last changed size (formed, shrank, held, grew): a grow
        # waits ``resize_interval_s`` after it. Kept on the job's epoch record too
        # (``EpochRecord.resized_at``), so a new leader counts from the same time.
        self.last_resize: dict[str, float] = {}

    # --- what the rest of the policy tells us ---------------------------------------------------

    def registered(self, key: WorkerKey, afresh: bool, now: float, out: Outcome) -> None:
        """A worker of a rendezvous job registered (``afresh``: new, a new process, or back
        from stale: its live time starts over). A worker that is not a member may make the job
        grow (a member's renewals, by the thousand, need no look)."""
        recorded = self.recorded_since.pop(key, None)
        if afresh or key not in self.live_since:
            self.live_since[key] = now
            self.ready_since.pop(key, None)
        elif (
            recorded is not None and now - self.resumed_at <= 2 * self.fleet.config.renew_interval_s
        ):
            # The first renewal a new leader hears, on time: the worker was live across the
            # takeover, so its settle goes on from what its record says.
            self.live_since[key] = min(self.live_since[key], recorded)
        self._warm(key, now)
        state = self.fleet.epochs.get(EpochKey(key.job, None))
        m = state.membership if state is not None else None
        if m is not None and m.member(key.replica, key.worker) is None:
            self._step(key.job, now, out)

    def left(self, key: WorkerKey) -> None:
        """The worker is gone (deregistered, forgotten, expired): nothing of it is kept, so
        the maps stay as large as the fleet and a worker registering again under its name
        starts as a new one."""
        self.live_since.pop(key, None)
        self.ready_since.pop(key, None)
        self.warming.discard(key)
        self.recorded_since.pop(key, None)
        confirmed = self.confirmed.get(key.job)
        if confirmed is not None:
            confirmed.discard(key)

    def checkpointed(self, key: WorkerKey, now: float, out: Outcome) -> None:
        """A worker's trainer saved the checkpoint asked for: one confirmation of a grow."""
        state = self.fleet.epochs.get(EpochKey(key.job, None))
        if state is None or state.grow is None:
            return
        self.confirmed.setdefault(key.job, set()).add(key)
        self._step(key.job, now, out)

    def tick(self, newly_stale: Iterable[WorkerKey], now: float, out: Outcome) -> None:
        """Stale workers start their live time over; waiting grows may start or finish."""
        for key in newly_stale:
            self.live_since.pop(key, None)
            self.ready_since.pop(key, None)
            self.recorded_since.pop(key, None)
        for job in sorted(self.watch):
            self._step(job, now, out)

    def resume(self, now: float) -> None:
        """A new leader: every worker counts as live from now (renewals are not stored) until
        it is heard from within two renewal intervals, and then from its record's last write
        (``updated_at``: its arrival, a new process, its return from stale and its turning
        ready are each written, so the record is never older than its live and ready time).
        One first heard later may have been silent past the TTL before the takeover (that is
        not stored): it counts from now. Every job's last resize is the one its epoch record
        says (now for a record written before it said one), and grows read from the store are
        watched."""
        fleet = self.fleet
        live = [k for k in fleet.workers if k not in fleet.stale]
        self.live_since = {k: now for k in live}
        self.recorded_since = {
            k: min(now, rec.updated_at)
            for k in live
            if (rec := fleet.workers[k]).registration.rendezvous is not None
        }
        self.resumed_at = now
        self.ready_since = {}
        self.warming = {k for k in live if not warm(fleet.workers[k])}
        for ekey, state in fleet.epochs.items():
            if ekey.replica is None and state.membership is not None:
                self.last_resize[ekey.job] = state.resized_at or now
                self.watch.add(ekey.job)

    def resized(self, job: str, now: float) -> None:
        """The job's membership changed size at ``now`` (formed, shrank, held, grew): a grow
        waits. Noted on its epoch record, which the caller writes ahead with the membership."""
        self.last_resize[job] = now
        state = self.fleet.epochs.get(EpochKey(job, None))
        if state is not None:
            state.resized_at = now

    def abandon(
        self, ekey: EpochKey, state: EpochRecord, why: str, now: float, out: Outcome
    ) -> None:
        """The job's grow is void (another command came first, a member was lost, nobody is
        left to join); it starts again once the job settles."""
        state.grow = None
        self.confirmed.pop(ekey.job, None)
        if state not in out.write_ahead and state not in out.put_epochs:
            out.put_epochs.append(state)
        out.events.append(event_at(ekey, "grow_abandoned", now, epoch=state.epoch, detail=why))

    def _warm(self, key: WorkerKey, now: float) -> None:
        """Whether ``key`` is ready to start a trainer at once, from its registration: the
        settle counts from when it became so."""
        r = self.fleet.workers[key].registration.rendezvous
        if r is not None and not r.ready:
            self.warming.add(key)
            self.ready_since.pop(key, None)
        elif key in self.warming:
            self.warming.discard(key)
            self.ready_since[key] = now

    # --- the decision -----------------------------------------------------------------------------

    def _step(self, job: str, now: float, out: Outcome) -> None:
        """Start, finish or give up the job's grow, as it stands at ``now``."""
        ekey = EpochKey(job, None)
        state = self.fleet.epochs.get(ekey)
        if state is None or state.membership is None:  # held or forming: the rendezvous' turn
            self.watch.discard(job)
            return
        if state.grow is not None:
            self._wait(ekey, state, now, out)
        else:
            self._start(ekey, state, now, out)

    def _start(self, ekey: EpochKey, state: EpochRecord, now: float, out: Outcome) -> None:
        current = state.membership
        assert current is not None
        job, fleet, cfg = ekey.job, self.fleet, self.fleet.config
        usable = fleet.usable(job, now)
        hi = fleet.nnodes(job)[1]
        if len(current.members) >= hi or not rule.free_workers(current, job, usable):
            self.watch.discard(job)
            return
        self.watch.add(job)
        joining = rule.joining(
            current,
            job,
            usable,
            self.live_since,
            fleet.last_seen,
            now,
            cfg.grow_settle_s,
            2 * cfg.renew_interval_s,
            hi,
            ready_since=self.ready_since,
        )
        in_flight = self.issuer.pending(ekey, now)
        if not joining or rule.wait_reason(
            now, self.last_resize.get(job), cfg.resize_interval_s, in_flight
        ):
            return
        names = ", ".join(f"{c.key.replica}/{c.key.worker}" for c in joining)
        size = f"{len(current.members)} -> {len(current.members) + len(joining)} node(s)"
        reason = f"grow {size} ({names} joining): save a checkpoint now"
        state.grow = GrowRecord(
            epoch=fleet.scopes.next_epoch_peek(ekey),
            started_at=now,
            joining=[WorkerRef(replica=c.key.replica, worker=c.key.worker) for c in joining],
        )
        command = self.issuer.issue(
            ekey, "checkpoint", reason, [], f"grow:{job}", now, out, pending=False
        )
        state.grow.epoch = command.epoch
        self.confirmed[job] = set()
        out.events.append(event_at(ekey, "grow_started", now, epoch=command.epoch, detail=reason))
        out.events.append(
            event_at(ekey, "checkpoint_issued", now, epoch=command.epoch, detail=reason)
        )
        self._wait(ekey, state, now, out)  # nobody to wait for: at once

    def _wait(self, ekey: EpochKey, state: EpochRecord, now: float, out: Outcome) -> None:
        grow, current = state.grow, state.membership
        assert grow is not None and current is not None
        if grow.epoch != state.epoch:
            what = state.command.kind if state.command else "command"
            self.abandon(
                ekey,
                state,
                f"a {what} at epoch {state.epoch} came first; the job grows once it settles",
                now,
                out,
            )
            return
        confirmed = self.confirmed.get(ekey.job, set())
        fleet = self.fleet
        waiting = [
            k
            for k in fleet.member_keys(ekey.job, current)
            if k not in confirmed and k not in fleet.stale and not fleet.workers[k].retired
        ]
        if waiting and now - grow.started_at < fleet.config.grow_checkpoint_timeout_s:
            return
        self._finish(ekey, state, waiting, now, out)

    def _finish(
        self,
        ekey: EpochKey,
        state: EpochRecord,
        unconfirmed: list[WorkerKey],
        now: float,
        out: Outcome,
    ) -> None:
        """The restart with the larger membership, once the checkpoint is saved (or the wait
        is over): the joining workers still live and usable, as many as MAX has room for."""
        grow, current = state.grow, state.membership
        assert grow is not None and current is not None
        job, fleet = ekey.job, self.fleet
        named = {WorkerKey(job, w.replica, w.worker) for w in grow.joining}
        room = fleet.nnodes(job)[1] - len(current.members)
        fresh = 2 * fleet.config.renew_interval_s
        joining = [
            c
            for c in rule.free_workers(current, job, fleet.usable(job, now))
            if c.key in named and rule.on_time(c.key, fleet.last_seen, now, fresh)
        ][:room]
        if not joining:
            self.abandon(ekey, state, "the joining workers are gone", now, out)
            return
        state.grow = None
        self.confirmed.pop(job, None)
        candidates = fleet.candidates(job)
        m = rdzv.grow(current, fleet.scopes.next_epoch_peek(ekey), job, candidates, joining)
        saved = (
            "every member saved the checkpoint"
            if not unconfirmed
            else f"no checkpoint confirmed by {', '.join(_name(k) for k in unconfirmed)} within "
            f"{fleet.config.grow_checkpoint_timeout_s:g}s"
        )
        reason = (
            f"grow to {len(m.members)} node(s), world size {m.world_size}, coordinator "
            f"{m.coordinator_addr}:{m.coordinator_port} ({saved})"
        )
        command = self.issuer.issue(
            ekey, "restart", reason, [], f"grow:{job}", now, out, membership=m
        )
        self.resized(job, now)
        added = {c.key for c in joining}
        for member in m.members:
            key = WorkerKey(job, member.replica, member.worker)
            if key in added:
                detail = f"node rank {member.node_rank} (ranks {rdzv.span(member)}): {reason}"
                fleet.changed(
                    event_at(key, "member_added", now, epoch=command.epoch, detail=detail), out
                )


def warm(rec: WorkerRecord) -> bool:
    """Can the worker start a trainer at once (``Rendezvous.ready``: an older agent's
    registration says nothing, and is)?"""
    r = rec.registration.rendezvous
    return r is None or r.ready


def _name(key: WorkerKey) -> str:
    return f"{key.replica}/{key.worker}"
