"""The controller: a thin async shell around the pure policy.

Every inbound message goes the same way: size check and strict decode (a bad one is counted,
logged and answered with an error, never raised), a synchronous call into ``Policy`` (the
decision), then ``_commit``: persist the write-ahead records (epoch ceilings, rarely any),
publish the commands, persist the other records, publish the events. Commits run one at a time,
in decision order, so the store never goes backwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from marduk import __version__, bus
from marduk.drmap import WorkerKey
from marduk.embedded import (
    EmbeddedServer,
    EmbeddedServerError,
    StateDirLock,
    default_state_dir,
    is_local_host,
    listening,
    parse_addr,
)
from marduk.errors import MardukError, ProtocolError
from marduk.policy import Outcome, Policy, PolicyConfig, PolicyError
from marduk.protocol import (
    MAX_MESSAGE_BYTES,
    Ack,
    AckReply,
    Command,
    ControllerEvent,
    ControllerInfo,
    DeregisterReply,
    Deregistration,
    DeviceHealth,
    ErrorReply,
    Hello,
    Query,
    QueryReply,
    RegisterReply,
    Registration,
    Report,
    ReportReply,
    decode,
    encode,
)
from marduk.store import StateStore
from marduk.subjects import Subjects

log = logging.getLogger("marduk.controller")
T = TypeVar("T", bound=msgspec.Struct)


@dataclass(slots=True)
class ControllerSettings:
    """Controller settings; the CLI maps options and MARDUK_* variables onto these."""

    addr: str = bus.DEFAULT_ADDR
    """NATS URL(s). Local and not listening: an embedded server is started (unless disabled)."""
    prefix: str = "marduk"
    """Subject prefix shared by every Marduk process of a deployment."""
    embedded: bool = True
    """Start an embedded nats-server when nothing listens at a local ``addr``."""
    state_dir: Path = field(default_factory=default_state_dir)
    """Where the embedded server keeps its JetStream store, log and pid file."""
    kv_replicas: int = 1
    """Replicas of the state bucket (3 on a production NATS cluster)."""
    max_message_bytes: int = MAX_MESSAGE_BYTES
    """Inbound messages larger than this are rejected."""
    connect_timeout: float = 10.0
    """How long to wait for NATS at startup."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)


class StartupError(MardukError):
    pass


