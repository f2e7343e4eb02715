"""What the monitor commands do, as plain async functions (the CLI only prints).

Publishing health events is monitor_cli/health.py's (its names are here too, for the CLI).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from marduk.errors import (
    MardukError,
    NoControllerError,
    PermissionDeniedError,
)
from marduk.transport import bus
from marduk.transport.credentials import redact
from marduk.wire.protocol import (
    ControllerEvent,
    Drain,
    DrainReply,
    Forget,
    ForgetReply,
    Hello,
    PerfQuery,
    PerfReply,
    Query,
    QueryReply,
    QueryWhat,
    decode,
)
from marduk.wire.subjects import Subjects
from monitor_cli.health import STATS as STATS
from monitor_cli.health import NoHealthStreamError as NoHealthStreamError
from monitor_cli.health import UndecidedError as UndecidedError
from monitor_cli.health import connect as connect
from monitor_cli.health import publish_durably as publish_durably
from monitor_cli.health import publish_health as publish_health
from monitor_cli.health import store as store
from monitor_cli.health import watch_stored as watch_stored

log = logging.getLogger("monitor_cli.client")


async def subscribe(nc: NATS, subject: str, **kw: Any) -> Subscription:
    """Subscribe, and raise PermissionDeniedError (one line naming the subject) if the server
    refuses: it says so asynchronously, and a refused subscription would only stay silent."""
    since = time.time()
    sub = await nc.subscribe(subject, **kw)
    refused = await bus.refused(nc, [subject], since)
    if refused:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        raise PermissionDeniedError(refused)
    return sub


async def drain(
    addr: str,
    prefix: str,
    devices: list[str],
    host: str = "",
    *,
    undrain: bool = False,
    reason: str = "",
    timeout: float = 5.0,
) -> DrainReply:
    nc = await bus.connect(addr, name="marduk-monitor", timeout=timeout)
    try:
        return await bus.request(
            nc,
            Subjects(prefix).drain,
            Drain(devices=devices, host=host, undrain=undrain, reason=reason),
            DrainReply,
            timeout=timeout,
            addr=addr,
        )
    finally:
        await bus.close(nc, drain=False)


async def forget(
    addr: str,
    prefix: str,
    job: str,
    replica: str | None = None,
    worker: int | None = None,
    timeout: float = 5.0,
) -> ForgetReply:
    nc = await connect(addr, timeout=timeout)
    try:
        return await bus.request(
            nc,
            Subjects(prefix).forget,
            Forget(job=job, replica=replica, worker=worker),
            ForgetReply,
            timeout=timeout,
            addr=addr,
        )
    finally:
        await bus.close(nc, drain=False)


async def query(
    addr: str, prefix: str, what: QueryWhat = "map", job: str | None = None, timeout: float = 5.0
) -> QueryReply:
    """Ask the controller; large answers come in pages, assembled here into one reply."""
    nc = await connect(addr, timeout=timeout)
    try:
        return await query_on(nc, prefix, what, job, timeout, addr=addr)
    finally:
        await bus.close(nc, drain=False)


async def perf(
    addr: str, prefix: str, job: str | None = None, timeout: float = 5.0
) -> PerfReply | None:
    """The jobs' performance and the slow devices (``ctl.perf_query``); None when no controller
    answers it (an older one): status shows the rest without it."""
    nc = await connect(addr, timeout=timeout)
    try:
        return await perf_on(nc, prefix, job, timeout)
    except MardukError:
        return None
    finally:
        await bus.close(nc, drain=False)


async def perf_on(
    nc: NATS, prefix: str, job: str | None = None, timeout: float = 5.0
) -> PerfReply | None:
    """``perf`` on a connection the caller keeps (``top`` asks every refresh)."""
    try:
        return await bus.request(
            nc, Subjects(prefix).perf_query, PerfQuery(job=job), PerfReply, timeout=timeout
        )
    except PermissionDeniedError:
        raise
    except MardukError:
        return None


async def query_on(
    nc: NATS,
    prefix: str,
    what: QueryWhat = "map",
    job: str | None = None,
    timeout: float = 5.0,
    *,
    addr: str = "",
) -> QueryReply:
    """``query`` on a connection the caller keeps (``top`` asks every second)."""
    subject = Subjects(prefix).query
    first = await bus.request(
        nc, subject, Query(what=what, job=job), QueryReply, timeout=timeout, addr=addr
    )
    page = first
    while page.next_offset is not None:
        page = await bus.request(
            nc,
            subject,
            Query(what=what, job=job, offset=page.next_offset, snapshot=first.snapshot),
            QueryReply,
            timeout=timeout,
            addr=addr,
        )
        if page.snapshot != first.snapshot:
            raise MardukError(
                "the controller's answer changed while it was being read (a takeover?); ask again"
            )
        first.workers.extend(page.workers)
        first.devices.extend(page.devices)
    first.next_offset = None
    return first


@dataclass(frozen=True, slots=True)
class Notice:
    """What ``watch`` notices about NATS or the controller, apart from the controller's events."""

    kind: Literal["nats_lost", "nats_back", "controller_silent", "controller_serving"]
    text: str


