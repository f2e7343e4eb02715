"""The library a trainer imports: register with the controller, receive commands.

``AsyncClient`` does the work on an asyncio loop; ``Client`` runs one on a background thread
(named ``marduk-agent``) for synchronous training loops. Nothing here raises into the training
loop after ``connect`` has returned: a lost connection is retried in the background (visible as
``state``), bad messages are counted and recorded in ``errors``, and every wait has a timeout.

Commands are fenced by epochs: a command whose epoch is below the last one received is stale,
and one at that epoch that says nothing new is a duplicate (the controller resends commands
until they are confirmed); both are dropped (``stats["dropped_stale"]``). A command at the same
epoch with more devices is an update — another device failed and joined the restart in flight —
and is delivered again (``stats["updates"]``): act on each epoch once, read its devices.

After a reconnect, whenever a controller announces it took over, and every renewal interval
(the controller says how often), the client registers again; the reply carries the current
epoch and the command that set it, so a command missed while disconnected is delivered then
(level-triggered).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import queue
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from agent import handoff
from agent.fencing import Fence, Verdict
from agent.handoff import Handoff, HandoffError
from marduk import bus
from marduk import protocol as wire
from marduk.auth import SIG_HEADER, verify
from marduk.credentials import Credentials, redact
from marduk.errors import MardukError, RequestRejected
from marduk.subjects import Subjects, check_job, check_replica

log = logging.getLogger("agent")

State = Literal["connecting", "registered", "disconnected", "closed"]


class AgentError(MardukError):
    """Root of the errors the agent library raises (only from connect/close, never later)."""


@dataclass(frozen=True, slots=True)
class Command:
    """A command for this replica, as the trainer sees it."""

    kind: Literal["restart", "fail", "stop", "checkpoint"]
    epoch: int
    reason: str
    devices: tuple[str, ...]
    job: str
    replica: str | None  # None: sent to every replica of the job (scope "job")
    scope: Literal["replica", "job"]
    command_id: str
    issued_at: float
    received_at: float = field(compare=False)

    @property
    def is_failure(self) -> bool:
        return self.kind in ("restart", "fail")

    def to_wire(self) -> wire.Command:
        return wire.Command(
            command_id=self.command_id,
            job=self.job,
            replica=self.replica,
            scope=self.scope,
            kind=self.kind,
            epoch=self.epoch,
            reason=self.reason,
            devices=list(self.devices),
            issued_at=self.issued_at,
        )

    @classmethod
    def from_wire(cls, c: wire.Command, received_at: float) -> Command:
        return cls(
            kind=c.kind,
            epoch=c.epoch,
            reason=c.reason,
            devices=tuple(c.devices),
            job=c.job,
            replica=c.replica,
            scope=c.scope,
            command_id=c.command_id,
            issued_at=c.issued_at,
            received_at=received_at,
        )


@dataclass(slots=True)
class Options:
    """Everything ``connect`` resolves from arguments, MARDUK_* variables and defaults."""

    job: str
    replica: str
    worker: int
    devices: list[str]
    addr: str
    prefix: str
    scope: Literal["replica", "job"]
    timeout: float
    incarnation: int
    epoch: int
    role: Literal["library", "supervisor"] = "library"
    resync_interval: float = 30.0
    host: str = field(default_factory=socket.gethostname)
    credentials: Credentials = field(default_factory=Credentials)
    # Public keys commands must be signed with; None: signatures are not checked (no auth).
    controller_keys: list[str] | None = None
    # Under ``marduk agent run``: its unix socket (the library talks to it, see agent/local.py).
    agent_socket: str | None = None


def resolve_controller_keys(
    given: str | None, credentials: Credentials, env: dict[str, str] | None = None
) -> list[str] | None:
    """Keys to verify command signatures with: the argument, MARDUK_CONTROLLER_KEY, or the
    ``controller.pub`` that ``marduk auth init`` wrote beside the nkey seed file."""
    from marduk.auth import CONTROLLER_PUB, load_public_keys

    env = dict(os.environ) if env is None else env
    value = given or env.get("MARDUK_CONTROLLER_KEY")
    if not value and credentials.nkey is not None:
        beside = credentials.nkey.parent / CONTROLLER_PUB
        value = str(beside) if beside.is_file() else None
    return load_public_keys(value) if value else None


def resolve_options(
    replica_id: str | None,
    devices: list[str] | None,
    job: str | None,
    addr: str | None,
    scope: str | None,
    *,
    worker: int | None = None,
    prefix: str | None = None,
    timeout: float = 30.0,
    role: Literal["library", "supervisor"] = "library",
    credentials: Credentials | None = None,
    controller_key: str | None = None,
) -> Options:
    try:
        given = Handoff.from_env()
    except HandoffError as e:
        raise AgentError(str(e)) from None
    replica = replica_id or given.replica
    if not replica:
        raise AgentError(f"replica_id is required (or set {handoff.REPLICA})")
    job = job or given.job or "default"
    scope = scope or given.scope or "replica"
    if scope not in ("replica", "job"):
        raise AgentError(f"scope must be 'replica' or 'job', not {scope!r}")
    try:
        check_job(job)
        check_replica(replica)
    except ValueError as e:
        raise AgentError(str(e)) from None
    if devices is None:
        from agent.devices import local_device_uuids

        devices = local_device_uuids()
    creds = credentials if credentials is not None else bus.default_credentials()
    try:
        creds.check()
        keys = resolve_controller_keys(controller_key, creds)
    except MardukError as e:
        raise AgentError(str(e)) from None
    return Options(
        job=job,
        replica=replica,
        worker=worker if worker is not None else (given.worker or 0),
        devices=list(devices),
        addr=addr or bus.default_addr(),
        prefix=prefix or given.prefix or "marduk",
        scope=scope,  # type: ignore[arg-type]
        timeout=timeout,
        incarnation=given.restart_count,
        epoch=given.epoch,
        agent_socket=given.agent_socket if role == "library" else None,
        role=role,
        credentials=creds,
        controller_keys=keys,
    )


OnCommand = Callable[[Command], Any]


class CommandInbox:
    """Epoch fencing and delivery of commands to the trainer, shared by both clients.

    A command whose epoch is not above the last one received is dropped; a ``restart`` or
    ``fail`` sets ``failed`` until acknowledged; commands go to ``deliver`` (the sync client's
    queue) or to ``wait()``; ``on_command`` runs on the client's loop, guarded.
    """

    def __init__(
        self,
        opts: Options,
        on_command: OnCommand | None,
        deliver: Callable[[Command], None] | None,
    ) -> None:
        self.opts = opts
        self.state: State = "connecting"
        self.stats: Counter[str] = Counter()
        self.errors: deque[str] = deque(maxlen=50)
        self._on_command = on_command
        self._deliver = deliver
        self._queue: asyncio.Queue[Command] = asyncio.Queue()
        self.fence = Fence.started_at(opts.epoch)  # which commands are news (agent/fencing.py)
        self._checkpoint: Command | None = None  # a checkpoint asked for, not yet saved
        self._pending_failure: Command | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.last_step: int | None = None
        self.last_progress = 0.0

    def _verify_by_asking(self) -> None:
        """Ask the controller what is current (AsyncClient re-registers; under a supervisor the
        local channel forwards only what the supervisor vetted, so nothing to do)."""

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _record(self, message: str) -> None:
        self.errors.append(f"{time.strftime('%H:%M:%S')} {message}")
        log.warning("%s", message)

    def _accept(self, c: wire.Command, *, confirmed: bool = False) -> None:
        """Fence and deliver a command. ``confirmed``: it came in the controller's reply."""
        last = self.fence.received
        verdict, self.fence = self.fence.admit(c.epoch, c.devices, confirmed=confirmed)
        if verdict is Verdict.IMPLAUSIBLE:
            self.stats["dropped_implausible"] += 1
            self._record(
                f"dropped a command with epoch {c.epoch} (last {last}): "
                "beyond what the controller could have issued; asking it"
            )
            self._verify_by_asking()
            return
        if not verdict.delivers:
            self.stats["dropped_stale"] += 1
            return
        self._deliver_command(c, update=verdict is Verdict.UPDATE)

    def _deliver_command(self, c: wire.Command, *, update: bool) -> None:
        """Hand a command the fence let through to the trainer (queue, ``on_command``)."""
        self.stats["updates" if update else f"commands.{c.kind}"] += 1
        command = Command.from_wire(c, time.time())
        if command.kind == "checkpoint" and not update:
            self._checkpoint = command
        pending = self._pending_failure
        if command.is_failure and (not update or pending is None or pending.epoch == c.epoch):
            self._pending_failure = command
        if self._deliver is not None:
            self._deliver(command)
        else:
            self._queue.put_nowait(command)
        if self._on_command is not None:
            try:
                result = self._on_command(command)
                if asyncio.iscoroutine(result):
                    self._spawn(self._guard(result))
            except Exception as e:  # a callback's bug must not kill the client
                self._record(f"on_command callback raised {type(e).__name__}: {e}")

    async def _guard(self, coro: Any) -> None:
        try:
            await coro
        except Exception as e:
            self._record(f"on_command callback raised {type(e).__name__}: {e}")

    def _clear_failure(self, command: Command | None) -> Command | None:
        command = command or self._pending_failure
        if command is not None:
            self.fence = self.fence.ack(command.epoch)
        pending = self._pending_failure
        if command is not None and pending is not None and command.epoch >= pending.epoch:
            self._pending_failure = None
        return command

    async def wait(self, timeout: float | None = None) -> Command | None:
        """The next command for this replica, or None after ``timeout`` seconds."""
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None

    @property
    def checkpoint_requested(self) -> bool:
        """The controller asked to checkpoint now (the host is about to go away): save at the
        next safe point, then call ``checkpoint_saved(step)``; keep training."""
        return self._checkpoint is not None

    @property
    def failed(self) -> bool:
        """A restart or fail command has arrived and has not been acknowledged."""
        return self._pending_failure is not None

    @property
    def last_failure(self) -> Command | None:
        return self._pending_failure

    @property
    def epoch(self) -> int:
        """The last epoch received."""
        return self.fence.received


