"""The controller: a thin async shell around the pure policy.

Every inbound message goes the same way (each in its own task, started in arrival order):
size check and strict decode (a bad one is counted, logged rate-limited and answered with an
error, never raised), a synchronous call into ``Policy`` (the decision), then ``_commit``
(``marduk.commit``): check that we still lead, persist the write-ahead records (epoch ceilings,
rarely any), check again, publish the commands, persist the other records, publish the events.
Commits go out in decision order, many together, and no key is written out of that order, so
the store never goes backwards; a reply or an acknowledgement waits for its own records.

Several controllers may run against one NATS (DESIGN.md decision 9): each campaigns for the
lease (``marduk.leadership``); the leader serves (request subjects, the durable health
consumer, the periodic ``tick``), the others are hot standbys that mirror the state buckets and
take over when the lease lapses. Health events arrive through a JetStream stream
(``marduk.health_stream``) and are acknowledged only after their decision is committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import re
import socket
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import nats.errors
from nats import micro
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import ServiceUnavailableError
from nats.micro.request import Request as MicroRequest
from nats.micro.service import Service as MicroService
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from marduk import __version__, auth, bus
from marduk.aio import Backoff, Pulse, RateLimitedLog, TaskSet, wait_any
from marduk.commit import CommitPipeline, NotServing, Steps
from marduk.credentials import Credentials, redact
from marduk.drmap import WorkerKey
from marduk.embedded import EmbeddedServer, ServerKeeper, default_state_dir
from marduk.errors import ConnectError, MardukError, ProtocolError
from marduk.health_stream import HealthConsumer, ensure_stream
from marduk.leadership import Leadership
from marduk.metrics import MetricsServer, Probes, StatsCollector, gauge, histogram
from marduk.paging import ENVELOPE_BYTES, SnapshotCache
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
    Drain,
    DrainReply,
    ErrorReply,
    Forget,
    ForgetReply,
    Hello,
    Query,
    QueryReply,
    RegisterReply,
    Registration,
    Report,
    ReportReply,
    Standby,
    decode,
    encode,
)
from marduk.records import EpochRecord
from marduk.role import Event, Role, RoleMachine
from marduk.store import Fenced, Loaded, StateMirror, StateStore
from marduk.subjects import REPLY_HEADER, Subjects

log = logging.getLogger("marduk.controller")
T = TypeVar("T", bound=msgspec.Struct)


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
    """Replicas of the buckets and the health stream (3 on a production NATS cluster)."""
    max_message_bytes: int = MAX_MESSAGE_BYTES
    """Inbound messages larger than this are rejected."""
    connect_timeout: float = 10.0
    """How long to wait for NATS at startup."""
    lease_ttl: float = 2.0
    """Seconds a leader's lease lasts without renewal; a standby takes over after that."""
    dedup_window_s: float = 3600.0
    """How long handled health event ids are remembered (across restarts and failovers)."""
    ack_wait_s: float = 2.0
    """A health event delivered but not acknowledged is redelivered after this long (also the
    worst delay of an event delivered just before a new leader's subscription reached the
    consumer's node, on a cluster)."""
    tick_interval_s: float = 0.25
    """How often the leader lets time pass in the policy (stale workers, resends)."""
    credentials: Credentials = field(default_factory=Credentials)
    """How the controller authenticates to NATS (``--nkey``, ``--creds``, TLS, ...)."""
    auth_dir: Path | None = None
    """``marduk auth init`` directory: the embedded server enforces its configuration, and the
    controller uses its ``controller.nk`` unless other credentials are given."""
    insecure: bool = False
    """Allow an embedded server without auth on a non-loopback address."""
    metrics_addr: str | None = None
    """Serve /metrics, /healthz and /readyz on HOST:PORT (off when None)."""
    policy: PolicyConfig = field(default_factory=PolicyConfig)


STATE_OPEN_S = 30.0
"""How long a starting controller waits for JetStream to answer (a cluster electing leaders)."""


def _not_ready(e: BaseException) -> bool:
    """JetStream did not answer in time or is electing: worth trying again at startup."""
    return isinstance(e, asyncio.TimeoutError | ServiceUnavailableError)


class StartupError(MardukError):
    pass


