"""Durable health events: a JetStream stream captures ``<prefix>.health``.

Any publish the server accepts on the health subject (``nats pub`` included) is stored, so an
event is handled even when no controller runs at that moment or the leader dies while handling
it. The leader consumes through one durable push consumer (queue group, explicit acks) and acks
an event only after its decision is committed; an unacked event is redelivered after
``ack_wait`` (to whichever controller leads then), and the event-id dedup makes that harmless.

A monitor that wants the decision names a subject in the ``Marduk-Reply-To`` header; the
controller publishes its ``HealthReply`` there after committing (``docs/protocol.md``).

The stream sends no acknowledgement (``no_ack``): JetStream acknowledges on whatever reply
subject the publisher names, with the server's rights, so a monitor naming
``$KV.marduk_leader.leader`` would have overwritten the lease. Instead the stream republishes the
headers of each stored event on ``<prefix>.health.stored`` (after storing it, and on a cluster
after its replicas agree); a monitor finds its own there by its ``Marduk-Reply-To`` inbox.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RePublish,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import NotFoundError

log = logging.getLogger("marduk.health_stream")

CONSUMER = "marduk-controller"


def stream_name(prefix: str) -> str:
    return prefix.replace(".", "_") + "_health"


async def ensure_stream(
    nc: NATS, prefix: str, subject: str, *, replicas: int = 1, max_age_s: float = 86400.0
) -> str:
    """Create the health stream if it does not exist (or make an older one stop acknowledging
    and start republishing); return its name."""
    js = nc.jetstream(timeout=5.0)
    name = stream_name(prefix)
    stored = stored_subject(subject)
    try:
        info = await js.stream_info(name)
    except NotFoundError:
        await js.add_stream(
            StreamConfig(
                name=name,
                subjects=[subject],
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE,
                num_replicas=replicas,
                max_age=max_age_s,
                max_msgs=1_000_000,
                description="Marduk: device health events, kept until handled (and a day more)",
                no_ack=True,
                republish=RePublish(src=subject, dest=stored, headers_only=True),
            )
        )
        log.info("created stream %s for %s", name, subject)
        return name
    config = info.config
    if not config.no_ack or config.republish is None or config.republish.dest != stored:
        config.no_ack = True
        config.republish = RePublish(src=subject, dest=stored, headers_only=True)
        await js.update_stream(config)
        log.info("stream %s: acknowledgements off, stored events republished on %s", name, stored)
    return name


def stored_subject(health_subject: str) -> str:
    """Where the stream republishes the headers of what it stored (``Subjects.health_stored``)."""
    return health_subject + ".stored"


class HealthConsumer:
    """The leader's subscription to the durable consumer of the health stream."""

    def __init__(self, nc: NATS, prefix: str, subject: str, *, ack_wait_s: float = 2.0) -> None:
        self.nc = nc
        self.stream = stream_name(prefix)
        self.subject = subject
        self.ack_wait_s = ack_wait_s
        self._sub: object | None = None
        self.replayed_from = 0  # the last restart from the ack floor (0: none)
        self._start_again_at = 0

    async def start(
        self, cb: Callable[[Msg], Awaitable[None]], *, previous_gone: bool = False
    ) -> None:
        """Subscribe. ``previous_gone``: the previous leader's process is provably gone (its
        connection closed), so events it was delivered and never acknowledged are delivered
        again now rather than after ``ack_wait``: the consumer is made again from its ack floor
        (events acknowledged above the floor come again too; the event-id dedup answers them
        as duplicates)."""
        js = self.nc.jetstream(timeout=5.0)
        if previous_gone:
            self._start_again_at = await self._restart_from_ack_floor() or self._start_again_at
        start = self._start_again_at  # kept until a subscription made it (a retry needs it)
        self._sub = await js.subscribe(
            self.subject,
            queue=CONSUMER,
            durable=CONSUMER,
            stream=self.stream,
            cb=cb,
            manual_ack=True,
            pending_msgs_limit=1_000_000,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE if start else DeliverPolicy.ALL,
                opt_start_seq=start or None,
                ack_wait=self.ack_wait_s,
                # Few enough in flight that a backlog is acked well within ack_wait.
                max_ack_pending=1_000,
                # An event that keeps failing to be handled (a bug it triggers) stops being
                # redelivered after this many tries instead of deposing leaders forever.
                max_deliver=20,
            ),
        )
        self._start_again_at = 0

    async def _restart_from_ack_floor(self) -> int:
        """Delete the consumer if events await acks; return the sequence to start again from
        (0: keep it as it is)."""
        js = self.nc.jetstream(timeout=5.0)
        try:
            info = await js.consumer_info(self.stream, CONSUMER)
        except NotFoundError:
            return 0
        if not info.num_ack_pending or info.ack_floor is None:
            return 0
        start = (info.ack_floor.stream_seq or 0) + 1
        await js.delete_consumer(self.stream, CONSUMER)
        self.replayed_from = start
        log.info(
            "the previous leader is gone with %d event(s) unacknowledged: delivering again from "
            "stream sequence %d",
            info.num_ack_pending,
            start,
        )
        return start

    async def stop(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await sub.unsubscribe()  # type: ignore[attr-defined]
            except Exception as e:
                log.debug("unsubscribe: %s", e)
