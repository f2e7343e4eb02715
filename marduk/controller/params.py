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

from marduk.controller.commit import NotServing
from marduk.controller.context import Context, Route
from marduk.core.params import (
    ParamsError,
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

WorkersOf = Callable[[str], Iterable[tuple[str, int]]]


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
        self._applied: dict[str, dict[tuple[str, int], tuple[int, dict[str, str]]]] = {}
        self._loaded_term: int | None = None
        self._load_lock = asyncio.Lock()
        self._job_locks: dict[str, asyncio.Lock] = {}
        self._resend: dict[str, tuple[float, float]] = {}  # job -> (due, wait), monotonic
        self._reloaded_at = 0.0

    # --- the endpoints ---------------------------------------------------------------------------

    def routes(self) -> list[Route]:
        s = self._ctx.subjects
        return [
            Route("params_set", s.params_set, ParamsSet, self.set, False),
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
        store = self._require_store()
        lock = self._job_locks.setdefault(req.job, asyncio.Lock())
        async with lock:  # one set of a job at a time here; the CAS covers other controllers
            for _ in range(CAS_TRIES):
                current, revision = self._docs.get(req.job, (JobParams(job=req.job), 0))
                if req.if_version is not None and req.if_version > current.version:
                    # The client read a version we have not: ours is stale (a late write of
                    # another controller's). Read the key before judging the compare-and-set.
                    await self._refresh(req.job)
                    current, revision = self._docs.get(req.job, (current, revision))
                result = apply_set(
                    current,
                    req.values,
                    replica=req.replica,
                    by=req.by,
                    now=time.time(),
                    if_version=req.if_version,
                )
                if not result.changed:
                    return ParamsSetReply(params=current, changed=[])
                try:
                    revision = await store.put(result.params, revision)
                except ParamsConflict:
                    # Another controller (a lapsed leader's late write) got there first: read
                    # it and apply this change on top of it.
                    self._ctx.stats["params.cas_retries"] += 1
                    await self._refresh(req.job)
                    continue
                break
            else:
                raise ParamsError("conflict", f"job {req.job}: the parameters kept changing")
            self._docs[req.job] = (result.params, revision)
        self._ctx.stats["params.sets"] += 1
        # Stored: from here on a new leader delivers it even if we die before the publish.
        if not self._ctx.leading():
            raise NotServing("the lease lapsed after a parameters set was stored")
        await self._publish(req.job)
        await self._announce(
            ControllerEvent(
                kind="params_set",
                ts=time.time(),
                job=req.job,
                replica=req.replica,
                detail=f"by {req.by or 'unknown'}: {describe_change(result, req.replica)}",
            )
        )
        return ParamsSetReply(params=result.params, changed=result.changed)

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
        table[key] = (req.version, dict(req.rejected))
        self._ctx.stats["params.applied"] += 1
        if req.rejected and before != table[key]:
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
