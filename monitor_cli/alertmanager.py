"""An Alertmanager webhook receiver: alerts about a device become health events.

For sites that already alert on GPU health with DCGM + Prometheus + Alertmanager: point a
``webhook_config`` at ``marduk monitor alertmanager`` and every alert that carries the device
label (``UUID`` by default, as dcgm-exporter names it) becomes a ``DeviceHealth`` event, stored
durably in the health stream for the controller:

* a firing alert: ``failed``, or the state its ``--state-label`` value maps to
  (``severity=warning`` -> ``degraded`` by default; a value that is a state name is that state);
* a resolved alert: ``healthy``, unless the same notification still has a firing alert for
  that device (group by the device label and a notification holds all of a device's alerts);
* several alerts for one device in one notification: one event, the most severe;
* an alert without the label: counted (``alerts.no_device``) and ignored.

The event id is the alert's fingerprint, status and ``startsAt``: Alertmanager repeats a
notification (``repeat_interval``, retries, HA peers) and the controller answers a repeated id
with its first decision, so a repeat never restarts anything twice.

Answers: 200 once every event is stored (decided or not); 503 with one line when NATS is away
longer than ``publish_timeout_s`` (Alertmanager retries 5xx); 400 with one line for a payload
that is not Alertmanager's webhook JSON (it does not retry 4xx). ``GET /healthz`` (liveness),
``/readyz`` (200 while connected to NATS) and ``/metrics`` (``stats``: ``webhooks.*``,
``alerts.*``, ``alertmanager_events.*``, ``nats.*``, ``publish.retries``) on the same port. The
payload (version 4) is documented at https://prometheus.io/docs/alerting/latest/configuration/#webhook_config.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import hmac
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Final, Literal, get_args

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from marduk.aio import HttpServer, TaskSet, parse_host_port, respond
from marduk.errors import MardukError, ProtocolError, RequestRejected
from marduk.shell.metrics import StatsCollector
from marduk.transport import bus
from marduk.wire.protocol import DeviceHealth, HealthState, decode, encode
from monitor_cli.publisher import DurablePublisher, UnavailableError

log = logging.getLogger("marduk.monitor.alertmanager")

SOURCE: Final = "alertmanager"
MAX_BODY_BYTES: Final = 8 * 1024 * 1024  # thousands of alerts in one notification
_MAX_HEADERS: Final = 100
_SEVERITY: Final[dict[HealthState, int]] = {"failed": 3, "preempting": 2, "degraded": 1}
_STATES: Final = frozenset(_SEVERITY)
# /metrics help of the events the receiver published (marduk_alertmanager_events_*_total).
_HELP: Final = {
    **{
        f"alertmanager_events.{state}": f"Events stored and decided by the controller, {state}."
        for state in (*_STATES, "healthy")
    },
    "alertmanager_events.duplicate": "Events stored that repeat one already decided.",
    "alertmanager_events.undecided": "Events stored that no controller decided within the "
    "receiver's wait (one decides them once it serves); formerly "
    "marduk_alertmanager_events_stored_total.",
    "alertmanager_events.rejected": "Events the controller refused (not stored).",
}


# --- the webhook payload (wire types, decoded strictly at the edge) -----------------------------


class Alert(msgspec.Struct, kw_only=True, rename="camel"):
    status: Literal["firing", "resolved"]
    labels: dict[str, str] = {}
    annotations: dict[str, str] = {}
    starts_at: str = ""
    ends_at: str = ""
    fingerprint: str = ""  # Alertmanager >= 0.19; derived from the labels when absent


class WebhookMessage(msgspec.Struct, kw_only=True, rename="camel"):
    version: str = ""
    group_key: str = ""
    truncated_alerts: int = 0
    status: str = ""
    receiver: str = ""
    alerts: list[Alert]


_decoder = msgspec.json.Decoder(WebhookMessage)


class PayloadError(MardukError, ValueError):
    """The request body is not an Alertmanager webhook notification."""


def decode_webhook(body: bytes) -> WebhookMessage:
    """Decode a notification or raise PayloadError with one line saying what is wrong."""
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as e:
        raise PayloadError(f"not an Alertmanager webhook payload: {e}") from None
    except msgspec.DecodeError as e:
        raise PayloadError(f"malformed JSON: {e}") from None
    except (RecursionError, UnicodeDecodeError) as e:
        raise PayloadError(f"malformed JSON: {type(e).__name__}") from None


# --- alerts -> events (pure) ---------------------------------------------------------------------


@dataclass(slots=True)
class AlertMapping:
    """How alerts become health states."""

    device_label: str = "UUID"
    """The label that names the device: its value must be the id agents register."""
    state_label: str = "severity"
    """The label whose value picks the state of a firing alert."""
    state_map: dict[str, HealthState] = field(
        default_factory=lambda: {"warning": "degraded", "info": "degraded"}
    )
    """state_label value -> state; a value that is a state name maps to itself; else failed."""

    def state_for(self, labels: dict[str, str]) -> HealthState:
        value = labels.get(self.state_label, "")
        if value in self.state_map:
            return self.state_map[value]
        if value in _STATES:
            return value
        return "failed"


def parse_state_map(text: str) -> dict[str, HealthState]:
    """``warning=degraded,info=degraded`` -> a dict; one clear error line otherwise."""
    out: dict[str, HealthState] = {}
    allowed = [s for s in get_args(HealthState) if s in _STATES]  # a firing alert is not healthy
    for item in filter(None, (part.strip() for part in text.split(","))):
        value, sep, state = item.partition("=")
        if not sep or not value.strip() or state.strip() not in allowed:
            raise MardukError(
                f"--state-map {item!r}: expected VALUE=STATE with STATE one of "
                f"{', '.join(allowed)} (e.g. warning=degraded)"
            )
        out[value.strip()] = state.strip()  # type: ignore[assignment]
    return out


@dataclass(slots=True)
class Plan:
    """What one notification asks for: the events to publish and what was left out."""

    events: list[DeviceHealth] = field(default_factory=list)
    skipped: Counter[str] = field(default_factory=Counter)


def plan_events(message: WebhookMessage, mapping: AlertMapping) -> Plan:
    """One event per device named in ``message``: its most severe firing alert, else healthy."""
    plan = Plan()
    firing: dict[str, list[Alert]] = {}
    resolved: dict[str, list[Alert]] = {}
    for alert in message.alerts:
        device = alert.labels.get(mapping.device_label, "")
        if not device:
            plan.skipped["no_device"] += 1
            continue
        (firing if alert.status == "firing" else resolved).setdefault(device, []).append(alert)
    for device, alerts in firing.items():
        ranked = sorted(
            alerts,
            key=lambda a: (-_SEVERITY[mapping.state_for(a.labels)], a.starts_at, _fingerprint(a)),
        )
        first = ranked[0]
        state = mapping.state_for(first.labels)
        reason = _describe(first)
        if len(alerts) > 1:
            reason += f" (and {len(alerts) - 1} more alert(s))"
        plan.events.append(_event(device, state, first, reason, first.starts_at))
    for device, alerts in resolved.items():
        if device in firing:
            plan.skipped["superseded"] += len(alerts)  # still firing for another reason
            continue
        last = max(alerts, key=lambda a: (a.ends_at, _fingerprint(a)))
        reason = f"alert {last.labels.get('alertname', '?')} resolved"
        plan.events.append(_event(device, "healthy", last, reason, last.ends_at))
    valid = []
    for event in plan.events:
        try:
            decode(encode(event), DeviceHealth)  # the bounds the controller will check
            valid.append(event)
        except ProtocolError as e:
            plan.skipped["invalid_device"] += 1
            log.warning("ignored an alert: %s", e)
    plan.events = valid
    return plan


def _event(device: str, state: HealthState, alert: Alert, reason: str, at: str) -> DeviceHealth:
    status = "firing" if state != "healthy" else "resolved"
    # startsAt identifies this firing of the alert; its resolution shares it.
    event_id = f"{SOURCE}-{_fingerprint(alert)}-{status}-{alert.starts_at}"[:256]
    return DeviceHealth(
        device=device,
        state=state,
        reason=reason[:4096],
        source=SOURCE,
        event_id=event_id,
        timestamp=_unix(at),
    )


def _describe(alert: Alert) -> str:
    name = alert.labels.get("alertname", "?")
    text = alert.annotations.get("summary") or alert.annotations.get("description") or ""
    return f"alert {name}" + (f": {text}" if text else "")


def _fingerprint(alert: Alert) -> str:
    if alert.fingerprint:
        return alert.fingerprint
    labels = "\x00".join(f"{k}={v}" for k, v in sorted(alert.labels.items()))
    return hashlib.sha256(labels.encode()).hexdigest()[:16]


def _unix(rfc3339: str) -> float:
    """Unix seconds, or 0 (the controller then uses its receive time) for none or junk."""
    try:
        t = dt.datetime.fromisoformat(rfc3339).timestamp()
    except ValueError:
        return 0.0
    return t if t > 0 else 0.0


# --- the HTTP server ------------------------------------------------------------------------------


@dataclass(slots=True)
class ReceiverSettings:
    listen: str = "127.0.0.1:9095"
    """HOST:PORT to serve on (0.0.0.0:9095 for an Alertmanager on another machine)."""
    addr: str = bus.DEFAULT_ADDR
    """NATS server URL(s)."""
    prefix: str = "marduk"
    """Subject prefix of the deployment."""
    mapping: AlertMapping = field(default_factory=AlertMapping)
    token: str = ""
    """If set, a POST must carry ``Authorization: Bearer <token>`` (Alertmanager's
    ``http_config.authorization``)."""
    publish_timeout_s: float = 30.0
    """How long a notification waits for NATS before the answer is 503 (Alertmanager retries)."""
    decide_timeout_s: float = 5.0
    """How long to wait for the controller's decision; past it the stored event still counts."""
    max_concurrent_publishes: int = 32


