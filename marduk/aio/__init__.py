"""The asyncio toolkit every package shares: named, guarded background tasks, one backoff, one
rate-limited logger, a pulse to wait on and the bones of a one-request HTTP server.

Standard library only (and ``marduk.errors``), so the agent library, the controller and the
monitors can all import it without pulling in anything else (a contract in pyproject.toml).
See docs/architecture.md, *Package map*.
"""

from marduk.aio.backoff import Backoff
from marduk.aio.http import HttpServer, Response, parse_host_port, respond
from marduk.aio.pulse import Pulse, wait_any
from marduk.aio.ratelimit import RateLimitedLog
from marduk.aio.tasks import TaskSet, restart_forever

__all__ = [
    "Backoff",
    "HttpServer",
    "Pulse",
    "RateLimitedLog",
    "Response",
    "TaskSet",
    "parse_host_port",
    "respond",
    "restart_forever",
    "wait_any",
]