class Controller:
    """Owns the policy, the NATS connection, the store, the lease and (maybe) the server."""

    def __init__(self, settings: ControllerSettings) -> None:
        self.settings = settings
        self.subjects = Subjects(settings.prefix)
        self.host = socket.gethostname()
        self.controller_id = f"{self.host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.started_at = time.time()
        self.stats: Counter[str] = Counter()
        if settings.policy.exclusive_devices is None:
            # Device claims are exclusive across jobs only where identities bind jobs.
            settings.policy = dataclasses.replace(
                settings.policy,
                exclusive_devices=bool(settings.credentials or settings.auth_dir),
            )
        self.policy = Policy(settings.policy)
        self.nc: NATS | None = None
        self.store: StateStore | None = None
        self.mirror: StateMirror | None = None
        self.leadership: Leadership | None = None
        self.server: EmbeddedServer | None = None
        self.url = settings.addr
        st = settings
        self.keeper = ServerKeeper(
            st.addr,
            st.state_dir,
            embedded=st.embedded,
            auth_dir=st.auth_dir,
            insecure=st.insecure,
            stats=self.stats,
        )
        self._subs: list[Subscription] = []
        self._health: HealthConsumer | None = None
        self._pipeline = CommitPipeline(
            Steps(
                leading=self._leading,
                write_ahead=self._write_ahead,
                publish=self._publish_outcome,
                persist=self._persist,
                announce=self._announce_all,
                stop=self._stop_committing,
                publish_failed=self._publish_failed,
            )
        )
        # Requests in flight at once: each endpoint's handler spawns one task per request, so
        # a registration waiting for its records does not hold up the next one's decision.
        self._in_flight = asyncio.Semaphore(_REQUESTS_IN_FLIGHT)
        # Long-running loops: one that crashes or returns is fatal (the process's supervisor
        # restarts it, a standby leads meanwhile).
        self._tasks = TaskSet(self._task_crashed, on_return=self._task_returned)
        self._term_task: asyncio.Task[None] | None = None
        self._event_seq = 0
        # A flood of junk must not flood the log: a few lines per kind a minute; an internal
        # error's traceback once a minute per kind.
        self._limited = RateLimitedLog(log, clock=time.time)
        self._internal = RateLimitedLog(log, burst=1, more=None, clock=time.time)
        self._standbys: dict[str, tuple[ControllerInfo, float]] = {}
        # A standby's policy built from its mirror ahead of a takeover: (mirror version, policy).
        self._prepared: tuple[int, Policy] | None = None
        self.credentials = settings.credentials
        if settings.auth_dir is not None and not (
            settings.credentials.nkey or settings.credentials.creds
        ):
            self.credentials = replace(
                settings.credentials, nkey=settings.auth_dir / "controller.nk"
            )
        # Commands are signed with the controller's nkey, so agents can tell them from forgeries.
        self._signing_seed: bytes | None = None
        self.registry = CollectorRegistry()
        self.registry.register(StatsCollector(self.stats, self._gauges))
        self._notice_latency = histogram(
            self.registry,
            "marduk_event_to_command_seconds",
            "From a health event's delivery to its commands being published.",
        )
        self._metrics: MetricsServer | None = None
        self._service: MicroService | None = None
        self._snapshots = SnapshotCache()
        # The one role (marduk.role); the two events below follow it for waiters.
        self._roles = RoleMachine(self._role_changed)
        self._role_pulse = Pulse()
        self.serving = asyncio.Event()  # SERVING and subscribed (cleared on leaving SERVING)
        self.fatal = asyncio.Event()  # FAILED
        self.fatal_reason = ""
        self._background = TaskSet(self._background_failed)  # per request, per event, ...

    @property
    def role(self) -> Role:
        return self._roles.role

    def _role_changed(self, before: Role, after: Role, event: Event, why: str) -> None:
        if before is Role.SERVING:
            self.serving.clear()
        if after is Role.FAILED:
            self.fatal_reason = why
            self.fatal.set()
        self._role_pulse.notify()

    def _stopping(self) -> bool:
        return self._roles.is_(Role.STOPPING, Role.STOPPED)

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, open the durable state, and campaign; serving starts once elected."""
        if self.credentials.nkey:
            self._signing_seed = auth.read_seed(self.credentials.nkey)
        self.url = await self.keeper.ensure()
        self.server = self.keeper.server
        try:
            self.nc = await bus.connect(
                self.url,
                name=f"marduk-controller {self.controller_id}",
                timeout=self.settings.connect_timeout,
                reconnect=True,
                on_disconnected=self._on_disconnected,
                on_reconnected=self._on_reconnected,
                on_closed=self._on_closed,
                credentials=self.credentials,
            )
        except ConnectError as e:
            if self.settings.embedded:
                raise
            raise StartupError(f"{e} (--no-embedded: start NATS there first)") from None
        bus.require_jetstream(self.nc, redact(self.url))  # one clear line, not an API error
        st = self.settings
        deadline = time.monotonic() + STATE_OPEN_S
        while True:
            opened_at = time.time()
            try:
                await self._open_state()
                break
            except Exception as e:
                # A credential without the controller's rights shows as a timeout: say which.
                denied = bus.last_denial(opened_at)
                await self._close_state()
                if not denied and _not_ready(e) and time.monotonic() < deadline:
                    # A cluster still electing its JetStream leaders (a fresh one, or one
                    # under load) answers late: wait for it rather than exit.
                    log.warning(
                        "JetStream at %s is not ready (%s); trying again",
                        redact(self.url),
                        str(e) or type(e).__name__,
                    )
                    await asyncio.sleep(1.0)
                    continue
                raise StartupError(
                    f"cannot open the JetStream state at {redact(self.url)}: {denied or e}"
                ) from e
        self._health = HealthConsumer(
            self.nc, st.prefix, self.subjects.health, ack_wait_s=st.ack_wait_s
        )
        if st.metrics_addr:
            self._metrics = MetricsServer(st.metrics_addr, Probes(self.registry, self._ready))
            await self._metrics.start()
        assert self.leadership is not None  # _open_state made it
        self._roles.handle(Event.STARTED, "campaigning")
        self._spawn(self.leadership.run(), "leadership")
        self._spawn(self.leadership.watch_holder(), "leadership-watch")
        self._spawn(self._tick_loop(), "tick")
        self._spawn(self._standby_loop(), "standby-heartbeat")
        self._spawn(self._gc_loop(), "gc")
        self._spawn(self._prepare_loop(), "prepare-takeover")
        if self.server is not None:
            self._spawn(self.keeper.watch(self._stopping), "embedded-server-watch")
        log.info(
            "controller %s started on prefix %r at %s (%s; commands %s); "
            "campaigning for the lease (TTL %gs)",
            self.controller_id,
            st.prefix,
            redact(self.url),
            self.credentials.describe(),
            "signed" if self._signing_seed else "unsigned",
            st.lease_ttl,
        )

    async def _open_state(self) -> None:
        """The buckets, the health stream, the standby mirror and the lease."""
        st, nc = self.settings, self.nc
        assert nc is not None
        self.store = await StateStore.open(
            nc, st.prefix, replicas=st.kv_replicas, dedup_window_s=st.dedup_window_s
        )
        await ensure_stream(nc, st.prefix, self.subjects.health, replicas=st.kv_replicas)
        self.mirror = StateMirror(self.store)
        await self.mirror.start()
        self.leadership = Leadership(
            nc,
            st.prefix,
            self.controller_id,
            ttl=st.lease_ttl,
            replicas=st.kv_replicas,
            pid=os.getpid(),
            host=self.host,
            on_elected=self._on_elected,
            on_deposed=self._on_deposed,
        )
        await self.leadership.open()

    async def _close_state(self) -> None:
        """Undo a half-done ``_open_state`` before trying again (or giving up)."""
        mirror, leadership = self.mirror, self.leadership
        self.mirror = self.leadership = None
        if mirror is not None:
            with contextlib.suppress(Exception):
                await mirror.stop()
        if leadership is not None:
            with contextlib.suppress(Exception):
                await leadership.close()

    async def stop(self) -> None:
        """Stop serving, hand the lease over, close NATS, stop the embedded server."""
        if self._stopping():
            return
        self._roles.handle(Event.STOP, "fatal" if self.fatal.is_set() else "asked to stop")
        await self._stop_serving()
        if self.leadership is not None:
            await self.leadership.resign()
        if self._term_task is not None:
            self._term_task.cancel()
        await self._tasks.stop()
        if self._term_task is not None:
            await asyncio.gather(self._term_task, return_exceptions=True)
        if self.mirror is not None:
            await self.mirror.stop()
        if self._metrics is not None:
            await self._metrics.stop()
        if self.nc is not None:
            await bus.close(self.nc)
            self.nc = None
        await self.keeper.stop()
        self.server = None
        self._roles.handle(Event.STOPPED)
        interesting = {k: v for k, v in sorted(self.stats.items()) if v}
        log.info("controller stopped; counters: %s", interesting or "none")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Start a named long-running task; a crash or an unexpected exit is fatal and logged."""
        self._tasks.spawn(coro, name)

    def _task_crashed(self, task: asyncio.Task[Any], error: BaseException) -> None:
        log.error("task %s crashed", task.get_name(), exc_info=error)
        self._die(f"task {task.get_name()} crashed: {error}")

    def _task_returned(self, task: asyncio.Task[Any]) -> None:
        self._die(f"task {task.get_name()} exited unexpectedly")

    def _die(self, reason: str) -> None:
        self._roles.handle(Event.FATAL, reason)  # ignored once failed or stopping

    async def _on_closed(self) -> None:
        # nats-py gives up on a connection only after a protocol error: nothing will bring it
        # back, so end (exit 1); the process's supervisor restarts it, a standby leads meanwhile.
        if not self._stopping():
            self._die(bus.refusal(self.nc) or "the NATS connection was closed (a protocol error?)")

    async def _on_disconnected(self) -> None:
        if self._stopping():  # our own close, not a lost connection
            return
        self.stats["nats.disconnects"] += 1
        log.warning("disconnected from NATS; reconnecting")

    async def _on_reconnected(self) -> None:
        log.info(
            "reconnected to NATS at %s",
            redact(self.nc.connected_url.geturl()) if self.nc and self.nc.connected_url else "?",
        )
        if self.nc is not None and self._roles.is_(Role.SERVING):
            await self._publish_hello()

    # --- leadership ------------------------------------------------------------------------------

    async def _on_elected(self, term: int) -> None:
        # Not awaited by the lease loop: renewals go on while the state is brought in.
        if self._roles.handle(Event.ELECTED, f"term {term}") is not Role.TAKING_OVER:
            return  # failed or stopping: the lease lapses unserved
        if self._term_task is not None:
            self._term_task.cancel()
        self._term_task = asyncio.create_task(self._lead(term), name=f"lead-term-{term}")

    async def _lead(self, term: int) -> None:
        try:
            await self._start_serving(term)
        except asyncio.CancelledError:
            raise
        except Fenced as e:
            # The store has a later term than our lease (a successor claimed it, or the lease
            # bucket was recreated and its terms started again): campaign above it next time.
            if self.leadership is not None:
                self.leadership.term_floor = max(self.leadership.term_floor, e.term)
            self.stats["store.fenced"] += 1
            await self._step_down(f"could not claim term {term} in the store: {e}", term)
        except (MardukError, OSError, TimeoutError, nats.errors.Error) as e:
            # NATS or JetStream not answering right now: let a standby (or us, later) try.
            self.stats["errors.takeover"] += 1
            await self._step_down(f"could not start serving (term {term}): {e}", term)
        except Exception as e:
            # A bug: campaigning again would fail the same way. End the process (exit 1) so
            # its supervisor restarts it and a standby leads meanwhile.
            log.exception("could not start serving (term %d)", term)
            self._die(f"could not start serving: {type(e).__name__}: {e}")

    async def _start_serving(self, term: int) -> None:
        assert self.nc is not None and self.store is not None and self.mirror is not None
        t0 = time.monotonic()
        # Our first write: from now on no write of an earlier term (a lapsed leader's delayed
        # or reconnect-buffered one) can land, so the state read below is final (the store
        # refuses it; DESIGN.md decision 13). Raises Fenced if a later term claimed it.
        await self.store.claim_term(term, self.controller_id)
        js = self.nc.jetstream(timeout=5.0)
        up_to_date = await self.mirror.caught_up(js)
        if up_to_date:
            # The handled events are read once the mirror has caught up, not while it does: a
            # deposed leader's last dedup records land before the state they go with, and
            # reading them first could miss one (the event would be handled twice). The events
            # bucket is not mirrored: its keys expire without a delete a watch would see.
            replies = await self.store.load_handled()
            prepared, self._prepared = self._prepared, None
            loaded, source = self.mirror.snapshot(), "mirror"
            if prepared is not None and prepared[0] == self.mirror.version:
                # Built while we stood by from exactly what the mirror holds now (no await
                # since the check).
                self.policy, source = prepared[1], "mirror, prepared"
                self.stats["state.from_prepared"] += 1
            else:
                self.policy = self._build_policy(loaded)
        else:
            self._prepared = None
            loaded, source = await self.store.load(), "bucket"
            replies = loaded.handled
            self.policy = self._build_policy(loaded)
        self.policy.resume(replies, time.time())
        t_state = time.monotonic()
        self.stats["state.skipped_records"] += loaded.skipped
        # Handlers act from here on: a stored event the consumer delivers the moment it is
        # subscribed must be handled, not left for redelivery after ack_wait.
        self._pipeline.reopen()
        self._roles.handle(Event.TOOK_OVER, f"term {term}, state from {source}")
        s = self.subjects
        # A NATS micro service: `nats micro ls|info|stats` and $SRV.PING find the leader, its
        # endpoints and version (standbys serve nothing, so they are not listed).
        self._service = await micro.add_service(
            self.nc,
            name="marduk",
            version=__version__,
            description="Marduk controller: device<->replica map, targeted restarts",
            metadata={"prefix": s.prefix, "controller_id": self.controller_id, "term": str(term)},
            # Its own queue group, not a shared one: a leader whose lease lapsed and has not
            # unsubscribed yet must not take a share of the requests (it drops them); each
            # controller sees every request and only the one that leads answers.
            queue_group=f"marduk-{self.controller_id}",
        )
        for name, subject, type_, handler in (
            ("register", s.any_job("register"), Registration, self._on_register),
            ("deregister", s.any_job("deregister"), Deregistration, self._on_deregister),
            ("ack", s.any_job("ack"), Ack, self._on_ack),
            ("report", s.any_job("report"), Report, self._on_report),
            ("query", s.query, Query, self._on_query),
            ("forget", s.forget, Forget, self._on_forget),
            ("drain", s.drain, Drain, self._on_drain),
        ):
            await self._service.add_endpoint(
                name=name,
                subject=subject,
                handler=self._endpoint(type_, handler),  # type: ignore[arg-type]
            )
        self._subs = [await self.nc.subscribe(s.standby, cb=self._on_standby)]
        assert self._health is not None
        gone = self.leadership is not None and self.leadership.holder_gone
        await self._health.start(self._on_health_msg, previous_gone=gone)
        await self.nc.flush()
        if self._roles.is_(Role.SERVING):
            self.serving.set()
        # Agents re-register when they hear this: a level-triggered resync after a takeover.
        await self._publish_hello()
        self.stats["leader.terms"] += 1
        log.info(
            "controller %s serving prefix %r at %s (leader, term %d; state from %s: "
            "%d worker(s), %d device(s), %d epoch(s) in %.0f ms: state %.0f ms, subscribing "
            "%.0f ms)",
            self.controller_id,
            s.prefix,
            redact(self.url),
            term,
            source,
            len(loaded.workers),
            sum(1 for _ in self.policy.drmap.devices()),  # not device_to_replicas: 0.15 s
            len(loaded.epochs),
            (time.monotonic() - t0) * 1000,
            (t_state - t0) * 1000,
            (time.monotonic() - t_state) * 1000,
        )

    async def _step_down(self, why: str, term: int) -> None:
        """Stop serving and give the lease up: whoever leads next rebuilds from the store.

        Tied to ``term``: a step-down decided in one term never stops or resigns a later one
        (we may have been deposed and re-elected while it waited, or while it drained)."""
        lead = self.leadership
        if lead is None or lead.term != term or not self._roles.is_(Role.TAKING_OVER, Role.SERVING):
            log.info("not stepping down (%s): term %d is over", why, term)
            return
        log.error("stepping down (term %d): %s", term, why)
        self._roles.handle(Event.STEP_DOWN, why)
        await self._stop_serving()
        if self._roles.is_(Role.STEPPING_DOWN):  # not deposed (and maybe re-elected) meanwhile
            self._roles.handle(Event.STEPPED_DOWN, f"term {term}")
        await lead.resign(term)

    def _spawn_step_down(self, why: str) -> None:
        # Not from inside the commit: _stop_serving waits for the commits in flight.
        term = self.leadership.term if self.leadership is not None else 0
        self._spawn_background(self._step_down(why, term), "step-down")

    def _spawn_background(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        return self._background.spawn(coro, name)

    def _background_failed(self, task: asyncio.Task[Any], error: BaseException) -> None:
        """A spawned task's error would otherwise vanish (nobody awaits it): count and log it."""
        self.stats["errors.internal"] += 1
        self._internal.log(
            f"task.{task.get_name()}",
            logging.ERROR,
            "internal error in task %s (repeats this minute are counted)",
            task.get_name(),
            exc_info=error,
        )

    async def _on_deposed(self, why: str) -> None:
        before = self.role
        if self._roles.handle(Event.DEPOSED, why) is before:
            return  # stepped down already, or failed or stopping: stop() stops serving
        if self._term_task is not None:
            self._term_task.cancel()
            self._term_task = None
        self.stats["leader.depositions"] += 1
        await self._stop_serving()
        log.warning("standby now (%s)", why)

    async def _stop_serving(self) -> None:
        """Unsubscribe and drain the commits in flight (the role has left SERVING already)."""
        service, self._service = self._service, None
        if service is not None:
            with contextlib.suppress(Exception):
                await service.stop()
        subs, self._subs = self._subs, []
        for sub in subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self._health is not None:
            await self._health.stop()
        # Nothing queued goes out any more; let what is going out or being written finish.
        self._pipeline.close()
        await self._pipeline.drain()

    def _ready(self) -> tuple[bool, str]:
        if self._leading():
            return True, f"leader (term {self.leadership.term if self.leadership else 0})"
        if self.mirror is not None and self.mirror.healthy and self.nc and self.nc.is_connected:
            return True, "hot standby (state mirror current)"
        return False, "not leading and no current state mirror"

    def _gauges(self) -> Iterator[Metric]:
        leading = self._leading()
        yield gauge(
            "marduk_leader", "1 if this controller leads.", {"leader": float(leading)}, "role"
        )
        if not leading:
            return
        p = self.policy
        workers = {"live": float(len(p.workers) - len(p.stale)), "stale": float(len(p.stale))}
        yield gauge("marduk_workers", "Registered workers, by state.", workers, "state")
        devices: Counter[str] = Counter({"healthy": 0, "degraded": 0, "failed": 0})
        for name in p.drmap.devices():
            rec = p.devices.get(name)
            devices[rec.state if rec else "healthy"] += 1
        yield gauge(
            "marduk_devices",
            "Devices in use, by health state.",
            {k: float(v) for k, v in devices.items()},
            "state",
        )
        standbys = float(len(self._live_standbys()))
        yield gauge("marduk_standbys", "Hot standbys heard from.", {"all": standbys}, "scope")

    def _leading(self) -> bool:
        # Connected too: what nats-py buffers while reconnecting would go out after a new
        # leader may have taken over.
        return (
            self._roles.is_(Role.SERVING)
            and self.leadership is not None
            and self.leadership.serving()
            and self.nc is not None
            and self.nc.is_connected
        )

    async def _publish_hello(self) -> None:
        assert self.nc is not None
        await self.nc.publish(
            self.subjects.hello,
            encode(Hello(controller_id=self.controller_id, started_at=self.started_at)),
        )

    def info(self) -> ControllerInfo:
        lead = self.leadership
        return ControllerInfo(
            controller_id=self.controller_id,
            version=__version__,
            pid=os.getpid(),
            started_at=self.started_at,
            prefix=self.settings.prefix,
            host=self.host,
            role="leader" if self._leading() else "standby",
            term=lead.term if lead is not None else 0,
        )

    async def _standby_loop(self) -> None:
        """Standbys announce themselves to the leader about once a second (for status)."""
        while True:
            await asyncio.sleep(1.0)
            if self.nc is None or not self.nc.is_connected or self._leading():
                continue
            with contextlib.suppress(Exception):
                await self.nc.publish(
                    self.subjects.standby, encode(Standby(controller=self.info()))
                )

    def _live_standbys(self) -> list[ControllerInfo]:
        """Standbys heard from in the last 3 s (they announce themselves every second)."""
        now = time.monotonic()
        self._standbys = {k: v for k, v in self._standbys.items() if now - v[1] < 3.0}
        return [info for info, _ in self._standbys.values()]

    async def _on_standby(self, msg: Msg) -> None:
        try:
            info = decode(msg.data, Standby).controller
        except ProtocolError as e:
            self._reject("standby", e.reason, str(e), msg.subject)
            return
        if info.controller_id != self.controller_id:
            self._standbys[info.controller_id] = (info, time.monotonic())

    def _build_policy(self, loaded: Loaded) -> Policy:
        # 100k objects made at once would set off full collections over them again and again
        # (2/3 of the time at 25k workers): collect none while building, then freeze them all.
        gc.disable()
        try:
            return Policy.from_records(
                self.settings.policy, loaded.workers, loaded.epochs, loaded.devices
            )
        finally:
            gc.enable()
            gc.freeze()

    async def _prepare_loop(self) -> None:
        """A standby builds the policy it would lead with once the leader looks gone (the
        lease unrenewed for half a TTL) and the mirror has been quiet a moment: the build
        (~0.2-0.4 s at 100k devices) is then done while the lease runs out, and a takeover only
        checks that the mirror has not changed since. Woken by what it waits for (the role, a
        lease sighting, a mirror change) or at the deadline it computed, never polling."""
        built_at = -_PREPARE_EVERY_S
        while True:
            lead, mirror = self.leadership, self.mirror
            if lead is None or mirror is None:
                await wait_any([self._role_pulse], None)
                continue
            wait, pulses = self._prepare_wait(time.monotonic(), built_at)
            if wait is not None and wait <= 0:
                version = mirror.version
                policy = self._build_policy(mirror.snapshot())  # no await: the mirror holds still
                self._prepared = (version, policy)
                built_at = time.monotonic()
                self.stats["state.prepared"] += 1
                continue
            await wait_any(pulses, wait)

    def _prepare_wait(self, now: float, built_at: float) -> tuple[float | None, list[Pulse]]:
        """How long until a build is due (<= 0: now; None: not until something changes), and
        the changes that may make it due sooner."""
        lead, mirror = self.leadership, self.mirror
        assert lead is not None and mirror is not None
        roles, lease, records = self._role_pulse, lead.observed, mirror.changed
        if not self._roles.is_(Role.STANDBY):
            if self._roles.is_(Role.SERVING):
                self._prepared = None  # leading with the live policy
            return None, [roles]
        silent = lead.silent_for()
        if silent < lead.ttl / 2:
            self._prepared = None  # the leader renews after all: no takeover coming
            return lead.ttl / 2 - silent, [roles, lease]
        if not mirror.healthy or (
            self._prepared is not None and self._prepared[0] == mirror.version
        ):
            return None, [roles, lease, records]
        due = max(mirror.changed_at + _PREPARE_QUIET_S, built_at + _PREPARE_EVERY_S)
        return due - now, [roles, lease]

    async def _gc_loop(self) -> None:
        """Keep Python's full garbage collections short at 100k devices.

        A full collection scans every tracked object: ~60 ms for the policy of 10k workers,
        more at 25k, and it ran every few thousand registrations, stalling commands (the p99
        of notices). Once a second the young generations are collected (cheap: they hold only
        what was made since) and every object still tracked is then frozen (``gc.freeze``),
        out of the full collections' reach: refcounting still frees frozen objects, only
        garbage *cycles* among them wait for the one full collection every
        ``_GC_FULL_INTERVAL_S``. That one blocks the loop (150-450 ms at 25k x 4 under load),
        so it runs right after a lease renewal, when the most time is left before the fence.
        """
        last_full = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            lead = self.leadership
            due = time.monotonic() - last_full >= _GC_FULL_INTERVAL_S
            if due and (lead is None or not lead.is_leader or lead.since_renewal() < lead.ttl / 8):
                gc.unfreeze()
                gc.collect()
                last_full = time.monotonic()
            else:
                gc.collect(1)  # young garbage is reclaimed, not frozen
            gc.freeze()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.tick_interval_s)
            if not self._leading():
                continue
            try:
                await self._commit(self.policy.tick(time.time()))
            except NotServing:
                continue
            except Exception:
                self._log_internal("tick")

    # --- the edge: decode, dispatch, reply -------------------------------------------------------

    def _endpoint(
        self,
        type_: type[T],
        handler: Callable[[T, str], Awaitable[msgspec.Struct | None]],
    ) -> Callable[[MicroRequest], Awaitable[None]]:
        """A micro endpoint handler: decode strictly, decide, answer; never raise."""
        kind = type_.__name__.lower()
        limit = self.settings.max_message_bytes

        async def on_request(request: MicroRequest) -> None:
            # One task per request (bounded): this endpoint's next request is decided while
            # this one's records are written, so their commits go out together. Tasks start
            # in the order they are created, so decisions keep the order requests arrived in.
            await self._in_flight.acquire()
            task = self._spawn_background(handle(request), f"request-{kind}")
            task.add_done_callback(lambda _t: self._in_flight.release())

        async def handle(request: MicroRequest) -> None:
            self.stats[f"received.{kind}"] += 1
            if not self._leading():
                # Our lease lapsed (a paused process) and we have not noticed yet: the new
                # leader answers; one reply per request.
                self.stats["fenced"] += 1
                return
            reply: msgspec.Struct | None
            try:
                req = decode(request.data, type_, max_bytes=limit)
                reply = await handler(req, request.subject)
            except NotServing:
                return  # no answer: the client retries and reaches the new leader
            except ProtocolError as e:
                reply = self._reject(kind, e.reason, str(e), request.subject)
            except PolicyError as e:
                reply = self._reject(kind, e.code, str(e), request.subject)
            except Exception as e:  # the controller never crashes on input
                self._log_internal(f"{kind} on {request.subject}")
                reply = ErrorReply(code="internal", message=f"{type(e).__name__}: {e}"[:4000])
            reply_to = request._msg.reply
            if reply is not None and reply_to:
                await self._answer(reply_to, reply)

        return on_request

    async def _answer(self, subject: str, reply: msgspec.Struct) -> None:
        if self.nc is None:
            return
        if not subject.startswith("_INBOX."):
            # Never a confused deputy: a caller naming $KV..., $JS... or marduk.ctl.hello as
            # its reply subject would have us write there with the controller's rights.
            self._reject("reply", "reply_subject", f"not an inbox: {subject[:100]}", subject)
            return
        try:
            await self.nc.publish(subject, encode(reply))
        except nats.errors.MaxPayloadError as e:
            # Say so, rather than leave the client to conclude nobody answered.
            self.stats["errors.reply_too_large"] += 1
            self._log_limited("reply", f"reply on {subject} too large: {e}")
            too_large = ErrorReply(
                code="reply_too_large",
                message=f"the answer ({len(encode(reply))} bytes) exceeds the server's max "
                f"payload ({self.nc.max_payload} bytes)",
            )
            with contextlib.suppress(Exception):
                await self.nc.publish(subject, encode(too_large))
        except Exception as e:
            self.stats["errors.reply"] += 1
            self._log_limited("reply", f"could not answer on {subject}: {e}")

    def _reject(self, kind: str, reason: str, message: str, subject: str) -> ErrorReply:
        self.stats[f"rejected.{reason}"] += 1
        self.stats["rejected"] += 1
        self._log_limited(f"{kind}.{reason}", f"rejected {kind} on {subject}: {message}")
        return ErrorReply(code=reason, message=message[:4000])

    def _log_limited(self, key: str, line: str, level: int = logging.WARNING) -> None:
        """The first few of each kind per minute: a flood of junk must not flood the log."""
        self._limited.log(key, level, "%s", line)

    def _log_internal(self, what: str) -> None:
        """An internal error: counted; the traceback once a minute per kind, not per message."""
        self.stats["errors.internal"] += 1
        self._internal.log(
            f"handling.{what.split(' ')[0]}",
            logging.ERROR,
            "internal error handling %s (repeats this minute are counted)",
            what,
            exc_info=True,
        )

    def _check_subject_job(self, job: str, subject: str) -> None:
        if self.subjects.job_of(subject) != job:
            raise ProtocolError("subject_mismatch", f"message for job {job!r} sent on {subject}")

    # --- handlers --------------------------------------------------------------------------------

    async def _on_register(self, reg: Registration, subject: str) -> RegisterReply:
        self._check_subject_job(reg.job, subject)
        try:
            result = self.policy.register(reg, time.time())
        except PolicyError as e:
            if e.code == "duplicate_worker":
                # Who was refused: the worker's identity, for watchers and alerts.
                await self._announce(
                    ControllerEvent(
                        kind="duplicate_worker",
                        ts=time.time(),
                        job=reg.job,
                        replica=reg.replica,
                        worker=reg.worker,
                        detail=str(e),
                    )
                )
            raise
        await self._commit(result.outcome)
        return RegisterReply(
            job=reg.job,
            replica=reg.replica,
            worker=reg.worker,
            outcome=result.result,  # type: ignore[arg-type]
            epoch=result.epoch,
            command=result.command,
            renew_interval=result.renew_interval,
            unusable_devices=result.unusable,
        )

    async def _on_deregister(self, req: Deregistration, subject: str) -> DeregisterReply:
        self._check_subject_job(req.job, subject)
        key = WorkerKey(req.job, req.replica, req.worker)
        outcome, known = self.policy.deregister(key, req.reason, time.time())
        await self._commit(outcome)
        return DeregisterReply(known=known)

    async def _on_ack(self, ack: Ack, subject: str) -> AckReply:
        self._check_subject_job(ack.job, subject)
        key = WorkerKey(ack.job, ack.replica, ack.worker)
        outcome = self.policy.ack(key, ack.epoch, time.time(), devices=ack.devices)
        await self._commit(outcome)
        return AckReply(epoch=self.policy.epoch_of_worker(key))

    async def _on_report(self, report: Report, subject: str) -> ReportReply:
        self._check_subject_job(report.job, subject)
        result = self.policy.on_report(report, time.time())
        self.stats[f"reports.{report.status}"] += 1
        if any(not a.coalesced for a in result.actions):
            what = report.failure_class or "unclassified"
            self._count_bounded("restarts", f"{report.status}/{what}")
        await self._commit(result.outcome)
        return ReportReply(actions=result.actions)

    async def _on_forget(self, req: Forget, subject: str) -> ForgetReply:
        outcome = self.policy.forget(req.job, req.replica, req.worker, time.time())
        await self._commit(outcome)
        return ForgetReply(removed=[str(k) for k in outcome.deleted_workers])

    async def _on_drain(self, req: Drain, subject: str) -> DrainReply:
        result = self.policy.drain(req.devices, req.host, req.undrain, req.reason, time.time())
        await self._commit(result.outcome)
        for conflict in result.conflicts:
            log.warning("drain --host %s: conflicting claim: %s", req.host, conflict)
        return DrainReply(
            devices=result.devices, actions=result.actions, conflicts=result.conflicts
        )

    async def _on_health_msg(self, msg: Msg) -> None:
        # One task per event, started in delivery order (so decided in it): the next event is
        # decided and its command published while this one's records are written. The
        # consumer's max_ack_pending bounds how many are in flight.
        self._spawn_background(self._handle_health_msg(msg), "health-event")

    async def _handle_health_msg(self, msg: Msg) -> None:
        """One event from the durable consumer: decide, commit, answer, then acknowledge."""
        self.stats["received.devicehealth"] += 1
        if not self._leading():
            return  # not acked: redelivered to whoever leads after ack_wait
        reply_to = (msg.headers or {}).get(REPLY_HEADER, "")
        if reply_to and (
            len(reply_to) > _REPLY_SUBJECT_MAX or not _REPLY_SUBJECT.fullmatch(reply_to)
        ):
            # A subject the server would refuse (too long, spaces, wildcards) would make our
            # publish fail and nats-py drop the connection: decide, but answer nobody.
            self._reject("devicehealth", "reply_header", f"bad {REPLY_HEADER} header", msg.subject)
            reply_to = ""
        reply: msgspec.Struct
        try:
            event = decode(msg.data, DeviceHealth, max_bytes=self.settings.max_message_bytes)
            if not event.event_id:
                # Stable across redeliveries: the stream sequence names the event.
                event.event_id = f"{self.subjects.prefix}.health#{msg.metadata.sequence.stream}"
            reply = await self._on_health(event)
        except NotServing:
            return
        except ProtocolError as e:
            reply = self._reject("devicehealth", e.reason, str(e), msg.subject)
            # Named as a valid event would be: its own id, or its stream sequence.
            reply.event_id = (
                _event_id_of(msg.data)
                or f"{self.subjects.prefix}.health#{msg.metadata.sequence.stream}"
            )
        except Exception:
            # Not the event's fault (a publish failed mid-commit, a bug): it is not terminated
            # but left for redelivery (bounded by the consumer's max_deliver), and since our
            # state may now be ahead of the store we step down; whoever leads rebuilds.
            self._log_internal("devicehealth")
            self._spawn_step_down("internal error while handling a health event")
            return
        if not isinstance(reply, ErrorReply) and not self._leading():
            # Its records are stored under our term (the store fenced them), so an ack landing
            # late would be harmless; still, a lapsed leader neither answers nor acks: the
            # event is redelivered to whoever leads, which finds it handled (or decides it).
            return
        if reply_to:
            await self._answer(reply_to, reply)
        try:
            # A bad message is terminated (never redelivered); a handled one acknowledged.
            await (msg.term() if isinstance(reply, ErrorReply) else msg.ack())
        except Exception as e:
            self.stats["errors.ack"] += 1
            self._log_limited("ack", f"could not acknowledge a health event: {e}")

    async def _on_health(self, event: DeviceHealth) -> msgspec.Struct:
        now = time.time()
        if not event.timestamp:
            event.timestamp = now
        t0 = time.perf_counter()
        result = self.policy.on_health(event, now)
        reply = result.reply
        if reply.duplicate:
            self.stats["health.duplicates"] += 1
        elif not reply.known:
            self.stats["health.unknown_device"] += 1
        else:
            self.stats[f"events.{event.state}"] += 1
            self._count_source(event.source)
            for action in reply.actions:
                if action.coalesced:
                    self.stats["health.coalesced"] += 1
                else:
                    self.stats[f"restarts.device/{action.kind}"] += 1
        commit = self._pipeline.submit(result.outcome)
        await commit.published
        if result.outcome.commands:
            self._notice_latency.observe(time.perf_counter() - t0)
        await commit.durable
        return reply

    def _count_source(self, source: str) -> None:
        self._count_bounded("sources", source or "unknown")

    def _count_bounded(self, family: str, label: str, limit: int = 100) -> None:
        """Count under a label chosen by a peer: at most ``limit`` labels, then "other"."""
        key = f"{family}.{label[:100]}"
        if key not in self.stats and sum(k.startswith(family + ".") for k in self.stats) >= limit:
            key = f"{family}.other"
        self.stats[key] += 1

    async def _on_query(self, query: Query, subject: str) -> QueryReply:
        """Answer a query, one page at a time: every reply fits the server's max payload."""
        now = time.monotonic()
        standbys = self._live_standbys()
        job = query.job
        snap = self._snapshots.get(
            query.snapshot,
            now,
            lambda: (
                self.policy.worker_infos(job) if query.what == "map" else [],
                self.policy.device_infos(job) if query.what in ("map", "devices") else [],
            ),
        )
        budget = (self.nc.max_payload if self.nc is not None else 1 << 20) - ENVELOPE_BYTES
        page, next_offset = snap.page(query.offset, budget)
        self.stats["queries.pages"] += 1
        return QueryReply(
            controller=self.info(),
            standbys=standbys,
            stats=dict(self.stats) if page.offset == 0 else {},
            workers=page.workers,
            devices=page.devices,
            snapshot=snap.id,
            offset=page.offset,
            next_offset=next_offset,
            total_workers=len(snap.workers),
            total_devices=len(snap.devices),
        )

    # --- commit: persist, then publish -----------------------------------------------------------

    async def _commit(self, outcome: Outcome) -> None:
        """Commit a decision (``marduk.commit``): back once its records are written; raises
        ``NotServing`` if it was fenced, and then nothing of it went out."""
        await self._pipeline.commit(outcome)

    def _publish_failed(self, error: Exception) -> None:
        self.stats["errors.publish"] += 1
        self._log_limited("publish", f"a command could not be published: {error}")

    def _stop_committing(self, counter: str, why: str) -> None:
        self.stats[counter] += 1
        self._spawn_step_down(why)

    async def _publish_outcome(self, outcome: Outcome) -> None:
        for command in outcome.commands:
            await self._publish_command(command)
            self.stats[f"commands.{command.kind}"] += 1
        for command in outcome.resent:
            await self._publish_command(command)
            self.stats["commands.resent"] += 1
        for notice in outcome.notices:
            # After the commands: the failed replicas hear first. Signed like them.
            await self._publish_command(notice)
            self.stats["commands.peer_failed"] += 1

    async def _announce_all(self, outcome: Outcome) -> None:
        for event in outcome.events:
            await self._announce(event)

    async def _announce(self, event: ControllerEvent) -> None:
        self._log_event(event)
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.publish(self.subjects.events(event.job), encode(event))

    async def _write_ahead(self, ceilings: list[EpochRecord]) -> bool:
        """Make the epoch ceilings durable; False if they could not be while we lead."""
        if self.store is None:
            return True
        store = self.store
        if await self._retry(lambda: store.write_ahead(ceilings), budget_s=_WRITE_AHEAD_BUDGET_S):
            return True
        log.error("epoch ceilings not persisted; the commands do not go out")
        return False

    async def _persist(self, outcomes: list[Outcome]) -> None:
        """Write the outcomes' other records (after their commands went out)."""
        if self.store is None or not any(_has_writes(o) for o in outcomes):
            return
        store = self.store
        if not await self._retry(lambda: store.apply(outcomes), budget_s=_PERSIST_BUDGET_S):
            # The commands went out already (their ceilings are durable), but our state is
            # ahead of the store, and a lapsed leader must not answer or acknowledge: nothing
            # waiting on these records is answered or acked (the events are redelivered), and
            # we step down; whoever leads next rebuilds from the store and the agents.
            log.error("state not persisted after publishing; stepping down")
            self._stop_committing("store.persist_failed", "records could not be written")
            raise NotServing("records not persisted")

    async def _retry(self, write: Callable[[], Awaitable[None]], *, budget_s: float) -> bool:
        """Try a write while we lead, for at most ``budget_s`` in all (each attempt at most
        ``_WRITE_ATTEMPT_S``); False if it never succeeded.

        Bounded, since later commits wait for this one: a write-ahead gives up after
        ``_WRITE_AHEAD_BUDGET_S`` (then we step down and the event is redelivered to whoever
        leads, which rebuilds from the store: a JetStream election is ridden out that way);
        records written after publishing get ``_PERSIST_BUDGET_S``. Every write is idempotent,
        and one acknowledged after we gave up only makes the store more current.
        """
        deadline = time.monotonic() + budget_s
        backoff, attempt = Backoff(initial=0.05, cap=0.5), 0
        while True:
            attempt += 1
            remaining = deadline - time.monotonic()
            try:
                await asyncio.wait_for(write(), min(_WRITE_ATTEMPT_S, max(remaining, 0.01)))
                return True
            except Fenced as e:
                # Refused by the store: another leader's term began. Retrying cannot help.
                self.stats["store.fenced"] += 1
                self._log_limited("store", f"state write refused: {e}")
                return False
            except Exception as e:  # TimeoutError (not acknowledged in time) included
                self.stats["store.errors"] += 1
                why = str(e) or type(e).__name__
                self._log_limited("store", f"state write failed (attempt {attempt}): {why}")
            if not self._leading() or deadline - time.monotonic() <= backoff.delay:
                break
            await asyncio.sleep(backoff.next())
        self.stats["store.given_up"] += 1
        return False

    async def _publish_command(self, command: Command) -> None:
        assert self.nc is not None
        payload = encode(command)
        headers = None
        if self._signing_seed is not None:
            headers = {auth.SIG_HEADER: auth.sign(self._signing_seed, payload)}
        await self.nc.publish(self._command_subject(command), payload, headers=headers)

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
        if event.kind == "unknown_device":
            self._log_limited("unknown_device", line, level)
        else:
            # As fields too, for JSON logs: job, replica, worker, epoch, device, event.
            fields = {
                "event": event.kind,
                "job": event.job,
                "replica": event.replica,
                "worker": event.worker,
                "epoch": event.epoch,
                "device": event.device,
                "event_id": event.event_id or None,
            }
            log.log(level, "%s", line, extra={k: v for k, v in fields.items() if v is not None})


