"""Membership decisions: the controller as the rendezvous of jobs whose node ranks it assigns
(``marduk agent run --nnodes MIN:MAX``). Part of the pure policy (no I/O, ``now`` passed in);
``marduk.core.policy.Policy`` mixes it in and holds the state it works on. The rule itself (who,
which ranks, which coordinator port) is ``marduk.core.membership``'s.

* **Admission.** A registration with a ``rendezvous`` is checked before anything changes: scope
  ``job``, the job's shape, no node rank claimed twice (``rank_conflict``,
  ``shape_mismatch``). A job has static ranks or the controller's, never both.
* **The first epoch.** Once enough workers are here (MAX, or MIN for the join timeout, which
  ``tick`` watches) the membership forms: a ``restart`` at a new epoch that carries it.
* **Every restart** of such a job renews it (``_issue`` asks ``_next_membership``); a changed
  membership goes into the write-ahead with its epoch record.
* **A member out of service** (the device policy would ``fail`` the job, or ``tick`` finds it
  stale) is retired and leaves the membership in one restart: a spare takes its ranks, or the job
  shrinks, or it is held below MIN (``_replace_members``; docs/decisions.md #16).
"""

from __future__ import annotations

from collections.abc import Iterable

from marduk.core import membership as rdzv
from marduk.core.decisions import Outcome, PolicyConfig, PolicyError, worker_key
from marduk.core.drmap import WorkerKey
from marduk.core.records import DeviceRecord, EpochKey, EpochRecord, WorkerRecord
from marduk.core.scopes import Scopes
from marduk.wire.protocol import (
    Command,
    CommandKind,
    ControllerEvent,
    Member,
    Membership,
    Registration,
    WorkerRef,
)


