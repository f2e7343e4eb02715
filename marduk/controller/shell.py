"""The controller's shell: lifecycle (connect, open the state, campaign, stop), the role, the
long-running loops, and the parts (edge, handlers, outbox, takeover, standbys) wired together:
each is handed a ``Context`` and the few callables it uses, never the ``Controller``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Coroutine, Iterator
from dataclasses import replace
from typing import Any

from nats.aio.client import Client as NATS
from nats.js.errors import ServiceUnavailableError
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from marduk import __version__
from marduk.aio import Pulse, TaskSet
from marduk.controller.commit import CommitPipeline, NotServing, Steps
from marduk.controller.context import Context, Logs
from marduk.controller.edge import Edge
from marduk.controller.handlers import Handlers
from marduk.controller.leadership import Leadership
from marduk.controller.outbox import Outbox
from marduk.controller.params import ParamsDesk
from marduk.controller.perf import PerfMonitor
from marduk.controller.settings import ControllerSettings, StartupError
from marduk.controller.standbys import Standbys
from marduk.controller.takeover import Opened, Serving, Takeover
from marduk.controller.telemetry import gauges
from marduk.core.policy import Policy
from marduk.core.role import Event, Role, RoleMachine
from marduk.errors import ConnectError, MardukError
from marduk.shell.metrics import MetricsServer, Probes, StatsCollector
from marduk.store.health_stream import HealthConsumer, ensure_stream
from marduk.store.mirror import StateMirror
from marduk.store.params import ParamsStore
from marduk.store.state import StateStore
from marduk.transport import auth, bus
from marduk.transport.credentials import redact
from marduk.transport.embedded import EmbeddedServer, ServerKeeper
from marduk.wire.protocol import ControllerInfo
from marduk.wire.subjects import Subjects

log = logging.getLogger("marduk.controller")


STATE_OPEN_S = 30.0
"""How long a starting controller waits for JetStream to answer (a cluster electing leaders)."""


def _not_ready(e: BaseException) -> bool:
    """JetStream did not answer in time or is electing: worth trying again at startup."""
    return isinstance(e, asyncio.TimeoutError | ServiceUnavailableError)


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
        self.params_store: ParamsStore | None = None
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
        self.health: HealthConsumer | None = None
        self.registry = CollectorRegistry()
        self.registry.register(StatsCollector(self.stats, self._gauges))
        # Long-running loops: one that crashes or returns is fatal (the process's supervisor
        # restarts it, a standby leads meanwhile).
        self._tasks = TaskSet(self._task_crashed, on_return=self._task_returned)
        # The work in flight (per request, per event, a step-down): counted and logged if it
        # fails; ``stop`` gives it a grace, then cancels it.
        self._logs = Logs(self.stats)
        self._background = TaskSet(self._logs.task_failed)
        # The one role (marduk.core.role); the two events below follow it for waiters.
        self.roles = RoleMachine(self._role_changed)
        self.role_pulse = Pulse()
        self.serving = asyncio.Event()  # SERVING and subscribed (cleared on leaving SERVING)
        self.fatal = asyncio.Event()  # FAILED
        self.fatal_reason = ""
        self.credentials = settings.credentials
        if settings.auth_dir is not None and not (
            settings.credentials.nkey or settings.credentials.creds
        ):
            self.credentials = replace(
                settings.credentials, nkey=settings.auth_dir / "controller.nk"
            )
        # Commands are signed with the controller's nkey, so agents can tell them from forgeries.
        self.signing_seed: bytes | None = None
        self._metrics: MetricsServer | None = None
        self._wire_parts()

    def _wire_parts(self) -> None:
        """The parts, each with one job, handed what it uses (a ``Context`` and callables);
        the controller holds the state they share (connection, store, mirror, lease, policy,
        counters) and is the only one to assign it."""
        ctx = Context(
            settings=self.settings,
            subjects=self.subjects,
            controller_id=self.controller_id,
            stats=self.stats,
            logs=self._logs,
            leading=self.leading,
            spawn=self.spawn_background,
            step_down=self._step_down,
            connection=self._connection,
        )
        self.standbys = Standbys(ctx, info=self.info)
        self.outbox = Outbox(ctx, store=lambda: self.store, signing_seed=lambda: self.signing_seed)
        self.pipeline = CommitPipeline(
            Steps(
                leading=self.leading,
                write_ahead=self.outbox.write_ahead,
                publish=self.outbox.publish_outcome,
                persist=self.outbox.persist,
                announce=self.outbox.announce_all,
                stop=self.outbox.stop_committing,
                publish_failed=self.outbox.publish_failed,
            )
        )
        self.params = ParamsDesk(
            ctx,
            store=lambda: self.params_store,
            term=lambda: self.leadership.term if self.leadership is not None else 0,
            workers_of=lambda job: [
                (k.replica, k.worker) for k in self.policy.drmap.workers_of_job(job)
            ],
            announce=self.outbox.announce,
            sign=self.outbox.signature,
        )
        self.handlers = Handlers(
            ctx,
            policy=lambda: self.policy,
            submit=self.pipeline.submit,
            announce=self.outbox.announce,
            standbys=self.standbys.live,
            info=self.info,
            registry=self.registry,
            params_for=self.params.for_registration,
            more_routes=self.params.routes,
        )
        self.perf = PerfMonitor(
            ctx,
            policy=lambda: self.policy,
            announce=self.outbox.announce,
            submit=self.pipeline.submit,
            term=lambda: self.leadership.term if self.leadership is not None else 0,
            config=self.settings.stragglers,
            actions=self.settings.straggler_actions,
        )
        self.edge = Edge(
            ctx, routes=self.handlers.routes, decide_health=self.handlers.decide_health
        )
        self.takeover = Takeover(
            ctx,
            roles=self.roles,
            role_pulse=self.role_pulse,
            serving=self.serving,
            pipeline=self.pipeline,
            opened=Opened(
                store=lambda: self.store,
                mirror=lambda: self.mirror,
                health=lambda: self.health,
                lease=lambda: self.leadership,
                url=lambda: self.url,
            ),
            serving_with=Serving(
                add_endpoints=self.edge.add_endpoints,
                on_health=self.edge.on_health_msg,
                on_standby=self.standbys.on_announcement,
            ),
            adopt=self._adopt,
            info=self.info,
            die=self.die,
        )

    @property
    def role(self) -> Role:
        return self.roles.role

    def _role_changed(self, before: Role, after: Role, event: Event, why: str) -> None:
        if before is Role.SERVING:
            self.serving.clear()
        if self.mirror is not None:
            # Serving, every write is ours: the mirror keeps them undecoded until it is read.
            self.mirror.leading = after is Role.SERVING
        if after is Role.FAILED:
            self.fatal_reason = why
            self.fatal.set()
        self.role_pulse.notify()

    def _stopping(self) -> bool:
        return self.roles.is_(Role.STOPPING, Role.STOPPED)

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, open the durable state, and campaign; serving starts once elected."""
        if self.credentials.nkey:
            self.signing_seed = auth.read_seed(self.credentials.nkey)
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
        self.health = HealthConsumer(
            self.nc, st.prefix, self.subjects.health, ack_wait_s=st.ack_wait_s
        )
        if st.metrics_addr:
            self._metrics = MetricsServer(st.metrics_addr, Probes(self.registry, self._ready))
            await self._metrics.start()
        await self.perf.start(self.nc)
        assert self.leadership is not None  # _open_state made it
        self.roles.handle(Event.STARTED, "campaigning")
        self._spawn(self.leadership.run(), "leadership")
        self._spawn(self.leadership.watch_holder(), "leadership-watch")
        self._spawn(self._tick_loop(), "tick")
        self._spawn(self.params.run(), "params")
        self._spawn(self.standbys.announce_loop(), "standby-heartbeat")
        self._spawn(self._gc_loop(), "gc")
        self._spawn(self.perf.sweep_loop(), "perf-sweep")
        self._spawn(self.takeover.prepare_loop(), "prepare-takeover")
        if self.server is not None:
            self._spawn(self.keeper.watch(self._stopping), "embedded-server-watch")
        log.info(
            "controller %s started on prefix %r at %s (%s; commands %s); "
            "campaigning for the lease (TTL %gs)",
            self.controller_id,
            st.prefix,
            redact(self.url),
            self.credentials.describe(),
            "signed" if self.signing_seed else "unsigned",
            st.lease_ttl,
        )

    async def _open_state(self) -> None:
        """The buckets (state, events, params, slowness), the health stream, the standby mirror
        and the lease."""
        st, nc = self.settings, self.nc
        assert nc is not None
        self.store = await StateStore.open(
            nc, st.prefix, replicas=st.kv_replicas, dedup_window_s=st.dedup_window_s
        )
        await ensure_stream(nc, st.prefix, self.subjects.health, replicas=st.kv_replicas)
        self.params_store = await ParamsStore.open(nc, st.prefix, replicas=st.kv_replicas)
        await self.perf.open(nc, replicas=st.kv_replicas)
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
            on_elected=self.takeover.on_elected,
            on_deposed=self.takeover.on_deposed,
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
        """Stop serving, hand the lease over, stop the loops, let the work in flight finish,
        close NATS, stop the embedded server.

        In kopf's order: nothing new comes in (unsubscribed, the pipeline drained), the root
        tasks (the loops, the takeover in progress) are cancelled and awaited, then the work
        in flight (a request's answer, an event's acknowledgement, a step-down) gets
        ``stop_grace_s`` to finish while NATS is still up; what is still running then is
        cancelled and named in the log (``TaskSet.drain``)."""
        if self._stopping():
            return
        self.roles.handle(Event.STOP, "fatal" if self.fatal.is_set() else "asked to stop")
        await self.takeover.stop_serving()
        await self.perf.stop()
        if self.leadership is not None:
            await self.leadership.resign()
        term_task = self.takeover.cancel_term()
        # A root loop that would not stop is named in the log, not awaited forever.
        await self._tasks.stop(self.settings.stop_grace_s)
        if term_task is not None:
            await asyncio.gather(term_task, return_exceptions=True)
        grace = self.settings.stop_grace_s
        await self._background.drain(grace, cancel_s=grace)
        if self.mirror is not None:
            await self.mirror.stop()
        if self._metrics is not None:
            await self._metrics.stop()
        if self.nc is not None:
            await bus.close(self.nc)
            self.nc = None
        await self.keeper.stop()
        self.server = None
        self.roles.handle(Event.STOPPED)
        interesting = {k: v for k, v in sorted(self.stats.items()) if v}
        log.info("controller stopped; counters: %s", interesting or "none")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        """Start a named long-running task; a crash or an unexpected exit is fatal and logged."""
        self._tasks.spawn(coro, name)

    def _task_crashed(self, task: asyncio.Task[Any], error: BaseException) -> None:
        log.error("task %s crashed", task.get_name(), exc_info=error)
        self.die(f"task {task.get_name()} crashed: {error}")

    def _task_returned(self, task: asyncio.Task[Any]) -> None:
        self.die(f"task {task.get_name()} exited unexpectedly")

    def die(self, reason: str) -> None:
        self.roles.handle(Event.FATAL, reason)  # ignored once failed or stopping

    async def _on_closed(self) -> None:
        # nats-py gives up on a connection only after a protocol error: nothing will bring it
        # back, so end (exit 1); the process's supervisor restarts it, a standby leads meanwhile.
        if not self._stopping():
            self.die(bus.refusal(self.nc) or "the NATS connection was closed (a protocol error?)")

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
        if self.nc is not None and self.roles.is_(Role.SERVING):
            await self.takeover.publish_hello()

    # --- what the parts are handed --------------------------------------------------------------

    def spawn_background(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """A task of the work in flight (a request, an event's commit, a step-down)."""
        return self._background.spawn(coro, name)

    def _step_down(self, why: str) -> None:
        self.takeover.spawn_step_down(why)

    def _connection(self) -> NATS:
        if self.nc is None:
            raise NotServing("not connected to NATS")
        return self.nc

    def _adopt(self, policy: Policy) -> None:
        """Lead with the policy a takeover made (the handlers, the tick and /metrics read it)."""
        self.policy = policy

    def _gauges(self) -> Iterator[Metric]:
        yield from gauges(self.leading(), self.policy, lambda: len(self.standbys.live()))
        yield from self.perf.metrics()

    def _ready(self) -> tuple[bool, str]:
        if self.leading():
            return True, f"leader (term {self.leadership.term if self.leadership else 0})"
        if self.mirror is not None and self.mirror.healthy and self.nc and self.nc.is_connected:
            return True, "hot standby (state mirror current)"
        return False, "not leading and no current state mirror"

    def leading(self) -> bool:
        # Connected too: what nats-py buffers while reconnecting would go out after a new
        # leader may have taken over.
        return (
            self.roles.is_(Role.SERVING)
            and self.leadership is not None
            and self.leadership.serving()
            and self.nc is not None
            and self.nc.is_connected
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
            role="leader" if self.leading() else "standby",
            term=lead.term if lead is not None else 0,
        )

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
            if not self.leading():
                continue
            try:
                await self.pipeline.submit(self.policy.tick(time.time())).durable
            except NotServing:
                continue
            except Exception:
                self._logs.internal("tick")


_GC_FULL_INTERVAL_S = 600.0


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