class AsyncClient(CommandInbox):
    """Registered membership of one worker in a replica, on the current asyncio loop."""

    def __init__(
        self,
        opts: Options,
        on_command: OnCommand | None = None,
        *,
        deliver: Callable[[Command], None] | None = None,
    ) -> None:
        super().__init__(opts, on_command, deliver)
        self.subjects = Subjects(opts.prefix)
        self._nc: NATS | None = None
        self._register_lock = asyncio.Lock()
        self._registered_once = False
        self.renew_interval = opts.resync_interval
        self._last_hello = 0.0
        # Devices of ours the controller has taken out of service (RegisterReply).
        self.unusable_devices: list[str] = []

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect and register; raise AgentError when that fails within ``opts.timeout``."""
        o = self.opts
        deadline = time.monotonic() + o.timeout
        try:
            self._nc = await bus.connect(
                o.addr,
                name=f"marduk-agent {o.job}/{o.replica}/{o.worker}",
                timeout=o.timeout,
                reconnect=True,
                on_disconnected=self._on_disconnected,
                on_reconnected=self._on_reconnected,
                credentials=o.credentials,
            )
            nc = self._nc
            await nc.subscribe(self.subjects.replica_commands(o.job, o.replica), cb=self._on_msg)
            await nc.subscribe(self.subjects.job_commands(o.job), cb=self._on_msg)
            await nc.subscribe(self.subjects.hello, cb=self._on_hello)
            await self._register(timeout=max(0.5, deadline - time.monotonic()), retry=True)
        except MardukError as e:
            await self.close(deregister=False)
            raise AgentError(str(e)) from None
        self._spawn(self._resync_loop())

    async def close(self, *, deregister: bool = True, reason: str = "closed") -> None:
        """Deregister (best effort) and disconnect. Safe to call twice."""
        if self.state == "closed":
            return
        was_registered = self._registered_once
        self.state = "closed"
        for task in list(self._tasks):
            task.cancel()
        if self._nc is not None:
            if deregister and was_registered and self._nc.is_connected:
                o = self.opts
                with contextlib.suppress(Exception):
                    await bus.request(
                        self._nc,
                        self.subjects.deregister(o.job),
                        wire.Deregistration(
                            job=o.job, replica=o.replica, worker=o.worker, reason=reason
                        ),
                        wire.DeregisterReply,
                        timeout=2.0,
                    )
            await bus.close(self._nc)

    # --- registration ----------------------------------------------------------------------------

    async def _register(self, *, timeout: float, retry: bool = False) -> None:
        """Register (again). With ``retry``, keep trying until ``timeout`` runs out."""
        o = self.opts
        reg = wire.Registration(
            job=o.job,
            replica=o.replica,
            worker=o.worker,
            host=o.host,
            devices=o.devices,
            scope=o.scope,
            pid=os.getpid(),
            incarnation=o.incarnation,
            epoch=self.fence.acked,
            seen_epoch=self.fence.received,
            role=o.role,
        )
        deadline = time.monotonic() + timeout
        waiting_said = time.monotonic()
        if retry:
            log.info(
                "registering with the controller at %s (up to %.0f s)", redact(o.addr), timeout
            )
        async with self._register_lock:
            while True:
                assert self._nc is not None
                left = deadline - time.monotonic()
                try:
                    reply = await bus.request(
                        self._nc,
                        self.subjects.register(o.job),
                        reg,
                        wire.RegisterReply,
                        timeout=max(0.2, min(left, 5.0)),
                        addr=o.addr,
                    )
                    break
                except MardukError as e:
                    # A controller restarting or failing over answers nothing for a moment, and
                    # an identity held by a dead process frees itself after the worker TTL:
                    # retry both till the end. Other refusals are final.
                    out_of_time = time.monotonic() + 0.2 >= deadline
                    final = isinstance(e, RequestRejected) and e.code != "duplicate_worker"
                    if not retry or out_of_time or final:
                        raise
                    if time.monotonic() - waiting_said >= 5.0:
                        waiting_said = time.monotonic()
                        log.info(
                            "waiting for the controller at %s (%s), %.0f s left",
                            redact(o.addr),
                            _short(e),
                            deadline - time.monotonic(),
                        )
                    await asyncio.sleep(0.2 if not isinstance(e, RequestRejected) else 1.0)
        self.stats["registrations"] += 1
        if reply.unusable_devices != self.unusable_devices:
            self.unusable_devices = list(reply.unusable_devices)
            if self.unusable_devices:
                self._record(
                    "the controller says these devices are out of service (quarantined or "
                    f"drained): {', '.join(self.unusable_devices)}; this replica cannot run here"
                )
        if reply.renew_interval > 0:
            self.renew_interval = reply.renew_interval
        first = not self._registered_once
        self._registered_once = True
        if self.state != "closed":
            self.state = "registered"
        # A fresh process (not started at an epoch) starts after every restart commanded so far;
        # any other adopts the epoch, or receives the command it missed (level-triggered).
        fresh = first and o.epoch == 0
        verdict, self.fence = self.fence.registered(reply.epoch, reply.command, fresh=fresh)
        if verdict.delivers:
            assert reply.command is not None
            self.stats["converged"] += 1
            self._deliver_command(reply.command, update=verdict is Verdict.UPDATE)
        elif verdict is Verdict.STALE:
            self.stats["dropped_stale"] += 1

    async def reregister(self) -> None:
        try:
            await self._register(timeout=5.0)
        except MardukError as e:
            self._record(f"re-registration failed: {e}")

    async def _on_disconnected(self) -> None:
        if self.state != "closed":
            self.state = "disconnected"
            self.stats["disconnects"] += 1

    async def _on_reconnected(self) -> None:
        if self.state != "closed":
            self._spawn(self.reregister())

    async def _on_hello(self, msg: Msg) -> None:
        # At most one re-registration a second: a flood of hellos (forged, or many controllers
        # starting) must not become a flood of registrations.
        now = time.monotonic()
        if self.state == "closed" or not self._registered_once or now - self._last_hello < 1.0:
            self.stats["hello_ignored"] += 1
            return
        self._last_hello = now
        self._spawn(self.reregister())

    def _verify_by_asking(self) -> None:
        if self.state != "closed" and self._registered_once:
            self._spawn(self.reregister())

    async def _resync_loop(self) -> None:
        # Renewals keep this worker live in the controller's eyes (and converge it).
        while True:
            await asyncio.sleep(self.renew_interval)
            if self._nc is not None and self._nc.is_connected:
                await self.reregister()

    # --- commands --------------------------------------------------------------------------------

    async def _on_msg(self, msg: Msg) -> None:
        keys = self.opts.controller_keys
        if keys is not None and not verify(keys, msg.data, (msg.headers or {}).get(SIG_HEADER)):
            self.stats["dropped_forged"] += 1
            self._record(f"dropped a command on {msg.subject} not signed by the controller")
            return
        try:
            command = wire.decode(msg.data, wire.Command)
        except ValueError as e:
            self.stats["bad_commands"] += 1
            self._record(f"dropped an undecodable command on {msg.subject}: {e}")
            return
        self._accept(command)

    async def report(self, report: wire.Report) -> wire.ReportReply:
        """Send a supervisor's report (marduk agent run); raises MardukError if unanswered."""
        assert self._nc is not None
        return await bus.request(
            self._nc,
            self.subjects.report(self.opts.job),
            report,
            wire.ReportReply,
            timeout=5.0,
            addr=self.opts.addr,
        )

    # Progress. Under ``marduk agent run`` these feed its hang detection (agent/local.py);
    # a standalone client only records them (``last_step``): nothing watches for hangs then.
    async def step(self, step: int) -> None:
        self.last_step, self.last_progress = step, time.time()

    async def heartbeat(self) -> None:
        self.last_progress = time.time()

    async def section(self, name: str, open_: bool, timeout: float | None = None) -> None:
        self.last_progress = time.time()

    async def checkpoint_saved(self, step: int) -> bool:
        """Tell the controller the checkpoint it asked for is saved at ``step`` (recorded in
        status: the job can be resumed from it). Clears ``checkpoint_requested``."""
        asked, self._checkpoint = self._checkpoint, None
        o = self.opts
        report = wire.Report(
            job=o.job,
            replica=o.replica,
            worker=o.worker,
            status="checkpointed",
            epoch=self.fence.acked,
            incarnation=o.incarnation,
            step=step,
            summary=f"checkpoint saved at step {step}"
            + (f" (asked at epoch {asked.epoch})" if asked else ""),
        )
        try:
            await self.report(report)
        except MardukError as e:
            self._record(f"checkpoint report not confirmed: {e}")
            return False
        return True

    async def ack(self, command: Command | None = None) -> bool:
        """Acknowledge ``command`` (default: the pending failure): clears ``failed`` and tells
        the controller this worker applied the epoch. Returns True once the controller
        confirmed (5 s at most); False is recorded in ``errors``, never raised."""
        command = self._clear_failure(command)
        if command is None:
            return True
        o = self.opts
        ack = wire.Ack(
            job=o.job,
            replica=o.replica,
            worker=o.worker,
            epoch=command.epoch,
            command_id=command.command_id,
        )
        try:
            assert self._nc is not None
            await bus.request(
                self._nc, self.subjects.ack(o.job), ack, wire.AckReply, timeout=5.0, addr=o.addr
            )
        except MardukError as e:
            self._record(f"ack not confirmed ({e}); the next registration reports the epoch")
            return False
        return True