# What a reply subject may be: tokens without wildcards or whitespace, well under the server's
# control-line limit (4 KiB).
_REPLY_SUBJECT = re.compile(r"[^\s.*>]+(\.[^\s.*>]+)*")
_REPLY_SUBJECT_MAX = 512
_REQUESTS_IN_FLIGHT = 1024  # x 256 KiB at most each: a flood stays well under 500 MiB
_GC_FULL_INTERVAL_S = 600.0
# A write-ahead gives up (and the leader steps down) after this long in all; records written
# after publishing after the second; each attempt waits at most the third for its
# acknowledgements (BatchWriter's own 5 s would hold every later commit up to 30 s).
_WRITE_AHEAD_BUDGET_S = 1.5
_PERSIST_BUDGET_S = 3.0
_WRITE_ATTEMPT_S = 0.5
_PREPARE_QUIET_S = 0.2
_PREPARE_EVERY_S = 1.0


_WARN_EVENTS = frozenset(
    {
        "unknown_device",
        "fail_issued",
        "worker_crashed",
        "worker_hung",
        "worker_gave_up",
        "worker_stale",
        "worker_expired",
        "duplicate_worker",
    }
)


def _has_writes(o: Outcome) -> bool:
    return bool(
        o.put_workers
        or o.deleted_workers
        or o.put_epochs
        or o.deleted_epochs
        or o.put_devices
        or o.deleted_devices
        or o.handled
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
