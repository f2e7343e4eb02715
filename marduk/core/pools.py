"""Pools of hot spares that several jobs draw from (``marduk agent run --spare-pool NAME``). Part
of the pure policy (no I/O, ``now`` passed in): ``PoolRules`` over the policy's ``Fleet``;
docs/decisions.md #18.

* **A pool** is named like a job: its spares (``--spare --spare-pool NAME``) register under the
  job ``NAME`` (its subjects, and an agent credential valid for every job that may draw from
  it), with ``Rendezvous.pool`` = ``NAME``. A pool runs nothing: no membership forms, nothing
  grows. A job whose workers name the pool (``Rendezvous.pool`` on its non-spares) may draw
  from it.
* **The claim.** When a member of such a job is lost and no spare of the job's own fits
  (``membership.replace``: the job's spares first), a free, usable spare of the pool with the
  member's shape (local ranks and devices per node) takes its ranks at the next epoch, as a job
  spare does. The spare's record moves to the job at once (same replica and worker) and the
  claim (``PoolClaim``) goes on the job's epoch record, written ahead with the membership that
  gives it the ranks: a new leader reads the claim and finishes the move (``reconcile``), and
  the spare is never free in the pool again, so no second job gets it. A job held below MIN
  (no spare was free when it lost the member) claims, the same way, as many free spares of its
  shape as bring it back to MIN when it forms again (``MembershipRules.rendezvous``); a job
  forming its first membership claims none.
* **The hand-over.** The spare, still registered under the pool, learns of the claim at its
  next registration (a spare waiting for ranks registers again each second): the reply's
  ``claimed_by`` names the job, and its agent registers there, as the job's worker, and starts
  at the membership. A spare that never arrives goes stale like any silent member (the worker
  TTL bounds the wait) and the job replaces it again or shrinks.
* **Afterwards.** A claimed spare stays the job's: it never goes back to the pool (it ran the
  job's trainers, on the job's credentials and devices; a fresh pod is the clean spare). The
  claim ends when the job lets go of the worker (deregistered, expired or forgotten); a new
  process under a claimed name meanwhile joins the job, not the pool.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from marduk.core import membership as rdzv
from marduk.core.decisions import Outcome, PolicyError, event_at, worker_key
from marduk.core.drmap import WorkerKey
from marduk.core.fleet import Fleet
from marduk.core.records import EpochKey, EpochRecord, PoolClaim, WorkerRecord
from marduk.wire.protocol import Registration


def is_pool_spare(reg: Registration) -> bool:
    """A spare of a pool registered under the pool's name (free, or not yet told of a claim)."""
    r = reg.rendezvous
    return r is not None and r.spare and r.pool == reg.job


def check(reg: Registration, others: Iterable[Registration]) -> None:
    """Refuse (PolicyError) a registration that mixes a pool with a job: a pool spare in a job
    that is not a pool, a job's worker under a pool's name, or workers of one job that name two
    pools."""
    r = reg.rendezvous
    if r is None:
        return
    name = f"{reg.replica}/{reg.worker}"
    if r.pool is not None and r.pool == reg.job and not r.spare:
        raise PolicyError(
            "invalid",
            f"worker {name} names pool {r.pool!r} as its own job: only spares (--spare) "
            "register under a pool's name",
        )
    for other in others:
        q = other.rendezvous
        if q is None:
            continue
        if is_pool_spare(reg) != is_pool_spare(other):
            what = "a pool of spares" if is_pool_spare(other) else "a job, not a pool"
            raise PolicyError(
                "shape_mismatch",
                f"{reg.job!r} is {what} (worker {other.replica}/{other.worker}); worker "
                f"{name} cannot register there",
            )
        if not r.spare and not q.spare and q.pool != r.pool:
            raise PolicyError(
                "shape_mismatch",
                f"job {reg.job!r} draws spares from pool {q.pool or 'none'} (worker "
                f"{other.replica}/{other.worker}); worker {name} names {r.pool or 'none'}",
            )


