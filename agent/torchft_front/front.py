"""The front's process: a gRPC server where the Managers connect (``TORCHFT_LIGHTHOUSE``),
torchft's real lighthouse behind it, and the job's commands from NATS.

* ``Quorum``: passed through to the real lighthouse as opaque bytes (never decoded, so
  torchft's quorum messages may change), with the caller's deadline; its error, if any, is
  the caller's. For ``rebuild_s`` after the front starts, calls wait (see ``FrontConfig``).
* ``Heartbeat``: its replica id read (``wire``), taken into the table (``heartbeats``) and
  answered at once; a refused one (a dropped incarnation) is answered too, so its Manager
  does not reconnect. Every ``beat_every_s`` each live id's last request is sent on to the real
  lighthouse, and a new id's first one at once.
* Commands: ``restart`` and ``fail`` on ``<prefix>.<job>.cmd.replica.*`` and
  ``<prefix>.<job>.cmd.job`` drop the group's incarnations (``Heartbeats.order``).

Imports grpcio (the ``torchft`` extra); ``python -m agent.torchft_front.front CONFIG_JSON
--spare`` is how the supervisor starts it (``main``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from typing import Any

import grpc
import grpc.aio

from agent.torchft_front.config import FrontConfig
from agent.torchft_front.heartbeats import Heartbeats
from agent.torchft_front.wire import (
    HEARTBEAT_METHOD,
    HEARTBEAT_SERVICE,
    QUORUM_METHOD,
    MalformedMessage,
    heartbeat_replica_id,
)
from marduk.aio.ratelimit import RateLimitedLog
from marduk.errors import ConnectError, ProtocolError
from marduk.shell.logs import setup_logging
from marduk.transport import bus
from marduk.transport.credentials import Credentials
from marduk.wire import codec
from marduk.wire.protocol import Command
from marduk.wire.subjects import Subjects

log = logging.getLogger("marduk.torchft_front")
ORDERS = ("restart", "fail")
# One port, one front: without this grpc sets SO_REUSEPORT and a second front on the same
# port would take half the Managers' connections.
SERVER_OPTIONS = [("grpc.so_reuseport", 0)]
FORWARD_TIMEOUT_S = 1.0
COUNTS_EVERY_S = 60.0


class Front:
    def __init__(self, cfg: FrontConfig) -> None:
        self.cfg = cfg
        self.table = Heartbeats(cfg.heartbeat_timeout_s)
        self.requests: dict[str, bytes] = {}  # live id -> its last heartbeat request, as sent
        self.ready = asyncio.Event()  # the rebuild is over: quorums and beats go through
        self.channel = grpc.aio.insecure_channel(cfg.lighthouse)
        self.up_quorum = self.channel.unary_unary(QUORUM_METHOD)
        self.up_beat = self.channel.unary_unary(HEARTBEAT_METHOD)
        self.errors: dict[str, int] = {}
        self.said = RateLimitedLog(log)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._said_at = time.monotonic()
        self._said_counts: dict[str, int] = {}

    def count(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1

    async def quorum(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await self.ready.wait()
        remaining = context.time_remaining()
        try:
            reply: bytes = await self.up_quorum(request, timeout=remaining)
        except grpc.aio.AioRpcError as e:
            self.count("quorum_failed")
            self.said.log("quorum", logging.WARNING, "quorum: the lighthouse: %s", e.code())
            await context.abort(e.code(), e.details() or "")
        return reply

    async def heartbeat(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            ft_id = heartbeat_replica_id(request)
        except MalformedMessage as e:
            self.count("heartbeat_malformed")
            self.said.log("malformed", logging.WARNING, "a heartbeat refused: %s", e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"heartbeat: {e}")
        if self.table.beat(ft_id, time.monotonic()):
            self.requests[ft_id] = request
            if self.table.is_new(ft_id):
                log.info("heartbeat from %s: new", ft_id)
                if self.ready.is_set():
                    self._send([ft_id])
        return b""  # LighthouseHeartbeatResponse {}

    def order(self, data: bytes, subject: str) -> None:
        """A command of the job from NATS: ``restart`` or ``fail`` drops its groups."""
        try:
            cmd = codec.decode(data, Command)
        except ProtocolError as e:
            self.count("command_undecodable")
            self.said.log("command", logging.WARNING, "a command on %s refused: %s", subject, e)
            return
        if cmd.kind not in ORDERS or cmd.job != self.cfg.job:
            return
        gone = self.table.order(cmd.replica, cmd.epoch, time.monotonic())
        for ft_id in gone:
            self.requests.pop(ft_id, None)
        if gone:
            who = cmd.replica or "every group"
            log.info("%s %s at epoch %d: dropped %s", who, cmd.kind, cmd.epoch, ", ".join(gone))

    def _send(self, ids: list[str]) -> None:
        """Heartbeat ``ids`` toward the lighthouse (their requests taken now: one dropped after
        this call is not sent again)."""
        self._spawn(self._forward([self.requests[i] for i in ids if i in self.requests]))

    async def _forward(self, requests: list[bytes]) -> None:
        calls = [self.up_beat(r, timeout=FORWARD_TIMEOUT_S) for r in requests]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException):
                self.count("forward_failed")
                self.said.log("forward", logging.WARNING, "heartbeat to the lighthouse: %s", result)

    async def beats(self) -> None:
        """Age out the silent, forward the live, every ``beat_every_s``."""
        start = time.monotonic()
        while True:
            now = time.monotonic()
            for ft_id in self.table.expire(now):
                self.requests.pop(ft_id, None)
                log.info(
                    "heartbeat from %s: silent for %gs, aged out",
                    ft_id,
                    self.cfg.heartbeat_timeout_s,
                )
            if not self.ready.is_set() and now - start >= self.cfg.rebuild_s:
                await self._forward([self.requests[i] for i in self.table.ids()])
                self.ready.set()
                log.info("serving: %d groups heard while rebuilding", len(self.table.live))
            elif self.ready.is_set():
                self._send(self.table.ids())
            self._say_counts(now)
            await asyncio.sleep(self.cfg.beat_every_s)

    def _say_counts(self, now: float) -> None:
        """Once a minute, when something was refused or failed: every count so far."""
        counts = {
            **{k: v for k, v in self.table.counts.items() if k.startswith("refused")},
            **self.errors,
        }
        if now - self._said_at >= COUNTS_EVERY_S and counts != self._said_counts:
            self._said_at, self._said_counts = now, counts
            log.info(
                "counts: %s",
                ", ".join(
                    f"{k} {v}" for k, v in sorted({**self.table.counts, **self.errors}.items())
                ),
            )

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


async def serve(cfg: FrontConfig, stop: asyncio.Event) -> int:
    front = Front(cfg)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    handlers = {
        "Quorum": grpc.unary_unary_rpc_method_handler(front.quorum),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(front.heartbeat),
    }
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(HEARTBEAT_SERVICE, handlers),)
    )
    try:
        port = server.add_insecure_port(cfg.bind)
    except RuntimeError as e:
        log.error("cannot listen on %s: %s", cfg.bind, e)
        return 1
    await server.start()
    log.info(
        "listening on %s (port %d), lighthouse %s, job %s", cfg.bind, port, cfg.lighthouse, cfg.job
    )
    loop = asyncio.get_running_loop()
    # Heartbeats are served from now on, NATS or not: Marduk's orders only make it faster.
    beats = loop.create_task(front.beats(), name="marduk-ft-beats")
    orders = loop.create_task(take_orders(front, cfg), name="marduk-ft-orders")
    try:
        await stop.wait()
    finally:
        beats.cancel()
        orders.cancel()
        await asyncio.gather(beats, orders, return_exceptions=True)
        await server.stop(0.5)
        await front.channel.close()
    return 0


async def take_orders(front: Front, cfg: FrontConfig, retry_s: float = 2.0) -> None:
    """Subscribe to the job's commands, connecting until it works (a NATS server that is
    down costs the drops, not the front: the groups still age out after its timeout)."""
    subjects = Subjects(cfg.prefix)

    async def on_msg(msg: Any) -> None:
        front.order(msg.data, msg.subject)

    while True:
        try:
            nc = await bus.connect(
                cfg.addr, name=f"marduk-torchft-lighthouse-{cfg.job}", reconnect=True, timeout=10
            )
            break
        except ConnectError as e:
            front.count("nats_unreachable")
            front.said.log("nats", logging.WARNING, "NATS: %s; drops wait for it", e)
            await asyncio.sleep(retry_s)
    try:
        await nc.subscribe(subjects.replica_commands(cfg.job, "*"), cb=on_msg)
        await nc.subscribe(subjects.job_commands(cfg.job), cb=on_msg)
        await nc.flush()
        log.info("taking %s's restart and fail commands from %s", cfg.job, cfg.addr)
        await asyncio.Event().wait()
    finally:
        with contextlib.suppress(Exception):
            await bus.close(nc)


def main(argv: list[str]) -> int:
    """``front.py CONFIG_JSON [--spare]``: with ``--spare``, wait for a line on stdin (the
    supervisor's word that the front before it died) before serving; EOF: exit."""
    cfg = FrontConfig.from_json(argv[1])
    if "--spare" in argv[2:] and not sys.stdin.buffer.readline():
        return 0
    setup_logging()
    bus.set_default_credentials(Credentials.from_env())

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await serve(cfg, stop)

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main(sys.argv))
