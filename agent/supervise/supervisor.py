"""``marduk agent run``: the pod's main process. Starts the trainers, watches them, restarts them.

The pod survives when a trainer dies. This process registers the node's devices with the
controller once (so the registration outlives trainer restarts), runs ``--nproc-per-node`` local
ranks (torchrun's contract: agent/supervise/launch.py), each in its own process group, passes their
output through line by line, and applies the decisions of the supervision core
(agent/supervise/supervision.py) to what it observes:

* a local rank crashes (exit code or signal) or hangs (no step for ``hang_timeout_s``; before
  the first step, ``startup_timeout_s``; a section open past its timeout): every local rank is
  stopped, the failure is reported with a diagnosis, and all start again at the epoch the
  controller answers with (standalone: the same epoch). With other local ranks still running,
  the report comes first and its answer is forwarded to their libraries as a restart before
  they get SIGTERM (``_tell_the_others``: ranks of a jax.distributed mesh swallow SIGTERM);
* a ``restart`` command (a device failure, another worker's crash in scope ``job``): every
  local rank restarts at the command's epoch, once per epoch;
* past ``max_restarts`` local failures within ``restart_window_s``, or on a ``fail`` command,
  it reports that it gives up and exits non-zero so the scheduler replaces the pod;
* every local rank exited 0: exit 0;
* SIGTERM/SIGINT (eviction, preemption): SIGTERM to the ranks, the grace period to
  checkpoint, ``preempted``, exit.

Stopping an incarnation is SIGTERM to every rank's process group and to every process its trainers
left behind (agent/supervise/proctree.py: the agent is their subreaper), ``grace_s`` to finish, then
SIGKILL. With no controller reachable (or ``--standalone``) the same rules run locally and the agent
keeps trying to join the controller in the background (agent/supervise/controller_link.py).

Exit codes: see ``ExitCode``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import shlex
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from agent.channel import handoff, messages
from agent.channel.handoff import Handoff
from agent.library.client import AsyncClient, Command
from agent.supervise import placement
from agent.supervise.controller_link import (
    REPORT_TIMEOUT_S,
    STOPPING_REPORT_TIMEOUT_S,
    ControllerLink,
)
from agent.supervise.launch import LaunchSpec, Std
from agent.supervise.ports import listening, port_for_incarnation
from agent.supervise.preflight import run_check
from agent.supervise.proctree import (
    become_subreaper,
    end_leftovers,
    find_leftovers,
    wait_groups_gone,
)
from agent.supervise.ranks import (
    CommandArrived,
    Fact,
    Joined,
    Preempted,
    Rank,
    RankExited,
    Tick,
)
from agent.supervise.reclaim import between_incarnations
from agent.supervise.signatures import Diagnosis, diagnose
from agent.supervise.starter import Starter, standby_command
from agent.supervise.supervision import (
    Decision,
    ExitCode,
    Finish,
    Forward,
    GiveUp,
    Ignore,
    Limits,
    Restart,
    Supervision,
    describe_returncode,
)
from agent.supervise.supervisor_config import SupervisorConfig, default_preload
from agent.supervise.trainer_channel import TrainerChannel
from agent.supervise.zygote import TrainerProcess
from marduk.aio import TaskSet
from marduk.errors import MardukError
from marduk.shell.metrics import MetricsServer, Probes, StatsCollector, gauge, histogram
from marduk.transport.credentials import redact
from marduk.wire import protocol as wire

__all__ = ["ExitCode", "Supervisor", "SupervisorConfig", "default_preload", "standby_command"]

log = logging.getLogger("agent.supervisor")
T = TypeVar("T")

MASTER_WAIT_S = 2.0  # at most, for rank 0 to listen on MASTER_PORT before the others start
CANCEL_WAIT_S = 1.0  # at most, for work cut short by SIGTERM to end
PUMP_DRAIN_S = 0.5  # after a rank exits: its output still in the pipe (a leftover may hold it)


async def read_output(stream: asyncio.StreamReader) -> bytes:
    """The next line of a trainer's output, its newline kept; b"" at the end.

    A line longer than the reader's limit (a progress bar redrawn with \\r, a big tensor
    printed, a JSON blob) comes back in pieces of at most the limit, without a newline until
    the last: passed through whole, never an error. (``readline()`` raises ValueError there,
    and a pump that stops reading blocks its trainer on a full pipe: a healthy trainer "hangs".)
    """
    try:
        return await stream.readuntil(b"\n")
    except asyncio.IncompleteReadError as e:
        return e.partial  # the last line, without its newline (b"": the end)
    except asyncio.LimitOverrunError as e:
        return await stream.readexactly(max(e.consumed, 1))


class Supervisor:
    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self.opts = config.opts
        self.launch = config.launch
        nproc = self.launch.nproc_per_node if self.launch is not None else 1
        self.core = Supervision(
            Limits(
                max_restarts=config.max_restarts,
                restart_window_s=config.restart_window_s,
                hang_timeout_s=config.hang_timeout_s,
                startup_timeout_s=config.startup_timeout_s,
            ),
            nproc,
            epoch=self.opts.epoch,
        )
        self.step_re = re.compile(config.step_regex)
        self.facts: asyncio.Queue[Fact] = asyncio.Queue()
        self.stats: Counter[str] = Counter()
        self._tasks = TaskSet(self._task_failed, prefix="marduk-agent-")
        self.starter = Starter(
            config.cmd,
            nproc=nproc,
            prespawn=config.prespawn,
            fork_server=config.fork_server,
            preload=config.preload,
            fork_server_timeout_s=config.fork_server_timeout_s,
            stats=self.stats,
            spawn=self._spawn,
        )
        # A private directory (0700, made race-free by mkdtemp) holds the trainers' sockets: no
        # other user can connect to them, or guess and squat their paths.
        self.socket_dir = tempfile.mkdtemp(
            prefix="marduk-agent-", dir=os.environ.get("XDG_RUNTIME_DIR") or None
        )
        names = ["agent.sock"] if nproc == 1 else [f"agent-{i}.sock" for i in range(nproc)]
        self.ranks = [
            Rank(i, os.path.join(self.socket_dir, name), config.tail_lines)
            for i, name in enumerate(names)
        ]
        self.channels: list[TrainerChannel] = []  # each rank's library (agent/channel/messages.py)
        self.master_port = 0
        # Where this node's ranks sit at the current incarnation (the controller's membership
        # with --nnodes MIN:MAX; else the launch spec as given).
        self.placed: LaunchSpec | None = config.launch
        self._master_first = False  # start rank 0 first, the others once it listens
        self.run_dir = ""  # --log-dir/<job>_<replica>_<worker>_<unique>, made at the first start
        self.registry = CollectorRegistry()
        self.registry.register(StatsCollector(self.stats, self._gauges))
        self.link = ControllerLink(
            self.opts,
            on_command=self._on_command,
            registry=self.registry,
            join_interval_s=config.join_interval_s,
            spawn=self._spawn,
        )
        self._restart_seconds = histogram(
            self.registry,
            "marduk_agent_restart_seconds",
            "From a trainer's end (crash, hang, command) to the next trainers running.",
        )
        self._first_step_seconds = histogram(
            self.registry,
            "marduk_agent_time_to_first_step_seconds",
            "From a trainer's start to its first step (or heartbeat).",
        )
        self._ended_at: float | None = None
        # SIGTERM/SIGINT: set at once, whatever the agent is doing (connecting, starting,
        # stopping, reporting); a second signal cuts the grace period short.
        self._signalled = asyncio.Event()
        self._signal_name = "SIGTERM"
        self._hurry = asyncio.Event()

    # --- what the rest of the code reads ----------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self.core.epoch

    @property
    def incarnation(self) -> int:
        return self.core.incarnation

    @property
    def nproc(self) -> int:
        return len(self.ranks)

    @property
    def step(self) -> int | None:
        """The lowest step of the ranks that stepped (the node's progress)."""
        steps = [r.step for r in self.core.ranks if r.step is not None]
        return min(steps) if steps else None

    # --- top level --------------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        logs = self.config.logs
        if logs.log_dir and not logs.wants_files:
            log.warning(
                "--log-dir %s: nothing is written there without --tee or --redirects "
                "(e.g. --tee 3 for both streams of every rank)",
                logs.log_dir,
            )
        if self.launch is not None and self.launch.thread_env(os.environ):
            log.warning(
                "OMP_NUM_THREADS set to 1 for each of the %d local ranks (as torchrun does); "
                "set it yourself to tune it",
                self.nproc,
            )
        # Orphans of our trainers (setsid'd helpers) become ours, not init's: ended with them.
        if not become_subreaper():
            log.warning(
                "cannot become a child subreaper: processes that leave a trainer's "
                "session may outlive it"
            )
        if self.config.standalone:
            log.info(
                "standalone: restarts are local; joining the controller at %s when it answers",
                redact(self.opts.addr),
            )
            self.link.join_in_background(self._joined)
        else:
            # Nothing starts until the controller answers: say so at once, not after the wait.
            log.info(
                "registering with the controller at %s: the trainers start once it answers "
                "(up to %g s; --standalone starts them now and joins it later)",
                redact(self.opts.addr),
                self.opts.timeout,
            )
            try:
                client = await self._or_signal(self.link.connect())
            except MardukError as e:
                if self.config.require_controller:
                    log.error("cannot register with the controller: %s", e)
                    return ExitCode.SETUP
                log.warning(
                    "cannot register with the controller (%s): running standalone (local "
                    "restarts only) and joining it when it answers",
                    e,
                )
                self.link.join_in_background(self._joined)
            else:
                if client is None:
                    log.warning("%s before the trainers started: exiting", self._signal_name)
                    await self.link.close(deregister=False)
                    return ExitCode.PREEMPTED
                gave_up = self.core.joined(client.epoch, list(client.unusable_devices))
                if gave_up is not None:
                    # Quarantined or drained by the controller: running here cannot help; the
                    # pod goes back to the scheduler (a node the device is not on).
                    log.error("%s; not starting the trainer", gave_up.why)
                    await self._report("gave_up", summary="devices out of service")
                    await self.link.close(deregister=True, reason="devices out of service")
                    return gave_up.code
        metrics = None
        if self.config.metrics_addr:
            metrics = MetricsServer(self.config.metrics_addr, Probes(self.registry, self._ready))
            try:
                await metrics.start()
            except MardukError as e:
                log.error("%s", e)
                await self.link.close(deregister=False)
                return ExitCode.SETUP
        for rank in self.ranks:
            channel = TrainerChannel(
                rank.socket_path,
                functools.partial(self._on_trainer, rank.index),
                epoch=lambda: self.epoch,
                stats=self.stats,
            )
            await channel.start()
            self.channels.append(channel)
        background = [
            self._spawn(self._status_loop(), "status"),
            self._spawn(self._ticker(), "ticker"),
        ]
        try:
            return await self._loop()
        finally:
            for task in background:
                task.cancel()
            await self._stop_all("the agent is exiting")
            for channel in self.channels:
                channel.close()
            with contextlib.suppress(OSError):
                os.rmdir(self.socket_dir)
            await self.starter.close()
            await end_leftovers(set(), 1.0)
            await self.link.close(deregister=False)
            if metrics is not None:
                await metrics.stop()

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._signalled.is_set():
            log.warning("%s again: the trainers get no more grace (SIGKILL)", sig.name)
            self._hurry.set()
            return
        self._signal_name = sig.name
        self._signalled.set()
        self.facts.put_nowait(Preempted(sig.name))

    async def _or_signal(self, coro: Coroutine[Any, Any, T]) -> T | None:
        """``coro``'s result, or None when SIGTERM/SIGINT came first (it is cancelled)."""
        if self._signalled.is_set():
            coro.close()
            return None
        work = asyncio.ensure_future(coro)
        signalled = asyncio.ensure_future(self._signalled.wait())
        await asyncio.wait({work, signalled}, return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        if work.done():
            return work.result()
        work.cancel()
        # Not forever: a library may hold on to its cancellation (nats-py while connecting).
        await asyncio.wait([work], timeout=CANCEL_WAIT_S)
        return None

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """A named background task whose failure is logged and counted, not lost."""
        return self._tasks.spawn(coro, name)

    def _task_failed(self, task: asyncio.Task[Any], e: BaseException) -> None:
        self.stats["errors.task"] += 1
        log.error("background task %s failed: %s: %s", task.get_name(), type(e).__name__, e)

    async def _joined(self, client: AsyncClient) -> None:
        """Standalone until now: the controller's epochs apply from the next restart on."""
        self.facts.put_nowait(Joined(client.epoch, list(client.unusable_devices)))
        if any(r.running for r in self.ranks):
            await self._report("running")
        if self.opts.peer_notices and not client.opts.peer_notices:
            self._ask_for_peer_notices()

    def _on_command(self, command: Command) -> None:
        if command.is_notice:
            # Another replica fails: nothing to restart here; the trainers' libraries decide
            # (a torchft group abandons its step). At once, not behind the supervision loop.
            self._spawn(self._forward(command), "notice")
            return
        self.facts.put_nowait(CommandArrived(command))

    def _ask_for_peer_notices(self) -> None:
        """A trainer's library wants ``peer_failed`` notices: register asking for them (from
        now on, for every later incarnation too)."""
        client = self.link.client
        asked = self.opts.peer_notices and (client is None or client.opts.peer_notices)
        self.opts.peer_notices = True  # often the very object the client holds
        if client is not None and not asked:
            client.opts.peer_notices = True
            self._spawn(client.reregister(), "register")

    def _ready(self) -> tuple[bool, str]:
        if not all(r.running for r in self.ranks):
            return False, "not every trainer is running"
        waiting = [i for i, r in enumerate(self.core.ranks) if not r.progress_at]
        if waiting:
            who = "trainer" if self.nproc == 1 else f"local rank(s) {waiting}"
            return False, f"{who} (incarnation {self.incarnation}) has not stepped yet"
        return True, f"trainer stepping (epoch {self.epoch}, step {self.step})"

    def _gauges(self) -> Iterator[Metric]:
        running = float(sum(r.running for r in self.ranks))
        yield gauge(
            "marduk_agent_trainer_running",
            "Trainers (local ranks) running.",
            {"trainer": running},
            "process",
        )
        yield gauge(
            "marduk_agent_epoch",
            "The epoch the trainers run at.",
            {"current": float(self.epoch)},
            "epoch",
        )
        yield gauge(
            "marduk_agent_incarnation",
            "Trainer starts so far (0: the first).",
            {"current": float(max(self.incarnation, 0))},
            "incarnation",
        )

    # --- the loop: start every rank, wait for a decision, apply it --------------------------------

    async def _loop(self) -> int:
        while True:
            if self._signalled.is_set():  # came while stopping or between incarnations
                code = await self._apply(self.core.preempted(self._signal_name), None)
                assert code is not None
                return code
            try:
                await self._start_all()
            except OSError as e:
                log.error("cannot start the trainer %s: %s", shlex.join(self.config.cmd), e)
                await self._report("gave_up", summary=f"cannot start: {e}")
                return ExitCode.SETUP
            decision, command = await self._supervise()
            if command is not None:
                await self._forward(command)  # the libraries learn why they are stopped
            answered = await self._tell_the_others(decision)
            await self._stop_all(decision_why(decision))
            self._ended_at = time.monotonic()
            code = await self._apply(decision, command, answered)
            if code is not None:
                return code
            await self._or_signal(self._cleanup())

    async def _supervise(self) -> tuple[Decision, Command | None]:
        """Feed the core what happens until it decides something the ranks must stop for."""
        while True:
            fact = await self.facts.get()
            now = time.monotonic()
            command = None
            decision: Decision | None
            if isinstance(fact, RankExited):
                if fact.incarnation != self.core.incarnation:
                    continue  # a rank of an incarnation already stopped
                decision = self.core.exited(fact.rank, fact.returncode, now)
                if fact.returncode == 0 and decision is None:
                    log.info("local rank %d finished (exit 0)", fact.rank)
            elif isinstance(fact, Tick):
                decision = self.core.tick(now)
            elif isinstance(fact, Preempted):
                decision = self.core.preempted(fact.signal)
            elif isinstance(fact, Joined):
                decision = self.core.joined(fact.epoch, fact.unusable_devices)
            else:
                command = fact.command
                if command.kind == "peer_failed":  # forwarded by _on_command, never queued
                    continue
                decision = self.core.command(command.kind, command.epoch, command.reason)
                if isinstance(decision, Forward):
                    # Save now, keep training: the trainers' libraries see it; nothing stops.
                    log.warning("%s", decision.why)
                    await self._forward(command)
                    continue
            if decision is None or isinstance(decision, Ignore):
                continue
            return decision, command

    async def _tell_the_others(self, decision: Decision) -> tuple[int | None] | None:
        """A local rank failed while others run: report it now, before they are stopped, and
        forward the restart the controller answers with to their libraries, as a command's
        restart is. Returns the answer (a 1-tuple: the epoch, or None when no controller
        answered), or None when this does not apply (the report is then made after the stop).

        The ranks of one ``jax.distributed`` mesh under one agent: JAX's preemption service
        swallows SIGTERM, and a rank blocked in a collective with the dead one never exits, so
        without a message first (``agent.jax.exit_on_restart`` ends it) the stop waited out the
        whole grace period. Only a controller issues epochs; standalone, nothing is forwarded.
        """
        if not isinstance(decision, Restart) or decision.failure is None:
            return None
        if not any(r.running for i, r in enumerate(self.ranks) if i != decision.rank):
            return None
        answered = await self._report_failure(decision.failure, decision.failure, decision)
        if answered is not None and answered > self.epoch:
            o = self.opts
            restart = wire.Command(
                command_id=f"local-{os.getpid()}-{self.incarnation}",
                job=o.job,
                replica=o.replica,
                scope=o.scope,
                kind="restart",
                epoch=answered,
                reason=f"local rank {decision.rank} {decision.failure}",
                issued_at=time.time(),
            )
            for channel in self.channels:
                await channel.forward(restart)
        return (answered,)

    async def _apply(
        self,
        decision: Decision,
        command: Command | None,
        answered: tuple[int | None] | None = None,
    ) -> int | None:
        """Report the decision and prepare the restart; an exit code ends the agent.
        ``answered``: the failure was reported already (``_tell_the_others``)."""
        if isinstance(decision, Finish):
            log.info("trainer finished (exit 0)" if self.nproc == 1 else "every rank finished")
            await self._report("exited", exit_code=0)
            await self.link.close(deregister=True, reason="trainer exited 0")
            return ExitCode.OK
        if isinstance(decision, GiveUp):
            if decision.code == ExitCode.PREEMPTED:
                log.warning("%s: stopped the trainers", decision.why)
                await self._report("preempted", summary=decision.why)
            elif decision.code == ExitCode.STOPPED:
                log.warning("%s", decision.why)
            elif decision.failure is not None:
                log.error("%s", decision.why)
                await self._report_failure("gave_up", decision.failure, decision)
            else:
                log.error("%s; giving up", decision.why)
                await self._report("gave_up", summary=decision.why)
                if command is None:  # the controller we joined says our devices are out
                    await self.link.close(deregister=True, reason=decision.why)
            return int(decision.code)
        assert isinstance(decision, Restart)
        if decision.failure is None:
            assert command is not None
            log.warning("%s", decision.why)
            self.stats["restarts.command"] += 1
            self.core.restarting_at(command.epoch)
            # Not awaited: the next trainer need not wait for the controller's answer (a round
            # trip to a controller busy with the whole job's acks); a lost ack is resent by
            # the next registration.
            self._spawn(self.link.ack(command), "ack")
            if command.devices and not await self._preflight(
                f"device(s) {', '.join(command.devices)}"
            ):
                return ExitCode.DEVICE_FAILED
            return None
        diagnosis = self._diagnose(decision.rank)
        what = diagnosis.failure_class if diagnosis else "unclassified"
        self.stats[f"restarts.{decision.failure}/{what}"] += 1
        if answered is None:
            answered = (await self._report_failure(decision.failure, decision.failure, decision),)
        self.core.restart_epoch(answered[0])
        device_class = diagnosis is not None and diagnosis.action == "check_device"
        if device_class and not await self._preflight(what):
            return ExitCode.DEVICE_FAILED
        return None

    def _diagnose(self, rank: int | None) -> Diagnosis | None:
        return diagnose(self.ranks[rank].tail) if rank is not None else None

    # --- one incarnation of every rank ------------------------------------------------------------

    def _trainer_env(self) -> dict[str, str]:
        """What every rank's trainer gets (and the fork server imports with)."""
        o = self.opts
        given = Handoff(
            job=o.job,
            replica=o.replica,
            worker=o.worker,
            epoch=self.epoch,
            restart_count=max(self.incarnation, 0),
            devices=tuple(o.devices),
            scope=o.scope,
            addr=o.addr,
            supervisor_pid=os.getpid(),
        )
        threads = self.launch.thread_env(os.environ) if self.launch is not None else {}
        return {**os.environ, **threads, "PYTHONUNBUFFERED": "1", **given.to_env()}

    def _rank_env(self, rank: Rank, base: dict[str, str]) -> dict[str, str]:
        env = {**base, handoff.AGENT_SOCKET: rank.socket_path}
        if self.placed is not None:
            env.update(
                self.placed.env(rank.index, self.opts.devices, self.incarnation, self.master_port)
            )
        return env

    async def _placement(self) -> LaunchSpec:
        """This node's place at the epoch it starts at: the controller's membership (waited
        for; a newer one moves the epoch up to its command's)."""
        assert self.launch is not None
        epoch, m, me = await placement.membership_for(
            lambda: self.link.client, self.opts, self.epoch
        )
        self.core.restarting_at(epoch)
        client = self.link.client
        if placement.refresh_ports(self.opts, m, me) and client is not None:
            client.opts.rendezvous = self.opts.rendezvous
            self._spawn(client.reregister(), "register")
        log.info("%s", placement.describe(epoch, m, me))
        return self.launch.placed(
            len(m.members), me.node_rank, m.coordinator_addr, m.coordinator_port
        )

    async def _start_all(self) -> None:
        """Start every rank. A signal meanwhile: the ranks not started yet are not (the loop
        then stops those that are)."""
        if self.launch is not None and self.launch.from_controller:
            placed = await self._or_signal(self._placement())
            if placed is None:
                log.warning("%s before this node had its ranks: not starting", self._signal_name)
                return
            self.placed = placed
        incarnation = self.core.started(time.monotonic())
        if self.placed is not None:
            self.master_port = port_for_incarnation(self.placed, self.epoch)
        base = self._trainer_env()
        for rank in self.ranks:
            rank.tail.clear()
            self._open_logs(rank, incarnation)
            try:
                proc = await self._or_signal(
                    self.starter.start(
                        rank.index,
                        self._rank_env(rank, base),
                        first=incarnation == 0,
                        base_env=base,
                    )
                )
            except OSError:
                await self._stop_all("a local rank could not start")
                raise
            if proc is None:
                log.warning(
                    "%s while starting the trainers: not starting the rest", self._signal_name
                )
                return
            rank.proc = proc
            self._watch(rank, incarnation)
            if rank.index == 0 and self._master_first:
                await self._wait_for_master()
        started = time.monotonic()
        self.stats["trainer_starts"] += self.nproc
        for rank in self.ranks:
            by = self.starter.slots[rank.index].started_by
            if by:
                self.stats[f"trainer_starts.{by}"] += 1
        if self._ended_at is not None:
            self._restart_seconds.observe(started - self._ended_at)
            self._ended_at = None
        by = self.starter.slots[0].started_by
        pids = ", ".join(str(r.proc.pid) for r in self.ranks if r.proc is not None)
        log.info(
            "trainer%s started: pid%s %s, epoch %d, incarnation %d%s",
            "" if self.nproc == 1 else "s",
            "" if self.nproc == 1 else "s",
            pids,
            self.epoch,
            incarnation,
            f" (pre-spawned), from the {by}" if by else "",
        )
        # In the background: the loop must see crashes and signals while the controller
        # answers (5 s at most when it is gone but NATS is not).
        self._spawn(self._report_running(), "report-running")

    async def _report_running(self) -> None:
        await self._report("running")

    def _watch(self, rank: Rank, incarnation: int) -> None:
        proc = rank.proc
        assert proc is not None
        pumps = [
            self._spawn(self._pump(rank, proc.stdout, Std.OUT), f"rank{rank.index}-stdout"),
            self._spawn(self._pump(rank, proc.stderr, Std.ERR), f"rank{rank.index}-stderr"),
        ]
        waiter = self._spawn(
            self._wait_exit(rank, proc, incarnation, pumps), f"rank{rank.index}-wait"
        )
        rank.tasks = [*pumps, waiter]

    async def _wait_exit(
        self,
        rank: Rank,
        proc: TrainerProcess,
        incarnation: int,
        pumps: list[asyncio.Task[None]],
    ) -> None:
        code = await proc.wait()
        # Nothing lost at exit; but a process it left behind may hold the pipe open.
        _, pending = await asyncio.wait(pumps, timeout=PUMP_DRAIN_S)
        for task in pending:
            task.cancel()
        self.facts.put_nowait(RankExited(incarnation, rank.index, code))

    async def _ticker(self) -> None:
        interval = self.config.tick_interval_s
        while True:
            await asyncio.sleep(interval)
            self.facts.put_nowait(Tick())

    async def _stop_all(self, why: str) -> None:
        """SIGTERM every rank's group and every process the trainers left behind; the grace
        period; SIGKILL what is left; wait until all of it is gone."""
        running = [r for r in self.ranks if r.running]
        # A trainer being forked ahead of time is ours before its pid is known: not a leftover.
        await self.starter.settle()
        spare = self.starter.infrastructure_pids()
        deadline = time.monotonic() + self.config.grace_s
        termed: set[int] = set()  # processes sent SIGTERM already: one each, not a second
        if running:
            pids = ", ".join(str(r.proc.pid) for r in running if r.proc is not None)
            who = "the trainer" if self.nproc == 1 else f"{len(running)} local rank(s)"
            log.warning("stopping %s (pid %s): %s", who, pids, why)
            for r in running:
                assert r.proc is not None
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(r.proc.pid, signal.SIGTERM)
            # Their whole trees: helpers that left the group (setsid) get the same grace.
            groups = {r.proc.pid for r in running if r.proc is not None}
            for p in await find_leftovers(spare):
                with contextlib.suppress(Exception):
                    if os.getpgid(p.pid) not in groups:  # (killpg signalled those)
                        p.send_signal(signal.SIGTERM)
                    termed.add(p.pid)
            ended = asyncio.gather(*(r.proc.wait() for r in running if r.proc is not None))
            hurry: asyncio.Future[Any] = asyncio.ensure_future(self._hurry.wait())
            await asyncio.wait(
                [ended, hurry], timeout=self.config.grace_s, return_when=asyncio.FIRST_COMPLETED
            )
            hurry.cancel()
            if not ended.done():
                if not self._hurry.is_set():
                    log.warning("trainer ignored SIGTERM for %gs; SIGKILL", self.config.grace_s)
                for r in running:
                    if r.proc is not None and r.proc.returncode is None:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(r.proc.pid, signal.SIGKILL)
                await ended
        # What stays of the ranks' groups (children forked in them) is ours to wait for: the
        # agent is their subreaper. Never by bare pgid: a finished rank's pid may be reused.
        if self._hurry.is_set():
            deadline = time.monotonic()
        groups = {r.proc.pid for r in self.ranks if r.proc is not None}
        await wait_groups_gone(groups, spare, deadline)
        await end_leftovers(spare, max(0.0, deadline - time.monotonic()), termed)
        for r in self.ranks:
            for task in r.tasks:
                if task.done() or task is asyncio.current_task():
                    continue
                task.cancel()
            r.close_logs()

    # --- output -----------------------------------------------------------------------------------

    def _open_logs(self, rank: Rank, attempt: int) -> None:
        logs = self.config.logs
        if logs.wants_files and not self.run_dir:
            base = logs.log_dir or tempfile.mkdtemp(prefix="marduk_logs_")
            o = self.opts
            # One directory per run, as torchrun makes: the last run's logs stay.
            os.makedirs(base, exist_ok=True)
            self.run_dir = tempfile.mkdtemp(prefix=f"{o.job}_{o.replica}_{o.worker}_", dir=base)
            log.info("rank logs under %s", self.run_dir)
        rank.open_logs(logs, self.run_dir, attempt)

    async def _pump(self, rank: Rank, stream: asyncio.StreamReader | None, which: Std) -> None:
        """Pass a rank's output through line by line (prefixed, teed, redirected); keep the
        tail; parse steps."""
        if stream is None:
            return
        logs = self.config.logs
        console = sys.stdout.buffer if which == Std.OUT else sys.stderr.buffer
        show = logs.to_console(rank.index, which)
        prefix = logs.prefix(self.placed, rank.index) if self.placed is not None else b""
        file = rank.files[0 if which == Std.OUT else 1] if rank.files else None
        at_start = True  # of a line: a long line's later pieces get no prefix
        while True:
            line = await read_output(stream)
            if not line:
                return
            if show:
                console.write(prefix + line if at_start else line)
                console.flush()
            at_start = line.endswith(b"\n")
            if file is not None and not file.closed:
                file.write(line)
                file.flush()
            text = line.decode(errors="replace").rstrip()
            rank.tail.append(text)
            m = self.step_re.search(text)
            if m:
                with contextlib.suppress(ValueError, IndexError):
                    self._progress(rank.index, int(m.group(1)))

    def _progress(self, rank: int, step: int | None) -> None:
        if self.core.progress(rank, step, time.monotonic()):
            self._stepped(rank)

    def _stepped(self, rank: int) -> None:
        self._first_step_seconds.observe(time.monotonic() - self.core.ranks[rank].started_at)
        self.starter.stepped(rank)
        if rank == 0 and self.launch is not None and self.nproc > 1 and self.launch.nnodes == 1:
            # Rank 0 hosts the rendezvous store at MASTER_PORT (torch's env://): from the next
            # restart on, the other ranks start once it listens, instead of trying it too early
            # and backing off for up to a second.
            self._master_first = listening(self.master_port)

    async def _wait_for_master(self) -> None:
        deadline = time.monotonic() + MASTER_WAIT_S
        while not listening(self.master_port):
            if time.monotonic() > deadline:
                log.info("rank 0 did not listen on MASTER_PORT within %gs", MASTER_WAIT_S)
                self._master_first = False
                return
            await asyncio.sleep(0.002)

    # --- the trainers' library (the trainer channel) ---------------------------------------------

    async def _on_trainer(self, rank: int, msg: messages.ToAgent) -> None:
        now = time.monotonic()
        match msg:
            case messages.Hello(peer_notices=True):
                self._ask_for_peer_notices()
            case messages.Step(step=step):
                self._progress(rank, step)
            case messages.Heartbeat():
                self._progress(rank, None)
            case messages.Checkpointed(step=step):
                log.info("trainer saved the checkpoint asked for at step %d", step)
                await self._report("checkpointed", summary=f"checkpoint saved at step {step}")
            case messages.Section(name=name, open=open_, timeout=timeout):
                if self.core.section(rank, name, open_, timeout, now):
                    self._stepped(rank)

    async def _forward(self, cmd: Command) -> None:
        """Tell the trainers' libraries (those connected) why they are about to be stopped."""
        for channel in self.channels:
            await channel.forward(cmd.to_wire())

    async def _status_loop(self) -> None:
        """Report progress (last step and when) while the trainers run."""
        while True:
            await asyncio.sleep(self.config.status_interval_s)
            stepped = [r for r in self.core.ranks if r.step is not None]
            if any(r.running for r in self.ranks) and stepped:
                age = time.monotonic() - min(r.step_at for r in stepped)
                await self._report("running", step_at=time.time() - age)

    # --- between incarnations ---------------------------------------------------------------------

    async def _preflight(self, after: str) -> bool:
        """Check the devices in a fresh process before restarting onto them (when enabled).

        False: a device is broken; it was reported (gave_up, failure class ``preflight``) and
        the agent exits 71 so the pod goes back to the scheduler instead of restarting into it.
        """
        if not self.config.preflight:
            return True
        t0 = time.monotonic()
        ok, lines = await run_check(
            self._trainer_env(), self.config.preflight_expect, self.config.preflight_timeout_s
        )
        took = time.monotonic() - t0
        self.stats["preflight.ok" if ok else "preflight.failed"] += 1
        if ok:
            log.info("device check after %s passed in %.2fs", after, took)
            return True
        failed = [x for x in lines if x.startswith("PREFLIGHT FAIL")] or lines[-3:]
        log.error("device check after %s failed in %.2fs: %s", after, took, " | ".join(failed))
        await self._report(
            "gave_up",
            failure_class="preflight",
            action="check_device",
            summary=f"device check failed after {after}",
            lines=[x[:4000] for x in failed[-20:]],
        )
        return False

    async def _cleanup(self) -> None:
        """Between incarnations: remove stale lockfiles, run the user's cleanup command, wait
        for the GPUs' memory to be released."""
        c = self.config
        await between_incarnations(
            c.stale_files,
            c.cleanup_cmd,
            self.opts.devices,
            reclaim_timeout_s=c.reclaim_timeout_s,
            reclaim_tolerance_mib=c.reclaim_tolerance_mib,
        )

    # --- reports ----------------------------------------------------------------------------------

    async def _report_failure(
        self, status: str, failure: str, decision: Restart | GiveUp
    ) -> int | None:
        """Report a crash or hang; return the epoch the controller says to restart at (None:
        no controller answered)."""
        rc = decision.returncode
        code, sig = describe_returncode(rc) if rc is not None else (None, "")
        d = self._diagnose(decision.rank)
        where = f"exit code {code}" if code is not None else (sig or "killed")
        who = "trainer" if self.nproc == 1 else f"local rank {decision.rank}"
        log.error(
            "%s %s (%s)%s", who, failure, where, f": {d.failure_class} - {d.summary}" if d else ""
        )
        tail = list(self.ranks[decision.rank].tail) if decision.rank is not None else []
        summary = d.summary if d else (decision.why if failure == "hung" else "")
        reply = await self._report(
            status,  # type: ignore[arg-type]
            exit_code=code,
            signal=sig,
            failure_class=d.failure_class if d else "",
            action=d.action if d else "",
            summary=summary,
            lines=list(d.lines) if d else tail[-5:],
        )
        if reply is None:
            return None
        return max([self.epoch, *(a.epoch for a in reply.actions)])

    async def _report(self, status: wire.ReportStatus, **fields: object) -> wire.ReportReply | None:
        """Report to the controller, when one is joined (None: no answer)."""
        o = self.opts
        report = wire.Report(
            job=o.job,
            replica=o.replica,
            worker=o.worker,
            status=status,
            epoch=self.epoch,
            incarnation=max(self.incarnation, 0),
            step=self.step,
            **fields,  # type: ignore[arg-type]
        )
        stopping = self._signalled.is_set()
        return await self.link.report(
            report, STOPPING_REPORT_TIMEOUT_S if stopping else REPORT_TIMEOUT_S
        )


def decision_why(decision: Decision) -> str:
    if isinstance(decision, Finish):
        return "every rank finished"
    return decision.why
