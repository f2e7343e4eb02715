"""The controller's commit pipeline: outcomes go out in decision order, many at a time.

Every decision the policy takes becomes an ``Outcome`` that the shell must *commit*: check that
it still leads, make the epoch ceilings durable (write-ahead), check again, publish the
commands, write the other records, announce the events. ``CommitPipeline`` does that for a
queue of outcomes, in the order they were decided, in *batches*:

* the write-ahead records of every outcome queued so far are written together (one batch of
  KV writes in flight, not one round trip each), then the lease is checked again, then every
  command of the batch is published in decision order;
* a batch's other records are written while the next batch's write-ahead and commands proceed;
  writes of one batch start only after the previous batch's writes have finished, and a
  write-ahead that touches a key still being written waits for it, so the store ends as the
  last decision left it (no key is ever written out of decision order);
* a commit is *published* once its commands are out and *durable* once its records are
  written; replies and acknowledgements wait for ``durable``. Records that cannot be written
  (refused by the store's fence: another term began; or never acknowledged) fail ``durable``
  with ``NotServing``: nothing is answered or acknowledged for them.

If the lease is gone before or after a write-ahead, or a write-ahead cannot be made durable,
nothing more goes out: that batch, and everything queued behind it, fails with ``NotServing``,
and the pipeline stays closed until the next term ``reopen``s it (the controller steps down and
whoever leads next rebuilds from the store).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from marduk.core.decisions import Outcome
from marduk.core.records import EpochRecord
from marduk.errors import MardukError

MAX_BATCH = 1024
"""Outcomes committed together at most: bounds a batch's writes in flight."""


class NotServing(MardukError):
    """This controller lost the lease between deciding and committing: drop, do not answer."""


@dataclass(slots=True)
class Commit:
    """One outcome on its way out: ``published`` once its commands are out, ``durable`` once its
    records are written. Both raise ``NotServing`` if it was dropped."""

    outcome: Outcome
    published: asyncio.Future[None] = field(default_factory=lambda: _future())
    durable: asyncio.Future[None] = field(default_factory=lambda: _future())


def _future() -> asyncio.Future[None]:
    f: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    # A commit nobody awaits (fire and forget) must not log "exception never retrieved".
    f.add_done_callback(lambda f: f.cancelled() or f.exception())
    return f


@dataclass(slots=True)
class Steps:
    """What the pipeline calls (the controller's ``Outbox`` supplies them)."""

    leading: Callable[[], bool]
    write_ahead: Callable[[list[EpochRecord]], Awaitable[bool]]
    """Write the ceilings (retrying); False if they are not durable."""
    publish: Callable[[Outcome], Awaitable[None]]
    """Publish an outcome's commands (and resends)."""
    persist: Callable[[list[Outcome]], Awaitable[None]]
    """Write the outcomes' other records (retrying); raises if they are not durable (and the
    commits' waiters then get ``NotServing``: no reply, no acknowledgement)."""
    announce: Callable[[Outcome], Awaitable[None]]
    stop: Callable[[str, str], None]
    """``stop(counter, why)``: count it and step down (called once per failure)."""
    publish_failed: Callable[[Exception], None] = lambda e: None
    """Count and log a publish that raised (one commit's; the rest of its batch goes on)."""


