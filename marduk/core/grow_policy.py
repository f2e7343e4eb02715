"""Growing a job back towards MAX at a safe point (docs/decisions.md #17). Part of the pure
policy (no I/O, ``now`` passed in); ``marduk.core.policy.Policy`` mixes it in. Who may join and
when is ``marduk.core.grow``'s rule; the membership it makes is ``marduk.core.membership``'s.

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
  any other (``MembershipPolicy._replace_members``).
"""

from __future__ import annotations

from collections.abc import Iterable

from marduk.core import grow as rule
from marduk.core import membership as rdzv
from marduk.core.decisions import Outcome
from marduk.core.drmap import WorkerKey
from marduk.core.membership_policy import MembershipPolicy
from marduk.core.records import EpochKey, EpochRecord, GrowRecord
from marduk.wire.protocol import WorkerRef


class GrowPolicy(MembershipPolicy):
    """The grow half of ``Policy``'s membership decisions (state initialised there)."""

    # Jobs that may grow (a free worker, or a grow waiting): looked at on every tick.
    _grow_watch: set[str]
    # Members that confirmed the checkpoint of their job's grow (in memory: a new leader
    # waits out the bound instead).
    _grow_confirmed: dict[str, set[WorkerKey]]
    # Since when each worker of a rendezvous job has been live without going stale.
    _live_since: dict[WorkerKey, float]
    last_seen: dict[WorkerKey, float]

    def _pending(self, ekey: EpochKey, now: float) -> bool:
        raise NotImplementedError

    # --- what the rest of the policy tells us ---------------------------------------------------

    def _grow_registered(self, key: WorkerKey, afresh: bool, now: float, out: Outcome) -> None:
        """A worker of a rendezvous job registered (``afresh``: new, a new process, or back
        from stale: its live time starts over). A worker that is not a member may make the job
        grow (a member's renewals, by the thousand, need no look)."""
        if afresh or key not in self._live_since:
            self._live_since[key] = now
        state = self.epochs.get(EpochKey(key.job, None))
        m = state.membership if state is not None else None
        if m is not None and m.member(key.replica, key.worker) is None:
            self._grow_step(key.job, now, out)

    def _grow_checkpointed(self, key: WorkerKey, now: float, out: Outcome) -> None:
        """A worker's trainer saved the checkpoint asked for: one confirmation of a grow."""
        state = self.epochs.get(EpochKey(key.job, None))
        if state is None or state.grow is None:
            return
        self._grow_confirmed.setdefault(key.job, set()).add(key)
        self._grow_step(key.job, now, out)

    def _grow_tick(self, newly_stale: Iterable[WorkerKey], now: float, out: Outcome) -> None:
        """Stale workers start their live time over; waiting grows may start or finish."""
        for key in newly_stale:
            self._live_since.pop(key, None)
        for job in sorted(self._grow_watch):
            self._grow_step(job, now, out)

    def _grow_resume(self, now: float) -> None:
        """A new leader: every worker counts as live from now, every job's last resize as now
        (when they were is not stored), and grows read from the store are watched."""
        self._live_since = {k: now for k in self.workers if k not in self.stale}
        for ekey, state in self.epochs.items():
            if ekey.replica is None and state.membership is not None:
                self._last_resize[ekey.job] = now
                self._grow_watch.add(ekey.job)

    # --- the decision -----------------------------------------------------------------------------

    def _grow_step(self, job: str, now: float, out: Outcome) -> None:
        """Start, finish or give up the job's grow, as it stands at ``now``."""
        ekey = EpochKey(job, None)
        state = self.epochs.get(ekey)
        if state is None or state.membership is None:  # held or forming: the rendezvous' turn
            self._grow_watch.discard(job)
            return
        if state.grow is not None:
            self._grow_wait(ekey, state, now, out)
        else:
            self._grow_start(ekey, state, now, out)

    def _grow_start(self, ekey: EpochKey, state: EpochRecord, now: float, out: Outcome) -> None:
        current = state.membership
        assert current is not None
        job = ekey.job
        usable = [c for c in self._candidates(job) if not self._unfit(c.key, now)]
        hi = self._nnodes(job)[1]
        if len(current.members) >= hi or not rule.free_workers(current, job, usable):
            self._grow_watch.discard(job)
            return
        self._grow_watch.add(job)
        cfg = self.config
        joining = rule.joining(
            current,
            job,
            usable,
            self._live_since,
            self.last_seen,
            now,
            cfg.grow_settle_s,
            2 * cfg.renew_interval_s,
            hi,
        )
        if not joining or rule.wait_reason(
            now, self._last_resize.get(job), cfg.resize_interval_s, self._pending(ekey, now)
        ):
            return
        names = ", ".join(f"{c.key.replica}/{c.key.worker}" for c in joining)
        size = f"{len(current.members)} -> {len(current.members) + len(joining)} node(s)"
        reason = f"grow {size} ({names} joining): save a checkpoint now"
        state.grow = GrowRecord(
            epoch=self.scopes.next_epoch_peek(ekey),
            started_at=now,
            joining=[WorkerRef(replica=c.key.replica, worker=c.key.worker) for c in joining],
        )
        command = self._issue(
            ekey, "checkpoint", reason, [], f"grow:{job}", now, out, pending=False
        )
        state.grow.epoch = command.epoch
        self._grow_confirmed[job] = set()
        self._event(out, "grow_started", job, None, command.epoch, now, reason)
        self._event(out, "checkpoint_issued", job, None, command.epoch, now, reason)
        self._grow_wait(ekey, state, now, out)  # nobody to wait for: at once

    def _grow_wait(self, ekey: EpochKey, state: EpochRecord, now: float, out: Outcome) -> None:
        grow, current = state.grow, state.membership
        assert grow is not None and current is not None
        if grow.epoch != state.epoch:
            what = state.command.kind if state.command else "command"
            self._grow_abandon(
                ekey,
                state,
                f"a {what} at epoch {state.epoch} came first; the job grows once it settles",
                now,
                out,
            )
            return
        confirmed = self._grow_confirmed.get(ekey.job, set())
        waiting = [
            k
            for k in self._member_keys(ekey.job, current)
            if k not in confirmed and k not in self.stale and not self.workers[k].retired
        ]
        if waiting and now - grow.started_at < self.config.grow_checkpoint_timeout_s:
            return
        self._grow_finish(ekey, state, waiting, now, out)

    def _grow_finish(
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
        job = ekey.job
        named = {WorkerKey(job, w.replica, w.worker) for w in grow.joining}
        usable = [c for c in self._candidates(job) if not self._unfit(c.key, now)]
        room = self._nnodes(job)[1] - len(current.members)
        fresh = 2 * self.config.renew_interval_s
        joining = [
            c
            for c in rule.free_workers(current, job, usable)
            if c.key in named and rule.on_time(c.key, self.last_seen, now, fresh)
        ][:room]
        if not joining:
            self._grow_abandon(ekey, state, "the joining workers are gone", now, out)
            return
        state.grow = None
        self._grow_confirmed.pop(job, None)
        candidates = self._candidates(job)
        m = rdzv.grow(current, self.scopes.next_epoch_peek(ekey), job, candidates, joining)
        saved = (
            "every member saved the checkpoint"
            if not unconfirmed
            else f"no checkpoint confirmed by {', '.join(_name(k) for k in unconfirmed)} within "
            f"{self.config.grow_checkpoint_timeout_s:g}s"
        )
        reason = (
            f"grow to {len(m.members)} node(s), world size {m.world_size}, coordinator "
            f"{m.coordinator_addr}:{m.coordinator_port} ({saved})"
        )
        command = self._issue(ekey, "restart", reason, [], f"grow:{job}", now, out, membership=m)
        self._last_resize[job] = now
        added = {c.key for c in joining}
        for member in m.members:
            if WorkerKey(job, member.replica, member.worker) in added:
                self._event(
                    out,
                    "member_added",
                    job,
                    member,
                    command.epoch,
                    now,
                    f"node rank {member.node_rank} (ranks {rdzv.span(member)}): {reason}",
                )

    def _grow_abandon(
        self, ekey: EpochKey, state: EpochRecord, why: str, now: float, out: Outcome
    ) -> None:
        state.grow = None
        self._grow_confirmed.pop(ekey.job, None)
        if state not in out.write_ahead and state not in out.put_epochs:
            out.put_epochs.append(state)
        self._event(out, "grow_abandoned", ekey.job, None, state.epoch, now, why)


def _name(key: WorkerKey) -> str:
    return f"{key.replica}/{key.worker}"
