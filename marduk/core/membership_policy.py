"""Membership decisions: the controller as the rendezvous of jobs whose node ranks it assigns
(``marduk agent run --nnodes MIN:MAX``). Part of the pure policy (no I/O, ``now`` passed in):
``MembershipRules``, over the policy's ``Fleet``, its ``Issuer`` and the ``GrowRules`` it tells
of a lost member. The rule itself (who, which ranks, which coordinator port) is
``marduk.core.membership``'s.

* **Admission.** A registration with a ``rendezvous`` is checked before anything changes: scope
  ``job``, the job's shape, no node rank claimed twice (``rank_conflict``,
  ``shape_mismatch``). A job has static ranks or the controller's, never both. The job's
  workers agree with each other, so a few of them stand for all (``_others``): admission
  costs no scan of a big job. A first registration whose entry could make the job's
  membership command too large for its agents is refused (``check_size``,
  ``membership_too_large``); a pool's spare is reckoned when a job would claim it
  (``_small_enough``).
* **The first epoch.** Once enough workers are here (MAX, or MIN for the join timeout, which
  ``tick`` watches) the membership forms: a ``restart`` at a new epoch that carries it. A
  registration looks only where it may change that (``registered``).
* **Every restart** of such a job renews it (``Issuer.issue``); a changed membership goes into
  the write-ahead with its epoch record.
* **A member out of service** (the device policy would ``fail`` the job, or ``tick`` finds it
  stale) is retired and leaves the membership in one restart: a spare takes its ranks, or the job
  shrinks, or it is held below MIN (``replace_members``; docs/decisions.md #16). A held job forms
  again as a new one does, with free spares of its pool counted up to MIN (claimed, written
  ahead with that membership: docs/decisions.md #18). A failure that
  spends its device's budget does so even while a restart of the job is in flight: the device
  policy asks ``spends_budget`` before merging it into that restart.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import msgspec

from marduk.core import membership as rdzv
from marduk.core import pools as pool
from marduk.core.command_size import COMMAND_BUDGET
from marduk.core.decisions import Outcome, PolicyError, event_at, worker_key
from marduk.core.drmap import WorkerKey
from marduk.core.fleet import Fleet
from marduk.core.grow_policy import GrowRules
from marduk.core.issuer import Issuer
from marduk.core.pools import PoolRules
from marduk.core.records import EpochKey, EpochRecord
from marduk.wire.protocol import (
    MAX_MESSAGE_BYTES,
    Command,
    CommandKind,
    Member,
    Registration,
    Rendezvous,
)


class MembershipRules:
    """Admission, forming and the members lost of jobs whose ranks the controller assigns."""

    def __init__(self, fleet: Fleet, issuer: Issuer, grow: GrowRules, pools: PoolRules) -> None:
        self.fleet = fleet
        self.issuer = issuer
        self.grow = grow
        self.pools = pools
        # Jobs with MIN workers but no membership yet: since when (the join timeout counts
        # from there). Derived from the workers' records and the job's epoch record
        # (``since``), so a new leader goes on counting (``resume``).
        self.quorum_since: dict[str, float] = {}
        # Held jobs that draw from a pool: looked at on every tick, as a spare of the pool may
        # register (or become usable) and bring them back to MIN.
        self.held: set[str] = set()

    def resume(self) -> None:
        """A new leader: the jobs waiting for a membership (forming, or held) are watched again,
        their join timeout counting from when it did before."""
        fleet = self.fleet
        # A held job may have none of its workers left: its epoch record names it.
        kept = {k.job for k, e in fleet.epochs.items() if k.replica is None and held(e)}
        for job in sorted(fleet.job_workers.keys() | kept):
            state = fleet.epochs.get(EpochKey(job, None))
            if (state is None or state.membership is None) and not self.pools.is_pool(job):
                since = self.since(state, fleet.candidates(job))
                if since is not None:
                    self.quorum_since[job] = since
                if held(state) and self.pools.pool_of(job) is not None:
                    self.held.add(job)

    def since(self, state: EpochRecord | None, candidates: list[rdzv.Candidate]) -> float | None:
        """Since when the job has had MIN workers (None: it has not): the registration of the
        MIN-th of those here, and, for a job held below MIN, not before it was held (its last
        resize). Wall-clock times from the records, so any leader finds the same."""
        at = rdzv.quorum_since(candidates)
        if at is None or state is None:
            return at
        return max(at, state.resized_at)

    def tick(self, now: float, out: Outcome) -> None:
        """The join timeout may have passed for jobs waiting for a membership (their first, or
        held), or a pool spare may bring a held job back to MIN."""
        for job in sorted(self.quorum_since.keys() | self.held):
            self.rendezvous(EpochKey(job, None), now, out)

    def check(self, reg: Registration, state: EpochRecord | None, *, renewal: bool = False) -> None:
        """Refuse a worker that cannot take part in its job's membership (or, without a
        rendezvous, a worker of a job that has one, and the reverse).

        ``renewal``: the live worker's process renews the registration it was admitted with.
        Every worker admitted since was checked against it, so only its claim on a node rank
        is checked again, against the current membership (a spare may hold that rank now):
        a renewal of a 1,024-node job's worker then costs no scan of the other 1,023."""
        key = worker_key(reg)
        membership = state.membership if state is not None else None
        if renewal and reg.rendezvous is not None:
            try:
                rdzv.check_claim(
                    rdzv.Candidate(key, reg.rendezvous), self.fleet.is_candidate, membership
                )
            except rdzv.MembershipError as e:
                raise PolicyError(e.code, str(e)) from None
            return
        workers = self.fleet.workers
        # The job's workers agree with each other (each was checked against those there when
        # it came), so one of each kind stands for all: a first registration costs no scan of
        # a 1,024-node job's other workers.
        others = self._others(reg.job, key)
        if reg.rendezvous is None:
            if reg.scope == "job" and any(
                workers[k].registration.rendezvous is not None for k in others
            ):
                raise PolicyError(
                    "shape_mismatch",
                    f"job {reg.job!r} has its ranks from the controller (--nnodes MIN:MAX); "
                    f"worker {key.replica}/{key.worker} brings no rendezvous",
                )
            return
        if reg.scope != "job":
            raise PolicyError("invalid", "ranks from the controller need scope job")
        pool.check(reg, (workers[k].registration for k in others))
        if any(workers[k].registration.rendezvous is None for k in others):
            raise PolicyError(
                "shape_mismatch",
                f"job {reg.job!r} has static ranks; worker {key.replica}/{key.worker} asks the "
                "controller for one (--nnodes MIN:MAX without --node-rank)",
            )
        new = rdzv.Candidate(key, reg.rendezvous)
        if reg.rendezvous.node_rank is not None:  # a rank claim: against every live worker
            live = self.fleet.candidates(reg.job)
        else:  # the shape: against a live non-spare (they all have the same)
            live = [c for c in self.fleet.candidates_of(others) if not c.rendezvous.spare][:1]
        try:
            rdzv.check(new, live, membership, self.fleet.is_candidate)
        except rdzv.MembershipError as e:
            raise PolicyError(e.code, str(e)) from None

    def check_size(self, reg: Registration) -> None:
        """Refuse the first registration of a worker whose entry could make its job's membership
        command exceed ``COMMAND_BUDGET``: agents refuse a message over MAX_MESSAGE_BYTES, so no
        member could read it and the job would never start. The bound is the MAX largest
        entries of the job's workers and this one (a spare may take any member's place:
        ``command_size.MembershipSizes.bound``), so it also refuses a spare that would make the
        membership too large when it swaps in. Workers already registered are never refused
        (nor evicted): only a first registration is checked, so renewals cost nothing more."""
        r = reg.rendezvous
        if r is None or pool.is_pool_spare(reg):
            return  # a pool forms nothing: its spare is reckoned in the job that claims it
        key = worker_key(reg)
        # A spare's --nnodes is not checked against the job's: take the job's MAX.
        max_nodes = self.fleet.nnodes(reg.job)[1] if r.spare else r.max_nodes
        bound = self.fleet.sizes.bound(key, r, max_nodes)
        if bound.fits:
            return
        raise PolicyError(
            "membership_too_large",
            f"worker {key.replica}/{key.worker} would make job {reg.job!r} too large to "
            f"command: its membership of {bound.nodes} node(s) could encode to {bound.size} "
            f"bytes, over the {COMMAND_BUDGET}-byte budget of a command (agents refuse "
            f"messages over {MAX_MESSAGE_BYTES} bytes: no member could read it); shorten the "
            f"replica names (this one's is {len(key.replica)} characters) and the agents' "
            f"--local-addr ({len(r.addr)}), or run fewer nodes per job (--nnodes MAX)",
        )

    def _others(self, job: str, key: WorkerKey) -> list[WorkerKey]:
        """Workers of ``job`` other than ``key`` that stand for all of them: the first one, the
        first non-spare and the first live non-spare (often one worker: the first)."""
        workers, fleet = self.fleet.workers, self.fleet
        picked: list[WorkerKey] = []
        nonspare = live = False
        for k in fleet.job_workers.get(job, ()):
            if k == key:
                continue
            r = workers[k].registration.rendezvous
            if r is None:  # static ranks: the job's kind is all that is asked
                return [k]
            spare = r.spare
            take = not picked or (not spare and not nonspare)
            if not spare and not live and fleet.is_candidate(k):
                take = live = True
            if take:
                picked.append(k)
                nonspare = nonspare or not spare
            if live and nonspare:
                break
        return picked

    def registered(self, ekey: EpochKey, r: Rendezvous, now: float, out: Outcome) -> None:
        """A worker (``r``: its rendezvous) of the job registered: its membership may form.
        ``rendezvous`` looks at all of the job's workers, so it is skipped where a registration
        cannot change what it decides (on every first registration of a 1,024-node job that
        was O(N^2)): fewer workers registered than MIN, or the job already watched by ``tick``
        (MIN here, or held) with fewer than MAX registered: only the join timeout can form it
        then, and a new registration (the latest) does not move when MIN were first here; the
        next tick forms it. A spare's ``--nnodes`` is not checked against the job's: it is
        always looked at."""
        state = self.fleet.epochs.get(ekey)
        if state is not None and state.membership is None and not r.spare:
            n = len(self.fleet.job_workers.get(ekey.job, ()))
            watched = ekey.job in self.quorum_since or ekey.job in self.held
            if n < r.min_nodes or (watched and n < r.max_nodes):
                return
        self.rendezvous(ekey, now, out)

    def rendezvous(self, ekey: EpochKey, now: float, out: Outcome) -> None:
        """Form the job's first membership once enough workers are here (a restart at a new
        epoch that carries it), or note since when MIN of them are."""
        state = self.fleet.epochs.get(ekey)
        if state is None or state.membership is not None:
            self.quorum_since.pop(ekey.job, None)
            self.held.discard(ekey.job)
            return
        own = self.fleet.candidates(ekey.job)
        pool = self._pool_spares(ekey.job, state, own, now)
        candidates = [*own, *pool]
        since = self.since(state, candidates)
        if since is None:
            self.quorum_since.pop(ekey.job, None)
            return
        self.quorum_since[ekey.job] = since
        timeout = self.fleet.config.join_timeout_s
        if not rdzv.ready(candidates, since, now, timeout):
            return
        # A worker whose device failed takes no rank (looked at once ready, not on every
        # registration): the job waits for MIN fit ones, as long as the join timeout says.
        fit = [c for c in own if not self.fleet.unfit(c.key, now)]
        if len(fit) < len(own):
            candidates = [*fit, *pool]
            since = self.since(state, candidates)
            if since is None or not rdzv.ready(candidates, since, now, timeout):
                return
        membership = rdzv.form(self.fleet.scopes.next_epoch_peek(ekey), candidates)
        if membership is None:
            return  # given node ranks that the workers here cannot fill yet
        self.quorum_since.pop(ekey.job, None)
        self.held.discard(ekey.job)
        placed = {(m.replica, m.worker) for m in membership.members}
        chosen = [c for c in pool if (c.key.replica, c.key.worker) in placed]
        self.pools.claim(state, chosen, now, out)  # written ahead with the membership
        reason = (
            f"membership formed: {len(membership.members)} node(s), world size "
            f"{membership.world_size}, coordinator {membership.coordinator_addr}:"
            f"{membership.coordinator_port}"
        )
        command = self.issuer.issue(
            ekey, "restart", reason, [], "rendezvous", now, out, membership=membership
        )
        self.grow.resized(ekey.job, now)  # on the epoch record the restart wrote ahead
        self.fleet.changed(
            event_at(ekey, "membership_formed", now, epoch=command.epoch, detail=reason), out
        )

    def _pool_spares(
        self, job: str, state: EpochRecord, own: list[rdzv.Candidate], now: float
    ) -> list[rdzv.Candidate]:
        """For a job held below MIN: the free spares of its pool that would bring it back to
        MIN (of its local ranks and devices per node, oldest first, no more than it lacks), as
        candidates of the job, with its MIN:MAX (a pool spare's ``--nnodes`` is not used); none
        for any other job (a pool is for members lost, not for forming a job's first
        membership). The shape is its own workers', or, with none of them left, the one its
        epoch record kept from the hold."""
        shape = self.fleet.shape(job) if held(state) else None
        if shape is None:
            return []
        fit = [c for c in own if c.rendezvous.nproc == shape.nproc]
        lacking = shape.min_nodes - len(fit)
        if lacking <= 0:
            return []
        spares = [
            c
            for c in self.pools.claimable(job, now)
            if c.rendezvous.nproc == shape.nproc and c.devices == shape.devices
        ]
        spares = self._small_enough(job, spares, now, None)
        return [
            replace(
                c,
                rendezvous=msgspec.structs.replace(
                    c.rendezvous, min_nodes=shape.min_nodes, max_nodes=shape.max_nodes
                ),
            )
            for c in spares[:lacking]
        ]

    def _small_enough(
        self, job: str, spares: list[rdzv.Candidate], now: float, out: Outcome | None
    ) -> list[rdzv.Candidate]:
        """Those of the pool's ``spares`` (``PoolRules.claimable``) that the job's membership
        has room for, each on its own (``check_size``'s bound). A pool spare is admitted by its
        pool, which forms nothing, so it is reckoned when a job would claim it; one without
        room is skipped, announced in ``out`` (``spare_skipped``; None: on a held job's tick,
        which looks again each time, silently)."""
        if not spares:
            return spares
        max_nodes = self.fleet.nnodes(job)[1]
        kept = []
        for c in spares:
            bound = self.fleet.sizes.bound(c.key, c.rendezvous, max_nodes)
            if bound.fits:
                kept.append(c)
            elif out is not None:
                detail = (
                    f"pool spare {c.key.replica}/{c.key.worker} not claimed: with it the "
                    f"membership of {bound.nodes} node(s) could encode to {bound.size} bytes, "
                    f"over the {COMMAND_BUDGET}-byte budget of a command; shorten the pool "
                    "spares' replica names and --local-addr"
                )
                out.events.append(event_at(c.key, "spare_skipped", now, detail=detail))
        return kept

    # --- members out of service: a spare takes their ranks, or the job shrinks, or it is held --

    def issue_or_replace(
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
        (``replace_members``); None when no member does (only spares: nothing to send), and
        for a pool of spares."""
        state = self.fleet.epochs.get(ekey)
        if ekey.replica is None and self.pools.is_pool(ekey.job):
            return None  # a pool runs nothing: its spare is unusable, not told (nor the others)
        if kind != "fail" or ekey.replica is not None or state is None or not state.membership:
            return self.issuer.issue(ekey, kind, reason, devices, cause, now, out)
        used = set(devices)
        workers = self.fleet.workers
        lost = {
            key: reason
            for key in self.fleet.member_keys(ekey.job, state.membership)
            if used & set(workers[key].registration.devices)
        }
        if not lost:
            return None
        return self.replace_members(ekey, state, lost, devices, cause, now, out)

    def spends_budget(self, ekey: EpochKey, device: str, now: float) -> bool:
        """Would a failure of ``device`` (a member's: ``Fleet.in_play``) spend its budget now, in
        a job with a membership, while the command in flight does not list it yet? Then it takes
        the member out at a new epoch instead of joining that restart, where it would be
        neither counted nor acted on and the member would restart on the bad device
        (``DeviceRules`` is handed this)."""
        state = self.fleet.epochs.get(ekey)
        if ekey.replica is not None or state is None or state.membership is None:
            return False
        if state.command is not None and device in state.command.devices:
            return False  # a repeat of the failure the restart in flight is for
        rec = self.fleet.devices.get(device)
        config = self.fleet.config
        window = config.device_failure_window_s
        recent = sum(now - t < window for t in rec.failures) if rec is not None else 0
        return recent + 1 > config.device_max_failures

    def lose_silent(self, keys: Iterable[WorkerKey], now: float, out: Outcome) -> None:
        """Members gone stale (their host is gone, or cut off) leave their job's membership."""
        by_job: dict[EpochKey, dict[WorkerKey, str]] = {}
        for key in keys:
            ekey = self.fleet.epoch_key(key)
            state = self.fleet.epochs.get(ekey)
            m = state.membership if state is not None else None
            if ekey.replica is None and m and m.member(key.replica, key.worker) is not None:
                why = f"member {key.replica}/{key.worker} silent past the worker TTL"
                by_job.setdefault(ekey, {})[key] = why
        for ekey, lost in by_job.items():
            self.replace_members(ekey, self.fleet.epochs[ekey], lost, [], "stale", now, out)

    def replace_members(
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
        self._retire(lost, now, out)
        lowest = self.fleet.nnodes(ekey.job)[0]  # the job's MIN (a non-spare's --nnodes)
        claimable = self._small_enough(ekey.job, self.pools.claimable(ekey.job, now), now, out)
        change = rdzv.replace(
            previous,
            self.fleet.scopes.next_epoch_peek(ekey),
            ekey.job,
            lost,
            self.fleet.usable(ekey.job, now),
            lowest,
            claimable,
            {k: len(self.fleet.workers[k].registration.devices) for k in lost},
        )
        if change.membership is not None:
            chosen = {spare.key for _, spare in change.replaced}
            self.pools.claim(state, [c for c in claimable if c.key in chosen], now, out)
        why = "; ".join(sorted(set(lost.values())))
        m = change.membership
        if change.dropped or m is None:
            self.grow.resized(ekey.job, now)  # never delayed itself; a grow waits after it
        if state.grow is not None:  # its new workers were candidates for the lost ranks
            self.grow.abandon(ekey, state, f"{why}: a member lost during the wait", now, out)
        if m is None:
            left = len(previous.members) - len(change.dropped)
            what = (
                f"job held: {left} node(s) left, below MIN {lowest}; its trainers wait until "
                f"{lowest} worker{'' if lowest == 1 else 's'} {'is' if lowest == 1 else 'are'} "
                "registered, then the membership forms again"
            )
            state.membership = None
            # Its shape and pool, kept: its last workers may go too, and a pool's spares bring
            # it back to MIN all the same (``_pool_spares``).
            state.shape = self.fleet.shape(ekey.job)
            if state not in out.write_ahead:
                out.write_ahead.append(state)
        else:
            what = (
                f"{len(m.members)} node(s), world size {m.world_size}, coordinator "
                f"{m.coordinator_addr}:{m.coordinator_port}"
            )
        command = self.issuer.issue(
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
        self._announce(ekey.job, change, lost, command.epoch, (why, what), now, out)
        if m is None:
            if self.pools.pool_of(ekey.job) is not None:
                self.held.add(ekey.job)  # a spare of its pool may bring it back
            self.rendezvous(ekey, now, out)
        return command

    def _retire(self, lost: dict[WorkerKey, str], now: float, out: Outcome) -> None:
        """The members ``lost`` are never members or spares again (their agents exit 71)."""
        for key, why in lost.items():
            rec = self.fleet.workers.get(key)
            if rec is not None and not rec.retired:
                rec.retired, rec.updated_at = why, now
                out.put_workers.append(rec)

    def _announce(
        self,
        job: str,
        change: rdzv.Change,
        lost: dict[WorkerKey, str],
        epoch: int,
        said: tuple[str, str],
        now: float,
        out: Outcome,
    ) -> None:
        """The events of a membership change: each member replaced by a spare or dropped (the
        job shrinks), or the job held (``said``: why, and what the job is now); the last one is
        the job's last change (``Fleet.changed``)."""
        m = change.membership
        why, what = said
        for gone, spare in change.replaced:
            detail = (
                f"node rank {gone.node_rank} (ranks {rdzv.span(gone)}) to spare "
                f"{spare.key.replica}/{spare.key.worker}: {lost[_key(job, gone)]}"
            )
            self.fleet.changed(
                event_at(_key(job, gone), "member_replaced", now, epoch=epoch, detail=detail), out
            )
        for gone in change.dropped if m is not None else ():
            # A member not lost itself left with its NVLink segment (``--segment``).
            because = lost.get(_key(job, gone), "its NVLink segment left whole")
            detail = (
                f"no free spare of {gone.nproc} rank(s): the job goes on without node rank "
                f"{gone.node_rank} ({because}); {what}"
            )
            self.fleet.changed(
                event_at(_key(job, gone), "job_shrunk", now, epoch=epoch, detail=detail), out
            )
        if m is None:
            held = event_at(
                EpochKey(job, None), "job_held", now, epoch=epoch, detail=f"{why}; {what}"
            )
            self.fleet.changed(held, out)


def held(state: EpochRecord | None) -> bool:
    """Is the job held below MIN: no membership, after it had one (its last resize the hold)?"""
    return state is not None and state.membership is None and state.resized_at > 0


def _key(job: str, m: Member) -> WorkerKey:
    return WorkerKey(job, m.replica, m.worker)
