"""Live parameters, the controller's part (decisions.md #20): store, fan out, hand out, converge.

``marduk monitor set`` asks ``ctl.params.set``; the desk applies the change (the pure rules of
``marduk.core.params``), stores the new version with a compare-and-set on the key's revision
(``marduk.store.params``: a concurrent set, here or at another controller, is read again and
applied on top, never lost), and only then publishes the whole document on the job's
``cmd.params`` subject, signed like commands. Every registration's reply carries it, so a new
incarnation starts with the current values.

Level-triggered: workers acknowledge the version they applied (``params.applied``); while any
registered worker of a job is behind the stored version, the document is published again
(backing off). A new leader reads the bucket at its term's start and publishes every job's
document once, so a set stored by a leader killed before its fan-out is still delivered, and
the workers' acknowledgements (repeated for a version they already run) rebuild the table of
who runs what.

Handed what it uses: the context, the store, the term, the workers of a job (the policy's
map), ``announce`` for events and ``sign`` for signatures.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import msgspec

from marduk.controller.commit import NotServing
from marduk.controller.context import Context, Route
from marduk.core.params import (
    Ack,
    ParamsError,
    SetResult,
    apply_set,
    behind,
    describe_change,
    worker_states,
)
from marduk.store.params import ParamsConflict, ParamsStore
from marduk.transport.auth import SIG_HEADER
from marduk.wire.codec import encode
from marduk.wire.params import (
    JobParams,
    Params,
    ParamsApplied,
    ParamsAppliedReply,
    ParamsQuery,
    ParamsQueryReply,
    ParamsSet,
    ParamsSetReply,
)
from marduk.wire.protocol import ControllerEvent

RESEND_FIRST_S = 1.0
"""A job with workers behind its version is published again after this, then at twice the
wait each time (at most ``RESEND_MAX_S``) until they catch up or a new version resets it."""
RESEND_MAX_S = 30.0
RELOAD_S = 5.0
"""How often a leader reads the bucket again (a write of a lapsed leader's that landed late)."""
CAS_TRIES = 8
ALWAYS_FITS = 2048
"""A document this small always fits in a registration reply beside a command (commands are
kept 4 KiB under the message limit: ``marduk.core.command_size``)."""

SET_INTERVAL_S = 0.01
"""A job's parameters are written at most once per this long: sets that come faster (a storm)
wait and are merged into the next write, in order (``params.rate_limited``,
``params.coalesced``)."""

WorkersOf = Callable[[str], Iterable[tuple[str, int]]]


@dataclass(frozen=True, slots=True)
class _Waiting:
    req: ParamsSet
    done: asyncio.Future[ParamsSetReply]


class ParamsDesk:
    def __init__(
        self,
        ctx: Context,
        *,
        store: Callable[[], ParamsStore | None],
        term: Callable[[], int],
        workers_of: WorkersOf,
        announce: Callable[[ControllerEvent], Awaitable[None]],
        sign: Callable[[bytes], str | None],
    ) -> None:
        self._ctx = ctx
        self._store = store
        self._term = term
        self._workers_of = workers_of
        self._announce = announce
        self._sign = sign
        self._docs: dict[str, tuple[JobParams, int]] = {}  # job -> (document, KV revision)
        self._applied: dict[str, dict[tuple[str, int], Ack]] = {}
        self._loaded_term: int | None = None
        self._load_lock = asyncio.Lock()
        self._job_locks: dict[str, asyncio.Lock] = {}
        self._queued: dict[str, list[_Waiting]] = {}  # job -> sets waiting for its next write
        self._written_at: dict[str, float] = {}  # job -> its last write (monotonic)
        self._resend: dict[str, tuple[float, float]] = {}  # job -> (due, wait), monotonic
        self._reloaded_at = 0.0

    # --- the endpoints ---------------------------------------------------------------------------

    def routes(self) -> list[Route]:
        s = self._ctx.subjects
        return [
            # Concurrent: a storm of sets queues behind the job's write and joins the next one.
            Route("params_set", s.params_set, ParamsSet, self.set, True),
            Route("params_get", s.params_get, ParamsQuery, self.get, False),
            Route("params_applied", s.any_job("params.applied"), ParamsApplied, self.applied, True),
        ]

    async def set(self, req: ParamsSet, subject: str) -> ParamsSetReply:
        await self._ensure_loaded()
        workers = set(self._workers_of(req.job))
        if req.job not in self._docs and not workers:
            raise ParamsError(
                "unknown_job",
                f"no job {req.job!r} is registered (marduk monitor status lists them)",
            )
        if req.replica is not None and req.replica not in {r for r, _ in workers}:
            raise ParamsError(
                "unknown_replica", f"job {req.job} has no replica {req.replica!r} registered"
            )
        waiting = _Waiting(req, asyncio.get_running_loop().create_future())
        self._queued.setdefault(req.job, []).append(waiting)
        lock = self._job_locks.setdefault(req.job, asyncio.Lock())
        async with lock:  # one write of a job at a time here; the CAS covers other controllers
            if not waiting.done.done():  # else a batch before ours took this set along
                await self._write_batch(req.job)
        return await waiting.done

    async def _write_batch(self, job: str) -> None:
        """Every set of ``job`` queued since the last write, in one version: a storm of sets
        costs one write and one fan-out per ``SET_INTERVAL_S`` (or per write, if slower), each
        applied on top of the one before (the last value wins, none is lost)."""
        wait = self._written_at.get(job, 0.0) + SET_INTERVAL_S - time.monotonic()
        if wait > 0:
            self._ctx.stats["params.rate_limited"] += 1
            await asyncio.sleep(wait)
        batch = self._queued.pop(job, [])
        self._ctx.stats["params.coalesced"] += len(batch) - 1
        try:
            await self._store_batch(job, batch)
        except BaseException as e:
            for w in batch:
                if not w.done.done():
                    w.done.set_exception(e if isinstance(e, Exception) else NotServing("stopping"))
            if not isinstance(e, Exception):
                raise

    async def _store_batch(self, job: str, batch: list[_Waiting]) -> None:
        store = self._require_store()
        for _ in range(CAS_TRIES):
            current, revision = self._docs.get(job, (JobParams(job=job), 0))
            if any(
                w.req.if_version is not None and w.req.if_version > current.version for w in batch
            ):
                # A client read a version we have not: ours is stale (a late write of another
                # controller's). Read the key before judging the compare-and-set.
                await self._refresh(job)
                current, revision = self._docs.get(job, (current, revision))
            doc, results = current, list[SetResult | ParamsError]()
            for w in batch:
                r = w.req
                try:
                    result = apply_set(
                        doc,
                        r.values,
                        replica=r.replica,
                        by=r.by,
                        now=time.time(),
                        if_version=r.if_version,
                    )
                except ParamsError as e:
                    results.append(e)
                    continue
                doc = result.params
                results.append(result)
            if doc is current:  # nothing changed
                for w, outcome in zip(batch, results, strict=True):
                    if isinstance(outcome, ParamsError):
                        w.done.set_exception(outcome)
                    else:
                        w.done.set_result(ParamsSetReply(params=current, changed=[]))
                return
            # One version for the whole batch: the versions between were never stored.
            doc = msgspec.structs.replace(doc, version=current.version + 1)
            try:
                revision = await store.put(doc, revision)
            except ParamsConflict:
                # Another controller (a lapsed leader's late write) got there first: read it
                # and apply these changes on top of it.
                self._ctx.stats["params.cas_retries"] += 1
                await self._refresh(job)
                continue
            break
        else:
            raise ParamsError("conflict", f"job {job}: the parameters kept changing")
        self._docs[job] = (doc, revision)
        self._written_at[job] = time.monotonic()
        await self._settle(job, doc, batch, results)

    async def _settle(
        self,
        job: str,
        doc: JobParams,
        batch: list[_Waiting],
        results: list[SetResult | ParamsError],
    ) -> None:
        """``doc`` is stored: send it, say each set's change, answer each set."""
        self._ctx.stats["params.sets"] += sum(
            1 for r in results if isinstance(r, SetResult) and r.changed
        )
        # Stored: from here on a new leader delivers it even if we die before the publish.
        if not self._ctx.leading():
            raise NotServing("the lease lapsed after a parameters set was stored")
        await self._publish(job)
        for w, outcome in zip(batch, results, strict=True):
            if isinstance(outcome, ParamsError):
                w.done.set_exception(outcome)
                continue
            said = SetResult(doc, outcome.changed, outcome.old, outcome.new)
            if outcome.changed:
                await self._announce(
                    ControllerEvent(
                        kind="params_set",
                        ts=time.time(),
                        job=job,
                        replica=w.req.replica,
                        detail=f"by {w.req.by or 'unknown'}: "
                        + describe_change(said, w.req.replica),
                    )
                )
            w.done.set_result(ParamsSetReply(params=doc, changed=outcome.changed))

    async def get(self, req: ParamsQuery, subject: str) -> ParamsQueryReply:
        await self._ensure_loaded()
        workers = list(self._workers_of(req.job))
        if req.job not in self._docs and not workers:
            raise ParamsError("unknown_job", f"no job {req.job!r} is registered")
        params = self._docs.get(req.job, (JobParams(job=req.job), 0))[0]
        rows = worker_states(params, workers, self._applied.get(req.job, {}))
        return ParamsQueryReply(params=params, workers=rows)

    async def applied(self, req: ParamsApplied, subject: str) -> ParamsAppliedReply:
        if self._ctx.subjects.job_of(subject) != req.job:
            raise ParamsError("subject_mismatch", f"message for job {req.job!r} sent on {subject}")
        await self._ensure_loaded()
        version = self._docs.get(req.job, (JobParams(job=req.job), 0))[0].version
        if req.version > version:
            raise ParamsError(
                "unknown_version", f"job {req.job} is at version {version}, not {req.version}"
            )
        table = self._applied.setdefault(req.job, {})
        key = (req.replica, req.worker)
        before = table.get(key)
        if before is not None and before[0] > req.version:
            return ParamsAppliedReply(version=version)  # a late ack of an older version
        table[key] = Ack(req.version, dict(req.rejected), tuple(req.ranks))
        self._ctx.stats["params.applied"] += 1
        if req.rejected and (before is None or before[:2] != table[key][:2]):
            why = ", ".join(f"{k}: {v}" for k, v in sorted(req.rejected.items()))
            await self._announce(
                ControllerEvent(
                    kind="params_rejected",
                    ts=time.time(),
                    job=req.job,
                    replica=req.replica,
                    worker=req.worker,
                    detail=f"version {req.version}: {why}",
                )
            )
        return ParamsAppliedReply(version=version)

    # --- what other parts ask --------------------------------------------------------------------

    async def for_registration(
        self, job: str, replica: str, worker: int, room: Callable[[], int]
    ) -> JobParams | None:
        """The job's document for a registration's reply (None: none was ever set). One that
        does not fit beside the reply's command (``room()``: the bytes left; asked only for a
        large document) is left out, and the worker counted as behind: the document comes on
        its own subject within a second."""
        if self._store() is None:
            return None
        await self._ensure_loaded()
        doc = self._docs.get(job)
        if doc is None or doc[0].version == 0:
            return None
        params = doc[0]
        size = len(encode(params))
        if size > ALWAYS_FITS and size > room():
            self._ctx.stats["params.reply_omitted"] += 1
            self._applied.get(job, {}).pop((replica, worker), None)
            return None
        return params

    async def run(self, interval: float = 0.25) -> None:
        """The convergence loop: publish again to jobs with workers behind, read the bucket
        again now and then. Never raises (a failure is counted and logged)."""
        while True:
            await asyncio.sleep(interval)
            if not self._ctx.leading() or self._store() is None:
                continue
            try:
                await self.tick(time.monotonic())
            except NotServing:
                continue  # the lease lapsed meanwhile: whoever leads next converges
            except Exception:
                self._ctx.logs.internal("params tick")

    async def tick(self, now: float) -> None:
        await self._ensure_loaded()
        if now - self._reloaded_at >= RELOAD_S:
            self._reloaded_at = now
            await self._reload()
        for job, (params, _) in list(self._docs.items()):
            if params.version == 0:
                continue
            workers = list(self._workers_of(job))
            table = self._applied.get(job)
            if table is not None and len(table) > len(workers):
                # Workers gone (deregistered, forgotten, expired) are no longer anyone's.
                keep = set(workers)
                self._applied[job] = {k: v for k, v in table.items() if k in keep}
            late = behind(params, workers, self._applied.get(job, {}))
            if not late:
                self._resend.pop(job, None)
                continue
            due, wait = self._resend.get(job, (now + RESEND_FIRST_S, RESEND_FIRST_S))
            if now >= due:
                self._ctx.stats["params.resent"] += 1
                await self._publish(job)
                wait = min(wait * 2, RESEND_MAX_S)
                due = now + wait
            self._resend[job] = (due, wait)

    # --- inside ----------------------------------------------------------------------------------

    async def _refresh(self, job: str) -> None:
        got = await self._require_store().get(job)
        self._docs[job] = got if got is not None else (JobParams(job=job), 0)

    def _require_store(self) -> ParamsStore:
        store = self._store()
        if store is None:
            raise NotServing("the parameters bucket is not open")
        return store

    async def _ensure_loaded(self) -> None:
        term = self._term()
        if self._loaded_term == term:
            return
        async with self._load_lock:
            if self._loaded_term == term:
                return
            docs, skipped = await self._require_store().load()
            self._ctx.stats["params.skipped_records"] += skipped
            self._docs = docs
            self._loaded_term = term
            self._reloaded_at = time.monotonic()
        # A new term: say every job's document once (a set stored by a leader that died before
        # its publish goes out now; workers acknowledge what they run, rebuilding the table).
        for job, (params, _) in list(docs.items()):
            if params.version > 0:
                await self._publish(job)

    async def _reload(self) -> None:
        docs, _ = await self._require_store().load()
        for job, (params, revision) in docs.items():
            have = self._docs.get(job)
            if have is None or have[0].version < params.version:
                self._docs[job] = (params, revision)
                await self._publish(job)

    async def _publish(self, job: str) -> None:
        doc = self._docs.get(job)
        if doc is None or not self._ctx.leading():
            return
        payload = encode(Params(params=doc[0]))
        signature = self._sign(payload)
        headers = {SIG_HEADER: signature} if signature is not None else None
        subject = self._ctx.subjects.params_commands(job)
        await self._ctx.connection().publish(subject, payload, headers=headers)
        self._ctx.stats["params.published"] += 1
