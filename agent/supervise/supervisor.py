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
  local rank restarts at the command's epoch, once per epoch, after ``restart_grace_s`` at most
  (a trainer whose SIGTERM JAX's preemption service takes waits for peers that are stopping);
* past ``max_restarts`` local failures within ``restart_window_s``, or on a ``fail`` command,
  it reports that it gives up and exits non-zero so the scheduler replaces the pod;
* every local rank exited 0: exit 0;
* SIGTERM/SIGINT (eviction, preemption): SIGTERM to the ranks, the grace period to
  checkpoint, ``preempted``, exit.

Stopping an incarnation is SIGTERM to every rank's process group and to every process its trainers
left behind (agent/supervise/proctree.py: the agent is their subreaper), the grace the core gives
the decision to finish (``Grace``: ``restart_grace_s`` when the scope restarts at a new epoch,
its other processes stopping at the same moment; ``grace_s`` for everything else), then SIGKILL.
With no controller reachable (or ``--standalone``) the same rules run locally and the agent keeps
trying to join the controller in the background (agent/supervise/controller_link.py).

Exit codes: see ``ExitCode``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shlex
import tempfile
import time
from collections import Counter
from collections.abc import Coroutine, Iterator
from typing import Any

import msgspec
from prometheus_client.core import Metric

from agent.channel import messages
from agent.library.client import AsyncClient, Command
from agent.library.params import merge_rank_acks
from agent.supervise import placement
from agent.supervise.before_first_start import (
    give_up_unhealthy,
    join_controller,
    warn_about_setup,
)
from agent.supervise.between_incarnations import BetweenIncarnations
from agent.supervise.controller_link import ControllerLink
from agent.supervise.launch import LaunchSpec
from agent.supervise.local_ckpt import LocalCkpt, Persister
from agent.supervise.output import RankOutput
from agent.supervise.ports import CoordinatorFirst, MasterFirst, port_for_incarnation
from agent.supervise.proctree import end_leftovers
from agent.supervise.rank_facts import CommandArrived, Fact, Joined, Preempted, Rank, Tick, decide
from agent.supervise.rank_processes import RankProcesses
from agent.supervise.reports import Reporter, restart_for_others
from agent.supervise.signals import CANCEL_WAIT_S, Signals
from agent.supervise.start_checks import CheckSpec, NodeHealth
from agent.supervise.start_choice import StartMode
from agent.supervise.starter import Starter, prestarted_command
from agent.supervise.supervision import (
    Decision,
    ExitCode,
    Finish,
    Forward,
    GiveUp,
    Grace,
    Ignore,
    Limits,
    Restart,
    Supervision,
)
from agent.supervise.supervisor_config import SupervisorConfig, default_preload
from agent.supervise.telemetry import Telemetry, gauges, readiness
from agent.supervise.trainer_channel import TrainerChannels
from agent.supervise.trainer_env import rank_env, trainer_env
from agent.supervise.trainer_requests import TrainerRequests
from marduk.aio import TaskSet
from marduk.errors import MardukError
from marduk.shell.metrics import MetricsServer, Probes

__all__ = [
    "CANCEL_WAIT_S",
    "ExitCode",
    "Supervisor",
    "SupervisorConfig",
    "default_preload",
    "prestarted_command",
]

log = logging.getLogger("agent.supervisor")
# A warm trainer's MARDUK_WARM_START, as the log says where it came from.
STARTED_FROM = {"zygote": "the zygote", "standby": "a prestarted trainer"}


class Supervisor:
    """Wires the parts of ``marduk agent run`` together and runs its loop: the core decides,
    ``RankProcesses`` watches and stops the ranks, ``RankOutput`` pumps their output,
    ``Reporter`` tells the controller, ``Telemetry`` counts, ``Signals`` cuts work short."""

    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self.opts = o = config.opts
        self.launch = config.launch
        nproc = self.launch.nproc_per_node if self.launch is not None else 1
        self.core = Supervision(
            Limits(
                max_restarts=config.max_restarts,
                restart_window_s=config.restart_window_s,
                hang_timeout_s=config.hang_timeout_s,
                startup_timeout_s=config.startup_timeout_s,
                learning=config.learning,
            ),
            nproc,
            epoch=o.epoch,
        )
        self.grace = Grace(full_s=config.grace_s, restart_s=config.restart_grace_s)
        self.facts: asyncio.Queue[Fact] = asyncio.Queue()
        self.stats: Counter[str] = Counter()
        self._tasks = TaskSet(self._task_failed, prefix="marduk-agent-")
        self.signals = Signals(lambda name: self.facts.put_nowait(Preempted(name)))
        self.starter = Starter(
            config.cmd,
            nproc=nproc,
            prespawn=config.prespawn,
            fork_server=config.fork_server,
            preload=config.preload,
            fork_server_timeout_s=config.fork_server_timeout_s,
            stats=self.stats,
            spawn=self._spawn,
            numactl=config.numactl,
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
        if self.launch is not None and self.launch.from_controller and o.rendezvous is not None:
            # Its fork server will import the framework while it waits for its place: the
            # controller grows a job with it only once that is done (docs/decisions.md #17).
            warms = self.starter.mode() is StartMode.ZYGOTE
            o.rendezvous = msgspec.structs.replace(o.rendezvous, ready=not warms)
        self.channels = TrainerChannels()  # each rank's library (agent/channel/messages.py)
        # Each local rank's last word on the live parameters: rank -> (version, rejected).
        self._params_acks: dict[int, tuple[int, dict[str, str]]] = {}
        # Where this node's ranks sit at the current incarnation (the controller's membership
        # with --nnodes MIN:MAX; else the launch spec as given).
        self.placed: LaunchSpec | None = config.launch
        self._telling_warm: asyncio.Task[None] | None = None  # ``_tell_warm``, once
        launch = self.launch
        self.master = MasterFirst(launch is not None and nproc > 1 and launch.nnodes == 1)
        self._newest_command = o.epoch  # the highest epoch a command that stops ranks named
        self.coordinator = CoordinatorFirst(
            launch is not None, stopping_s=config.grace_s, superseded=self._superseded
        )
        self.telemetry = Telemetry(self.stats, self._gauges)
        self.link = ControllerLink(
            o,
            on_command=self._on_command,
            registry=self.telemetry.registry,
            join_interval_s=config.join_interval_s,
            spawn=self._spawn,
        )
        # Live parameters (decisions.md #20): forwarded to the trainers, acknowledged for them.
        self.link.on_params = self._params_changed
        run_prefix = f"{o.job}_{o.replica}_{o.worker}_"
        self.output = RankOutput(config.logs, config.step_regex, run_prefix, self._progress)
        self.procs = RankProcesses(
            self.ranks,
            self.starter,
            self.output,
            self.facts,
            self._spawn,
            grace_s=config.grace_s,
            signals=self.signals,
        )
        self.reporter = Reporter(o, self.link, self.core, self.ranks, self.signals.signalled.is_set)
        self.health = NodeHealth(config.checks or CheckSpec(), o, self.link, self.stats)
        self.between = BetweenIncarnations(
            config, o.devices, self.stats, self.reporter.report, self.health
        )
        self.ckpt = LocalCkpt.configured(config, o.job, o.replica, o.worker)  # local_ckpt.py
        self.persister: Persister | None = None
        self._saved: set[int] = set()  # the ranks that said they saved at the last notice

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

    # --- top level --------------------------------------------------------------------------------

    async def run(self) -> int:
        self.signals.install(asyncio.get_running_loop())
        warn_about_setup(self.config, self.nproc)
        unhealthy = await self.signals.or_signal(self.health.check("before the first start"))
        if unhealthy and self.health.kept_out:
            await self.health.mark(unhealthy)  # registered so: it takes no rank
        joined = await join_controller(
            self.config, self.link, self.core, self.signals, self.reporter.report, self._joined
        )
        if joined is not None:
            return joined
        if unhealthy:
            if not self.health.kept_out:  # nobody can take its place: the pod goes elsewhere
                return await give_up_unhealthy(self.link, self.reporter.report, unhealthy)
            self._spawn(self.health.recheck(), "node-recheck")
        metrics = None
        if self.config.metrics_addr:
            metrics = MetricsServer(
                self.config.metrics_addr, Probes(self.telemetry.registry, self._ready)
            )
            try:
                await metrics.start()
            except MardukError as e:
                log.error("%s", e)
                await self.link.close(deregister=False)
                return ExitCode.SETUP
        if not self.ckpt.open():
            self.ckpt = LocalCkpt(None)
        elif self.ckpt.persist_dir is not None:
            self.persister = Persister(self.ckpt, self.stats)
        paths = [r.socket_path for r in self.ranks]
        await self.channels.open(paths, self._on_trainer, lambda: self.epoch, self.stats)
        self.channels.hand_params(self.link.params)
        requests = TrainerRequests(self.core, lambda: self.link.client, self.stats, self._spawn)
        self.channels.hand_requests(requests.answer)
        background = [
            self._spawn(self.reporter.progress_loop(self.config.status_interval_s), "status"),
            self._spawn(self._ticker(), "ticker"),
        ]
        if self.persister is not None:
            background.append(self._spawn(self.persister.run(), "persist"))
        code: int | None = None
        try:
            code = await self._loop()
            return code
        finally:
            for task in background:
                task.cancel()
            await self.procs.stop_all("the agent is exiting")
            self.channels.close()
            with contextlib.suppress(OSError):
                os.rmdir(self.socket_dir)
            await self.starter.close()
            await end_leftovers(set(), 1.0)
            await self.link.close(deregister=False)
            if metrics is not None:
                await metrics.stop()
            if code is not None:
                self.ckpt.remove_if_done(code)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """A named background task whose failure is logged and counted, not lost."""
        return self._tasks.spawn(coro, name)

    def _task_failed(self, task: asyncio.Task[Any], e: BaseException) -> None:
        self.stats["errors.task"] += 1
        log.error("background task %s failed: %s: %s", task.get_name(), type(e).__name__, e)

    async def _joined(self, client: AsyncClient) -> None:
        """Standalone until now: the controller's epochs apply from the next restart on."""
        self.facts.put_nowait(Joined(client.epoch, list(client.unusable_devices)))
        if self.procs.any_running():
            await self.reporter.report("running")
        if self.opts.peer_notices and not client.opts.peer_notices:
            self._ask_for_peer_notices()

    def _on_command(self, command: Command) -> None:
        if command.is_notice:
            # Another replica fails: nothing to restart here; the trainers' libraries decide
            # (a torchft group abandons its step). At once, not behind the supervision loop.
            self._spawn(self._forward(command), "notice")
            return
        if command.kind != "checkpoint":
            self._newest_command = max(self._newest_command, command.epoch)
        self.facts.put_nowait(CommandArrived(command))

    def _superseded(self) -> bool:
        """A command newer than the epoch the ranks are starting at arrived: they are stopped
        as soon as they start, so no wait before starting them is worth it."""
        return self._newest_command > self.epoch

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
        return readiness(
            [r.running for r in self.ranks],
            [i for i, r in enumerate(self.core.ranks) if not r.progress_at],
            incarnation=self.incarnation,
            epoch=self.epoch,
            step=self.core.step,
        )

    def _gauges(self) -> Iterator[Metric]:
        lag = self.persister.lag(time.time()) if self.persister is not None else None
        return gauges(sum(r.running for r in self.ranks), self.epoch, self.incarnation, lag)

    # --- the loop: start every rank, wait for a decision, apply it --------------------------------

    async def _loop(self) -> int:
        while True:
            if self.signals.signalled.is_set():  # came while stopping or between incarnations
                code = await self._apply(self.core.preempted(self.signals.name), None)
                assert code is not None
                return code
            try:
                started = await self._start_all()
            except OSError as e:
                log.error("cannot start the trainer %s: %s", shlex.join(self.config.cmd), e)
                await self.reporter.report("gave_up", summary=f"cannot start: {e}")
                return ExitCode.SETUP
            if not started and not self.procs.any_running():
                # A signal before any rank started (waiting for this node's place): what
                # happened is a stop, reported as one; no tick may read it as a hang.
                self.core.stopped()
                continue
            decision, command = await self._supervise()
            self._saved.clear()
            if command is not None:
                await self._forward(command)  # the libraries learn why they are stopped
            answered = await self._tell_the_others(decision)
            if self.ckpt.on and (command is not None or (answered and answered[0])):
                await self._wait_saved()
            # Why the trainers stop is said once: by the stop's line, or (a give-up) before
            # it, at its level, the stop then only naming the processes.
            said = self.procs.any_running()
            grace_s = self.grace.of(decision, answered[0] if answered else None, self.epoch)
            if said and isinstance(decision, GiveUp):
                self.reporter.say_end(decision, stopping=True)
                await self.procs.stop_all(None, grace_s)
            else:
                await self.procs.stop_all(decision.why, grace_s)
            self.core.stopped()
            self.telemetry.trainers_ended(time.monotonic())
            code = await self._apply(decision, command, answered, said=said)
            if code is not None:
                return code
            await self.signals.or_signal(self.between.cleanup())

    async def _supervise(self) -> tuple[Decision, Command | None]:
        """Feed the core what happens until it decides something the ranks must stop for."""
        while True:
            fact = await self.facts.get()
            decision = decide(self.core, fact, time.monotonic())
            command = fact.command if isinstance(fact, CommandArrived) else None
            if command is not None and isinstance(decision, Forward):
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
        answered = await self.reporter.failure(decision.failure, decision.failure, decision)
        if answered is not None and answered > self.epoch:
            restart = restart_for_others(
                self.opts,
                answered,
                decision,
                command_id=f"local-{os.getpid()}-{self.incarnation}",
                issued_at=time.time(),
            )
            await self.channels.forward(restart)
        return (answered,)

    async def _apply(
        self,
        decision: Decision,
        command: Command | None,
        answered: tuple[int | None] | None = None,
        *,
        said: bool = False,
    ) -> int | None:
        """Report the decision and prepare the restart; an exit code ends the agent.
        ``answered``: the failure was reported already (``_tell_the_others``); ``said``: the
        decision's reason was logged already (as the trainers were stopped)."""
        if isinstance(decision, Finish | GiveUp):
            return await self.reporter.ended(decision, command, said=said)
        assert isinstance(decision, Restart)
        if decision.failure is None:
            assert command is not None
            if not said:
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
        diagnosis = self.reporter.diagnose(decision.rank)
        what = diagnosis.failure_class if diagnosis else "unclassified"
        self.stats[f"restarts.{decision.failure}/{what}"] += 1
        if answered is None:
            answered = (await self.reporter.failure(decision.failure, decision.failure, decision),)
        self.core.restart_epoch(answered[0])
        device_class = diagnosis is not None and diagnosis.action == "check_device"
        if device_class and not await self._preflight(what):
            return ExitCode.DEVICE_FAILED
        return None

    # --- one incarnation of every rank ------------------------------------------------------------

    def _trainer_env(self) -> dict[str, str]:
        """What every rank's trainer gets (and the fork server imports with)."""
        return trainer_env(
            self.opts,
            epoch=self.epoch,
            incarnation=self.incarnation,
            launch=self.launch,
            environ=os.environ,
            supervisor_pid=os.getpid(),
            local_ckpt=self.ckpt.handoff(),
        )

    async def _placement(self) -> LaunchSpec:
        """This node's place at the epoch it starts at: the controller's membership (waited
        for; a newer one moves the epoch up to its command's)."""
        assert self.launch is not None
        epoch, m, me = await placement.membership_for(
            lambda: self.link.client, self.opts, self.epoch, self.link.move
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

    async def _tell_warm(self) -> None:
        """Register again, ``ready``, once the fork server can fork this node's trainers at
        once (or gave up: they start cold)."""
        if self.opts.rendezvous is None or self.opts.rendezvous.ready:
            return
        warm = await self.starter.warmed()
        r = self.opts.rendezvous
        if r is None or r.ready:
            return
        # Ready either way: a node whose fork server failed starts its trainers cold (the
        # starter said why), not never.
        self.opts.rendezvous = msgspec.structs.replace(r, ready=True)
        client = self.link.client
        if warm:
            log.info("the fork server is ready: this node can start its trainers at once")
        if client is not None:
            client.opts.rendezvous = self.opts.rendezvous
            await client.reregister()

    async def _start_all(self) -> bool:
        """Start every rank (True once all are). A signal meanwhile: the ranks not started
        yet are not (the loop then stops those that are)."""
        if self.launch is not None and self.launch.from_controller:
            # The fork server imports the framework while this node waits for its place (a
            # spare may wait for hours): its first trainers are then forked, as a restart's are.
            self.starter.warm_up(self._trainer_env())
            if self._telling_warm is None:  # one task, whatever the restarts meanwhile
                self._telling_warm = self._spawn(self._tell_warm(), "warm")
            placed = await self.signals.or_signal(self._placement())
            if placed is None:
                log.warning("%s before this node had its ranks: not starting", self.signals.name)
                return False
            self.placed = placed
        incarnation = self.core.started(time.monotonic())
        if self.placed is not None:
            self.master.port = port_for_incarnation(self.placed, self.epoch)
            p = self.placed
            self.coordinator.placed(p.nnodes, p.node_rank, p.master_addr, self.master.port)
        base = self._trainer_env()
        if await self.procs.start_each(
            incarnation,
            base,
            functools.partial(self._rank_env, base),
            self.placed,
            self.master,
            self.coordinator,
        ):
            self._started(incarnation)
            return True
        return False

    def _rank_env(self, base: dict[str, str], rank: Rank) -> dict[str, str]:
        env = rank_env(
            base,
            rank=rank.index,
            socket_path=rank.socket_path,
            placed=self.placed,
            devices=self.opts.devices,
            incarnation=self.incarnation,
            master_port=self.master.port,
        )
        numa = self.config.numa
        return {**env, **numa[rank.index].env()} if numa else env

    def _started(self, incarnation: int) -> None:
        self.telemetry.trainers_started(time.monotonic())
        self.stats["trainer_starts"] += self.nproc
        for rank in self.ranks:
            by = self.starter.slots[rank.index].started_by
            if by:
                self.stats[f"trainer_starts.{by}"] += 1
        by = self.starter.slots[0].started_by
        pids = ", ".join(str(r.proc.pid) for r in self.ranks if r.proc is not None)
        log.info(
            "trainer%s started: pid%s %s, epoch %d, incarnation %d%s",
            "" if self.nproc == 1 else "s",
            "" if self.nproc == 1 else "s",
            pids,
            self.epoch,
            incarnation,
            f" (pre-spawned), from {STARTED_FROM.get(by, by)}" if by else "",
        )
        # In the background: the loop must see crashes and signals while the controller
        # answers (5 s at most when it is gone but NATS is not).
        self._spawn(self.reporter.running(), "report-running")

    async def _ticker(self) -> None:
        interval = self.config.tick_interval_s
        while True:
            await asyncio.sleep(interval)
            self.facts.put_nowait(Tick())

    # --- progress: step lines, and the trainers' library (the trainer channel) --------------

    def _progress(self, rank: int, step: int | None) -> None:
        if self.core.progress(rank, step, time.monotonic()):
            self._stepped(rank)

    def _stepped(self, rank: int) -> None:
        self.telemetry.first_step_seconds.observe(
            time.monotonic() - self.core.ranks[rank].started_at
        )
        self.starter.stepped(rank)
        self.master.stepped(rank)
        if self.coordinator.should_learn(rank):
            self._spawn(self.coordinator.learn(), "coordinator-probe")

    async def _on_trainer(self, rank: int, msg: messages.ToAgent) -> None:
        now = time.monotonic()
        match msg:
            case messages.TrainerHello(peer_notices=True):
                self._ask_for_peer_notices()
            case messages.Step(step=step):
                self._progress(rank, step)
            case messages.Heartbeat():
                self._progress(rank, None)
            case messages.Checkpointed(step=step):
                log.info("trainer saved the checkpoint asked for at step %d", step)
                await self.reporter.report(
                    "checkpointed", summary=f"checkpoint saved at step {step}"
                )
            case messages.Section(name=name, open=open_, timeout=timeout):
                if self.core.section(rank, name, open_, timeout, now):
                    self._stepped(rank)
            case messages.Perf(summary=summary):
                # Relayed under our own registration's names: the trainer cannot speak for
                # another worker (docs/protocol.md, *Performance summaries*).
                client = self.link.client
                if client is not None:
                    o = client.opts
                    summary = msgspec.structs.replace(
                        summary, job=o.job, replica=o.replica, worker=o.worker
                    )
                    self._spawn(_ignore(client.publish_perf(summary)), "perf")
            case messages.SavedAtNotice(step=step):
                self._saved.add(rank)
                log.info("rank %d saved its last snapshot at the notice (step %s)", rank, step)
            case messages.ParamsApplied(version=version, rejected=rejected):
                # One registration for all local ranks: the worker runs the lowest version
                # any of them does, and the controller hears each rank's word.
                self._params_acks[rank] = (version, dict(rejected))
                if self.nproc == 1:
                    await self.link.params_applied(version, rejected)
                    return
                await self.link.params_applied(*merge_rank_acks(self._params_acks, self.nproc))

    def _params_changed(self, _view: object) -> None:
        params = self.link.params()
        if params is not None:
            self._spawn(self.channels.forward_params(params), "forward-params")

    async def _wait_saved(self) -> None:
        """After a notice, until each running rank whose library is connected said it wrote
        its last snapshot (``SavedAtNotice``), at most ``--local-ckpt-flush`` (and a little
        for the message): then the stop (agent/library/snapshots.py)."""
        deadline = time.monotonic() + self.ckpt.flush_s + 0.2
        connected = self.channels.connected()
        while time.monotonic() < deadline:
            waiting = [
                i
                for i, r in enumerate(self.ranks)
                if r.running and connected[i] and i not in self._saved
            ]
            if not waiting:
                return
            await asyncio.sleep(0.005)
        self.stats["snapshots.notice_timeouts"] += 1
        log.warning("trainer(s) did not save within %gs of the notice", self.ckpt.flush_s)

    async def _forward(self, cmd: Command) -> None:
        """Tell the trainers' libraries (those connected) why they are about to be stopped."""
        await self.channels.forward(cmd.to_wire())

    async def _preflight(self, after: str) -> bool:
        return await self.between.preflight(self._trainer_env(), after)


async def _ignore(coro: Coroutine[Any, Any, object]) -> None:
    await coro
