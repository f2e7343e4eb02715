"""The node health check service's client: ``marduk agent run --node-check-endpoint`` asks it,
before a start, whether this node may run trainers.

NVIDIA's launcher asks a node health check daemon over a local socket before each rendezvous
(gRPC, ``HealthCheckService.RunHealthCheck``). Ours is one line of JSON each way, so a site's
existing checker (a shell script behind ``socat``, a Python one-liner) can answer it
(docs/protocol.md, *Node check*):

    -> {"v": 1, "kind": "node_check", "job": "lin", "replica": "n3", "worker": 0, "host": "n3"}
    <- {"healthy": false, "reason": "gpu 3: xid 79"}

Only an explicit ``"healthy": false`` keeps the node out. As in NVRx, a service that cannot be
reached (no socket, refused, no answer within the timeout) is not the node being bad: it is
logged and counted, and the node counts as healthy; so is an answer that is not the documented
one (a broken checker must not take every node out at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Literal

MAX_ANSWER = 64 * 1024  # bytes of one answer line

Verdict = Literal["healthy", "unhealthy", "unreachable", "malformed"]


class EndpointError(ValueError):
    """A ``--node-check-endpoint`` that names no socket: one line, for the user."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A unix socket (``path``) or a TCP ``host``:``port``."""

    path: str = ""
    host: str = ""
    port: int = 0

    def __str__(self) -> str:
        return self.path or f"{self.host}:{self.port}"


def parse_endpoint(text: str) -> Endpoint:
    """``/run/nhc.sock``, ``unix:///run/nhc.sock``, ``./nhc.sock`` or ``HOST:PORT``."""
    value = text.strip()
    if value.startswith("unix://"):
        value = value[len("unix://") :]
        if not value:
            raise EndpointError(f"--node-check-endpoint {text!r}: unix:// names no socket path")
        return Endpoint(path=value)
    if value.startswith(("/", "./", "../")):
        return Endpoint(path=value)
    host, colon, port = value.rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EndpointError(
            f"--node-check-endpoint {text!r}: a unix socket path (/run/nhc.sock, "
            "unix:///run/nhc.sock) or HOST:PORT"
        )
    return Endpoint(host=host.strip("[]"), port=int(port))


@dataclass(frozen=True, slots=True)
class Answer:
    verdict: Verdict
    reason: str = ""


def request_line(job: str, replica: str, worker: int, host: str) -> bytes:
    body = {"v": 1, "kind": "node_check", "job": job, "replica": replica, "worker": worker}
    return (json.dumps({**body, "host": host}) + "\n").encode()


def read_answer(line: bytes) -> Answer:
    """The service's answer line, as a verdict (pure)."""
    try:
        doc = json.loads(line)
    except ValueError:
        return Answer("malformed", f"not JSON: {line[:200]!r}")
    if not isinstance(doc, dict) or not isinstance(doc.get("healthy"), bool):
        return Answer("malformed", f'no boolean "healthy": {line[:200]!r}')
    reason = doc.get("reason", "")
    reason = reason if isinstance(reason, str) else json.dumps(reason)
    if doc["healthy"]:
        return Answer("healthy", reason)
    return Answer("unhealthy", reason[:1000] or "the node check service says unhealthy")


async def ask(endpoint: Endpoint, request: bytes, timeout_s: float) -> Answer:
    """One request, one answer, within ``timeout_s`` (connecting included)."""
    writer: asyncio.StreamWriter | None = None

    async def exchange() -> bytes:
        nonlocal writer
        if endpoint.path:
            reader, writer = await asyncio.open_unix_connection(endpoint.path, limit=MAX_ANSWER)
        else:
            reader, writer = await asyncio.open_connection(
                endpoint.host, endpoint.port, limit=MAX_ANSWER
            )
        writer.write(request)
        await writer.drain()
        return await reader.readline()

    try:
        line = await asyncio.wait_for(exchange(), timeout_s)
    except TimeoutError:
        return Answer("unreachable", f"no answer within {timeout_s:g}s")
    except (OSError, ValueError) as e:  # ValueError: a line over MAX_ANSWER
        return Answer("unreachable", f"{type(e).__name__}: {e}")
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    if not line:
        return Answer("unreachable", "the service closed the connection without an answer")
    return read_answer(line)
