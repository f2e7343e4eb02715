"""The local ranks' processes: each one started and watched (its output pumped, its exit
waited for and queued as a fact), and all of them stopped together: SIGTERM to every rank's
process group and to every process the trainers left behind (agent/supervise/proctree.py), the
grace period, SIGKILL, then wait until all of it is gone."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from agent.supervise.launch import LaunchSpec, Std
from agent.supervise.output import RankOutput
from agent.supervise.ports import CoordinatorFirst, MasterFirst
from agent.supervise.proctree import end_leftovers, find_leftovers, wait_groups_gone
from agent.supervise.rank_facts import Fact, Rank, RankExited
from agent.supervise.signals import Signals
from agent.supervise.starter import Starter
from agent.supervise.zygote import TrainerProcess

log = logging.getLogger("agent.supervisor")

PUMP_DRAIN_S = 0.5  # after a rank exits: its output still in the pipe (a leftover may hold it)

Spawn = Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]]


class RankProcesses:
    """Watches and stops the ranks' current processes."""

    def __init__(
        self,
        ranks: Sequence[Rank],
        starter: Starter,
        output: RankOutput,
        facts: asyncio.Queue[Fact],
        spawn: Spawn,
        *,
        grace_s: float,
        signals: Signals,
    ) -> None:
        self.ranks = ranks
        self._starter = starter
        self._output = output
        self._facts = facts
        self._spawn = spawn
        self._grace_s = grace_s
        self._signals = signals  # the first cuts starting short; a second, the grace period
        self._hurry = signals.hurry

    def any_running(self) -> bool:
        return any(r.running for r in self.ranks)

    async def start_each(
        self,
        incarnation: int,
        base: dict[str, str],
        env_of: Callable[[Rank], dict[str, str]],
        placed: LaunchSpec | None,
        master: MasterFirst,
        coordinator: CoordinatorFirst,
    ) -> bool:
        """Start every rank (``base``: the environment the fork server imports with) and
        watch it. False: a signal came first; the ranks not started yet are not."""
        if coordinator.wanted and await self._signals.or_signal(coordinator.wait()) is None:
            log.warning("%s while waiting for the coordinator: not starting", self._signals.name)
            return False
        for rank in self.ranks:
            rank.tail.clear()
            self._output.open_logs(rank, incarnation)
            try:
                proc = await self._signals.or_signal(
                    self._starter.start(
                        rank.index, env_of(rank), first=incarnation == 0, base_env=base
                    )
                )
            except OSError:
                await self.stop_all("a local rank could not start")
                raise
            if proc is None:
                log.warning(
                    "%s while starting the trainers: not starting the rest", self._signals.name
                )
                return False
            rank.proc = proc
            prefix = self._output.logs.prefix(placed, rank.index) if placed is not None else b""
            self.watch(rank, incarnation, prefix)
            if rank.index == 0 and master.wanted:
                await master.wait()
        return True

    def watch(self, rank: Rank, incarnation: int, prefix: bytes) -> None:
        """Pump the rank's output (lines prefixed with ``prefix``); queue its exit."""
        proc = rank.proc
        assert proc is not None
        pump = self._output.pump
        pumps = [
            self._spawn(pump(rank, proc.stdout, Std.OUT, prefix), f"rank{rank.index}-stdout"),
            self._spawn(pump(rank, proc.stderr, Std.ERR, prefix), f"rank{rank.index}-stderr"),
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
        self._facts.put_nowait(RankExited(incarnation, rank.index, code))

    async def stop_all(self, why: str | None, grace_s: float | None = None) -> None:
        """SIGTERM every rank's group and every process the trainers left behind; the grace
        period; SIGKILL what is left; wait until all of it is gone. ``why``: for the log
        line (None: the caller said it); ``grace_s``: the grace period (None: ``--grace``; a
        restart's is shorter, ``Grace`` in agent/supervise/supervision.py)."""
        grace = self._grace_s if grace_s is None else grace_s
        running = [r for r in self.ranks if r.running]
        # A trainer being forked ahead of time is ours before its pid is known: not a leftover.
        await self._starter.settle()
        spare = self._starter.infrastructure_pids()
        deadline = time.monotonic() + grace
        termed: set[int] = set()  # processes sent SIGTERM already: one each, not a second
        if running:
            await self._terminate(running, spare, termed, why, grace)
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

    async def _terminate(
        self, running: list[Rank], spare: set[int], termed: set[int], why: str | None, grace: float
    ) -> None:
        """SIGTERM the running ranks and their trees; SIGKILL them after ``grace``."""
        pids = ", ".join(str(r.proc.pid) for r in running if r.proc is not None)
        who = "the trainer" if len(self.ranks) == 1 else f"{len(running)} local rank(s)"
        if why is None:
            log.info("stopping %s (pid %s)", who, pids)
        else:
            log.warning("stopping %s (pid %s): %s", who, pids, why)
        for r in running:
            assert r.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.proc.pid, signal.SIGTERM)
                # A stopped trainer (SIGSTOP, a frozen process: hung) holds the SIGTERM
                # pending until it runs again: without this it gets SIGKILL after the grace.
                os.killpg(r.proc.pid, signal.SIGCONT)
        # Their whole trees: helpers that left the group (setsid) get the same grace.
        groups = {r.proc.pid for r in running if r.proc is not None}
        for p in await find_leftovers(spare):
            with contextlib.suppress(Exception):
                if os.getpgid(p.pid) not in groups:  # (killpg signalled those)
                    p.send_signal(signal.SIGTERM)
                termed.add(p.pid)
        ended = asyncio.gather(*(r.proc.wait() for r in running if r.proc is not None))
        hurry: asyncio.Future[Any] = asyncio.ensure_future(self._hurry.wait())
        await asyncio.wait([ended, hurry], timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        hurry.cancel()
        if not ended.done():
            hurried = self._hurry.is_set()  # a second signal: said so already
            if grace < self._grace_s and not hurried:  # a restart's: JAX takes the SIGTERM
                log.info("trainer still running %gs after SIGTERM for a restart; SIGKILL", grace)
            elif not hurried:
                log.warning("trainer ignored SIGTERM for %gs; SIGKILL", grace)
            for r in running:
                if r.proc is not None and r.proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(r.proc.pid, signal.SIGKILL)
            await ended
