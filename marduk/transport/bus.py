"""Connecting to NATS and making requests, the same way for the controller, CLIs and agents.

nats-py's defaults suit none of them: its default error callback prints a traceback per failed
attempt, and with ``max_reconnect_attempts=0`` an initial connect never gives up. Here:

* ``connect(..., reconnect=False)`` (CLIs): a couple of quick attempts, then ``ConnectError``.
* ``connect(..., reconnect=True)`` (controller, agents): once connected, reconnect forever;
  the initial connect is bounded by ``timeout`` and raises ``ConnectError`` when it runs out.

Errors nats-py reports while (re)connecting are logged at debug level, never printed raw.
Credentials (``marduk.transport.credentials``) are the ones given, else the CLI's process
default, else the MARDUK_* variables. A permission violation the server reports is one warning
line (the first few per subject), counted in ``STATS``, and turns the request that caused it
into a ``PermissionDeniedError`` instead of a timeout. Addresses in messages are redacted. An
address is checked once, here (``parse_servers``), before anything connects."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import msgspec
import nats
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from marduk.aio import RateLimitedLog, TaskSet
from marduk.errors import (
    ConnectError,
    MardukError,
    NoControllerError,
    PermissionDeniedError,
    RequestRejected,
)
from marduk.transport.credentials import Credentials, redact
from marduk.wire.protocol import ErrorReply, decode, encode

DEFAULT_ADDR = "nats://localhost:4222"
NATS_SCHEMES = ("nats", "tls", "ws", "wss")
log = logging.getLogger("marduk.bus")

T = TypeVar("T")
Callback = Callable[[], Awaitable[None]]


STATS: Counter[str] = Counter()
"""Process-wide counters of connection trouble (permission violations, auth failures)."""

_default_credentials: Credentials | None = None
_PERMISSION_RE = re.compile(
    r"permissions violation for (publish|subscription) to \"?([^\"\s]+)", re.I
)
# Subjects the server refused to this process, with when: a request that then times out says so.
_denied: dict[str, tuple[str, float]] = {}
# Requests in flight, by connection and subject: a refusal of their subject ends them at once.
_waiting: dict[tuple[int, str], set[asyncio.Future[str]]] = {}


def default_addr() -> str:
    return os.environ.get("MARDUK_ADDR") or DEFAULT_ADDR


class InvalidAddressError(MardukError, ValueError):
    """``--addr`` / MARDUK_ADDR is not a list of NATS URLs."""


class NoJetStreamError(MardukError):
    """The NATS server runs without JetStream, where Marduk keeps its state."""

    def __init__(self, addr: str) -> None:
        super().__init__(
            f"the NATS server at {redact(addr)} has no JetStream: start it with -js "
            "(Marduk keeps its state there)"
        )
        self.addr = addr


def parse_servers(addr: str) -> list[str]:
    """The server URLs in ``addr`` (comma-separated), or InvalidAddressError (one line).

    The one check of an address, for every command and the library: ``nats://``, ``tls://``,
    ``ws://`` or ``wss://`` URLs, or ``HOST:PORT`` (which nats-py reads as ``nats://``). A bare
    word (``foo``) or another scheme (``http://``) is refused here rather than as a failed DNS
    lookup or a connection that never speaks NATS.
    """
    servers = [s.strip() for s in addr.split(",") if s.strip()]
    if not servers:
        raise InvalidAddressError(f"no NATS URL given (expected {_URL_FORM})")
    for url in servers:
        problem = _url_problem(url)
        if problem:
            raise InvalidAddressError(
                f"not a NATS URL: {_shown(url)!r} ({problem}; expected {_URL_FORM})"
            )
    return servers


_URL_FORM = "nats://HOST:PORT, or tls://, ws://, wss://; several comma-separated"


def _url_problem(url: str) -> str:
    scheme, sep, _ = url.partition("://")
    if sep and scheme.lower() not in NATS_SCHEMES:
        return f"{scheme}:// is not a NATS scheme"
    if not sep and ":" not in url:
        return "no scheme and no port"
    try:
        parts = urlsplit(url if sep else "nats://" + url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        return "bad port"
    if not parts.hostname:
        return "no host"
    return ""


def _shown(url: str) -> str:
    try:
        return redact(url)
    except ValueError:  # unparsable: it may hold a password, show only its scheme
        return url.partition("://")[0] + "://..." if "://" in url else "..."


def has_jetstream(nc: NATS) -> bool | None:
    """Whether the connected server announced JetStream (its INFO); None if unknown."""
    info = getattr(nc, "_server_info", None)  # nats-py keeps the INFO only here
    if not isinstance(info, dict) or not info:
        return None
    return bool(info.get("jetstream"))


def require_jetstream(nc: NATS, addr: str) -> None:
    """Raise NoJetStreamError when the server said it has no JetStream."""
    if has_jetstream(nc) is False:
        raise NoJetStreamError(addr)


def set_default_credentials(credentials: Credentials) -> None:
    """The CLI edge resolves options once; every connection of the process uses them."""
    global _default_credentials
    _default_credentials = credentials


def default_credentials() -> Credentials:
    return _default_credentials if _default_credentials is not None else Credentials.from_env()


async def connect(
    addr: str,
    *,
    name: str,
    timeout: float = 5.0,
    reconnect: bool = False,
    on_disconnected: Callback | None = None,
    on_reconnected: Callback | None = None,
    on_closed: Callback | None = None,
    credentials: Credentials | None = None,
    on_unreachable: Callable[[str], None] | None = None,
) -> NATS:
    """Connect to the NATS server(s) at ``addr`` (comma-separated URLs allowed).
    ``on_unreachable``: told why (``connection refused``), once, when an attempt fails while
    ``timeout`` lets it try again, so that a caller can say so at once, not at the end."""
    servers = parse_servers(addr)
    last_error: list[BaseException] = []
    told: list[bool] = []
    creds = credentials if credentials is not None else default_credentials()
    auth = creds.nats_options()  # CredentialsError (one line) for a missing file

    async def error_cb(e: Exception) -> None:
        match = _PERMISSION_RE.search(str(e))
        if match:
            _permission_violation(match.group(1).lower(), match.group(2), creds, id(nc))
            return
        refused = isinstance(e, nats.errors.AuthorizationError) or _is_auth_error(e)
        if refused:
            STATS["nats.authorization_errors"] += 1
            if connected:  # was accepted, now refused: rotated (and finished) or revoked
                _refused_after_connect(nc, creds)
                return
        # The server says why it refuses, then closes: the reset that follows must not hide it.
        if refused or not (last_error and _is_auth_error(last_error[0])):
            last_error[:] = [e]
        log.debug("nats: %s: %s", type(e).__name__, e)
        if on_unreachable is not None and not connected and not told:
            told.append(True)
            on_unreachable(_describe(last_error[0], creds))

    async def noop() -> None:
        return None

    nc = NATS()
    connected = False
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
        # Replies to this identity land under its own prefix, which only it may read.
        inbox_prefix=f"_INBOX.{creds.identity}" if creds.identity else "_INBOX",
        **auth,
    )
    try:
        await asyncio.wait_for(nc.connect(**options), timeout)
    except (TimeoutError, OSError, nats.errors.Error) as e:
        await _close_quietly(nc)
        cause = last_error[0] if last_error else e
        raise ConnectError(redact(addr), _describe(cause, creds)) from None
    connected = True
    return nc


REFUSED_AFTER_CONNECT = (
    "credentials refused by the server: was this identity rotated or revoked? "
    "restart with the new seed"
)
_refusals: dict[int, str] = {}


def refusal(nc: NATS | None) -> str | None:
    """Why ``nc`` was closed, if the server refused its credentials on a reconnect."""
    return _refusals.get(id(nc)) if nc is not None else None


def _refused_after_connect(nc: NATS, creds: Credentials) -> None:
    """A reconnect refused the credentials that connected: no retry can succeed (the key is
    no longer known), so say so in one line and close; closed callbacks see ``refusal``."""
    if id(nc) in _refusals:
        return
    _refusals[id(nc)] = f"{REFUSED_AFTER_CONNECT} ({creds.describe()})"
    log.error("%s", _refusals[id(nc)])
    if not nc.is_closed:
        _closing.spawn(_close_quietly(nc), "close-refused")


# Closing a connection whose credentials were refused, from nats-py's callback (held here: the
# event loop keeps only weak references to tasks). _close_quietly swallows its own errors.
_closing = TaskSet(lambda task, e: log.debug("%s failed: %s", task.get_name(), e), prefix="nats-")
# A permission violation: the first few per subject a minute (a loop of denied requests must not
# flood the log); every one is counted in STATS.
_violations = RateLimitedLog(log, burst=3, more="(more permission violations on %s are counted)")


def _permission_violation(op: str, subject: str, creds: Credentials, conn: int = 0) -> None:
    STATS["nats.permission_violations"] += 1
    who = _credential_name(creds)
    verb = "publish on" if op == "publish" else "subscribe to"
    # nats-py hands us the server's error lowercased: match subjects case-insensitively.
    key = subject.lower()
    _denied[key] = (f"authorization violation: {who} may not {verb} {subject}", time.time())
    for waiter in _waiting.get((conn, key), ()):
        if not waiter.done():
            waiter.set_result(_denied[key][0])
    _violations.log(key, logging.WARNING, "%s", _denied[key][0])
    if len(_denied) > 1000:
        _denied.clear()


def _credential_name(creds: Credentials) -> str:
    if creds.nkey:
        return f"the {creds.nkey.stem} credential"
    if creds.creds:
        return f"the {creds.creds.stem} credential"
    if creds.user:
        return f"user {creds.user}"
    return "this connection"


def _is_auth_error(e: BaseException) -> bool:
    return (
        isinstance(e, nats.errors.AuthorizationError) or "authorization violation" in str(e).lower()
    )


def _describe(e: BaseException, creds: Credentials | None = None) -> str:
    if _is_auth_error(e):
        given = creds.describe() if creds is not None else "no credentials"
        return f"authorization violation: the server refused {given} (wrong, revoked or missing)"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused"
    if isinstance(e, TimeoutError | NatsTimeoutError):
        return "timed out"
    text = str(e).strip() or type(e).__name__
    return text.removeprefix("nats: ")


async def _close_quietly(nc: NATS) -> None:
    try:
        await asyncio.wait_for(nc.close(), 2.0)
    except asyncio.CancelledError:
        # nats-py can raise this from close() when the server dropped the connection first
        # (a revoked credential); only a cancellation of our own task goes on up.
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
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
    """Send a request and decode the reply; the controller's ErrorReply becomes RequestRejected,
    and the server refusing the publish PermissionDeniedError, as soon as it says so."""
    try:
        msg = await _request_unless_denied(nc, subject, encode(message), timeout)
    except NoRespondersError:
        _raise_if_denied(subject)
        raise NoControllerError(subject, redact(addr), "no responders") from None
    except (TimeoutError, NatsTimeoutError):
        _raise_if_denied(subject)
        raise NoControllerError(subject, redact(addr), f"no reply within {timeout:g}s") from None
    union: Any = reply_type | ErrorReply
    # Replies may be as large as the server allows (queries are paged to fit it).
    reply: Any = decode(msg.data, union, max_bytes=max(nc.max_payload, len(msg.data)))
    if isinstance(reply, ErrorReply):
        raise RequestRejected(reply.code, reply.message)
    return reply  # type: ignore[no-any-return]


async def _request_unless_denied(nc: NATS, subject: str, payload: bytes, timeout: float) -> Any:
    key = (id(nc), subject.lower())
    refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    _waiting.setdefault(key, set()).add(refused)
    asked = asyncio.ensure_future(nc.request(subject, payload, timeout=timeout))
    try:
        either: set[asyncio.Future[Any]] = {asked, refused}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if refused.done() and not asked.done():
            raise PermissionDeniedError(refused.result())
        return await asked
    finally:
        if not asked.done():
            asked.cancel()
        waiters = _waiting.get(key)
        if waiters is not None:
            waiters.discard(refused)
            if not waiters:
                del _waiting[key]


def _raise_if_denied(subject: str) -> None:
    denied = _denied.get(subject.lower())
    if denied is not None and time.time() - denied[1] < 60:
        raise PermissionDeniedError(denied[0])


async def refused(nc: NATS, subjects: list[str], since: float) -> str | None:
    """After publishing or subscribing on ``nc``: the server's refusal of one of ``subjects``
    since ``since``, if any. The server's -ERR can trail the PONG of one flush by a moment
    (measured: about 1 in 5), never that of a second."""
    for _ in range(2):
        await nc.flush(timeout=2)
        for subject in subjects:
            refusal = denied(subject, since)
            if refusal:
                return refusal
    return None


def last_denial(since: float) -> str | None:
    """The last permission error the server reported since ``since`` (``time.time()``)."""
    recent = [entry for entry in _denied.values() if entry[1] >= since]
    return max(recent, key=lambda entry: entry[1])[0] if recent else None


def denied(subject: str, since: float | None = None) -> str | None:
    """The permission error the server reported for ``subject`` in the last minute (or since
    ``since``, a ``time.time()``), if any."""
    entry = _denied.get(subject.lower())
    after = time.time() - 60 if since is None else since
    return entry[0] if entry is not None and entry[1] >= after else None