async def connect_async(
    replica_id: str | None = None,
    devices: list[str] | None = None,
    job: str | None = None,
    addr: str | None = None,
    scope: str | None = None,
    on_command: OnCommand | None = None,
    *,
    worker: int | None = None,
    prefix: str | None = None,
    timeout: float = 30.0,
    nkey: str | os.PathLike[str] | None = None,
    credentials: Credentials | None = None,
    controller_key: str | None = None,
) -> AsyncClient:
    """Register this worker and return once registered; raise AgentError after ``timeout``.

    Arguments left out come from MARDUK_REPLICA_ID, MARDUK_JOB (default ``default``),
    MARDUK_ADDR, MARDUK_SCOPE (default ``replica``), MARDUK_WORKER, MARDUK_PREFIX; ``devices``
    from MARDUK_DEVICES or ``local_device_uuids()``. Credentials: ``nkey`` (a seed file) or
    ``credentials``, else MARDUK_NKEY / MARDUK_CREDS / MARDUK_USER, MARDUK_PASSWORD /
    MARDUK_TOKEN / MARDUK_TLS_*. ``controller_key`` (or MARDUK_CONTROLLER_KEY, or the
    ``controller.pub`` beside the nkey file): commands not signed with it are dropped.
    """
    opts = resolve_options(
        replica_id,
        devices,
        job,
        addr,
        scope,
        worker=worker,
        prefix=prefix,
        timeout=timeout,
        credentials=_credentials(nkey, credentials),
        controller_key=controller_key,
    )
    client = _make_async(opts, on_command, None)
    await client.start()
    return client


