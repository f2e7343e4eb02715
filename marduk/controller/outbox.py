"""What a commit does: write ahead, publish the commands, persist, announce the events.

See docs/architecture.md, *The commit path*.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from marduk.aio import Backoff
from marduk.controller.commit import NotServing
from marduk.controller.context import Context
from marduk.controller.telemetry import log_event
from marduk.core.policy import Outcome
from marduk.core.records import EpochRecord
from marduk.store.kv import Fenced
from marduk.store.state import StateStore
from marduk.transport import auth
from marduk.wire.protocol import (
    Command,
    ControllerEvent,
    encode,
)

log = logging.getLogger("marduk.controller")

# A write-ahead gives up (and the leader steps down) after this long in all; records written
# after publishing after the second; each attempt waits at most the third for its
# acknowledgements (BatchWriter's own 5 s would hold every later commit up to 30 s).
_WRITE_AHEAD_BUDGET_S = 1.5
_PERSIST_BUDGET_S = 3.0
_WRITE_ATTEMPT_S = 0.5


def _has_writes(o: Outcome) -> bool:
    return bool(
        o.put_workers
        or o.deleted_workers
        or o.put_epochs
        or o.deleted_epochs
        or o.put_devices
        or o.deleted_devices
        or o.handled
    )


class Outbox:
    """The steps of the commit pipeline (``commit.Steps``): write ahead, publish, persist,
    announce, each write retried while we lead and within its budget.

    Handed the store (None until it is open) and the seed commands are signed with (None:
    unsigned; read at each command, so a new seed signs at once)."""

    def __init__(
        self,
        ctx: Context,
        *,
        store: Callable[[], StateStore | None],
        signing_seed: Callable[[], bytes | None],
    ) -> None:
        self._ctx = ctx
        self._store = store
        self._signing_seed = signing_seed
        self._signer: auth.Signer | None = None  # for the signing seed, made on first use

    def publish_failed(self, error: Exception) -> None:
        self._ctx.stats["errors.publish"] += 1
        self._ctx.logs.limited("publish", f"a command could not be published: {error}")

    def stop_committing(self, counter: str, why: str) -> None:
        self._ctx.stats[counter] += 1
        self._ctx.step_down(why)

    async def publish_outcome(self, outcome: Outcome) -> None:
        stats = self._ctx.stats
        for command in outcome.commands:
            await self.publish_command(command)
            stats[f"commands.{command.kind}"] += 1
        for command in outcome.resent:
            await self.publish_command(command)
            stats["commands.resent"] += 1
        for notice in outcome.notices:
            # After the commands: the failed replicas hear first. Signed like them.
            await self.publish_command(notice)
            stats["commands.peer_failed"] += 1

    async def announce_all(self, outcome: Outcome) -> None:
        for event in outcome.events:
            await self.announce(event)

    async def announce(self, event: ControllerEvent) -> None:
        log_event(event, self._ctx.logs.limited)
        if event.kind == "command_oversized":  # marduk_errors_total{kind="command_oversized"}
            self._ctx.stats["errors.command_oversized"] += 1
        with contextlib.suppress(Exception):  # NotServing (no connection) included
            nc = self._ctx.connection()
            await nc.publish(self._ctx.subjects.events(event.job), encode(event))

    async def write_ahead(self, ceilings: list[EpochRecord]) -> bool:
        """Make the epoch ceilings durable; False if they could not be while we lead."""
        store = self._store()
        if store is None:
            return True
        if await self.retry(lambda: store.write_ahead(ceilings), budget_s=_WRITE_AHEAD_BUDGET_S):
            return True
        log.error("epoch ceilings not persisted; the commands do not go out")
        return False

    async def persist(self, outcomes: list[Outcome]) -> None:
        """Write the outcomes' other records (after their commands went out)."""
        store = self._store()
        if store is None or not any(_has_writes(o) for o in outcomes):
            return
        if not await self.retry(lambda: store.apply(outcomes), budget_s=_PERSIST_BUDGET_S):
            # The commands went out already (their ceilings are durable), but our state is
            # ahead of the store, and a lapsed leader must not answer or acknowledge: nothing
            # waiting on these records is answered or acked (the events are redelivered), and
            # we step down; whoever leads next rebuilds from the store and the agents.
            log.error("state not persisted after publishing; stepping down")
            self.stop_committing("store.persist_failed", "records could not be written")
            raise NotServing("records not persisted")

    async def retry(self, write: Callable[[], Awaitable[None]], *, budget_s: float) -> bool:
        """Try a write while we lead, for at most ``budget_s`` in all (each attempt at most
        ``_WRITE_ATTEMPT_S``); False if it never succeeded.

        Bounded, since later commits wait for this one: a write-ahead gives up after
        ``_WRITE_AHEAD_BUDGET_S`` (then we step down and the event is redelivered to whoever
        leads, which rebuilds from the store: a JetStream election is ridden out that way);
        records written after publishing get ``_PERSIST_BUDGET_S``. Every write is idempotent,
        and one acknowledged after we gave up only makes the store more current.
        """
        deadline = time.monotonic() + budget_s
        backoff, attempt = Backoff(initial=0.05, cap=0.5), 0
        while True:
            attempt += 1
            remaining = deadline - time.monotonic()
            try:
                await asyncio.wait_for(write(), min(_WRITE_ATTEMPT_S, max(remaining, 0.01)))
                return True
            except Fenced as e:
                # Refused by the store: another leader's term began. Retrying cannot help.
                self._ctx.stats["store.fenced"] += 1
                self._ctx.logs.limited("store", f"state write refused: {e}")
                return False
            except Exception as e:  # TimeoutError (not acknowledged in time) included
                self._ctx.stats["store.errors"] += 1
                why = str(e) or type(e).__name__
                self._ctx.logs.limited("store", f"state write failed (attempt {attempt}): {why}")
            if not self._ctx.leading() or deadline - time.monotonic() <= backoff.delay:
                break
            await asyncio.sleep(backoff.next())
        self._ctx.stats["store.given_up"] += 1
        return False

    async def publish_command(self, command: Command) -> None:
        nc = self._ctx.connection()
        payload = encode(command)
        signature = self.signature(payload)
        headers = {auth.SIG_HEADER: signature} if signature is not None else None
        await nc.publish(self.command_subject(command), payload, headers=headers)

    def signature(self, payload: bytes) -> str | None:
        """The command's ``Marduk-Sig`` (None: the controller does not sign), by a key pair made
        once per seed, not once per command."""
        seed = self._signing_seed()
        if seed is None:
            return None
        if self._signer is None or self._signer.seed != seed:
            self._signer = auth.Signer(seed)
        return self._signer.sign(payload)

    def command_subject(self, command: Command) -> str:
        if command.replica is None:
            return self._ctx.subjects.job_commands(command.job)
        return self._ctx.subjects.replica_commands(command.job, command.replica)
