"""Connecting to NATS and making requests, the same way for the controller, CLIs and agents.

nats-py's defaults suit none of them: its default error callback prints a traceback per failed
attempt, and with ``max_reconnect_attempts=0`` an initial connect never gives up. Here:

* ``connect(..., reconnect=False)`` (CLIs): a couple of quick attempts, then ``ConnectError``.
* ``connect(..., reconnect=True)`` (controller, agents): once connected, reconnect forever;
  the initial connect is bounded by ``timeout`` and raises ``ConnectError`` when it runs out.

Errors nats-py reports while (re)connecting are logged at debug level, never printed raw.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from marduk.errors import ConnectError, NoControllerError, RequestRejected
from marduk.protocol import ErrorReply, decode, encode

DEFAULT_ADDR = "nats://localhost:4222"
log = logging.getLogger("marduk.bus")

T = TypeVar("T")
Callback = Callable[[], Awaitable[None]]


def default_addr() -> str:
    return os.environ.get("MARDUK_ADDR") or DEFAULT_ADDR


async def connect(
    addr: str,
    *,
    name: str,
    timeout: float = 5.0,
    reconnect: bool = False,
    on_disconnected: Callback | None = None,
    on_reconnected: Callback | None = None,
    on_closed: Callback | None = None,
) -> NATS:
    """Connect to the NATS server(s) at ``addr`` (comma-separated URLs allowed)."""
    last_error: list[BaseException] = []

    async def error_cb(e: Exception) -> None:
        last_error[:] = [e]
        log.debug("nats: %s: %s", type(e).__name__, e)

    async def noop() -> None:
        return None

    servers = [s.strip() for s in addr.split(",") if s.strip()]
    nc = NATS()
    options: dict[str, Any] = dict(
        servers=servers,
        name=name,
        error_cb=error_cb,
        disconnected_cb=on_disconnected or noop,
        reconnected_cb=on_reconnected or noop,
        closed_cb=on_closed or noop,
        connect_timeout=min(2.0, timeout),
        allow_reconnect=True,
        # -1: never stop. nats-py treats 0 as "never stop" too, so 1 is the smallest bound.
        max_reconnect_attempts=-1 if reconnect else 1,
        reconnect_time_wait=0.25 if reconnect else 0.1,
        ping_interval=10 if reconnect else 120,
        max_outstanding_pings=3,
    )
    try:
        await asyncio.wait_for(nc.connect(**options), timeout)
    except (TimeoutError, OSError, nats.errors.Error) as e:
        await _close_quietly(nc)
        cause = last_error[0] if last_error else e
        raise ConnectError(addr, _describe(cause)) from None
    return nc


def _describe(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, TimeoutError | NatsTimeoutError):
        return "timed out"
    text = str(e).strip() or type(e).__name__
    return text.removeprefix("nats: ")


async def _close_quietly(nc: NATS) -> None:
    try:
        await asyncio.wait_for(nc.close(), 2.0)
    except Exception:
        pass


async def close(nc: NATS, *, drain: bool = True, timeout: float = 2.0) -> None:
    """Drain (deliver what is pending) then close; safe to call twice."""
    if nc.is_closed:
        return
    try:
        if drain and nc.is_connected:
            await asyncio.wait_for(nc.drain(), timeout)
    except Exception as e:
        log.debug("drain failed: %s", e)
    await _close_quietly(nc)


async def request(
    nc: NATS,
    subject: str,
    message: msgspec.Struct,
    reply_type: type[T],
    *,
    timeout: float,
    addr: str = "",
) -> T:
    """Send a request and decode the reply; the controller's ErrorReply becomes RequestRejected."""
    try:
        msg = await nc.request(subject, encode(message), timeout=timeout)
    except NoRespondersError:
        raise NoControllerError(subject, addr, "no responders") from None
    except (TimeoutError, NatsTimeoutError):
        raise NoControllerError(subject, addr, f"no reply within {timeout:g}s") from None
    union: Any = reply_type | ErrorReply
    reply: Any = decode(msg.data, union)
    if isinstance(reply, ErrorReply):
        raise RequestRejected(reply.code, reply.message)
    return reply  # type: ignore[no-any-return]
