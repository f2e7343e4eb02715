"""How ``marduk agent run`` starts its trainers: cold, forked from the fork server, or from a
prestarted trainer — for each local rank.

One fork server (agent/supervise/zygote.py) per agent serves every local rank: each rank's next
trainer is forked ahead of time and waits for its environment (``RANK``, ``LOCAL_RANK``, the epoch,
...), given at activation. Where forking is unsafe or impossible, each rank keeps one prestarted
trainer (agent/supervise/prestarted.py), its own process started with its own environment.
Commands that are not ``python SCRIPT`` or ``python -m MODULE`` start cold.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import signal
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agent.channel import handoff
from agent.supervise import numa
from agent.supervise.start_choice import StartFacts, StartMode, choose, needs_import_check
from agent.supervise.zygote import ForkedProcess, TrainerProcess, Zygote, ZygoteError, ZygoteUnsafe
from marduk.transport.children import die_with_parent

log = logging.getLogger("agent.supervisor")

IMPORT_CHECK_TIMEOUT_S = 60.0
SETTLE_TIMEOUT_S = 10.0  # at most, for a fork or a prestarted trainer's start in flight
T = TypeVar("T")
PREFORK_AFTER_S = 1.0  # at the latest, after a start forked from the zygote: fork the next one


def prestarted_command(cmd: list[str], preload: list[str]) -> list[str] | None:
    """``cmd`` (``python SCRIPT ...`` or ``python -m MODULE ...``) run as a prestarted trainer, or
    None when ``cmd`` is not a plain Python trainer (then it is started directly)."""
    if len(cmd) < 2 or not os.path.basename(cmd[0]).startswith("python"):
        return None
    rest = cmd[1:]
    if (rest[0] == "-m" and len(rest) >= 2) or not rest[0].startswith("-"):
        return [
            cmd[0],
            "-m",
            "agent.supervise.prestarted",
            "--preload",
            ",".join(preload),
            "--",
            *rest,
        ]
    return None


async def exec_trainer(
    cmd: list[str], env: dict[str, str], *, stdin: bool
) -> asyncio.subprocess.Process:
    """``cmd`` in a session of its own (its process group is its pid), its output piped; bound
    to the CPUs ``env`` names (``--numa-bind``: agent/supervise/numa.py), if any."""
    return await asyncio.create_subprocess_exec(
        *cmd,
        stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
        start_new_session=True,  # its own process group, apart from ours and a prestarted one's
        preexec_fn=functools.partial(_in_child, env.get(numa.CPUS_ENV)),
    )


def _in_child(cpus: str | None) -> None:
    """Between fork and exec: die with the agent; bind to ``cpus`` (a no-op under numactl,
    which binds to the same CPUs after the exec). None of them allowed here (a cpuset that
    excludes the node): the trainer runs unbound rather than not at all."""
    die_with_parent(signal.SIGKILL)
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, numa.parse_cpulist(cpus))


def cold_command(cmd: list[str], env: dict[str, str], numactl: str | None) -> list[str]:
    """What a rank started cold runs: ``cmd``, under numactl when its binding names a node
    and numactl is installed (``--numa-bind``)."""
    node = env.get(numa.NODE_ENV)
    if numactl is None or node is None:
        return cmd
    binding = numa.Binding(int(node), numa.parse_cpulist(env.get(numa.CPUS_ENV, "")))
    return numa.numactl_command(cmd, numactl, binding)


@dataclass(slots=True)
class RankSlot:
    """The warm-start state of one local rank: its next trainer, ready or being made."""

    first_step: asyncio.Event = field(default_factory=asyncio.Event)
    forked: ForkedProcess | None = None  # the next trainer, forked ahead of time
    prefork_task: asyncio.Task[None] | None = None  # waits, then starts ``forking``
    forking: asyncio.Task[None] | None = None
    prestarted: asyncio.subprocess.Process | None = None
    prestarted_task: asyncio.Task[None] | None = None  # starts the next prestarted or zygote
    # How its current trainer started: its MARDUK_WARM_START, "zygote" or "standby" (prestarted;
    # the value trainers read, handoff.WarmStart), or "" (cold).
    started_by: str = ""


class Starter:
    """Starts the trainers of ``nproc`` local ranks, warm where it can."""

    def __init__(
        self,
        cmd: list[str],
        *,
        nproc: int,
        prespawn: bool,
        fork_server: bool,
        preload: list[str],
        fork_server_timeout_s: float,
        stats: Counter[str],
        spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]],
        numactl: str | None = None,
    ) -> None:
        self.cmd = cmd
        self.numactl = numactl  # cold starts run under it, bound (agent/supervise/numa.py)
        self.preload = preload
        self.fork_server_timeout_s = fork_server_timeout_s
        self.stats = stats
        self._spawn = spawn  # named, guarded background tasks (the supervisor's)
        self.prestarted_cmd = prestarted_command(cmd, preload)
        # The facts the start mode is chosen from (agent/supervise/start_choice.py); failures change
        # them.
        self.facts = StartFacts(
            prespawn=prespawn,
            python_command=self.prestarted_cmd is not None,
            fork_server=fork_server,
            has_pidfd=hasattr(os, "pidfd_open"),
        )
        self._chosen: tuple[StartMode, str] | None = None
        self.slots = [RankSlot() for _ in range(nproc)]
        self.zygote: Zygote | None = None
        self._zygote_task: asyncio.Task[None] | None = None
        self._warming: asyncio.Task[None] | None = None  # warm_up's fork server start
        self._warm_env: dict[str, str] = {}  # the environment it imports in
        self._dropping = asyncio.Lock()  # a failed fork server is dropped (and said) once
        # Processes of ours being made (a fork, a prestarted trainer's or the zygote's exec):
        # their pids are not known yet, so a sweep of leftovers must wait for them (``settle``).
        self._in_flight: set[asyncio.Future[Any]] = set()

    def infrastructure_pids(self) -> set[int]:
        """Processes of ours that are not trainers: the zygote, forked and prestarted trainers
        waiting (a sweep of leftover processes spares them and what they fork)."""
        pids = set()
        if self.zygote is not None and self.zygote.proc.returncode is None:
            pids.add(self.zygote.proc.pid)
        for s in self.slots:
            if s.forked is not None and s.forked.waiting:
                pids.add(s.forked.pid)
            if s.prestarted is not None and s.prestarted.returncode is None:
                pids.add(s.prestarted.pid)
        return pids

    async def start(
        self, rank: int, env: dict[str, str], *, first: bool, base_env: dict[str, str]
    ) -> TrainerProcess:
        """Rank ``rank``'s trainer, running with ``env``. ``first``: the job's first start;
        ``base_env``: the environment the fork server imports in (no rank's variables)."""
        slot = self.slots[rank]
        env = {k: v for k, v in env.items() if k != handoff.WARM_START}  # set by what starts it
        if needs_import_check(self.facts):
            await self._check_warm_starts(env)
        mode = self.mode()
        if mode is StartMode.COLD:
            slot.started_by = ""
            return await exec_trainer(cold_command(self.cmd, env, self.numactl), env, stdin=False)
        slot.first_step.clear()
        if mode is StartMode.ZYGOTE:
            proc = await self._fork(rank, env, first, base_env)
        else:
            proc = await self._activate_prestarted(rank, env)
        if self.mode() is StartMode.PRESTARTED:  # (forking turned out unsafe just now, or is off)
            # The next one starts once this trainer has made its first step (or after a
            # minute): importing a framework meanwhile would slow the restart it waits for.
            self._prepare(rank, self._prepare_prestarted(rank, env))
        return proc

    def warm_up(self, base_env: dict[str, str]) -> None:
        """Start the fork server now, before any trainer is asked for: an agent that waits for
        its place (a spare, or a worker waiting for its job's membership) then forks its first
        trainers at once instead of waiting for the framework's import on the way to its first
        step. ``base_env`` as for ``start``; a second call, or a cold start mode, does nothing."""
        if self._warming is None and self.zygote is None:
            self._warm_env = base_env
            self._warming = self._spawn(self._warm(base_env), "fork-server-warm-up")

    async def warmed(self) -> bool:
        """Until the fork server ``warm_up`` started can fork a trainer at once: it has imported
        the framework (True), or failed, or stayed silent for ``fork_server_timeout_s`` (False:
        the trainers start cold; a failure is said at once, in one line). At once, False, if
        there is none."""
        if self._warming is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._warming)
        zygote = self.zygote
        if zygote is None:
            return False
        try:
            await zygote.wait_ready(self.fork_server_timeout_s)
        except ZygoteUnsafe:
            return False  # the first start finds out, and uses a prestarted trainer
        except ZygoteError as e:
            async with self._dropping:
                if self.zygote is not zygote:
                    return False  # a start met the failure first, and said so
                await self._drop_failed_zygote(self._warm_env)
            if self.facts.imports_agent:  # else the import check said why, and where
                log.warning(
                    "the fork server (%s) failed: %s; the trainers start cold", self.cmd[0], e
                )
            return False
        return True

    async def _drop_failed_zygote(self, env: dict[str, str]) -> None:
        """The fork server failed: count it, stop it, and (once) check whether the trainer's
        python can import the agent package at all (if not, every start is cold)."""
        self._learn(zygote_failures=self.facts.zygote_failures + 1)
        await self._discard_zygote()
        await self._check_warm_starts(env)

    async def _warm(self, env: dict[str, str]) -> None:
        if needs_import_check(self.facts):
            await self._check_warm_starts(env)
        if self.mode() is StartMode.ZYGOTE and self.zygote is None:
            # Shielded: cancelled mid-exec (the agent stops), the process must not be orphaned.
            await asyncio.shield(self._install_zygote(env))

    def mode(self) -> StartMode:
        """How the next trainer starts (logged when the choice or its reason changes)."""
        chosen = choose(self.facts)
        if chosen != self._chosen:
            log.debug("trainers start %s: %s", chosen[0].value, chosen[1])
            self._chosen = chosen
        return chosen[0]

    def _learn(self, **facts: Any) -> None:
        self.facts = dataclasses.replace(self.facts, **facts)

    async def settle(self, timeout: float = SETTLE_TIMEOUT_S) -> None:
        """Until no process of ours is being made (each is then in ``infrastructure_pids``)."""
        if self._in_flight:
            await asyncio.wait(list(self._in_flight), timeout=timeout)

    async def _made(self, coro: Coroutine[Any, Any, T]) -> T:
        """``await coro``, known to ``settle`` meanwhile."""
        work = asyncio.ensure_future(coro)
        self._in_flight.add(work)
        work.add_done_callback(self._in_flight.discard)
        return await work

    def stepped(self, rank: int) -> None:
        self.slots[rank].first_step.set()

    async def close(self) -> None:
        """Stop every waiting trainer and the zygote (not the running trainers)."""
        if self._warming is not None:  # a fork server being started: it is ours to stop too
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._warming), SETTLE_TIMEOUT_S)
        for rank in range(len(self.slots)):
            await self._discard_prestarted(rank)
        await self._discard_zygote()

    # --- the fork server --------------------------------------------------------------------------

    async def _fork(
        self, rank: int, env: dict[str, str], first: bool, base_env: dict[str, str]
    ) -> TrainerProcess:
        """The trainer forked by the zygote (started first if there is none): the one forked
        ahead of time, else a fresh fork. If neither can be had, the trainer starts cold (or
        from a prestarted trainer, where forking is unsafe) and a new zygote starts once it has
        stepped."""
        slot = self.slots[rank]
        if self.zygote is None and first and rank == 0:
            # The first trainers wait for the zygote's import, as they would wait for their
            # own (or for the rest of it, if warm_up began it); every later start, the first
            # fault's included, is a fork.
            if self._warming is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self._warming)
            if self.zygote is None:
                self.zygote = await self._start_zygote(base_env)
        try:
            proc = await self._take_forked(rank)
            await proc.activate({**env, handoff.WARM_START: "zygote"})
        except (ZygoteError, OSError) as e:  # OSError: no pidfd (Linux < 5.3), no descriptors
            # One failure per fork server, not per rank: the ranks after the first of this
            # start find none running (it was discarded) and start cold without counting.
            async with self._dropping:  # once per fork server, whoever meets its failure
                if self.zygote is not None:
                    await self._drop_failed_zygote(env)
            if isinstance(e, ZygoteUnsafe):
                log.error("cannot fork trainers: %s; using a prestarted trainer instead", e)
                self._learn(fork_unsafe=True)
                return await self._activate_prestarted(rank, env)
            if self.facts.imports_agent is not False:  # else the import check said it all
                log.warning("fork server: %s; starting the trainer cold", e)
            self.stats["fork_server.failures"] += 1
            slot.started_by = ""
            cold = await exec_trainer(self.cmd, env, stdin=False)
            if self.mode() is StartMode.ZYGOTE and self._zygote_task is None:
                self._zygote_task = self._spawn(self._prepare_zygote(rank, base_env), "zygote")
            return cold
        self._learn(zygote_failures=0)
        slot.started_by = "zygote"
        # The next one is forked once this one has stepped (or after PREFORK_AFTER_S): forking
        # meanwhile would slow a restart (8 workers on 2 cores: 130 -> 280 ms). A fault before
        # that forks one directly. At the job's start, now: that start waits for imports
        # anyway, and a job's first step is when a bad device or a bug often shows.
        slot.prefork_task = self._spawn(
            self._prefork_later(rank, 0.0 if first else None), f"rank{rank}-prefork-later"
        )
        return proc

    async def _prefork_later(self, rank: int, after: float | None) -> None:
        slot = self.slots[rank]
        if after is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(slot.first_step.wait(), PREFORK_AFTER_S)
        slot.forking = self._spawn(self._prefork(rank), f"rank{rank}-prefork")

    async def _take_forked(self, rank: int) -> ForkedProcess:
        slot = self.slots[rank]
        if slot.prefork_task is not None:
            slot.prefork_task.cancel()
        if slot.forking is not None:  # one being forked: wait for it rather than fork two
            with contextlib.suppress(Exception):
                await asyncio.shield(slot.forking)
        proc, slot.forked = slot.forked, None
        if proc is not None and proc.waiting:
            return proc
        if proc is not None:
            await proc.discard()
        zygote = self.zygote
        if zygote is None or not zygote.alive:
            raise ZygoteError("the fork server is not running")
        await zygote.wait_ready(self.fork_server_timeout_s)
        return await zygote.fork()

    async def _prefork(self, rank: int) -> None:
        slot = self.slots[rank]
        zygote = self.zygote
        if zygote is None or not zygote.alive or slot.forked is not None:
            return
        try:
            forked = await self._made(zygote.fork())
        except (ZygoteError, OSError) as e:  # the next start finds out again, and falls back
            log.warning("fork server: %s", e)
            return
        if slot.forked is None:
            slot.forked = forked
        else:
            await forked.discard()

    async def _start_zygote(self, env: dict[str, str]) -> Zygote | None:
        python, *target = self.cmd
        try:
            zygote = await self._made(Zygote.start(python, target, self.preload, env))
        except OSError as e:
            log.warning("cannot start the fork server: %s", e)
            self._learn(zygote_failures=self.facts.zygote_failures + 1)
            return None
        log.info(
            "fork server started: pid %d, preloading %s",
            zygote.proc.pid,
            ",".join(self.preload) or "nothing",
        )
        return zygote

    async def _prepare_zygote(self, rank: int, env: dict[str, str]) -> None:
        """A new zygote, once the trainer started cold has stepped (or after a minute)."""
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.slots[rank].first_step.wait(), 60.0)
            # Shielded: a restart that cancels this task mid-exec must not orphan the process.
            await asyncio.shield(self._install_zygote(env))
        finally:
            self._zygote_task = None

    async def _install_zygote(self, env: dict[str, str]) -> None:
        zygote = await self._start_zygote(env)
        if self.zygote is None:
            self.zygote = zygote
        elif zygote is not None:  # a start raced this one
            await zygote.close()

    async def _discard_zygote(self) -> None:
        """Stop the zygote and the trainers it forked ahead of time (not the running ones)."""
        for slot in self.slots:
            if slot.prefork_task is not None:
                slot.prefork_task.cancel()
            if slot.forking is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(slot.forking)
        zygote, self.zygote = self.zygote, None
        for slot in self.slots:
            forked, slot.forked = slot.forked, None
            if forked is not None:
                await forked.discard()
        if zygote is not None:
            await zygote.close()

    async def _check_warm_starts(self, env: dict[str, str]) -> None:
        """Once: can the trainer's python import ``agent`` (the fork server and a prestarted
        trainer run in it)? If not (``-- python train.py`` with a python from another environment),
        every start is cold: a warm start would die before the trainer runs, and that death
        would count as the trainer's crash."""
        if self.facts.imports_agent is not None:
            return
        try:
            check = await asyncio.create_subprocess_exec(
                self.cmd[0],
                "-c",
                "import agent.supervise.prestarted, agent.supervise.zygote",
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                env=env,
            )
            _, err = await asyncio.wait_for(check.communicate(), IMPORT_CHECK_TIMEOUT_S)
            imports = check.returncode == 0
        except (OSError, TimeoutError) as e:
            err, imports = str(e).encode(), False
        self._learn(imports_agent=imports)
        if not imports:
            last = (err.decode(errors="replace").strip().splitlines() or ["?"])[-1]
            log.warning(
                "%s cannot import marduk's agent package (%s): starting every trainer cold "
                "(install marduk in that environment for warm restarts)",
                self.cmd[0],
                last,
            )
            self.stats["warm_starts.unavailable"] += 1

    # --- prestarted trainers ----------------------------------------------------------------------

    def _prepare(self, rank: int, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` (the start of the rank's next prestarted trainer) instead of any pending
        one."""
        slot = self.slots[rank]
        if slot.prestarted_task is not None:
            slot.prestarted_task.cancel()
        slot.prestarted_task = self._spawn(coro, f"rank{rank}-prestarted")

    async def _activate_prestarted(self, rank: int, env: dict[str, str]) -> TrainerProcess:
        assert self.prestarted_cmd is not None
        slot = self.slots[rank]
        if slot.prestarted_task is not None:
            slot.prestarted_task.cancel()
        proc, slot.prestarted = slot.prestarted, None
        if proc is None or proc.returncode is not None:
            proc = await exec_trainer(self.prestarted_cmd, env, stdin=True)
        # The rank's whole environment, not only the MARDUK_* variables that change (epoch,
        # restart count): torchrun's (TORCHELASTIC_RESTART_COUNT, a new MASTER_PORT) change too.
        # MARDUK_WARM_START says "standby" for a prestarted trainer: the value trainers read.
        order = {"env": {**env, handoff.WARM_START: "standby"}}
        assert proc.stdin is not None
        try:
            proc.stdin.write(json.dumps(order).encode() + b"\n")
            await proc.stdin.drain()
            proc.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            log.warning("the prestarted trainer died; starting one directly")
            slot.started_by = ""
            return await exec_trainer(cold_command(self.cmd, env, self.numactl), env, stdin=False)
        slot.started_by = "standby"
        return proc

    async def _prepare_prestarted(self, rank: int, env: dict[str, str]) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.slots[rank].first_step.wait(), 60.0)
        # Shielded: a restart that cancels this task mid-exec must not orphan the process.
        await asyncio.shield(self._start_prestarted(rank, env))

    async def _start_prestarted(self, rank: int, env: dict[str, str]) -> None:
        assert self.prestarted_cmd is not None
        slot = self.slots[rank]
        proc = await self._made(exec_trainer(self.prestarted_cmd, env, stdin=True))
        if slot.prestarted is None:
            slot.prestarted = proc
        else:  # a restart started its own meanwhile
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()

    async def _discard_prestarted(self, rank: int) -> None:
        slot = self.slots[rank]
        if slot.prestarted_task is not None:
            slot.prestarted_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await slot.prestarted_task
        proc, slot.prestarted = slot.prestarted, None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