class _ControllerWatch:
    """Turns pings and hellos into notices, each change said once."""

    def __init__(self, say: Callable[[Notice], None]) -> None:
        self.say = say
        self.up: bool | None = None  # None: not asked yet
        self.leader = ""

    def serving(self, controller_id: str, detail: str) -> None:
        if self.up and controller_id == self.leader:
            return
        if self.up:
            text = f"controller {controller_id} took over from {self.leader} ({detail})"
        elif self.up is False:
            text = f"controller {controller_id} serving again ({detail})"
        else:
            text = f"controller {controller_id} serving ({detail})"
        self.up, self.leader = True, controller_id
        self.say(Notice("controller_serving", text))

    def silent(self, detail: str) -> None:
        if self.up is False:
            return
        self.up = False
        self.say(Notice("controller_silent", f"controller not answering: {detail}"))


async def events(
    addr: str,
    prefix: str,
    job: str | None = None,
    timeout: float = 5.0,
    on_ready: Callable[[], None] | None = None,
    *,
    ping_interval: float = 2.0,
) -> AsyncIterator[ControllerEvent | bytes | Notice]:
    """Controller events as they happen (undecodable payloads raw), and Notices.

    No event for a while says nothing (a quiet job is normal), so the controller is pinged
    every ``ping_interval`` and a new leader's hello is heard: "controller not answering",
    "controller X serving again". NATS going away and coming back is noticed too.
    """
    s = Subjects(prefix)
    queue: asyncio.Queue[ControllerEvent | bytes | Notice] = asyncio.Queue()
    watch = _ControllerWatch(queue.put_nowait)
    closing = False

    async def lost() -> None:
        if not closing:
            queue.put_nowait(
                Notice("nats_lost", f"lost the connection to NATS at {redact(addr)}; reconnecting")
            )

    async def back() -> None:
        url = nc.connected_url
        where = f"{url.scheme}://{url.hostname}:{url.port}" if url else redact(addr)
        queue.put_nowait(Notice("nats_back", f"reconnected to NATS at {where}"))

    async def on_event(msg: Msg) -> None:
        try:
            queue.put_nowait(decode(msg.data, ControllerEvent))
        except ValueError:
            queue.put_nowait(msg.data)

    async def on_hello(msg: Msg) -> None:
        try:
            hello = decode(msg.data, Hello)
        except ValueError:
            return
        watch.serving(hello.controller_id, "it announced itself")

    nc = await connect(
        addr,
        name="marduk-monitor-watch",
        timeout=timeout,
        reconnect=True,
        on_disconnected=lost,
        on_reconnected=back,
    )
    pinger: asyncio.Task[None] | None = None
    try:
        await subscribe(nc, s.all_events if job is None else s.events(job), cb=on_event)
        # Credentials of the admin role may not subscribe here; the pings still tell.
        await nc.subscribe(s.hello, cb=on_hello)
        await nc.flush()
        if on_ready is not None:
            on_ready()
        pinger = asyncio.create_task(
            _ping(nc, s, watch, addr, min(timeout, ping_interval), ping_interval),
            name="watch-ping",
        )
        while True:
            yield await queue.get()
    finally:
        closing = True
        if pinger is not None:
            pinger.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pinger
        await bus.close(nc, drain=False)


async def _ping(
    nc: NATS, s: Subjects, watch: _ControllerWatch, addr: str, wait: float, interval: float
) -> None:
    """Ask the controller every ``interval`` whether it serves; tell ``watch`` what it hears."""
    while True:
        if nc.is_connected:
            try:
                reply = await bus.request(
                    nc, s.query, Query(what="ping"), QueryReply, timeout=wait, addr=addr
                )
                c = reply.controller
                watch.serving(c.controller_id, f"term {c.term}, pid {c.pid} on {c.host or '?'}")
            except NoControllerError:
                watch.silent(f"no reply within {wait:g}s")
            except Exception as e:  # keep watching whatever one ping met
                watch.silent(str(e) or type(e).__name__)
        await asyncio.sleep(interval)
