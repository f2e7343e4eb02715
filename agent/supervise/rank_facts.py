"""What ``marduk agent run`` keeps of each local rank, and the facts its shell feeds to the
supervision core (agent/supervise/supervision.py): ``decide`` gives the core each one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import deque
from dataclasses import dataclass
from typing import IO

from agent.library.client import Command
from agent.supervise.launch import LogSpec, Std
from agent.supervise.supervision import Decision, Supervision
from agent.supervise.zygote import TrainerProcess

log = logging.getLogger("agent.supervisor")

# --- what the shell observes (facts for the core) ------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankExited:
    incarnation: int
    rank: int
    returncode: int


@dataclass(frozen=True, slots=True)
class Tick:
    pass


@dataclass(frozen=True, slots=True)
class Preempted:
    signal: str = "SIGTERM"  # or SIGINT


@dataclass(frozen=True, slots=True)
class CommandArrived:
    command: Command


@dataclass(frozen=True, slots=True)
class Joined:
    epoch: int
    unusable_devices: list[str]


Fact = RankExited | Tick | Preempted | CommandArrived | Joined


class Rank:
    """One local rank: its current process, its output, its library's connections."""

    def __init__(self, index: int, socket_path: str, tail_lines: int) -> None:
        self.index = index
        self.socket_path = socket_path
        self.proc: TrainerProcess | None = None
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self.tasks: list[asyncio.Task[None]] = []  # output pumps and the exit waiter
        self.files: list[IO[bytes]] = []  # --log-dir files of the current attempt

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def open_logs(self, logs: LogSpec, run_dir: str, attempt: int) -> None:
        """This attempt's --log-dir files (--tee, --redirects): [stdout, stderr], or none."""
        self.close_logs()
        if not logs.wants_files:
            return
        for stream in (Std.OUT, Std.ERR):
            path = logs.path(run_dir, attempt, self.index, stream)
            if logs.to_file(self.index, stream):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                self.files.append(open(path, "wb"))  # noqa: SIM115 - closed by close_logs
            else:
                self.files.append(open(os.devnull, "wb"))  # noqa: SIM115 - as above

    def close_logs(self) -> None:
        for f in self.files:
            with contextlib.suppress(OSError):
                f.close()
        self.files = []


def decide(core: Supervision, fact: Fact, now: float) -> Decision | None:
    """The core's decision on one fact (None: nothing yet; a command's ``Forward`` and
    ``Ignore`` are the caller's). A rank of an incarnation already stopped, and a
    ``peer_failed`` notice (forwarded at once, never queued), are not its business."""
    if isinstance(fact, RankExited):
        if fact.incarnation != core.incarnation:
            return None
        decision = core.exited(fact.rank, fact.returncode, now)
        if fact.returncode == 0 and decision is None:
            log.info("local rank %d finished (exit 0)", fact.rank)
        return decision
    if isinstance(fact, Tick):
        return core.tick(now)
    if isinstance(fact, Preempted):
        return core.preempted(fact.signal)
    if isinstance(fact, Joined):
        return core.joined(fact.epoch, fact.unusable_devices)
    command = fact.command
    if command.kind == "peer_failed":
        return None
    return core.command(command.kind, command.epoch, command.reason)
