"""Health events into the stream, durably: stored by JetStream, then decided by the controller.

``publish_health`` (one event, for ``inject-failure`` and friends) and ``publish_durably`` (on a
long-lived connection: monitor_cli/publisher.py) store an event in the health stream and wait for
the controller's decision on the event's own reply inbox; ``store`` and ``watch_stored`` are the
steps, for tests and benchmarks that time them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from marduk.errors import (
    MardukError,
    PermissionDeniedError,
    RequestRejected,
)
from marduk.transport import bus
from marduk.transport.credentials import redact
from marduk.wire.protocol import (
    DeviceHealth,
    ErrorReply,
    HealthReply,
    HealthState,
    decode,
    encode,
)
from marduk.wire.subjects import REPLY_HEADER, Subjects

log = logging.getLogger("monitor_cli.health")


async def connect(addr: str, name: str = "marduk-monitor", timeout: float = 5.0, **kw: Any) -> NATS:
    """Connect as a monitor command; a server without JetStream is said so (no controller
    can run there) rather than found out as a timeout."""
    nc = await bus.connect(addr, name=name, timeout=timeout, **kw)
    try:
        bus.require_jetstream(nc, addr)
    except MardukError:
        await bus.close(nc, drain=False)
        raise
    return nc


class NoHealthStreamError(MardukError):
    """Nothing stores health events on this prefix: no controller has ever run on it."""


class UndecidedError(MardukError):
    """The event is stored durably, but no controller decided within the timeout."""

    def __init__(self, event_id: str, seq: int, timeout: float) -> None:
        super().__init__(
            f"event {event_id} is stored (stream sequence {seq}) but no controller decided "
            f"within {timeout:g}s; it will be handled when a controller serves"
        )
        self.event_id = event_id
        self.seq = seq


async def publish_health(
    addr: str,
    prefix: str,
    device: str,
    state: HealthState,
    *,
    reason: str = "",
    source: str = "marduk-monitor",
    timeout: float = 5.0,
    event_id: str = "",
) -> HealthReply:
    """Publish a health event durably, exactly as a monitor should, and return the decision.

    The event goes to ``<prefix>.health`` through JetStream: the server's acknowledgement means
    it is stored and will be handled even if no controller runs right now. The header
    ``Marduk-Reply-To`` names an inbox where the controller publishes its HealthReply once the
    decision is committed. Raises UndecidedError if that does not come within ``timeout``.
    """
    event = DeviceHealth(
        device=device,
        state=state,
        reason=reason,
        source=source,
        event_id=event_id or f"{source}-{uuid.uuid4().hex[:12]}",
        timestamp=time.time(),
    )
    nc = await connect(addr, timeout=timeout)
    try:
        return await publish_durably(nc, Subjects(prefix), event, timeout=timeout, addr=addr)
    finally:
        await bus.close(nc, drain=False)


async def publish_durably(
    nc: NATS, subjects: Subjects, event: DeviceHealth, *, timeout: float, addr: str = ""
) -> HealthReply:
    """Publish ``event`` to the health stream on ``nc`` and wait for the controller's reply.

    Only a reply naming our ``event_id`` is taken: the inbox is visible to every reader of
    ``health.stored``, so anyone may publish an event naming it (the controller answers that
    one there too); others are ignored and counted (``monitor.replies_ignored``).
    """
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    stored = await watch_stored(nc, subjects)
    deadline = time.monotonic() + timeout
    payload = encode(event)
    asked = 0
    try:
        seq = await store(nc, subjects, payload, inbox, stored, timeout=timeout, addr=addr)
        # Without an event_id the controller names the event by its stream sequence.
        ours = {event.event_id} if event.event_id else {f"{subjects.prefix}.health#{seq}"}
        while True:
            left = deadline - time.monotonic()
            try:
                msg = await sub.next_msg(timeout=max(0.05, min(left, 1.0)))
                reply = _reply_to(ours, event.event_id, msg)
                if reply is not None:
                    break
                continue
            except (TimeoutError, nats.errors.TimeoutError):
                if left <= 1.0:
                    raise UndecidedError(event.event_id, seq, timeout) from None
            # On a cluster the answer can beat our inbox's interest to the controller's node
            # and be dropped. Ask again with the same event id: the controller answers a
            # repeat with its first decision (and does nothing else).
            asked += 1
            again = await store(
                nc, subjects, payload, inbox, stored, timeout=max(0.5, left), addr=addr
            )
            if not event.event_id:
                ours.add(f"{subjects.prefix}.health#{again}")
    finally:
        await stored.unsubscribe()
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
    if isinstance(reply, ErrorReply):
        raise RequestRejected(reply.code, reply.message)
    if asked and reply.duplicate:
        reply = msgspec.structs.replace(reply, duplicate=False)  # our own repeat, not theirs
    return reply


STATS: Counter[str] = Counter()


def _reply_to(ours: set[str], event_id: str, msg: Msg) -> HealthReply | ErrorReply | None:
    """The controller's answer in ``msg`` if it answers ``event``; None (logged, counted) if it
    answers another event someone published naming our inbox, or is not an answer at all."""
    try:
        reply: Any = decode(msg.data, HealthReply | ErrorReply)  # type: ignore[arg-type]
    except ValueError:
        reply = None
    if reply is not None and reply.event_id in ours:
        return reply  # type: ignore[no-any-return]
    STATS["monitor.replies_ignored"] += 1
    if STATS["monitor.replies_ignored"] <= 5:
        other = getattr(reply, "event_id", None)
        log.warning(
            "ignored a reply on our inbox for another event (%r, ours %s): someone published "
            "an event naming our inbox",
            other,
            event_id or sorted(ours)[0],
        )
    return None


class StoredDispatcher:
    """One subscription to ``<prefix>.health.stored`` per connection, shared by every
    publish waiting on it: each stored notice goes to the publish whose inbox its
    ``Marduk-Reply-To`` header names (so N publishes in flight cost one copy of each notice,
    not N). Unsubscribed when the last watch ends."""

    def __init__(self, nc: NATS, subject: str) -> None:
        self.nc = nc
        self.subject = subject
        self.since = time.time()
        self.sub: Subscription | None = None
        self.users = 0
        self.refused: str | None = None  # the server's refusal of the subscription
        self._waiting: dict[str, asyncio.Queue[int]] = {}
        self._ready = asyncio.ensure_future(self._start())

    async def _start(self) -> None:
        self.sub = await self.nc.subscribe(
            self.subject, cb=self._on_stored, pending_msgs_limit=100_000
        )
        # Known before anything is published: an identity that may not read it would store
        # events it can never see stored.
        with contextlib.suppress(nats.errors.TimeoutError):
            self.refused = await bus.refused(self.nc, [self.subject], self.since)

    async def ready(self) -> None:
        await asyncio.shield(self._ready)

    async def _on_stored(self, msg: Msg) -> None:
        headers = msg.headers or {}
        queue = self._waiting.get(headers.get(REPLY_HEADER, ""))
        if queue is not None:
            queue.put_nowait(int(headers.get("Nats-Sequence", "0") or 0))

    def expect(self, inbox: str) -> asyncio.Queue[int]:
        return self._waiting.setdefault(inbox, asyncio.Queue())

    def forget(self, inbox: str) -> None:
        self._waiting.pop(inbox, None)


_dispatchers: weakref.WeakKeyDictionary[NATS, dict[str, StoredDispatcher]] = (
    weakref.WeakKeyDictionary()
)


@dataclass
class StoredWatch:
    """One publish's view of where the health stream republishes what it stored, subscribed
    (shared, per connection) before publishing."""

    dispatcher: StoredDispatcher
    inboxes: list[str] = field(default_factory=list)
    done: bool = False

    @property
    def since(self) -> float:
        return self.dispatcher.since

    @property
    def sub(self) -> Subscription | None:
        return self.dispatcher.sub

    async def unsubscribe(self) -> None:
        if self.done:
            return
        self.done = True
        d = self.dispatcher
        for inbox in self.inboxes:
            d.forget(inbox)
        d.users -= 1
        if d.users == 0:
            shared = _dispatchers.get(d.nc, {})
            if shared.get(d.subject) is d:
                del shared[d.subject]
            if d.sub is not None:
                with contextlib.suppress(Exception):
                    await d.sub.unsubscribe()


async def watch_stored(nc: NATS, subjects: Subjects) -> StoredWatch:
    shared = _dispatchers.setdefault(nc, {})
    d = shared.get(subjects.health_stored)
    if d is None:
        d = shared[subjects.health_stored] = StoredDispatcher(nc, subjects.health_stored)
    d.users += 1
    watch = StoredWatch(d)
    try:
        await d.ready()
    except BaseException:
        await watch.unsubscribe()
        raise
    return watch


async def store(
    nc: NATS,
    subjects: Subjects,
    payload: bytes,
    inbox: str,
    stored: StoredWatch,
    *,
    timeout: float,
    addr: str = "",
) -> int:
    """Publish to the health stream until it has stored the event or ``timeout`` runs out;
    return the event's stream sequence.

    The stream sends no acknowledgement (it would go to any reply subject, with the server's
    rights: see marduk/store/health_stream.py); it republishes the headers of what it stored on
    ``stored``'s subject, where ours carries our ``inbox``. Nothing comes while the stream has
    no leader (a NATS node was lost, an election: seconds): then we publish again.
    """
    deadline = time.monotonic() + timeout
    if inbox not in stored.inboxes:
        stored.inboxes.append(inbox)
    seen = stored.dispatcher.expect(inbox)
    while True:
        refused = stored.dispatcher.refused or bus.denied(subjects.health_stored, stored.since)
        if refused:  # checked before publishing: nothing is stored that we cannot see stored
            raise PermissionDeniedError(
                f"{refused}, so it cannot tell an event is stored (nothing was published); "
                "for a monitor or admin credential made by an older Marduk: regenerate the "
                "server configuration with `marduk auth update-config DIR` and reload the server"
            )
        since = time.time()
        await nc.publish(subjects.health, payload, headers={REPLY_HEADER: inbox})
        # The server has now accepted the publish or refused it. A slow one (a node lost) is
        # waited for below, and published to again.
        refused = None
        with contextlib.suppress(nats.errors.TimeoutError):
            refused = await bus.refused(nc, [subjects.health], since)
        if refused:
            raise PermissionDeniedError(refused)
        attempt_ends = min(deadline, time.monotonic() + 1.0)
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(seen.get(), max(0.0, attempt_ends - time.monotonic()))
        if time.monotonic() + 0.05 >= deadline:
            raise await _unstored(nc, subjects, addr, timeout)


async def _unstored(nc: NATS, subjects: Subjects, addr: str, timeout: float) -> MardukError:
    from marduk.store.health_stream import stream_name

    try:
        info = await nc.jetstream(timeout=1.0).stream_info(stream_name(subjects.prefix))
    except nats.js.errors.NotFoundError:
        return NoHealthStreamError(
            f"nothing stores health events at {redact(addr) or 'the server'} on "
            f"{subjects.health}: has a Marduk controller ever run with prefix "
            f"{subjects.prefix!r}?"
        )
    except Exception:
        info = None
    republish = info.config.republish if info is not None else None
    if info is not None and (republish is None or republish.dest != subjects.health_stored):
        return MardukError(
            f"the event may have been stored: the health stream {info.config.name} was made by "
            f"an older controller and does not say what it stores on {subjects.health_stored}; "
            "upgrade the controllers first (they update the stream when they start), then the "
            "monitors (docs/operations.md, Upgrading)"
        )
    return MardukError(
        f"the event may have been stored: the health stream did not confirm it within "
        f"{timeout:g}s: is JetStream available (a NATS node down, an election), and does a "
        f"controller of this version run (the stream republishes what it stores on "
        f"{subjects.health_stored})?"
    )