def parse_listen(listen: str) -> tuple[str, int]:
    return parse_host_port(listen, option="--listen", example="0.0.0.0:9095")


class _HttpError(Exception):
    def __init__(self, status: str, message: str, counter: str) -> None:
        super().__init__(message)
        self.status = status
        self.counter = counter


class AlertmanagerReceiver:
    """The webhook server on the current event loop; ``stats`` counts what it saw and did."""

    def __init__(self, settings: ReceiverSettings) -> None:
        self.settings = settings
        self.host, self.port = parse_listen(settings.listen)
        self.stats: Counter[str] = Counter()
        self.publisher = DurablePublisher(
            settings.addr,
            settings.prefix,
            self.stats,
            name="marduk-alertmanager",
            decide_timeout_s=settings.decide_timeout_s,
        )
        self.registry = CollectorRegistry()
        self.registry.register(StatsCollector(self.stats, list, help_texts=_HELP))
        self._server = HttpServer(self.host, self.port, self._accept, what="listen")
        self._handlers = TaskSet(self._handler_failed, prefix="alertmanager-")
        self._publishing = asyncio.Semaphore(settings.max_concurrent_publishes)

    async def start(self) -> None:
        _, self.port = await self._server.start()
        try:
            self.publisher.start()
        except BaseException:
            self._server.close()
            raise
        log.info(
            "receiving Alertmanager webhooks on http://%s:%d/ (device label %s)",
            self.host,
            self.port,
            self.settings.mapping.device_label,
        )
        if not self.settings.token and self.host not in ("127.0.0.1", "::1", "localhost"):
            log.warning(
                "anyone who reaches %s:%d can mark devices failed: set a bearer token "
                "(--token-file) or restrict the network",
                self.host,
                self.port,
            )

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop accepting, let requests in flight finish (``grace_s``), then close NATS."""
        self._server.close()
        await self._handlers.drain(grace_s)
        await self.publisher.close()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._handlers.spawn(self._handle(reader, writer), "request")

    def _handler_failed(self, task: asyncio.Task[Any], e: BaseException) -> None:
        # _handle catches every Exception; this is what it cannot (a BaseException): counted.
        self.stats["errors.internal"] += 1
        log.error("request handler %s failed: %s: %s", task.get_name(), type(e).__name__, e)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                async with asyncio.timeout(30.0):  # a slow client does not hold a handler
                    method, path, headers, body = await _read_request(reader)
                status, ctype, payload = await self._route(method, path, headers, body)
            except _HttpError as e:
                self.stats[f"webhooks.{e.counter}"] += 1
                log.warning("refused a request: %s", e)
                status, ctype, payload = e.status, "text/plain; charset=utf-8", f"{e}\n".encode()
            except TimeoutError:
                self.stats["webhooks.timeout"] += 1
                status, ctype, payload = "408 Request Timeout", "text/plain", b"request too slow\n"
            await respond(writer, (status, ctype, payload))
        except (OSError, asyncio.IncompleteReadError):
            pass  # the client went away
        except Exception:  # a bug must not end the server: log it, count it, answer nothing
            self.stats["errors.internal"] += 1
            log.exception("internal error handling a request")
        finally:
            writer.close()

    async def _route(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[str, str, bytes]:
        text = "text/plain; charset=utf-8"
        if method in ("GET", "HEAD"):
            if path == "/healthz":
                return "200 OK", text, b"ok\n"
            if path == "/readyz":
                if self.publisher.ready:
                    return "200 OK", text, b"connected to NATS\n"
                return "503 Service Unavailable", text, b"not connected to NATS\n"
            if path == "/metrics":
                return "200 OK", CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if method != "POST" or path != "/":
            raise _HttpError(
                "404 Not Found",
                "POST / (Alertmanager webhooks), GET /healthz, /readyz or /metrics",
                "not_found",
            )
        if self.settings.token:
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.settings.token}".encode()):
                raise _HttpError("401 Unauthorized", "missing or wrong bearer token", "auth")
        try:
            message = decode_webhook(body)
        except PayloadError as e:
            raise _HttpError("400 Bad Request", str(e), "malformed") from None
        return await self.handle_notification(message)

    async def handle_notification(self, message: WebhookMessage) -> tuple[str, str, bytes]:
        """Publish what ``message`` asks for; the HTTP answer as (status, type, body)."""
        if message.version not in ("", "4"):
            # Read what we understand; a newer Alertmanager adds fields, it has not removed any.
            if not self.stats["webhooks.unknown_version"]:
                log.warning("webhook payload version %r (this receiver reads 4)", message.version)
            self.stats["webhooks.unknown_version"] += 1
        if message.truncated_alerts:
            self.stats["alerts.truncated"] += message.truncated_alerts
            log.warning(
                "Alertmanager left %d alert(s) out of a notification (max_alerts): their "
                "devices are not reported",
                message.truncated_alerts,
            )
        for alert in message.alerts:
            self.stats[f"alerts.{alert.status}"] += 1
        plan = plan_events(message, self.settings.mapping)
        for why, n in plan.skipped.items():
            self.stats[f"alerts.{why}"] += n
        results = await asyncio.gather(*(self._publish(e) for e in plan.events))
        unavailable = [r for r in results if r.get("outcome") == "unavailable"]
        body: dict[str, Any] = {
            "events": results,
            "ignored": sum(plan.skipped.values()),
        }
        if unavailable:
            self.stats["webhooks.unavailable"] += 1
            reason = unavailable[0]["error"]
            log.warning("answered 503: %s", reason)
            return "503 Service Unavailable", "text/plain; charset=utf-8", f"{reason}\n".encode()
        self.stats["webhooks.accepted"] += 1
        return "200 OK", "application/json", json.dumps(body).encode() + b"\n"

    async def _publish(self, event: DeviceHealth) -> dict[str, Any]:
        result: dict[str, Any] = {
            "device": event.device,
            "state": event.state,
            "event_id": event.event_id,
        }
        async with self._publishing:
            try:
                reply = await self.publisher.publish(event, timeout=self.settings.publish_timeout_s)
            except UnavailableError as e:
                return {**result, "outcome": "unavailable", "error": str(e)}
            except RequestRejected as e:
                self.stats["alertmanager_events.rejected"] += 1
                log.error("the controller refused %s: %s", event.event_id, e)
                return {**result, "outcome": "rejected", "error": str(e)}
        if reply is None:
            self.stats["alertmanager_events.undecided"] += 1
            log.warning("%s %s: stored; no controller decided yet", event.device, event.state)
            return {**result, "outcome": "stored"}
        if reply.duplicate:
            self.stats["alertmanager_events.duplicate"] += 1
            log.debug("%s %s: a repeat of %s", event.device, event.state, event.event_id)
            return {**result, "outcome": "duplicate"}
        self.stats[f"alertmanager_events.{event.state}"] += 1
        acted = ", ".join(f"{a.job}/{a.replica or '*'} {a.kind}" for a in reply.actions)
        log.info(
            "%s %s (%s): %s",
            event.device,
            event.state,
            event.reason,
            acted or ("no replica uses it" if not reply.known else "no restart"),
        )
        return {**result, "outcome": "decided", "known": reply.known, "actions": len(reply.actions)}


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes]:
    try:
        line = await reader.readuntil(b"\r\n")
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            raise _HttpError("400 Bad Request", "not an HTTP request", "malformed")
        method, target, _ = parts
        headers: dict[str, str] = {}
        for _ in range(_MAX_HEADERS):
            raw = await reader.readuntil(b"\r\n")
            if raw == b"\r\n":
                break
            name, sep, value = raw.decode("latin-1").partition(":")
            if not sep:
                raise _HttpError("400 Bad Request", "malformed header line", "malformed")
            headers[name.strip().lower()] = value.strip()
        else:
            raise _HttpError("431 Request Header Fields Too Large", "too many headers", "malformed")
    except asyncio.LimitOverrunError:
        raise _HttpError(
            "431 Request Header Fields Too Large", "header too long", "malformed"
        ) from None
    body = b""
    if method == "POST":
        if "chunked" in headers.get("transfer-encoding", "").lower():
            raise _HttpError("411 Length Required", "send a Content-Length", "malformed")
        try:
            length = int(headers.get("content-length", ""))
        except ValueError:
            raise _HttpError("411 Length Required", "send a Content-Length", "malformed") from None
        if not 0 <= length <= MAX_BODY_BYTES:
            raise _HttpError(
                "413 Content Too Large", f"body over {MAX_BODY_BYTES} bytes", "too_large"
            )
        body = await reader.readexactly(length)
    return method, target.split("?", 1)[0], headers, body


async def run_receiver(settings: ReceiverSettings, stop: asyncio.Event) -> int:
    """Serve until ``stop`` is set; 0 on a clean stop."""
    receiver = AlertmanagerReceiver(settings)
    await receiver.start()
    try:
        await stop.wait()
        log.info("stopping")
    finally:
        await receiver.stop()
    return 0