class Controller:
    """Owns the policy, the NATS connection, the store and (maybe) the embedded server."""

    def __init__(self, settings: ControllerSettings) -> None:
        self.settings = settings
        self.subjects = Subjects(settings.prefix)
        self.controller_id = f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.started_at = time.time()
        self.stats: Counter[str] = Counter()
        self.policy = Policy(settings.policy)
        self.nc: NATS | None = None
        self.store: StateStore | None = None
        self.server: EmbeddedServer | None = None
        self.url = settings.addr
        self._lock: StateDirLock | None = None
        self._subs: list[Subscription] = []
        self._commit_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        self._event_seq = 0
        self._warned: Counter[str] = Counter()
        self.fatal = asyncio.Event()
        self.fatal_reason = ""
        self._stopping = False

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        await self._ensure_server()
        self.nc = await bus.connect(
            self.url,
            name=f"marduk-controller {self.controller_id}",
            timeout=self.settings.connect_timeout,
            reconnect=True,
            on_disconnected=self._on_disconnected,
            on_reconnected=self._on_reconnected,
        )
        try:
            self.store = await StateStore.open(
                self.nc, self.settings.prefix, replicas=self.settings.kv_replicas
            )
            loaded = await self.store.load()
        except Exception as e:
            raise StartupError(f"cannot open the JetStream state bucket at {self.url}: {e}") from e
        self.policy = Policy.restore(
            self.settings.policy, loaded.workers, loaded.epochs, loaded.devices
        )
        self.stats["state.skipped_records"] += loaded.skipped
        log.info(
            "state restored from bucket %s: %d worker(s), %d device(s), %d epoch(s)",
            self.store.bucket,
            len(loaded.workers),
            len(self.policy.drmap.device_to_replicas),
            len(loaded.epochs),
        )
        s = self.subjects
        self._subs = [
            await self._serve(s.any_job("register"), Registration, self._on_register),
            await self._serve(s.any_job("deregister"), Deregistration, self._on_deregister),
            await self._serve(s.any_job("ack"), Ack, self._on_ack),
            await self._serve(s.any_job("report"), Report, self._on_report),
            await self._serve(s.health, DeviceHealth, self._on_health),
            await self._serve(s.query, Query, self._on_query),
        ]
        await self.nc.flush()
        # Agents re-register when they hear this: a level-triggered resync after our restart.
        await self.nc.publish(
            s.hello, encode(Hello(controller_id=self.controller_id, started_at=self.started_at))
        )
        if self.server is not None:
            self._spawn(self._watch_server(), "embedded-server-watch")
        log.info("controller %s serving prefix %r at %s", self.controller_id, s.prefix, self.url)

    async def _ensure_server(self) -> None:
        host, port = parse_addr(self.settings.addr)
        if listening(host, port):
            log.info("using the NATS server at %s", self.settings.addr)
            return
        if not self.settings.embedded:
            raise StartupError(
                f"nothing listens at {self.settings.addr} and --no-embedded was given"
            )
        if not is_local_host(host):
            raise StartupError(
                f"nothing listens at {self.settings.addr}; it is not on this machine, "
                "so no embedded server is started"
            )
        self._lock = StateDirLock(self.settings.state_dir)
        self._lock.acquire()
        self.server = EmbeddedServer(host, port, self.settings.state_dir)
        await asyncio.to_thread(self.server.start)
        self.url = self.server.url
        log.info(
            "embedded NATS with JetStream at %s (state: %s)", self.url, self.settings.state_dir
        )

    async def stop(self) -> None:
        """Stop serving, finish in-flight commits, close NATS, stop the embedded server."""
        self._stopping = True
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs = []
        async with self._commit_lock:
            pass
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.nc is not None:
            await bus.close(self.nc)
            self.nc = None
        if self.server is not None:
            code = await asyncio.to_thread(self.server.stop)
            log.info("embedded NATS stopped (exit code %s)", code)
            self.server = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        interesting = {k: v for k, v in sorted(self.stats.items()) if v}
        log.info("controller stopped; counters: %s", interesting or "none")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Start a named long-running task; a crash or an unexpected exit is fatal and logged."""

        async def guarded() -> None:
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.exception("task %s crashed", name)
                self._die(f"task {name} crashed: {e}")
                return
            self._die(f"task {name} exited unexpectedly")

        self._tasks.append(asyncio.create_task(guarded(), name=name))

    def _die(self, reason: str) -> None:
        if not self.fatal.is_set():
            self.fatal_reason = reason
            self.fatal.set()

    async def _watch_server(self) -> None:
        # Poll: a thread blocked in Popen.wait() would keep the process from exiting if the
        # loop ever closed with the server still up.
        while self.server is not None and self.server.alive():  # noqa: ASYNC110
            await asyncio.sleep(0.5)
        raise EmbeddedServerError("the embedded nats-server exited")

    async def _on_disconnected(self) -> None:
        if self._stopping:  # our own close, not a lost connection
            return
        self.stats["nats.disconnects"] += 1
        log.warning("disconnected from NATS; reconnecting")

    async def _on_reconnected(self) -> None:
        log.info("reconnected to NATS")
        if self.nc is not None:
            await self.nc.publish(
                self.subjects.hello,
                encode(Hello(controller_id=self.controller_id, started_at=self.started_at)),
            )

    # --- the edge: decode, dispatch, reply -------------------------------------------------------

    async def _serve(
        self,
        subject: str,
        type_: type[T],
        handler: Callable[[T, Msg], Awaitable[msgspec.Struct | None]],
    ) -> Subscription:
        kind = type_.__name__.lower()
        limit = self.settings.max_message_bytes

        async def on_message(msg: Msg) -> None:
            self.stats[f"received.{kind}"] += 1
            reply: msgspec.Struct | None
            try:
                req = decode(msg.data, type_, max_bytes=limit)
                reply = await handler(req, msg)
            except ProtocolError as e:
                reply = self._reject(kind, e.reason, str(e), msg.subject)
            except PolicyError as e:
                reply = self._reject(kind, e.code, str(e), msg.subject)
            except Exception as e:  # the controller never crashes on input
                log.exception("error handling %s on %s", kind, msg.subject)
                self.stats["errors.internal"] += 1
                reply = ErrorReply(code="internal", message=f"{type(e).__name__}: {e}")
            if reply is not None and msg.reply and self.nc is not None:
                try:
                    await self.nc.publish(msg.reply, encode(reply))
                except Exception as e:
                    self.stats["errors.reply"] += 1
                    log.warning("could not answer on %s: %s", msg.reply, e)

        assert self.nc is not None
        return await self.nc.subscribe(subject, cb=on_message, pending_msgs_limit=1_000_000)

    def _reject(self, kind: str, reason: str, message: str, subject: str) -> ErrorReply:
        self.stats[f"rejected.{reason}"] += 1
        self.stats["rejected"] += 1
        # Log the first few of each kind per minute: a flood of junk must not flood the log.
        bucket = f"{kind}.{reason}.{int(time.time() // 60)}"
        self._warned[bucket] += 1
        if self._warned[bucket] <= 5:
            log.warning("rejected %s on %s: %s", kind, subject, message)
        if len(self._warned) > 1000:
            self._warned.clear()
        return ErrorReply(code=reason, message=message)

    def _check_subject_job(self, job: str, msg: Msg) -> None:
        subject_job = self.subjects.job_of(msg.subject)
        if subject_job != job:
            raise ProtocolError(
                "subject_mismatch", f"message for job {job!r} sent on {msg.subject}"
            )

    # --- handlers --------------------------------------------------------------------------------

    async def _on_register(self, reg: Registration, msg: Msg) -> RegisterReply:
        self._check_subject_job(reg.job, msg)
        result = self.policy.register(reg, time.time())
        await self._commit(result.outcome)
        return RegisterReply(
            job=reg.job,
            replica=reg.replica,
            worker=reg.worker,
            outcome=result.result,  # type: ignore[arg-type]
            epoch=result.epoch,
            command=result.command,
        )

    async def _on_deregister(self, req: Deregistration, msg: Msg) -> DeregisterReply:
        self._check_subject_job(req.job, msg)
        key = WorkerKey(req.job, req.replica, req.worker)
        outcome, known = self.policy.deregister(key, req.reason, time.time())
        await self._commit(outcome)
        return DeregisterReply(known=known)

    async def _on_ack(self, ack: Ack, msg: Msg) -> AckReply:
        self._check_subject_job(ack.job, msg)
        key = WorkerKey(ack.job, ack.replica, ack.worker)
        outcome = self.policy.ack(key, ack.epoch, time.time())
        await self._commit(outcome)
        return AckReply(epoch=self.policy.epoch_of_worker(key))

    async def _on_report(self, report: Report, msg: Msg) -> ReportReply:
        self._check_subject_job(report.job, msg)
        result = self.policy.on_report(report, time.time())
        self.stats[f"reports.{report.status}"] += 1
        await self._commit(result.outcome)
        return ReportReply(actions=result.actions)

    async def _on_health(self, event: DeviceHealth, msg: Msg) -> msgspec.Struct:
        now = time.time()
        if not event.event_id:
            self._event_seq += 1
            event.event_id = f"{self.controller_id}-{self._event_seq}"
        if not event.timestamp:
            event.timestamp = now
        result = self.policy.on_health(event, now)
        if result.reply.duplicate:
            self.stats["health.duplicates"] += 1
        elif not result.reply.known:
            self.stats["health.unknown_device"] += 1
        await self._commit(result.outcome)
        return result.reply

    async def _on_query(self, query: Query, msg: Msg) -> QueryReply:
        info = ControllerInfo(
            controller_id=self.controller_id,
            version=__version__,
            pid=os.getpid(),
            started_at=self.started_at,
            prefix=self.settings.prefix,
        )
        reply = QueryReply(controller=info, stats=dict(self.stats))
        if query.what in ("map", "devices"):
            reply.devices = self.policy.device_infos(query.job)
        if query.what == "map":
            reply.workers = self.policy.worker_infos(query.job)
        return reply

    # --- commit: persist, then publish -----------------------------------------------------------

    async def _commit(self, outcome: Outcome) -> None:
        async with self._commit_lock:
            if outcome.write_ahead:
                await self._persist(outcome, write_ahead=True)
            assert self.nc is not None
            for command in outcome.commands:
                await self.nc.publish(self._command_subject(command), encode(command))
                self.stats[f"commands.{command.kind}"] += 1
            await self._persist(outcome)
            for event in outcome.events:
                self._log_event(event)
                await self.nc.publish(self.subjects.events(event.job), encode(event))

    async def _persist(self, outcome: Outcome, *, write_ahead: bool = False) -> None:
        if self.store is None or not (write_ahead or _has_writes(outcome)):
            return
        for attempt in range(3):
            try:
                if write_ahead:
                    await self.store.write_ahead(outcome)
                else:
                    await self.store.apply(outcome)
                return
            except Exception as e:
                self.stats["store.errors"] += 1
                log.warning("state write failed (attempt %d/3): %s", attempt + 1, e)
                await asyncio.sleep(0.05 * (attempt + 1))
        # Availability over durability: the restart still goes out. Agents report the epochs
        # they applied when they re-register, so a restarted controller will not reuse them.
        log.error("state not persisted after 3 attempts; publishing the commands anyway")

    def _command_subject(self, command: Command) -> str:
        if command.replica is None:
            return self.subjects.job_commands(command.job)
        return self.subjects.replica_commands(command.job, command.replica)

    def _log_event(self, event: ControllerEvent) -> None:
        where = "/".join(str(p) for p in (event.job, event.replica, event.worker) if p is not None)
        parts = [event.kind, where, event.device and f"device {event.device}"]
        if event.epoch is not None and event.kind.endswith("_issued"):
            parts.append(f"epoch {event.epoch}")
        line = " ".join(p for p in parts if p)
        if event.detail:
            line += f" - {event.detail}"
        level = logging.WARNING if event.kind in _WARN_EVENTS else logging.INFO
        log.log(level, "%s", line)


_WARN_EVENTS = frozenset(
    {"unknown_device", "fail_issued", "worker_crashed", "worker_hung", "worker_gave_up"}
)


def _has_writes(o: Outcome) -> bool:
    return bool(
        o.put_workers or o.deleted_workers or o.put_epochs or o.deleted_epochs or o.put_devices
    )


async def run_controller(settings: ControllerSettings, stop: asyncio.Event) -> int:
    """Run until ``stop`` is set or something fatal happens. Returns the exit code."""
    controller = Controller(settings)
    try:
        try:
            await controller.start()
        except (MardukError, OSError) as e:
            log.error("%s", e)
            return 1
        waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(controller.fatal.wait())]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
        if controller.fatal.is_set():
            log.error("stopping: %s", controller.fatal_reason)
            return 1
        log.info("stopping (signal)")
        return 0
    finally:
        # Whatever happened (an unexpected error included), the embedded server goes too.
        await controller.stop()