class PoolRules:
    """Claims of pool spares by jobs (see the module)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def claimed_by(self, reg: Registration) -> str | None:
        """The job that claimed this pool spare, which must now register there; None: free (or
        not a pool spare)."""
        return self.fleet.claims.get(worker_key(reg)) if is_pool_spare(reg) else None

    def is_pool(self, job: str) -> bool:
        """Is ``job`` a pool of spares (its workers are the pool's spares)?"""
        return any(self.fleet.pool_spare(k) for k in self.fleet.job_workers.get(job, ()))

    def pool_of(self, job: str) -> str | None:
        """The pool ``job`` draws from: its live non-spares' ``--spare-pool``; with none live,
        what its epoch record kept when it was held (``EpochRecord.shape``), so a held job
        whose workers are all gone still draws from its pool."""
        for c in self.fleet.candidates(job):
            if not c.rendezvous.spare:
                return c.rendezvous.pool if c.rendezvous.pool != job else None
        state = self.fleet.epochs.get(EpochKey(job, None))
        return state.shape.pool if state is not None and state.shape is not None else None

    def claimable(self, job: str, now: float) -> list[rdzv.Candidate]:
        """The free, usable spares of the job's pool, as candidates of ``job`` (same replica and
        worker; one whose name a worker of the job holds already is left out), each with its
        device count, oldest first."""
        pool = self.pool_of(job)
        if pool is None:
            return []
        fleet = self.fleet
        taken = fleet.job_workers.get(job, set())
        out = []
        for c in fleet.usable(pool, now):
            key = WorkerKey(job, c.key.replica, c.key.worker)
            if c.rendezvous.spare and c.rendezvous.pool == pool and key not in taken:
                devices = len(fleet.workers[c.key].registration.devices)
                out.append(rdzv.Candidate(key, c.rendezvous, c.registered_at, devices, c.domain))
        return sorted(out, key=lambda c: (c.registered_at, c.key))

    def claim(
        self, state: EpochRecord, spares: Sequence[rdzv.Candidate], now: float, out: Outcome
    ) -> None:
        """``spares`` (from ``claimable``) take ranks in the job of ``state``: each one's record
        moves from the pool to the job and the claim goes on the job's epoch record (the caller
        writes it ahead with the membership)."""
        fleet = self.fleet
        for c in spares:
            pool = c.rendezvous.pool
            assert pool is not None
            src = WorkerKey(pool, c.key.replica, c.key.worker)
            moved = _moved(fleet.workers[src], state.job, now)
            fleet.put_worker(moved)  # first: the devices stay in use through the move
            fleet.heard(c.key, now)  # the wait for it to arrive counts from now
            fleet.remove_worker(src, out, now)
            out.put_workers.append(moved)
            fleet.claims[src] = state.job
            claim = PoolClaim(pool=pool, replica=src.replica, worker=src.worker, claimed_at=now)
            state.claims = [*state.claims, claim]
            detail = (
                f"spare {src.replica}/{src.worker} of pool {pool} claimed by job {state.job}: "
                "it registers there and takes the ranks at the next epoch"
            )
            out.events.append(event_at(c.key, "spare_claimed", now, detail=detail))

    def flush(self, out: Outcome) -> None:
        """Moves a new leader finished from the claims it read (``reconcile``): persisted with
        its first outcome."""
        fleet = self.fleet
        for dst, src in fleet.unsaved_moves:
            if dst in fleet.workers:
                out.put_workers.append(fleet.workers[dst])
            out.deleted_workers.append(src)
        fleet.unsaved_moves.clear()


def reconcile(
    workers: list[WorkerRecord], epochs: Iterable[EpochRecord]
) -> tuple[list[WorkerRecord], dict[WorkerKey, str], list[tuple[WorkerKey, WorkerKey]]]:
    """The records as the claims in ``epochs`` say they are: a claimed spare still recorded
    under its pool (the leader that claimed it stopped before that write) is the job's. Returns
    the workers, the claims index (pool key -> job) and the moves to persist (job key, pool
    key)."""
    claims: dict[WorkerKey, str] = {}
    for state in epochs:
        if state.replica is None:
            for c in state.claims:
                claims[WorkerKey(c.pool, c.replica, c.worker)] = state.job
    have = {worker_key(rec.registration) for rec in workers}
    out: list[WorkerRecord] = []
    moves: list[tuple[WorkerKey, WorkerKey]] = []
    for rec in workers:
        key = worker_key(rec.registration)
        job = claims.get(key)
        if job is None:
            out.append(rec)
            continue
        dst = WorkerKey(job, key.replica, key.worker)
        if dst not in have:  # else the move was persisted; the pool's record is left over
            out.append(_moved(rec, job, rec.updated_at))
            have.add(dst)
        moves.append((dst, key))
    return out, claims, moves


def _moved(rec: WorkerRecord, job: str, now: float) -> WorkerRecord:
    """A pool spare's record as the job's worker: it confirms nothing of the job yet."""
    reg = msgspec.structs.replace(rec.registration, job=job, epoch=0, seen_epoch=0)
    return WorkerRecord(registration=reg, registered_at=rec.registered_at, updated_at=now)
