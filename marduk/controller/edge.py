"""The controller's edge: decode, reject, answer; a bad message is never raised.

See docs/architecture.md, *The controller*.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol, TypeVar

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.micro.request import Request as MicroRequest
from nats.micro.service import Service as MicroService

from marduk.controller.commit import NotServing
from marduk.controller.context import Context, Route
from marduk.controller.endpoint_stats import ANSWERED, DROPPED, RequestEnd, ServiceTallies, Tally
from marduk.core.policy import PolicyError
from marduk.errors import ProtocolError
from marduk.wire.protocol import (
    DeviceHealth,
    ErrorReply,
    HealthReply,
    decode,
    encode,
)
from marduk.wire.subjects import REPLY_HEADER

T = TypeVar("T", bound=msgspec.Struct)
# What a reply subject may be: tokens without wildcards or whitespace, well under the server's
# control-line limit (4 KiB).
_REPLY_SUBJECT = re.compile(r"[^\s.*>]+(\.[^\s.*>]+)*")
_REPLY_SUBJECT_MAX = 512
_REQUESTS_IN_FLIGHT = 1024  # x 256 KiB at most each: a flood stays well under 500 MiB


class HealthDecision(Protocol):
    """A health event decided (``Handlers.decide_health``), its commit on its way out."""

    @property
    def reply(self) -> HealthReply: ...

    async def committed(self) -> None:
        """Back once the decision's commands are out and its records durable (``NotServing``:
        dropped)."""


class _EventIdOnly(msgspec.Struct):
    event_id: str = ""


def _event_id_of(data: bytes) -> str:
    """The event_id of a health event that failed validation, if it can be read at all: the
    monitor matches the ErrorReply to its event by it."""
    try:
        event_id = msgspec.json.decode(data, type=_EventIdOnly).event_id
    except (msgspec.DecodeError, ValueError, RecursionError):
        return ""
    return event_id if len(event_id) <= 256 else ""


def reply_subject(request: MicroRequest) -> str:
    """The subject a micro request asks to be answered on ("" if none).

    nats-py's micro ``Request`` (2.16) does not show it: ``respond()`` publishes to its message's
    reply subject, whatever that names, with our rights. The controller must see it first and
    answer only an ``_INBOX.`` subject (``Edge.answer``: never a confused deputy writing to
    ``$KV.>`` or ``marduk.ctl.hello``), so this reads the private message, in this one place.
    tests/unit/test_micro_reply.py fails if nats-py moves it."""
    return request._msg.reply or ""


class Edge:
    """Where messages come in and answers go out: decode strictly, reject (counted, logged a few
    times a minute), answer; never raise on input.

    Handed the handlers' table (``routes``) and their health decision (``decide_health``)."""

    def __init__(
        self,
        ctx: Context,
        *,
        routes: Callable[[], list[Route]],
        decide_health: Callable[[DeviceHealth], HealthDecision],
    ) -> None:
        self._ctx = ctx
        self._routes = routes
        self._decide_health = decide_health
        # Requests in flight at once: each endpoint's handler spawns one task per request, so
        # a registration waiting for its records does not hold up the next one's decision.
        self._in_flight = asyncio.Semaphore(_REQUESTS_IN_FLIGHT)

    async def add_endpoints(self, service: MicroService, tallies: ServiceTallies) -> None:
        """Serve every route of the table on ``service``, each counted in its ``tallies``."""
        for route in self._routes():
            await service.add_endpoint(
                name=route.name,
                subject=route.subject,
                handler=self.endpoint(
                    route.type_,
                    route.handler,
                    concurrent=route.concurrent,
                    tally=tallies.endpoint(route.name),
                ),
            )

    def endpoint(
        self,
        type_: type[T],
        handler: Callable[[T, str], Awaitable[msgspec.Struct | None]],
        *,
        concurrent: bool,
        tally: Tally | None = None,
    ) -> Callable[[MicroRequest], Awaitable[None]]:
        """A micro endpoint handler: decode strictly, decide, answer; never raise.

        nats-py's micro endpoint takes its requests one at a time (its subscription awaits the
        handler before the next message). That is the way for the operators' endpoints
        (``concurrent=False``). The agents' endpoints are ``concurrent``: a request is handed
        to a task of its own and the handler returns, so a registration storm is decided while
        earlier registrations' records are written and their commits go out together (awaited
        one by one, each would wait for its own store round trip). Micro's own stats then time
        only the hand-off, and never count an error (we answer errors, we do not raise them):
        ``tally`` records each request's whole work, from its decoding to its answer, and its
        errors by code, for the STATS reply's ``data`` (``endpoint_stats``).

        Either way the work is a task of ``ctx.spawn``'s, so a stop drains it (with a grace)
        rather than cut it off: an operator's request is awaited shielded, since stopping the
        service cancels the subscription's handler that awaits it."""
        kind = type_.__name__.lower()
        tally = tally if tally is not None else Tally()

        async def on_request(request: MicroRequest) -> None:
            if not concurrent:
                await asyncio.shield(self._ctx.spawn(handle(request), f"request-{kind}"))
                return
            # One task per request (bounded): this endpoint's next request is decided while
            # this one's records are written, so their commits go out together. Tasks start
            # in the order they are created, so decisions keep the order requests arrived in.
            await self._in_flight.acquire()
            task = self._ctx.spawn(handle(request), f"request-{kind}")
            task.add_done_callback(lambda _t: self._in_flight.release())

        async def handle(request: MicroRequest) -> None:
            start = tally.started()
            end = RequestEnd("cancelled", "stopped before it was answered", answered=False)
            try:
                end = await self._serve(request, type_, handler, kind)
            except Exception as e:  # a bug: the task's guard logs it; the tally counts it
                end = RequestEnd("internal", f"{type(e).__name__}: {e}", answered=False)
                raise
            finally:
                tally.done(start, end)

        return on_request

    async def _serve(
        self,
        request: MicroRequest,
        type_: type[T],
        handler: Callable[[T, str], Awaitable[msgspec.Struct | None]],
        kind: str,
    ) -> RequestEnd:
        """One request: decode, decide, answer; how that ended (never raises on input)."""
        self._ctx.stats[f"received.{kind}"] += 1
        if not self._ctx.leading():
            # Our lease lapsed (a paused process) and we have not noticed yet: the new leader
            # answers; one reply per request.
            self._ctx.stats["fenced"] += 1
            return DROPPED
        reply: msgspec.Struct | None
        try:
            req = decode(request.data, type_, max_bytes=self._ctx.settings.max_message_bytes)
            reply = await handler(req, request.subject)
        except NotServing:
            return DROPPED  # no answer: the client retries and reaches the new leader
        except ProtocolError as e:
            reply = self._ctx.logs.reject(kind, e.reason, str(e), request.subject)
        except PolicyError as e:
            reply = self._ctx.logs.reject(kind, e.code, str(e), request.subject)
        except Exception as e:  # the controller never crashes on input
            self._ctx.logs.internal(f"{kind} on {request.subject}")
            reply = ErrorReply(code="internal", message=f"{type(e).__name__}: {e}"[:4000])
        reply_to = reply_subject(request)
        if reply is None or not reply_to:
            return DROPPED
        failed = await self.answer(reply_to, reply, request.respond)
        if failed:
            why = "not an inbox" if failed == "reply_subject" else "could not answer on"
            return RequestEnd(failed, f"{why}: {reply_to[:100]}", answered=False)
        if isinstance(reply, ErrorReply):
            return RequestEnd(reply.code, reply.message)
        return ANSWERED

    async def answer(
        self,
        subject: str,
        reply: msgspec.Struct,
        respond: Callable[[bytes], Awaitable[None]] | None = None,
    ) -> str:
        """Answer on ``subject``, an inbox; through ``respond`` (a micro request's) if given.
        Returns "" once answered, else why not (an error code, counted)."""
        try:
            nc = self._ctx.connection()
        except NotServing:
            return "not_connected"

        async def send(data: bytes) -> None:
            await (respond(data) if respond is not None else nc.publish(subject, data))

        if not subject.startswith("_INBOX."):
            # Never a confused deputy: a caller naming $KV..., $JS... or marduk.ctl.hello as
            # its reply subject would have us write there with the controller's rights.
            self._ctx.logs.reject(
                "reply", "reply_subject", f"not an inbox: {subject[:100]}", subject
            )
            return "reply_subject"
        try:
            await send(encode(reply))
            return ""
        except nats.errors.MaxPayloadError as e:
            # Say so, rather than leave the client to conclude nobody answered.
            self._ctx.stats["errors.reply_too_large"] += 1
            self._ctx.logs.limited("reply", f"reply on {subject} too large: {e}")
            too_large = ErrorReply(
                code="reply_too_large",
                message=f"the answer ({len(encode(reply))} bytes) exceeds the server's max "
                f"payload ({nc.max_payload} bytes)",
            )
            with contextlib.suppress(Exception):
                await send(encode(too_large))
            return "reply_too_large"
        except Exception as e:
            self._ctx.stats["errors.reply"] += 1
            self._ctx.logs.limited("reply", f"could not answer on {subject}: {e}")
            return "reply"

    async def on_health_msg(self, msg: Msg) -> None:
        """One event from the durable consumer, decided here, in the consumer's callback: in
        delivery order, and with no task (a turn of the event loop, and whatever else is ready
        then) between its delivery and its command going out. What waits (the commit's records,
        the answer, the acknowledgement) goes on in a task of its own, so the next event is
        decided and its command published while this one's records are written; the
        consumer's max_ack_pending bounds how many are in flight."""
        finish = self.decide_health_msg(msg)
        if finish is not None:
            self._ctx.spawn(finish, "health-event")

    def decide_health_msg(self, msg: Msg) -> Coroutine[Any, Any, None] | None:
        """Decide an event without yielding; return what is left to do (None: nothing, and
        the event is not acked: redelivered to whoever leads after ack_wait)."""
        ctx = self._ctx
        ctx.stats["received.devicehealth"] += 1
        if not ctx.leading():
            return None
        reply_to = (msg.headers or {}).get(REPLY_HEADER, "")
        if reply_to and (
            len(reply_to) > _REPLY_SUBJECT_MAX or not _REPLY_SUBJECT.fullmatch(reply_to)
        ):
            # A subject the server would refuse (too long, spaces, wildcards) would make our
            # publish fail and nats-py drop the connection: decide, but answer nobody.
            ctx.logs.reject(
                "devicehealth", "reply_header", f"bad {REPLY_HEADER} header", msg.subject
            )
            reply_to = ""
        try:
            event = decode(msg.data, DeviceHealth, max_bytes=ctx.settings.max_message_bytes)
            if not event.event_id:
                # Stable across redeliveries: the stream sequence names the event.
                event.event_id = f"{ctx.subjects.prefix}.health#{msg.metadata.sequence.stream}"
            decided = self._decide_health(event)
        except ProtocolError as e:
            rejected = ctx.logs.reject("devicehealth", e.reason, str(e), msg.subject)
            # Named as a valid event would be: its own id, or its stream sequence.
            rejected.event_id = (
                _event_id_of(msg.data)
                or f"{ctx.subjects.prefix}.health#{msg.metadata.sequence.stream}"
            )
            return self._answer_health(msg, reply_to, rejected)
        except Exception:
            self._health_failed()
            return None
        return self._commit_health(msg, reply_to, decided)

    async def _commit_health(self, msg: Msg, reply_to: str, decided: HealthDecision) -> None:
        """Wait for the decision's commit, then answer and acknowledge."""
        try:
            await decided.committed()
        except NotServing:
            return
        except Exception:
            self._health_failed()
            return
        await self._answer_health(msg, reply_to, decided.reply)

    def _health_failed(self) -> None:
        # Not the event's fault (a publish failed mid-commit, a bug): it is not terminated
        # but left for redelivery (bounded by the consumer's max_deliver), and since our
        # state may now be ahead of the store we step down; whoever leads rebuilds.
        self._ctx.logs.internal("devicehealth")
        self._ctx.step_down("internal error while handling a health event")

    async def _answer_health(self, msg: Msg, reply_to: str, reply: msgspec.Struct) -> None:
        if not isinstance(reply, ErrorReply) and not self._ctx.leading():
            # Its records are stored under our term (the store fenced them), so an ack landing
            # late would be harmless; still, a lapsed leader neither answers nor acks: the
            # event is redelivered to whoever leads, which finds it handled (or decides it).
            return
        if reply_to:
            await self.answer(reply_to, reply)
        try:
            # A bad message is terminated (never redelivered); a handled one acknowledged.
            await (msg.term() if isinstance(reply, ErrorReply) else msg.ack())
        except Exception as e:
            self._ctx.stats["errors.ack"] += 1
            self._ctx.logs.limited("ack", f"could not acknowledge a health event: {e}")
