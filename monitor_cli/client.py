"""What the monitor commands do, as plain async functions (the CLI only prints)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

from marduk import bus
from marduk.protocol import (
    ControllerEvent,
    DeviceHealth,
    HealthReply,
    HealthState,
    Query,
    QueryReply,
    QueryWhat,
    decode,
)
from marduk.subjects import Subjects


async def publish_health(
    addr: str,
    prefix: str,
    device: str,
    state: HealthState,
    *,
    reason: str = "",
    source: str = "marduk-monitor",
    timeout: float = 5.0,
) -> HealthReply:
    """Publish a health event exactly as a monitor would, and return the controller's answer.

    The event goes to ``<prefix>.health`` like any monitor's; asking with a reply inbox is what
    lets the controller tell us which replicas it acted on.
    """
    event = DeviceHealth(
        device=device,
        state=state,
        reason=reason,
        source=source,
        event_id=f"{source}-{uuid.uuid4().hex[:12]}",
        timestamp=time.time(),
    )
    nc = await bus.connect(addr, name="marduk-monitor", timeout=timeout)
    try:
        return await bus.request(
            nc, Subjects(prefix).health, event, HealthReply, timeout=timeout, addr=addr
        )
    finally:
        await bus.close(nc, drain=False)


async def query(
    addr: str, prefix: str, what: QueryWhat = "map", job: str | None = None, timeout: float = 5.0
) -> QueryReply:
    nc = await bus.connect(addr, name="marduk-monitor", timeout=timeout)
    try:
        return await bus.request(
            nc,
            Subjects(prefix).query,
            Query(what=what, job=job),
            QueryReply,
            timeout=timeout,
            addr=addr,
        )
    finally:
        await bus.close(nc, drain=False)


async def events(
    addr: str,
    prefix: str,
    job: str | None = None,
    timeout: float = 5.0,
    on_ready: Callable[[], None] | None = None,
) -> AsyncIterator[ControllerEvent | bytes]:
    """Controller events as they happen; undecodable payloads are yielded raw."""
    s = Subjects(prefix)
    nc = await bus.connect(addr, name="marduk-monitor-watch", timeout=timeout, reconnect=True)
    try:
        sub = await nc.subscribe(s.all_events if job is None else s.events(job))
        await nc.flush()
        if on_ready is not None:
            on_ready()
        async for msg in sub.messages:
            try:
                yield decode(msg.data, ControllerEvent)
            except ValueError:
                yield msg.data
    finally:
        await bus.close(nc, drain=False)
