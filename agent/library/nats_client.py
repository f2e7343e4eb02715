"""``AsyncClient``: the library registered with the controller over NATS.

Nothing here raises into the training loop after ``start`` has returned: a lost connection is
retried in the background (visible as ``state``), bad messages are counted and recorded in
``errors``, and every wait has a timeout.

After a reconnect, whenever a controller announces it took over, and every renewal interval
(the controller says how often), the client registers again; the reply carries the current
epoch and the command that set it, so a command missed while disconnected is delivered then
(level-triggered). Which commands are news is ``agent/channel/fencing.py``'s rule.

Renewals are jittered (``renewal_delay``): the first comes at a random point of the first
interval and a half, each later one at the interval +-20%. A fleet whose workers started
together (one job's pods, a benchmark's 1,000 clients) would otherwise renew together, every
interval, for as long as it runs: a burst of registrations at the controller and the server
that lands on whatever else they are doing then (health events).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import time
from collections.abc import Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from agent.channel.fencing import Verdict
from agent.channel.requests import Answered
from agent.errors import AgentError
from agent.library.command import Command, OnCommand
from agent.library.inbox import CommandInbox
from agent.library.options import Options
from agent.library.perf import sender_for
from marduk.errors import MardukError, RequestRejected
from marduk.transport import bus
from marduk.transport.auth import SIG_HEADER, verify
from marduk.transport.credentials import redact
from marduk.wire import protocol as wire
from marduk.wire.params import Params, ParamsApplied, ParamsAppliedReply, RankApplied
from marduk.wire.subjects import Subjects

log = logging.getLogger("agent")


_instance: tuple[int, str] = (0, "")

RENEW_JITTER = 0.2  # a later renewal comes at the interval +-20%
FIRST_RENEWAL = (0.2, 1.2)  # the first, at a uniform point of this span (x the interval)


def renewal_delay(interval: float, first: bool, rand: Callable[[], float]) -> float:
    """Seconds until the next renewal, ``rand()`` uniform in [0, 1). The first is spread over
    a whole interval (0.2-1.2 x), so workers registered together fall out of step at once; each
    later one is 0.8-1.2 x, so they do not drift back into it. At most 1.2 x the interval: a
    third of the worker TTL is the interval, so a worker is never close to going stale."""
    if first:
        lo, hi = FIRST_RENEWAL
        return interval * (lo + (hi - lo) * rand())
    return interval * (1.0 + RENEW_JITTER * (2.0 * rand() - 1.0))


def process_instance() -> str:
    """A random token for this process, made at its first registration (a forked child makes
    its own): the controller tells a new process from the one before it by it where host name
    and pid repeat (a container's PID 1 in a StatefulSet pod that was replaced)."""
    global _instance
    if _instance[0] != os.getpid():
        _instance = (os.getpid(), secrets.token_hex(8))
    return _instance[1]


class AsyncClient(CommandInbox):
    """Registered membership of one worker in a replica, on the current asyncio loop."""

    def __init__(
        self,
        opts: Options,
        on_command: OnCommand | None = None,
        *,
        deliver: Callable[[Command], None] | None = None,
        rand: Callable[[], float] = random.random,
    ) -> None:
        super().__init__(opts, on_command, deliver)
        self.subjects = Subjects(opts.prefix)
        self._rand = rand  # the renewals' jitter (a test makes it deterministic)
        self._nc: NATS | None = None
        self._register_lock = asyncio.Lock()
        self._registered_once = False
        self.renew_interval = opts.resync_interval
        self._last_hello = 0.0
        # Devices of ours the controller has taken out of service (RegisterReply).
        self.unusable_devices: list[str] = []
        # A job whose ranks the controller assigns: the latest membership received, with the
        # epoch of the command that carried it; set (and ``membership_changed``) on news.
        self.membership: tuple[int, wire.Membership] | None = None
        self.membership_changed = asyncio.Event()
        # A spare of a pool that a job claimed (RegisterReply.claimed_by): it registers there
        # now (``membership_changed`` is set when this is).
        self.claimed_by: str | None = None

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self, *, on_unreachable: Callable[[str], None] | None = None) -> None:
        """Connect and register; raise AgentError when that fails within ``opts.timeout``.
        ``on_unreachable``: told at once why NATS cannot be reached (it is still tried)."""
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
                on_unreachable=on_unreachable,
            )
            nc = self._nc
            await nc.subscribe(self.subjects.replica_commands(o.job, o.replica), cb=self._on_msg)
            await nc.subscribe(self.subjects.job_commands(o.job), cb=self._on_msg)
            await nc.subscribe(self.subjects.params_commands(o.job), cb=self._on_params_msg)
            await nc.subscribe(self.subjects.hello, cb=self._on_hello)
            await self._register(timeout=max(0.5, deadline - time.monotonic()), retry=True)
        except MardukError as e:
            await self.close(deregister=False)
            raise AgentError(str(e)) from None
        self._spawn(self._resync_loop(), "renew")
        sender = sender_for(o, self.perf, self.publish_perf)
        if sender is not None:
            self._spawn(sender.run(), "perf")

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

    def _registration(self) -> wire.Registration:
        o = self.opts
        return wire.Registration(
            job=o.job,
            replica=o.replica,
            worker=o.worker,
            host=o.host,
            devices=o.devices,
            scope=o.scope,
            pid=os.getpid(),
            instance=process_instance(),
            incarnation=o.incarnation,
            epoch=self.fence.acked,
            seen_epoch=self.fence.received,
            revision=self.fence.acked_revision,
            role=o.role,
            peer_notices=o.peer_notices,
            rendezvous=o.rendezvous,
            nvlink_domain=o.nvlink_domain,
        )

    async def _register(self, *, timeout: float, retry: bool = False) -> None:
        """Register (again). With ``retry``, keep trying until ``timeout`` runs out."""
        reply = await self._ask_to_register(self._registration(), timeout=timeout, retry=retry)
        self._registered(reply)

    async def _ask_to_register(
        self, reg: wire.Registration, *, timeout: float, retry: bool
    ) -> wire.RegisterReply:
        o = self.opts
        deadline = time.monotonic() + timeout
        waiting_said = time.monotonic()
        if retry:
            log.debug(
                "registering with the controller at %s (up to %.1f s)", redact(o.addr), timeout
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
        return reply

    def _registered(self, reply: wire.RegisterReply) -> None:
        """What the controller's answer to a registration tells: devices out of service, the
        renewal interval, the command of the current epoch (a fresh process is past it)."""
        o = self.opts
        self.stats["registrations"] += 1
        if reply.claimed_by is not None:  # nothing else of the reply applies
            self._registered_once = True
            self.claimed_by = reply.claimed_by
            self.membership_changed.set()
            return
        if reply.params is not None and reply.params.job == o.job:
            self._take_params(reply.params, said_again=False)
        if reply.unusable_devices != self.unusable_devices:
            self.unusable_devices = list(reply.unusable_devices)
            if self.unusable_devices:
                self._record(
                    "the controller says these devices are out of service (quarantined or "
                    f"drained): {', '.join(self.unusable_devices)}; this replica cannot run here"
                )
        if reply.renew_interval > 0:
            self.renew_interval = reply.renew_interval
        if reply.command is not None:
            command = self._retired_here(reply.command)
            reply = msgspec.structs.replace(reply, command=command)
            self._note_membership(command)
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
        if bus.refusal(self._nc):  # said once by bus; no reconnect follows
            self.state = "disconnected"
            return
        if self._nc is None:  # never connected: the attempt failing is start's to say
            return
        if self.state != "closed":
            self.state = "disconnected"
            self.stats["disconnects"] += 1
            log.warning("lost the connection to NATS at %s; reconnecting", redact(self.opts.addr))

    async def _on_reconnected(self) -> None:
        if self.state != "closed":
            self._spawn(self.reregister(), "register")

    async def _on_hello(self, msg: Msg) -> None:
        # At most one re-registration a second: a flood of hellos (forged, or many controllers
        # starting) must not become a flood of registrations.
        now = time.monotonic()
        if self.state == "closed" or not self._registered_once or now - self._last_hello < 1.0:
            self.stats["hello_ignored"] += 1
            return
        self._last_hello = now
        self._spawn(self.reregister(), "register")

    def _verify_by_asking(self) -> None:
        if self.state != "closed" and self._registered_once:
            self._spawn(self.reregister(), "register")

    async def _resync_loop(self) -> None:
        # Renewals keep this worker live in the controller's eyes (and converge it); jittered,
        # so a fleet started together does not renew together (``renewal_delay``).
        first = True
        while True:
            await asyncio.sleep(renewal_delay(self.renew_interval, first, self._rand))
            first = False
            if self._nc is not None and self._nc.is_connected:
                await self.reregister()

    # --- commands --------------------------------------------------------------------------------

    def _forged(self, msg: Msg, what: str) -> bool:
        """True (counted, recorded) if ``msg`` is not signed by the controller (when its keys
        are known)."""
        keys = self.opts.controller_keys
        if keys is None or verify(keys, msg.data, (msg.headers or {}).get(SIG_HEADER)):
            return False
        self.stats["dropped_forged"] += 1
        self._record(f"dropped {what} on {msg.subject} not signed by the controller")
        return True

    async def _on_msg(self, msg: Msg) -> None:
        if self._forged(msg, "a command"):
            return
        try:
            command = wire.decode(msg.data, wire.Command)
        except ValueError as e:
            self.stats["bad_commands"] += 1
            self._record(f"dropped an undecodable command on {msg.subject}: {e}")
            return
        s, job = self.subjects, command.job
        to = (
            s.job_commands(job)
            if command.replica is None
            else s.replica_commands(job, command.replica)
        )
        if self._misdirected(command, msg.subject, to):
            return
        command = self._retired_here(command)
        self._note_membership(command)
        self._accept(command)

    def _retired_here(self, command: wire.Command) -> wire.Command:
        """A command of the job that names this worker ``retired`` (the controller took it out
        of the membership: a device out of service or past its budget, or it went silent; a
        spare has its ranks now) is a ``fail`` here: the agent exits 71 and the pod goes back
        to the scheduler, its replacement registering as a new spare."""
        me = wire.WorkerRef(replica=self.opts.replica, worker=self.opts.worker)
        if command.kind == "fail" or me not in command.retired:
            return command
        reason = f"retired from job {command.job}: {command.reason}"
        return msgspec.structs.replace(command, kind="fail", reason=reason[:4000])

    def _note_membership(self, command: wire.Command) -> None:
        """Keep the newest membership (by its command's epoch), whatever the fence says of the
        command: a supervisor waiting to start reads it here."""
        m = command.membership
        if m is None or (self.membership is not None and command.epoch <= self.membership[0]):
            return
        self.membership = (command.epoch, m)
        self.membership_changed.set()

    # --- live parameters (agent/library/params.py) ---------------------------------------------

    async def _on_params_msg(self, msg: Msg) -> None:
        if self._forged(msg, "parameters"):
            return
        try:
            doc = wire.decode(msg.data, Params).params
        except ValueError as e:
            self.stats["bad_params"] += 1
            self._record(f"dropped undecodable parameters on {msg.subject}: {e}")
            return
        if doc.job != self.opts.job:
            self.stats["bad_params"] += 1
            self._record(f"dropped parameters of job {doc.job!r} sent on {msg.subject}")
            return
        self._take_params(doc, said_again=True)

    def _take_params(self, doc: wire.JobParams, *, said_again: bool) -> None:
        """A document from the controller (``said_again``: on the bus, not in a reply)."""
        before = self.live.view.version
        ack = self.live.take(doc, said_again=said_again, on_error=self._on_params_failed)
        if self.live.view.version != before:
            self.stats["params_received"] += 1
        if ack is not None:
            self._spawn(self.params_applied(*ack), "params-applied")

    def _on_params_failed(self, e: Exception) -> None:
        self.stats["errors.on_params"] += 1
        self._record(f"on_params raised {type(e).__name__}: {e}")

    async def params_applied(
        self,
        version: int,
        rejected: dict[str, str] | None = None,
        ranks: list[RankApplied] | None = None,
    ) -> bool:
        """Tell the controller this worker runs ``version`` of the job's parameters, except the
        keys in ``rejected`` (key -> why); a supervisor of several local ranks adds each one's
        word (``ranks``). True once the controller confirmed (5 s at most); False is recorded
        in ``errors``, never raised; the controller asks again."""
        o = self.opts
        refused = {str(k): str(v)[:256] for k, v in (rejected or {}).items()}
        self.live.acked = (version, refused)
        if not self.connected:
            self._record("parameters not acknowledged: no connection to NATS")
            return False
        applied = ParamsApplied(
            job=o.job,
            replica=o.replica,
            worker=o.worker,
            version=version,
            rejected=refused,
            ranks=list(ranks or []),
        )
        try:
            assert self._nc is not None
            await bus.request(
                self._nc,
                self.subjects.params_applied(o.job),
                applied,
                ParamsAppliedReply,
                timeout=5.0,
                addr=o.addr,
            )
        except MardukError as e:
            self._record(f"parameters version {version} not acknowledged: {e}")
            return False
        return True

    @property
    def connected(self) -> bool:
        """The connection to NATS is up now (a request can be answered)."""
        return self._nc is not None and self._nc.is_connected

    async def report(self, report: wire.Report, timeout: float = 5.0) -> wire.ReportReply:
        """Send a supervisor's report (marduk agent run); raises MardukError if unanswered."""
        assert self._nc is not None
        return await bus.request(
            self._nc,
            self.subjects.report(self.opts.job),
            report,
            wire.ReportReply,
            timeout=timeout,
            addr=self.opts.addr,
        )

    async def workload_request(
        self, req: wire.WorkloadRequest, timeout: float = 5.0
    ) -> wire.WorkloadReply:
        """A trainer's request (``marduk.<job>.request``); raises MardukError if unanswered or
        refused (RequestRejected, with the controller's code)."""
        assert self._nc is not None
        return await bus.request(
            self._nc,
            self.subjects.request(self.opts.job),
            req,
            wire.WorkloadReply,
            timeout=timeout,
            addr=self.opts.addr,
        )

    async def _ask(self, kind: str, device: str | None, reason: str, timeout: float) -> Answered:
        """Registered over NATS itself: nobody restarts this trainer, so ``stop_restarting``
        has nothing to stop; the others go to the controller as an agent's would."""
        if kind == "stop_restarting":
            return Answered(False, "no `marduk agent run` restarts this trainer", "not_supervised")
        if not self.connected:
            return Answered(False, "not connected to NATS", "not_connected")
        o = self.opts
        req = wire.WorkloadRequest(
            job=o.job,
            replica=o.replica,
            worker=o.worker,
            kind=kind,  # type: ignore[arg-type]  # checked by agent/channel/requests.py
            device=device,
            reason=reason,
            request_id=secrets.token_hex(8),
        )
        try:
            reply = await self.workload_request(req, timeout)
        except RequestRejected as e:
            return Answered(False, e.detail, e.code)
        except MardukError as e:
            return Answered(False, str(e), "no_answer")
        return Answered(True, reply.detail)

    async def publish_perf(self, summary: wire.PerfSummary) -> bool:
        """One window's summary, published (not requested: a lost one costs one window of
        evidence); False while disconnected (not buffered to arrive late)."""
        if not self.connected:
            return False
        assert self._nc is not None
        await self._nc.publish(self.subjects.perf(self.opts.job), wire.encode(summary))
        return True

    # Progress. Under ``marduk agent run`` these feed its hang detection
    # (agent/channel/messages.py); a standalone client only records them (``last_step``): nothing
    # watches for hangs then.
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
        if not self.connected:  # not buffered to be sent late: the next registration says it
            self._record("ack not sent: no connection to NATS; the next registration reports it")
            return False
        o = self.opts
        # Said as the fence holds it, not as ``command`` was: an update that came before this
        # ack (another failure joined the restart) is covered by the incarnation that follows.
        fence = self.fence
        known = fence.devices if command.epoch == fence.received else command.devices
        ack = wire.Ack(
            job=o.job,
            replica=o.replica,
            worker=o.worker,
            epoch=command.epoch,
            command_id=command.command_id,
            devices=sorted(known),
            revision=fence.acked_revision if command.epoch == fence.acked else 0,
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


def _short(e: Exception) -> str:
    """The gist of why a registration attempt failed: "no responders", "duplicate_worker"."""
    if isinstance(e, RequestRejected):
        return e.code
    text = str(e)
    inner = text[text.rfind("(") + 1 : text.rfind(")")] if "(" in text else text
    return inner or type(e).__name__
