"""``marduk agent run``: the pod's main process. Spawns the trainer, watches it, restarts it.

The pod survives when the trainer dies: this process registers the worker's devices with the
controller itself (so the registration outlives trainer restarts), runs the trainer in its own
process group, passes its output through line by line, and

* on a crash (exit code or signal) or a hang (no step for ``hang_timeout_s``; before the first
  step, ``startup_timeout_s``) reports it with a diagnosis and restarts it at the epoch the
  controller answers with;
* on a ``restart`` command (a device failure, another worker's crash in scope ``job``) restarts
  it at the command's epoch, once per epoch;
* after ``max_restarts`` restarts caused by local failures within ``restart_window_s``, or on a
  ``fail`` command, reports that it gives up and exits non-zero so the scheduler replaces the pod;
* on SIGTERM/SIGINT (eviction, preemption) forwards SIGTERM to the trainer, gives it the grace
  period to checkpoint, reports ``preempted`` and exits.

Exit codes: see ``ExitCode``.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import json
import logging
import os
import re
import shlex
import signal
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from agent import handoff, local
from agent.client import AsyncClient, Command, Options
from agent.fencing import supersedes
from agent.handoff import Handoff
from agent.local import TrainerChannel
from agent.reclaim import wait_for_release
from agent.signatures import Diagnosis, diagnose
from agent.zygote import ForkedProcess, TrainerProcess, Zygote, ZygoteError, ZygoteUnsafe
from marduk import protocol as wire
from marduk.children import die_with_parent
from marduk.errors import MardukError
from marduk.metrics import MetricsServer, Probes, StatsCollector, gauge, histogram

log = logging.getLogger("agent.supervisor")

DEFAULT_STEP_REGEX = r"\bstep[\s:=#]+(\d+)"
ZYGOTE_RETRIES = 3
PREFORK_AFTER_S = 1.0  # at the latest, after a start forked from the zygote: fork the next one


class ExitCode(enum.IntEnum):
    OK = 0  # the trainer finished (exit 0)
    SETUP = 1  # could not register with the controller, or could not start the trainer
    GAVE_UP = 70  # restarted max_restarts times within the window: replace the pod
    DEVICE_FAILED = 71  # the controller sent `fail`: a device of this pod is bad
    # The controller sent `stop`. Never 0: a scheduler must not record a job stopped from
    # outside as finished (no controller path issues `stop` today; reserved for operators).
    STOPPED = 72
    PREEMPTED = 143  # SIGTERM/SIGINT (128 + 15): the trainer got the grace period


@dataclass(slots=True)
class SupervisorConfig:
    cmd: list[str]
    opts: Options
    max_restarts: int = 3
    restart_window_s: float = 3600.0
    hang_timeout_s: float = 600.0
    startup_timeout_s: float = 1800.0
    step_regex: str = DEFAULT_STEP_REGEX
    grace_s: float = 30.0
    tail_lines: int = 200
    cleanup_cmd: str = ""
    stale_files: list[str] = field(default_factory=lambda: ["/tmp/libtpu_lockfile"])
    # Start trainers warm, with these modules imported ahead of time: forked from a fork
    # server (agent/zygote.py) or, with fork_server off, from one standby process each.
    prespawn: bool = True
    preload: list[str] = field(default_factory=list)
    fork_server: bool = True
    # How long a trainer start waits for a fork server still importing before it starts cold.
    fork_server_timeout_s: float = 600.0
    # How often a running trainer's progress (last step and when) is reported.
    status_interval_s: float = 15.0
    # Serve /metrics, /healthz and /readyz (ready: the trainer is stepping) on HOST:PORT.
    metrics_addr: str | None = None
    # Before a restart after a device-class failure (a check_device diagnosis, or a restart
    # command naming devices), check the devices in a separate process (agent/preflight.py).
    preflight: bool = False
    preflight_timeout_s: float = 120.0
    preflight_expect: int | None = None  # devices the check must see (default: any)
    # Between incarnations, wait for the GPUs' memory to drop below this (0 s: don't wait).
    reclaim_timeout_s: float = 50.0
    reclaim_tolerance_mib: float = 512.0


@dataclass(slots=True)
class Exit:
    """Why one incarnation of the trainer ended."""

    reason: str  # exited | crashed | hung | command | signal
    returncode: int | None = None
    command: Command | None = None
    diagnosis: Diagnosis | None = None


def standby_command(cmd: list[str], preload: list[str]) -> list[str] | None:
    """The pre-spawn form of ``cmd`` (``python SCRIPT ...`` or ``python -m MODULE ...``), or
    None when ``cmd`` is not a plain Python trainer (then it is started directly)."""
    if len(cmd) < 2 or not os.path.basename(cmd[0]).startswith("python"):
        return None
    rest = cmd[1:]
    if (rest[0] == "-m" and len(rest) >= 2) or not rest[0].startswith("-"):
        return [cmd[0], "-m", "agent.standby", "--preload", ",".join(preload), "--", *rest]
    return None


def default_preload() -> list[str]:
    """jax, when this interpreter has it: the import that dominates a JAX trainer's start."""
    import importlib.util

    return ["jax"] if importlib.util.find_spec("jax") is not None else []