def _short(e: Exception) -> str:
    """The gist of why a registration attempt failed: "no responders", "duplicate_worker"."""
    if isinstance(e, RequestRejected):
        return e.code
    text = str(e)
    inner = text[text.rfind("(") + 1 : text.rfind(")")] if "(" in text else text
    return inner or type(e).__name__


def _credentials(
    nkey: str | os.PathLike[str] | None, credentials: Credentials | None
) -> Credentials | None:
    if nkey is None:
        return credentials
    from dataclasses import replace
    from pathlib import Path

    return replace(credentials or Credentials.from_env(), nkey=Path(nkey))


def _make_async(
    opts: Options, on_command: OnCommand | None, deliver: Callable[[Command], None] | None
) -> AsyncClient:
    """Under ``marduk agent run`` (``opts.agent_socket``), talk to it; else to the controller."""
    if opts.agent_socket:
        from agent.local import LocalAsyncClient

        return LocalAsyncClient(opts, opts.agent_socket, on_command, deliver=deliver)  # type: ignore[return-value]
    return AsyncClient(opts, on_command, deliver=deliver)


class Client:
    """Synchronous facade: one background thread runs an AsyncClient on its own loop.

    ``on_command`` callbacks run on that thread (``marduk-agent``), never on the training thread;
    keep them short and thread-safe, or use ``wait()``/``failed`` from the training loop.
    """

    def __init__(self, opts: Options, on_command: OnCommand | None = None) -> None:
        self._commands: queue.Queue[Command] = queue.Queue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="marduk-agent")
        self._thread.daemon = True
        self._thread.start()
        self._closed = False

        async def make() -> AsyncClient:
            client = _make_async(opts, on_command, self._commands.put_nowait)
            await client.start()
            return client

        try:
            self._async: AsyncClient = self._call(make(), timeout=opts.timeout + 5.0)
        except BaseException:
            self._stop_loop()
            raise
        # A script that ends without close() still deregisters (a crash does not, by design).
        atexit.register(self.close, "exited")

    def _call(self, coro: Any, timeout: float) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise AgentError(f"no answer from the agent thread within {timeout:g}s") from None

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()

    @property
    def opts(self) -> Options:
        return self._async.opts

    @property
    def state(self) -> State:
        return self._async.state

    @property
    def stats(self) -> Counter[str]:
        return self._async.stats

    @property
    def errors(self) -> list[str]:
        return list(self._async.errors)

    @property
    def failed(self) -> bool:
        return self._async.failed

    @property
    def last_failure(self) -> Command | None:
        return self._async.last_failure

    @property
    def epoch(self) -> int:
        return self._async.epoch

    def wait(self, timeout: float | None = None) -> Command | None:
        """The next command for this replica, or None after ``timeout`` seconds."""
        try:
            return self._commands.get(timeout=timeout)
        except queue.Empty:
            return None

    def poll(self) -> Command | None:
        """The next command if one is waiting, else None; never blocks."""
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def step(self, step: int) -> None:
        """Report training progress (feeds ``marduk agent run``'s hang detection). Never blocks."""
        self._fire(self._async.step(step))

    def heartbeat(self) -> None:
        """Report liveness without a step number. Never blocks."""
        self._fire(self._async.heartbeat())

    @contextlib.contextmanager
    def section(self, name: str, timeout: float | None = None) -> Iterator[None]:
        """A named part of the loop; open longer than ``timeout`` s, the trainer counts as hung.

        with client.section("checkpoint", timeout=120):
            save()
        """
        self._fire(self._async.section(name, True, timeout))
        try:
            yield
        finally:
            self._fire(self._async.section(name, False))

    def _fire(self, coro: Any) -> None:
        if self._closed:
            coro.close()
            return
        asyncio.run_coroutine_threadsafe(coro, self._loop)

    @property
    def checkpoint_requested(self) -> bool:
        """The controller asked to checkpoint now; see ``AsyncClient.checkpoint_requested``."""
        return self._async.checkpoint_requested

    def checkpoint_saved(self, step: int) -> bool:
        """Report the checkpoint saved at ``step``; clears ``checkpoint_requested``."""
        return self._call_recorded(self._async.checkpoint_saved(step))

    def ack(self, command: Command | None = None) -> bool:
        """Acknowledge a command (default: the pending failure); see ``AsyncClient.ack``."""
        return self._call_recorded(self._async.ack(command))

    def _call_recorded(self, coro: Any) -> bool:
        """Run ``coro`` on the client's loop; a failure is recorded in ``errors``, never raised."""
        if self._closed:
            coro.close()
            return False
        try:
            return bool(self._call(coro, timeout=7.0))
        except AgentError as e:
            self._async._record(str(e))
            return False

    def close(self, reason: str = "closed") -> None:
        """Deregister and disconnect. Safe to call twice; never raises."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            self._call(self._async.close(reason=reason), timeout=6.0)
        except Exception as e:
            log.debug("close: %s", e)
        self._stop_loop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect(
    replica_id: str | None = None,
    devices: list[str] | None = None,
    job: str | None = None,
    addr: str | None = None,
    scope: str | None = None,
    on_command: OnCommand | None = None,
    *,
    worker: int | None = None,
    prefix: str | None = None,
    timeout: float = 30.0,
    nkey: str | os.PathLike[str] | None = None,
    credentials: Credentials | None = None,
    controller_key: str | None = None,
) -> Client:
    """Register this worker with the controller and return a ``Client``.

    Returns once registered, or raises AgentError with one clear line after ``timeout``
    seconds. See ``connect_async`` for where arguments left out come from.
    """
    opts = resolve_options(
        replica_id,
        devices,
        job,
        addr,
        scope,
        worker=worker,
        prefix=prefix,
        timeout=timeout,
        credentials=_credentials(nkey, credentials),
        controller_key=controller_key,
    )
    return Client(opts, on_command)
