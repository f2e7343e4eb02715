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
"""

from __future__ import annotations

from marduk.core import membership as rdzv
from marduk.core.decisions import Outcome, PolicyConfig, PolicyError, worker_key
from marduk.core.drmap import WorkerKey
from marduk.core.records import EpochKey, EpochRecord, WorkerRecord
from marduk.core.scopes import Scopes
from marduk.wire.protocol import Command, CommandKind, ControllerEvent, Membership, Registration


class MembershipPolicy:
    """The membership half of ``Policy`` (state and helpers declared here, defined there)."""

    config: PolicyConfig
    scopes: Scopes
    workers: dict[WorkerKey, WorkerRecord]
    stale: set[WorkerKey]
    _job_workers: dict[str, set[WorkerKey]]
    # Jobs with MIN workers but no membership yet: since when (the join timeout counts from
    # there). In memory: a new leader starts the timeout over.
    _quorum_since: dict[str, float]

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
        """The live workers of ``job`` that brought a rendezvous."""
        out = []
        for key in sorted(self._job_workers.get(job, ())):
            rec = self.workers[key]
            r = rec.registration.rendezvous
            if r is not None and key not in self.stale:
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