def describe_returncode(code: int) -> tuple[int | None, str]:
    """(exit code, signal name) of an asyncio returncode (negative: killed by a signal)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return None, name
    return code, ""


class Supervisor:
    def __init__(self, config: SupervisorConfig) -> None:
        self.config = config
        self.opts = config.opts
        self.step_re = re.compile(config.step_regex)
        self.tail: deque[str] = deque(maxlen=config.tail_lines)
        self.commands: asyncio.Queue[Command] = asyncio.Queue()
        self.stop_signal: asyncio.Event = asyncio.Event()
        self.client: AsyncClient | None = None
        self.epoch = self.opts.epoch
        self.incarnation = -1  # the current trainer's; the first one is 0
        self.local_restarts: deque[float] = deque()
        self.step: int | None = None
        self.step_at = 0.0
        self.started_at = 0.0
        self.proc: TrainerProcess | None = None
        self.standby: asyncio.subprocess.Process | None = None
        self._standby_task: asyncio.Task[None] | None = None
        self.zygote: Zygote | None = None
        self.forked: ForkedProcess | None = None  # the next trainer, forked ahead of time
        self._prefork_task: asyncio.Task[None] | None = None  # waits, then starts _forking
        self._forking: asyncio.Task[None] | None = None
        self._zygote_failures = 0  # in a row; past ZYGOTE_RETRIES the standby is used instead
        self.started_by = ""  # how the current trainer started: zygote, standby or "" (cold)
        self._first_step = asyncio.Event()
        self.progress_at = 0.0  # monotonic time of the last step or heartbeat; 0: none yet
        self.sections: dict[str, tuple[float, float | None]] = {}
        # A private directory (0700, made race-free by mkdtemp) holds the trainer's socket: no
        # other user can connect to it, or guess and squat its path.
        self.socket_dir = tempfile.mkdtemp(
            prefix="marduk-agent-", dir=os.environ.get("XDG_RUNTIME_DIR") or None
        )
        self.socket_path = os.path.join(self.socket_dir, "agent.sock")
        self.channel: TrainerChannel | None = None  # the trainer's library (agent/local.py)
        self.standby_cmd = standby_command(config.cmd, config.preload) if config.prespawn else None
        self.stats: Counter[str] = Counter()
        self.registry = CollectorRegistry()
        self.registry.register(StatsCollector(self.stats, self._gauges))
        self._restart_seconds = histogram(
            self.registry,
            "marduk_agent_restart_seconds",
            "From a trainer's end (crash, hang, command) to the next trainer running.",
        )
        self._first_step_seconds = histogram(
            self.registry,
            "marduk_agent_time_to_first_step_seconds",
            "From a trainer's start to its first step (or heartbeat).",
        )
        self._ended_at: float | None = None

    # --- top level -------------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_signal.set)
        self.client = AsyncClient(
            self.opts, on_command=self.commands.put_nowait, deliver=lambda _c: None
        )
        try:
            await self.client.start()
        except MardukError as e:
            log.error("cannot register with the controller: %s", e)
            return ExitCode.SETUP
        self.epoch = max(self.epoch, self.client.epoch)
        if self.client.unusable_devices:
            # Quarantined or drained by the controller: running here cannot help; the pod goes
            # back to the scheduler (a node the device is not on).
            log.error(
                "device(s) %s out of service (quarantined or drained); not starting the trainer",
                ", ".join(self.client.unusable_devices),
            )
            await self._report("gave_up", summary="devices out of service")
            await self.client.close(deregister=True, reason="devices out of service")
            return ExitCode.DEVICE_FAILED
        # The library client's counters (commands, dropped forgeries, ...) are exported too.
        self.registry.register(StatsCollector(self.client.stats, lambda: []))
        metrics = None
        if self.config.metrics_addr:
            metrics = MetricsServer(self.config.metrics_addr, Probes(self.registry, self._ready))
            try:
                await metrics.start()
            except MardukError as e:
                log.error("%s", e)
                await self.client.close(deregister=False)
                return ExitCode.SETUP
        self.channel = TrainerChannel(
            self.socket_path, self._on_trainer, epoch=lambda: self.epoch, stats=self.stats
        )
        await self.channel.start()
        status = asyncio.create_task(self._status_loop())
        try:
            return await self._loop()
        finally:
            status.cancel()
            self.channel.close()
            with contextlib.suppress(OSError):
                os.rmdir(self.socket_dir)
            await self._discard_standby()
            await self.client.close(deregister=False)
            if metrics is not None:
                await metrics.stop()

    def _ready(self) -> tuple[bool, str]:
        if self.proc is None or self.proc.returncode is not None:
            return False, "no trainer running"
        if not self._first_step.is_set():
            return False, f"trainer (incarnation {self.incarnation}) has not stepped yet"
        return True, f"trainer stepping (epoch {self.epoch}, step {self.step})"

    def _gauges(self) -> Iterator[Metric]:
        running = float(self.proc is not None and self.proc.returncode is None)
        yield gauge(
            "marduk_agent_trainer_running",
            "1 while a trainer runs.",
            {"trainer": running},
            "process",
        )
        yield gauge(
            "marduk_agent_epoch",
            "The epoch the trainer runs at.",
            {"current": float(self.epoch)},
            "epoch",
        )
        yield gauge(
            "marduk_agent_incarnation",
            "Trainer starts so far (0: the first).",
            {"current": float(max(self.incarnation, 0))},
            "incarnation",
        )

    async def _loop(self) -> int:
        while True:
            try:
                await self._spawn()
            except OSError as e:
                log.error("cannot start the trainer %s: %s", shlex.join(self.config.cmd), e)
                await self._report("gave_up", summary=f"cannot start: {e}")
                return ExitCode.SETUP
            ended = await self._watch()
            self._ended_at = time.monotonic()
            if ended.reason == "exited":
                log.info("trainer finished (exit 0)")
                await self._report("exited", exit_code=0)
                assert self.client is not None
                await self.client.close(deregister=True, reason="trainer exited 0")
                return ExitCode.OK
            if ended.reason == "signal":
                await self._report("preempted", summary="SIGTERM to the agent")
                return ExitCode.PREEMPTED
            if ended.reason == "command":
                assert ended.command is not None
                cmd = ended.command
                if cmd.kind == "stop":
                    log.warning("stop command (epoch %d): %s", cmd.epoch, cmd.reason)
                    return ExitCode.STOPPED
                if cmd.kind == "fail":
                    log.error("fail command (epoch %d): %s; giving up", cmd.epoch, cmd.reason)
                    await self._report("gave_up", summary=f"fail command: {cmd.reason}")
                    return ExitCode.DEVICE_FAILED
                log.warning("restart command epoch %d: %s", cmd.epoch, cmd.reason)
                self.stats["restarts.command"] += 1
                self.epoch = cmd.epoch
                if self.client is not None:
                    await self.client.ack(cmd)
                if cmd.devices and not await self._preflight(f"device(s) {', '.join(cmd.devices)}"):
                    return ExitCode.DEVICE_FAILED
            else:  # crashed or hung: a local failure, counted against the budget
                if not self._within_budget():
                    log.error(
                        "restarted %d time%s within %gs; giving up",
                        self.config.max_restarts,
                        "" if self.config.max_restarts == 1 else "s",
                        self.config.restart_window_s,
                    )
                    await self._report_failure("gave_up", ended)
                    return ExitCode.GAVE_UP
                what = ended.diagnosis.failure_class if ended.diagnosis else "unclassified"
                self.stats[f"restarts.{ended.reason}/{what}"] += 1
                self.epoch = await self._report_failure(ended.reason, ended)
                device_class = (
                    ended.diagnosis is not None and ended.diagnosis.action == "check_device"
                )
                if device_class and not await self._preflight(what):
                    return ExitCode.DEVICE_FAILED
            await self._cleanup()

    async def _preflight(self, after: str) -> bool:
        """Check the devices in a fresh process before restarting onto them (when enabled).

        False: a device is broken; it was reported (gave_up, failure class ``preflight``) and
        the agent exits 71 so the pod goes back to the scheduler instead of restarting into it.
        """
        if not self.config.preflight:
            return True
        cmd = [sys.executable, "-m", "agent.preflight"]
        if self.config.preflight_expect:
            cmd += ["--expect", str(self.config.preflight_expect)]
        t0 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, **self._trainer_env()},
            start_new_session=True,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), self.config.preflight_timeout_s)
            ok, lines = proc.returncode == 0, out.decode(errors="replace").splitlines()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            ok, lines = (
                False,
                [f"PREFLIGHT FAIL no answer within {self.config.preflight_timeout_s:g}s"],
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

    def _within_budget(self) -> bool:
        now = time.monotonic()
        window = self.config.restart_window_s
        while self.local_restarts and now - self.local_restarts[0] > window:
            self.local_restarts.popleft()
        if len(self.local_restarts) >= self.config.max_restarts:
            return False
        self.local_restarts.append(now)
        return True

    # --- one incarnation -------------------------------------------------------------------------

    async def _spawn(self) -> None:
        self.incarnation += 1
        env = self._trainer_env()
        env.pop(handoff.WARM_START, None)  # set by the zygote or standby that starts it
        if self.standby_cmd is None:
            self.proc, self.started_by = await self._exec(self.config.cmd, env, stdin=False), ""
        else:
            self._first_step.clear()
            if self._fork_server_wanted():
                self.proc = await self._fork(env)
            else:
                self.proc = await self._activate_standby(env)
            if not self._fork_server_wanted():  # (or forking turned out unsafe just now)
                # The next one starts once this trainer has made its first step (or after a
                # minute): importing a framework meanwhile would slow the restart it waits for.
                self._prepare(self._prepare_standby(env))
        self.started_at = time.monotonic()
        self.stats["trainer_starts"] += 1
        if self.started_by:
            self.stats[f"trainer_starts.{self.started_by}"] += 1
        if self._ended_at is not None:
            self._restart_seconds.observe(self.started_at - self._ended_at)
            self._ended_at = None
        self.step, self.step_at, self.progress_at = None, 0.0, 0.0
        self.sections.clear()
        self.tail.clear()
        log.info(
            "trainer started: pid %d, epoch %d, incarnation %d%s",
            self.proc.pid,
            self.epoch,
            self.incarnation,
            f" (pre-spawned), from the {self.started_by}" if self.started_by else "",
        )
        await self._report("running")

    def _fork_server_wanted(self) -> bool:
        return (
            self.config.fork_server
            and self._zygote_failures < ZYGOTE_RETRIES
            and hasattr(os, "pidfd_open")
        )

    async def _fork(self, env: dict[str, str]) -> TrainerProcess:
        """The trainer forked by the zygote (started first if there is none): the one forked
        ahead of time, else a fresh fork. If neither can be had, the trainer starts cold (or
        from a standby, where forking is unsafe) and a new zygote starts once it has stepped."""
        if self.zygote is None and self.incarnation == 0:
            # The first trainer waits for the zygote's import, as it would wait for its own;
            # every later start, the first fault's included, is a fork.
            self.zygote = await self._start_zygote(env)
        try:
            proc = await self._take_forked()
            await proc.activate({**env, handoff.WARM_START: "zygote"})
        except (ZygoteError, OSError) as e:  # OSError: no pidfd (Linux < 5.3), no descriptors
            self._zygote_failures += 1
            await self._discard_zygote()
            if isinstance(e, ZygoteUnsafe):
                log.error("cannot fork trainers: %s; using a standby process instead", e)
                self._zygote_failures = ZYGOTE_RETRIES
                return await self._activate_standby(env)
            log.warning("fork server: %s; starting the trainer cold", e)
            self.stats["fork_server.failures"] += 1
            self.started_by = ""
            cold = await self._exec(self.config.cmd, env, stdin=False)
            if self._fork_server_wanted():
                self._prepare(self._prepare_zygote(env))
            return cold
        self._zygote_failures = 0
        self.started_by = "zygote"
        # The next one is forked once this one has stepped (or after PREFORK_AFTER_S): forking
        # meanwhile would slow a restart (8 workers on 2 cores: 130 -> 280 ms). A fault before
        # that forks one directly. At the job's start, now: that start waits for imports
        # anyway, and a job's first step is when a bad device or a bug often shows.
        first = self.incarnation == 0
        self._prefork_task = asyncio.create_task(self._prefork_later(0.0 if first else None))
        return proc

    async def _prefork_later(self, after: float | None) -> None:
        if after is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._first_step.wait(), PREFORK_AFTER_S)
        self._forking = asyncio.create_task(self._prefork())

    async def _take_forked(self) -> ForkedProcess:
        if self._prefork_task is not None:
            self._prefork_task.cancel()
        if self._forking is not None:  # one being forked: wait for it rather than fork two
            with contextlib.suppress(Exception):
                await asyncio.shield(self._forking)
        proc, self.forked = self.forked, None
        if proc is not None and proc.waiting:
            return proc
        if proc is not None:
            await proc.discard()
        zygote = self.zygote
        if zygote is None or not zygote.alive:
            raise ZygoteError("the fork server is not running")
        await zygote.wait_ready(self.config.fork_server_timeout_s)
        return await zygote.fork()

    async def _prefork(self) -> None:
        zygote = self.zygote
        if zygote is None or not zygote.alive or self.forked is not None:
            return
        try:
            forked = await zygote.fork()
        except (ZygoteError, OSError) as e:  # the next start finds out again, and falls back
            log.warning("fork server: %s", e)
            return
        if self.forked is None:
            self.forked = forked
        else:
            await forked.discard()

    async def _start_zygote(self, env: dict[str, str]) -> Zygote | None:
        python, *target = self.config.cmd
        try:
            zygote = await Zygote.start(python, target, self.config.preload, env)
        except OSError as e:
            log.warning("cannot start the fork server: %s", e)
            return None
        log.info(
            "fork server started: pid %d, preloading %s",
            zygote.proc.pid,
            ",".join(self.config.preload) or "nothing",
        )
        return zygote

    def _prepare(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` (the next standby's or zygote's start) instead of any pending one."""
        if self._standby_task is not None:
            self._standby_task.cancel()
        self._standby_task = asyncio.create_task(coro)

    async def _prepare_zygote(self, env: dict[str, str]) -> None:
        """A new zygote, once the trainer started cold has stepped (or after a minute)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._first_step.wait(), 60.0)
        # Shielded: a restart that cancels this task mid-exec must not orphan the process.
        await asyncio.shield(self._install_zygote(env))

    async def _install_zygote(self, env: dict[str, str]) -> None:
        zygote = await self._start_zygote(env)
        if self.zygote is None:
            self.zygote = zygote
        elif zygote is not None:  # a start raced this one
            await zygote.close()

    async def _discard_zygote(self) -> None:
        """Stop the zygote and the trainer it forked ahead of time (not the running one)."""
        if self._prefork_task is not None:
            self._prefork_task.cancel()
        if self._forking is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._forking)
        zygote, self.zygote = self.zygote, None
        forked, self.forked = self.forked, None
        if forked is not None:
            await forked.discard()
        if zygote is not None:
            await zygote.close()

    async def _activate_standby(self, env: dict[str, str]) -> asyncio.subprocess.Process:
        assert self.standby_cmd is not None
        if self._standby_task is not None:
            self._standby_task.cancel()
        proc, self.standby = self.standby, None
        if proc is None or proc.returncode is not None:
            proc = await self._exec(self.standby_cmd, env, stdin=True)
        order = {"env": handoff.warm_start_env(env, "standby")}
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(order).encode() + b"\n")
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            log.warning("the pre-spawned trainer died; starting one directly")
            self.started_by = ""
            return await self._exec(self.config.cmd, env, stdin=False)
        self.started_by = "standby"
        return proc

    async def _prepare_standby(self, env: dict[str, str]) -> None:
        assert self.standby_cmd is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._first_step.wait(), 60.0)
        # Shielded: a restart that cancels this task mid-exec must not orphan the process.
        await asyncio.shield(self._start_standby(env))

    async def _start_standby(self, env: dict[str, str]) -> None:
        assert self.standby_cmd is not None
        proc = await self._exec(self.standby_cmd, env, stdin=True)
        if self.standby is None:
            self.standby = proc
        else:  # a restart started its own meanwhile
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()

    async def _discard_standby(self) -> None:
        if self._standby_task is not None:
            self._standby_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._standby_task
        await self._discard_zygote()
        proc, self.standby = self.standby, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()

    async def _exec(
        self, cmd: list[str], env: dict[str, str], *, stdin: bool
    ) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *cmd,
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            start_new_session=True,  # its own process group, apart from ours and the standby's
            preexec_fn=functools.partial(die_with_parent, signal.SIGKILL),
        )

    def _trainer_env(self) -> dict[str, str]:
        o = self.opts
        given = Handoff(
            job=o.job,
            replica=o.replica,
            worker=o.worker,
            epoch=self.epoch,
            restart_count=self.incarnation,
            devices=tuple(o.devices),
            scope=o.scope,
            addr=o.addr,
            supervisor_pid=os.getpid(),
            agent_socket=self.socket_path,
        )
        return {**os.environ, "PYTHONUNBUFFERED": "1", **given.to_env()}

    async def _watch(self) -> Exit:
        assert self.proc is not None
        proc = self.proc
        pumps = [
            asyncio.create_task(self._pump(proc.stdout, sys.stdout.buffer)),
            asyncio.create_task(self._pump(proc.stderr, sys.stderr.buffer)),
        ]
        waiter = asyncio.create_task(proc.wait())
        stop = asyncio.create_task(self.stop_signal.wait())
        hang = asyncio.create_task(self._hang_watch())
        try:
            while True:
                next_cmd = asyncio.create_task(self.commands.get())
                done, _ = await asyncio.wait(
                    {waiter, stop, hang, next_cmd}, return_when=asyncio.FIRST_COMPLETED
                )
                if next_cmd in done:
                    cmd = next_cmd.result()
                    if cmd.kind == "restart" and not supersedes(cmd.epoch, self.epoch):
                        continue  # this incarnation already runs at (or after) that epoch
                    if cmd.kind == "checkpoint":
                        # Save now, keep training: the trainer's library sees it; nothing stops.
                        log.warning("checkpoint requested (epoch %d): %s", cmd.epoch, cmd.reason)
                        await self._forward(cmd)
                        continue
                    await self._forward(cmd)
                    await self._terminate(f"{cmd.kind} command, epoch {cmd.epoch}")
                    return Exit("command", command=cmd)
                next_cmd.cancel()
                if waiter in done:
                    await asyncio.gather(*pumps)  # nothing lost at exit
                    code = proc.returncode
                    assert code is not None
                    if code == 0:
                        return Exit("exited", 0)
                    return Exit("crashed", code, diagnosis=diagnose(self.tail))
                if stop in done:
                    await self._terminate("SIGTERM to the agent (preemption or eviction)")
                    return Exit("signal")
                if hang in done:
                    await self._terminate(hang.result())
                    return Exit("hung", proc.returncode, diagnosis=diagnose(self.tail))
        finally:
            for t in (waiter, stop, hang, *pumps):
                t.cancel()

    # --- the trainer's library (agent/local.py) ---------------------------------------------------

    async def _on_trainer(self, msg: local.ToAgent) -> None:
        match msg:
            case local.Step(step=step):
                self._progress(step)
            case local.Heartbeat():
                self._progress(None)
            case local.Checkpointed(step=step):
                log.info("trainer saved the checkpoint asked for at step %d", step)
                await self._report("checkpointed", summary=f"checkpoint saved at step {step}")
            case local.Section(name=name, open=open_, timeout=timeout):
                if open_:
                    self.sections[name] = (time.monotonic(), timeout or None)
                else:
                    self.sections.pop(name, None)
                self._progress(None)

    async def _forward(self, cmd: Command) -> None:
        """Tell the trainer's library (if it connected) why it is about to be stopped."""
        if self.channel is not None:
            await self.channel.forward(cmd.to_wire())

    async def _status_loop(self) -> None:
        """Report progress (last step and when) while the trainer runs."""
        while True:
            await asyncio.sleep(self.config.status_interval_s)
            if self.proc is not None and self.proc.returncode is None and self.step is not None:
                age = time.monotonic() - self.step_at
                await self._report("running", step_at=time.time() - age)

    async def _pump(self, stream: asyncio.StreamReader | None, out: object) -> None:
        """Pass the trainer's output through line by line; keep the tail; parse steps."""
        if stream is None:
            return
        while True:
            line = await stream.readline()
            if not line:
                return
            out.write(line)  # type: ignore[attr-defined]
            out.flush()  # type: ignore[attr-defined]
            text = line.decode(errors="replace").rstrip()
            self.tail.append(text)
            m = self.step_re.search(text)
            if m:
                with contextlib.suppress(ValueError, IndexError):
                    self._progress(int(m.group(1)))

    def _progress(self, step: int | None) -> None:
        now = time.monotonic()
        if step is not None:
            self.step, self.step_at = step, now
        self.progress_at = now
        if not self._first_step.is_set():
            self._first_step_seconds.observe(now - self.started_at)
        self._first_step.set()

    async def _hang_watch(self) -> str:
        while True:
            await asyncio.sleep(min(1.0, self.config.hang_timeout_s / 4))
            now = time.monotonic()
            for name, (opened, timeout) in self.sections.items():
                if timeout is not None and now - opened > timeout:
                    return f"section {name!r} open for more than {timeout:g}s"
            if not self.progress_at:
                if now - self.started_at > self.config.startup_timeout_s:
                    return f"no first step within {self.config.startup_timeout_s:g}s"
            elif now - self.progress_at > self.config.hang_timeout_s:
                last = f"after {self.step} " if self.step is not None else ""
                return f"no step {last}for {self.config.hang_timeout_s:g}s"

    async def _terminate(self, why: str) -> None:
        """SIGTERM the trainer's process group, wait the grace period, SIGKILL, wait it out."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            await self._wait_group_gone()
            return
        log.warning("stopping the trainer (pid %d): %s", proc.pid, why)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.config.grace_s)
        except TimeoutError:
            log.warning("trainer ignored SIGTERM for %gs; SIGKILL", self.config.grace_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        await self._wait_group_gone()

    async def _wait_group_gone(self, timeout: float = 10.0) -> None:
        """Until no process of the trainer's group is left (children it forked included)."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            except PermissionError:
                return
            await asyncio.sleep(0.01)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)

    async def _cleanup(self) -> None:
        """Between incarnations: remove stale lockfiles, run the user's cleanup command, wait
        for the GPUs' memory to be released."""
        for path in self.config.stale_files:
            with contextlib.suppress(FileNotFoundError, PermissionError):
                await asyncio.to_thread(os.unlink, path)
                log.info("removed stale %s", path)
        if self.config.cleanup_cmd:
            proc = await asyncio.create_subprocess_shell(self.config.cleanup_cmd)
            try:
                code = await asyncio.wait_for(proc.wait(), 60)
            except TimeoutError:
                proc.kill()
                code = -9
            if code != 0:
                log.warning("cleanup command exited %s", code)
        if self.config.reclaim_timeout_s > 0:
            await wait_for_release(
                self.opts.devices,
                tolerance_mib=self.config.reclaim_tolerance_mib,
                timeout_s=self.config.reclaim_timeout_s,
            )

    # --- reports ---------------------------------------------------------------------------------

    async def _report_failure(self, status: str, ended: Exit) -> int:
        """Report a crash or hang; return the epoch to restart at (the controller's answer)."""
        code, sig = (
            describe_returncode(ended.returncode) if ended.returncode is not None else (None, "")
        )
        d = ended.diagnosis
        where = f"exit code {code}" if code is not None else (sig or "killed")
        log.error(
            "trainer %s (%s)%s", status, where, f": {d.failure_class} - {d.summary}" if d else ""
        )
        reply = await self._report(
            status,  # type: ignore[arg-type]
            exit_code=code,
            signal=sig,
            failure_class=d.failure_class if d else "",
            action=d.action if d else "",
            summary=d.summary if d else "",
            lines=list(d.lines) if d else list(self.tail)[-5:],
        )
        epochs = [a.epoch for a in reply.actions] if reply else []
        return max([self.epoch, *epochs])

    async def _report(self, status: wire.ReportStatus, **fields: object) -> wire.ReportReply | None:
        if self.client is None:
            return None
        o = self.opts
        report = wire.Report(
            job=o.job,
            replica=o.replica,
            worker=o.worker,
            status=status,
            epoch=self.epoch,
            incarnation=self.incarnation,
            step=self.step,
            **fields,  # type: ignore[arg-type]
        )
        try:
            return await self.client.report(report)
        except MardukError as e:
            log.warning("report %s not delivered: %s", status, e)
            return None