class MembershipPolicy:
    """The membership half of ``Policy`` (state and helpers declared here, defined there)."""

    config: PolicyConfig
    scopes: Scopes
    workers: dict[WorkerKey, WorkerRecord]
    devices: dict[str, DeviceRecord]
    stale: set[WorkerKey]
    _job_workers: dict[str, set[WorkerKey]]
    # Jobs with MIN workers but no membership yet: since when (the join timeout counts from
    # there). In memory: a new leader starts the timeout over.
    _quorum_since: dict[str, float]
    # When each job's membership last changed size (formed, shrank, held, grew): a grow waits
    # ``resize_interval_s`` after it (marduk/core/grow_policy.py).
    _last_resize: dict[str, float]

    @property
    def epochs(self) -> dict[EpochKey, EpochRecord]:
        return self.scopes.records

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
        raise NotImplementedError

    def _epoch_key(self, key: WorkerKey) -> EpochKey:
        raise NotImplementedError

    def _grow_abandon(
        self, ekey: EpochKey, state: EpochRecord, why: str, now: float, out: Outcome
    ) -> None:
        raise NotImplementedError

    def _rendezvous_tick(self, now: float, out: Outcome) -> None:
        """The join timeout may have passed for jobs waiting for their first membership."""
        for job in list(self._quorum_since):
            self._rendezvous(EpochKey(job, None), now, out)

    def _check_rendezvous(self, reg: Registration, state: EpochRecord | None) -> None:
        """Refuse a worker that cannot take part in its job's membership (or, without a
        rendezvous, a worker of a job that has one, and the reverse)."""
        key = worker_key(reg)
        others = [k for k in self._job_workers.get(reg.job, ()) if k != key]
        if reg.rendezvous is None:
            if reg.scope == "job" and any(
                self.workers[k].registration.rendezvous is not None for k in others
            ):
                raise PolicyError(
                    "shape_mismatch",
                    f"job {reg.job!r} has its ranks from the controller (--nnodes MIN:MAX); "
                    f"worker {key.replica}/{key.worker} brings no rendezvous",
                )
            return
        if reg.scope != "job":
            raise PolicyError("invalid", "ranks from the controller need scope job")
        if any(self.workers[k].registration.rendezvous is None for k in others):
            raise PolicyError(
                "shape_mismatch",
                f"job {reg.job!r} has static ranks; worker {key.replica}/{key.worker} asks the "
                "controller for one (--nnodes MIN:MAX without --node-rank)",
            )
        try:
            rdzv.check(
                rdzv.Candidate(key, reg.rendezvous),
                self._candidates(reg.job),
                state.membership if state is not None else None,
            )
        except rdzv.MembershipError as e:
            raise PolicyError(e.code, str(e)) from None

    def _candidates(self, job: str) -> list[rdzv.Candidate]:
        """The live workers of ``job`` that brought a rendezvous and were not retired."""
        out = []
        for key in sorted(self._job_workers.get(job, ())):
            rec = self.workers[key]
            r = rec.registration.rendezvous
            if r is not None and key not in self.stale and not rec.retired:
                out.append(rdzv.Candidate(key, r, rec.registered_at))
        return out

    def _rendezvous(self, ekey: EpochKey, now: float, out: Outcome) -> None:
        """Form the job's first membership once enough workers are here (a restart at a new
        epoch that carries it), or note since when MIN of them are."""
        state = self.epochs.get(ekey)
        if state is not None and state.membership is not None:
            self._quorum_since.pop(ekey.job, None)
            return
        candidates = self._candidates(ekey.job)
        if not candidates or len(candidates) < candidates[0].rendezvous.min_nodes:
            self._quorum_since.pop(ekey.job, None)
            return
        since = self._quorum_since.setdefault(ekey.job, now)
        if not rdzv.ready(candidates, since, now, self.config.join_timeout_s):
            return
        membership = rdzv.form(self.scopes.next_epoch_peek(ekey), candidates)
        if membership is None:
            return  # given node ranks that the workers here cannot fill yet
        self._quorum_since.pop(ekey.job, None)
        self._last_resize[ekey.job] = now
        reason = (
            f"membership formed: {len(membership.members)} node(s), world size "
            f"{membership.world_size}, coordinator {membership.coordinator_addr}:"
            f"{membership.coordinator_port}"
        )
        command = self._issue(
            ekey, "restart", reason, [], "rendezvous", now, out, membership=membership
        )
        out.events.append(
            ControllerEvent(
                kind="membership_formed",
                ts=now,
                job=ekey.job,
                epoch=command.epoch,
                detail=reason,
            )
        )

    def _next_membership(
        self, ekey: EpochKey, state: EpochRecord, kind: CommandKind, epoch: int
    ) -> Membership | None:
        """A restart of a job with a membership renews it (same members, a new coordinator
        port); other commands carry the one in force."""
        if kind != "restart" or state.membership is None or ekey.replica is not None:
            return state.membership
        return rdzv.renew(state.membership, epoch, ekey.job, self._candidates(ekey.job))

    # --- members out of service: a spare takes their ranks, or the job shrinks, or it is held --

    def _in_play(self, workers: Iterable[WorkerKey]) -> frozenset[WorkerKey]:
        """Of ``workers``, those whose failure concerns their scope: all of them, except in a
        job with a membership, where spares and retired workers run nothing to restart."""
        out = set()
        for w in workers:
            state = self.epochs.get(self._epoch_key(w))
            if (
                state is None
                or state.membership is None
                or state.membership.member(w.replica, w.worker)
            ):
                out.add(w)
        return frozenset(out)

    def _issue_or_replace(
        self,
        ekey: EpochKey,
        kind: CommandKind,
        reason: str,
        devices: list[str],
        cause: str,
        now: float,
        out: Outcome,
    ) -> Command | None:
        """``kind`` for the scope; but a ``fail`` (``devices`` out of service or past their
        budget) of a job with a membership takes out only the members that use them
        (``_replace_members``); None when no member does (only spares: nothing to send)."""
        state = self.epochs.get(ekey)
        if kind != "fail" or ekey.replica is not None or state is None or not state.membership:
            return self._issue(ekey, kind, reason, devices, cause, now, out)
        used = set(devices)
        lost = {
            key: reason
            for key in self._member_keys(ekey.job, state.membership)
            if used & set(self.workers[key].registration.devices)
        }
        if not lost:
            return None
        return self._replace_members(ekey, state, lost, devices, cause, now, out)

    def _lose_silent(self, keys: Iterable[WorkerKey], now: float, out: Outcome) -> None:
        """Members gone stale (their host is gone, or cut off) leave their job's membership."""
        by_job: dict[EpochKey, dict[WorkerKey, str]] = {}
        for key in keys:
            ekey = self._epoch_key(key)
            state = self.epochs.get(ekey)
            m = state.membership if state is not None else None
            if ekey.replica is None and m and m.member(key.replica, key.worker) is not None:
                why = f"member {key.replica}/{key.worker} silent past the worker TTL"
                by_job.setdefault(ekey, {})[key] = why
        for ekey, lost in by_job.items():
            self._replace_members(ekey, self.epochs[ekey], lost, [], "stale", now, out)

    def _replace_members(
        self,
        ekey: EpochKey,
        state: EpochRecord,
        lost: dict[WorkerKey, str],
        devices: list[str],
        cause: str,
        now: float,
        out: Outcome,
    ) -> Command:
        """One restart of the job at a new epoch without the members ``lost`` (retired: told
        to exit 71): a free spare of each one's shape takes its ranks; with none, the job
        shrinks; below MIN it is held (no membership) until enough workers are back and it
        forms again. Written ahead with its epoch, as every membership."""
        previous = state.membership
        assert previous is not None
        for key, why in lost.items():
            rec = self.workers.get(key)
            if rec is not None and not rec.retired:
                rec.retired, rec.updated_at = why, now
                out.put_workers.append(rec)
        candidates = [c for c in self._candidates(ekey.job) if not self._unfit(c.key, now)]
        lowest = self._min_nodes(ekey.job)
        change = rdzv.replace(
            previous, self.scopes.next_epoch_peek(ekey), ekey.job, lost, candidates, lowest
        )
        why = "; ".join(sorted(set(lost.values())))
        m = change.membership
        if change.dropped or m is None:
            self._last_resize[ekey.job] = now  # never delayed itself; a grow waits after it
        if state.grow is not None:  # its new workers were candidates for the lost ranks
            self._grow_abandon(ekey, state, f"{why}: a member lost during the wait", now, out)
        if m is None:
            left = len(previous.members) - len(change.dropped)
            what = (
                f"job held: {left} node(s) left, below MIN {lowest}; its trainers wait until "
                f"{lowest} workers are registered, then the membership forms again"
            )
            state.membership = None
            if state not in out.write_ahead:
                out.write_ahead.append(state)
        else:
            what = (
                f"{len(m.members)} node(s), world size {m.world_size}, coordinator "
                f"{m.coordinator_addr}:{m.coordinator_port}"
            )
        command = self._issue(
            ekey,
            "restart",
            f"{why}: {what}",
            devices,
            cause,
            now,
            out,
            membership=m,
            pending=m is not None,
        )
        for lost_member, spare in change.replaced:
            self._event(
                out,
                "member_replaced",
                ekey.job,
                lost_member,
                command.epoch,
                now,
                f"node rank {lost_member.node_rank} (ranks {rdzv.span(lost_member)}) to spare "
                f"{spare.key.replica}/{spare.key.worker}: {lost[_key(ekey.job, lost_member)]}",
            )
        for gone in change.dropped if m is not None else ():
            self._event(
                out,
                "job_shrunk",
                ekey.job,
                gone,
                command.epoch,
                now,
                f"no free spare of {gone.nproc} rank(s): the job goes on without node rank "
                f"{gone.node_rank} ({lost[_key(ekey.job, gone)]}); {what}",
            )
        if m is None:
            self._event(out, "job_held", ekey.job, None, command.epoch, now, f"{why}; {what}")
            self._rendezvous(ekey, now, out)
        return command

    @staticmethod
    def _event(
        out: Outcome,
        kind: str,
        job: str,
        member: Member | None,
        epoch: int,
        now: float,
        detail: str,
    ) -> None:
        out.events.append(
            ControllerEvent(
                kind=kind,
                ts=now,
                job=job,
                replica=member.replica if member else None,
                worker=member.worker if member else None,
                epoch=epoch,
                detail=detail,
            )
        )

    def _member_keys(self, job: str, membership: Membership) -> list[WorkerKey]:
        """The registered workers of ``membership``."""
        keys = (_key(job, m) for m in membership.members)
        return [k for k in keys if k in self.workers]

    def _min_nodes(self, job: str) -> int:
        """The job's MIN (a non-spare's ``--nnodes``)."""
        return self._nnodes(job)[0]

    def _nnodes(self, job: str) -> tuple[int, int]:
        """The job's MIN:MAX: a live non-spare's ``--nnodes``, else the lowest MIN and the
        highest MAX any registered worker brought."""
        for c in self._candidates(job):
            if not c.rendezvous.spare:
                return c.rendezvous.min_nodes, c.rendezvous.max_nodes
        keys = sorted(self._job_workers.get(job, ()))
        found = [r for k in keys if (r := self.workers[k].registration.rendezvous) is not None]
        lo = min((r.min_nodes for r in found), default=1)
        return lo, max((r.max_nodes for r in found), default=lo)

    def _unfit(self, key: WorkerKey, now: float) -> str:
        """Why the worker may not take a rank ("" if it may): a device of it out of service or
        past its failure budget."""
        window, budget = self.config.device_failure_window_s, self.config.device_max_failures
        for device in self.workers[key].registration.devices:
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

    def _retired(self, ekey: EpochKey) -> list[WorkerRef]:
        """The job's retired workers still registered (``Command.retired``)."""
        if ekey.replica is not None:
            return []
        keys = sorted(self._job_workers.get(ekey.job, ()))
        return [
            WorkerRef(replica=k.replica, worker=k.worker) for k in keys if self.workers[k].retired
        ]


def _key(job: str, m: Member) -> WorkerKey:
    return WorkerKey(job, m.replica, m.worker)