class CommitPipeline:
    def __init__(self, steps: Steps) -> None:
        self.steps = steps
        self._queue: list[Commit] = []
        self._runner: asyncio.Task[None] | None = None
        self._writing: asyncio.Task[None] | None = None  # the previous batch's records
        self._writing_keys: frozenset[tuple[str, str | None]] = frozenset()
        self._closed = False
        self.contended = asyncio.Event()
        """Set when a commit had to wait for an earlier one (for tests: the analogue of a lock
        being contended)."""

    # --- the API ---------------------------------------------------------------------------------

    def submit(self, outcome: Outcome) -> Commit:
        """Queue an outcome behind every one decided before it (synchronously: the order of
        ``submit`` calls is the order things go out). The one way in: whoever answers or
        acknowledges awaits the commit's ``durable`` (a health event times ``published`` on
        the way)."""
        commit = Commit(outcome)
        if self._closed:
            _fail(commit, "not serving")
            return commit
        if self.busy():
            self.contended.set()
        self._queue.append(commit)
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run(), name="commit")
        return commit

    def busy(self) -> bool:
        """True while anything is queued, going out or being written."""
        return bool(self._queue) or _running(self._runner) or _running(self._writing)

    async def drain(self) -> None:
        """Wait until everything submitted has gone out (or been dropped) and been written."""
        while self.busy():
            for task in (self._runner, self._writing):
                if task is not None and not task.done():
                    await asyncio.wait([task])  # neither cancels it nor raises its error
            await asyncio.sleep(0)

    def close(self) -> None:
        """Drop everything queued, and every commit from now on, until ``reopen``."""
        self._closed = True
        queued, self._queue = self._queue, []
        for commit in queued:
            _fail(commit, "not serving")

    def reopen(self) -> None:
        self._closed = False

    # --- the runner ------------------------------------------------------------------------------

    async def _run(self) -> None:
        while self._queue and not self._closed:
            batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
            try:
                await self._go_out(batch)
            except BaseException as e:  # a publish failed, a bug: never leave a waiter hanging
                for commit in batch:
                    for f in (commit.published, commit.durable):
                        if not f.done():
                            f.set_exception(e if isinstance(e, Exception) else NotServing("stop"))
                if not isinstance(e, Exception):
                    raise

    async def _go_out(self, batch: list[Commit]) -> None:
        if not self.steps.leading():
            # Fenced: another controller may lead by now. Nothing of this goes out, and the
            # policy already holds these decisions: step down, so whoever leads next (perhaps
            # us, re-elected) rebuilds from the store.
            self._give_up(batch, "fenced", "a decision was fenced before it was committed")
            return
        ceilings = _last_per_key([r for c in batch for r in c.outcome.write_ahead])
        if ceilings:
            keys = frozenset((r.job, r.replica) for r in ceilings)
            if keys & self._writing_keys and _running(self._writing):
                assert self._writing is not None
                self.contended.set()
                await asyncio.wait([self._writing])  # never write a key out of order
            if not await self.steps.write_ahead(ceilings):
                # Not durable: publishing would let a restored controller issue the same epoch
                # again. Our in-memory state is ahead of the store: step down; the events (not
                # acknowledged) are redelivered to whoever leads next, which rebuilds.
                self._give_up(
                    batch, "store.write_ahead_failed", "epoch ceilings could not be written"
                )
                return
            if not self.steps.leading():  # the lease lapsed while we were writing
                self._give_up(batch, "fenced", "the lease lapsed during a write-ahead")
                return
        failed: dict[int, Exception] = {}
        for i, commit in enumerate(batch):
            if i and not self.steps.leading():
                # A publish can yield, and the lease can lapse meanwhile: nothing more goes out.
                # What went out is covered by the durable ceilings; its records are not written
                # (we step down; whoever leads next rebuilds from the store).
                for done in batch[:i]:
                    done.published.set_result(None)
                self._give_up(batch, "fenced", "the lease lapsed while publishing")
                return
            try:
                await self.steps.publish(commit.outcome)
            except Exception as e:  # one commit's error, not its batch's
                # Only this commit failed (a payload too large, a client error). The policy
                # keeps its decision and its records are still written with the batch: the
                # desired state in the bucket is level-triggered and a pending command is
                # resent by the tick. Stepping down instead would loop on a command that can
                # never go out. Its waiter gets the error (a health event is not acked).
                failed[i] = e
                self.steps.publish_failed(e)
        for i, commit in enumerate(batch):
            if i in failed:
                commit.published.set_exception(failed[i])
            else:
                commit.published.set_result(None)
        previous = self._writing
        self._writing = asyncio.create_task(
            self._write(batch, previous, failed), name="commit-write"
        )
        # The epoch keys being written, this batch's and (while they last) the earlier ones'
        # it waits for: the only keys a write-ahead also writes.
        keys = frozenset((r.job, r.replica) for c in batch for r in c.outcome.put_epochs)
        keys |= frozenset((k.job, k.replica) for c in batch for k in c.outcome.deleted_epochs)
        self._writing_keys = keys | (self._writing_keys if _running(previous) else frozenset())

    async def _write(
        self,
        batch: list[Commit],
        previous: asyncio.Task[None] | None,
        failed: dict[int, Exception],
    ) -> None:
        error: Exception | None = None
        try:
            if previous is not None:
                await asyncio.wait([previous])  # the earlier batch's records land first
            await self.steps.persist([c.outcome for c in batch])
            for commit in batch:
                await self.steps.announce(commit.outcome)
        except Exception as e:
            # Not durable (the store refused or never acknowledged the records; ``persist``
            # has stepped down): nobody waiting on them is answered or acknowledged. Read
            # here, not left on the task where nobody would see it.
            error = e
        finally:
            for i, commit in enumerate(batch):
                if commit.durable.done():
                    continue
                if i in failed:
                    commit.durable.set_exception(failed[i])
                elif error is not None:
                    commit.durable.set_exception(
                        error if isinstance(error, NotServing) else NotServing(str(error))
                    )
                else:
                    commit.durable.set_result(None)

    def _give_up(self, batch: list[Commit], counter: str, why: str) -> None:
        for commit in batch:
            _fail(commit, why)
        self.close()
        self.steps.stop(counter, why)


def _fail(commit: Commit, why: str) -> None:
    for f in (commit.published, commit.durable):
        if not f.done():
            f.set_exception(NotServing(why))


def _running(task: asyncio.Task[None] | None) -> bool:
    return task is not None and not task.done()


def _last_per_key(records: list[EpochRecord]) -> list[EpochRecord]:
    """One record per epoch key, the last decided (a later ceiling is never lower)."""
    last: dict[tuple[str, str | None], EpochRecord] = {}
    for r in records:
        last[(r.job, r.replica)] = r
    return list(last.values())
