"""The agent's supervision core: what happened in, what to do out. Pure, like marduk/core/policy.py.

``marduk agent run`` (agent/supervise/supervisor.py) runs processes and talks to the controller;
every decision about them is made here, from facts the shell observes, with ``now`` as an argument
(monotonic seconds) and no I/O:

* a local rank exits: 0 -> that rank is done (``Finish`` once every rank is); otherwise a local
  failure -> ``Restart`` (every local rank restarts together) or ``GiveUp`` past the budget;
* ``tick(now)``: a rank with no first step within ``startup_timeout_s``, no step or heartbeat
  for ``hang_timeout_s``, or a section open past its own timeout is hung: a local failure too;
* a trainer asked not to be restarted (``stop_restarting``): its next failure, or a restart
  command, is a ``GiveUp`` with the trainer's own exit code (``own_exit_code``) instead;
* a controller command: fenced by epoch (``Ignore`` when not newer); ``restart`` -> ``Restart``
  at its epoch (not counted against the budget), ``fail`` -> ``GiveUp`` 71, ``stop`` ->
  ``GiveUp`` 72, ``checkpoint`` -> ``Forward`` (the ranks save and keep training);
* SIGTERM to the agent (preemption, eviction) -> ``GiveUp`` 143 after the grace period;
* joining a controller late (standalone until then) -> ``GiveUp`` 71 when it says our devices
  are out of service, else nothing: its epochs apply from the next restart on.

How long the ranks get between SIGTERM and SIGKILL follows from the decision (``Grace``): a
restart the controller ordered is not waited out the way a preemption is.

Budget (decisions.md #6): at most ``max_restarts`` local failures within
``restart_window_s``; the next one gives up (exit 70) so the scheduler replaces the pod. Standalone
(no controller) the rules are the same: a local failure restarts at the current epoch, since only
a controller issues epochs; with one, at the epoch its reply names (``restart_epoch``).
"""

from __future__ import annotations

import enum
import signal
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from agent.channel.fencing import supersedes
from agent.supervise.learned_timeouts import NOT_LEARNING, Learning, Timeouts


class ExitCode(enum.IntEnum):
    OK = 0  # every local rank finished (exit 0)
    SETUP = 1  # could not start (a rejected registration, a trainer that cannot be executed)
    GAVE_UP = 70  # restarted max_restarts times within the window: replace the pod
    DEVICE_FAILED = 71  # the controller sent `fail`: a device of this pod is bad
    # The controller sent `stop`. Never 0: a scheduler must not record a job stopped from
    # outside as finished (no controller path issues `stop` today; reserved for operators).
    STOPPED = 72
    PREEMPTED = 143  # SIGTERM/SIGINT (128 + 15): the trainers got the grace period


@dataclass(frozen=True)
class Limits:
    """The supervision core's numbers (``marduk agent run`` options; no slots: the class
    attributes are the defaults, which agent/supervise/supervisor_config.py takes)."""

    max_restarts: int = 3
    restart_window_s: float = 3600.0
    hang_timeout_s: float = 600.0
    startup_timeout_s: float = 1800.0
    # Timeouts learned from the job instead (``--hang-timeout auto``): none by default.
    learning: Learning = NOT_LEARNING


CommandKind = Literal["restart", "fail", "stop", "checkpoint"]
FailureKind = Literal["crashed", "hung"]


# --- decisions ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Restart:
    """End every local rank (SIGTERM, grace, SIGKILL) and start them all again.

    ``failure``: a local failure of ``rank`` (counted against the budget; the shell reports it
    and restarts at ``restart_epoch`` of the controller's answer); None: a restart command at
    ``epoch``."""

    why: str
    epoch: int
    failure: FailureKind | None = None
    rank: int | None = None
    returncode: int | None = None


@dataclass(frozen=True, slots=True)
class GiveUp:
    """End every local rank and exit with ``code`` (an ``ExitCode``, or the trainer's own
    exit code once it asked not to be restarted)."""

    code: int
    why: str
    failure: FailureKind | None = None  # set when the last local failure exhausted the budget
    rank: int | None = None
    returncode: int | None = None


@dataclass(frozen=True, slots=True)
class Finish:
    """Every local rank exited 0: exit 0."""

    @property
    def why(self) -> str:
        """As every other decision's: why the ranks are stopped."""
        return "every rank finished"


@dataclass(frozen=True, slots=True)
class Forward:
    """Pass the command to the ranks' libraries; nothing stops (``checkpoint``)."""

    why: str


@dataclass(frozen=True, slots=True)
class Ignore:
    """A command not newer than the epoch the ranks run at (stale or duplicate)."""

    why: str


Decision = Restart | GiveUp | Finish | Forward | Ignore


@dataclass(frozen=True, slots=True)
class Grace:
    """Seconds between SIGTERM and SIGKILL, by why the ranks stop (``--grace``,
    ``--restart-grace``).

    A restart of the scope at a new epoch (a restart command: a peer crashed, a device failed;
    or the controller's answer to a local rank's failure, forwarded to the others first) stops
    every process of the scope at once: whatever a trainer does on SIGTERM with its peers (a
    collective checkpoint, JAX's preemption sync point, which needs every process to reach the
    next step) cannot complete, and a trainer that swallows SIGTERM (JAX's preemption service)
    only waits for that. Its ranks get ``restart_s``; the next incarnation restores the last
    periodic checkpoint. Every other stop gets ``full_s``: the pod is leaving (preemption,
    eviction, ``fail``, ``stop``, the budget spent), its trainers' save on SIGTERM is the one
    that matters; and a local failure that no controller answered (standalone) stops only this
    node's ranks, whose own save (local state) may still complete, as before."""

    full_s: float
    restart_s: float

    def of(self, decision: Decision, answered: int | None = None, epoch: int = 0) -> float:
        """The grace for ``decision``; ``answered``: the epoch the controller answered a local
        failure's report with before the stop, ``epoch`` the ranks' own."""
        if isinstance(decision, Restart) and (
            decision.failure is None or (answered is not None and answered > epoch)
        ):
            return min(self.restart_s, self.full_s)
        return self.full_s


# --- state ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class RankState:
    """What the shell has observed of one local rank's current incarnation."""

    started_at: float = 0.0
    progress_at: float = 0.0  # the last step, heartbeat or section change; 0: none yet
    step: int | None = None
    step_at: float = 0.0
    finished: bool = False  # exited 0
    sections: dict[str, tuple[float, float | None]] = field(default_factory=dict)


class Supervision:
    """The decisions of one agent over its ``nproc`` local ranks."""

    def __init__(self, limits: Limits, nproc: int = 1, epoch: int = 0) -> None:
        if nproc < 1:
            raise ValueError(f"nproc must be at least 1, not {nproc}")
        self.limits = limits
        self.nproc = nproc
        self.epoch = epoch
        self.incarnation = -1  # the ranks' current one; the first is 0
        self.failures: deque[float] = deque()  # local failures within the window, oldest first
        self.ranks = [RankState() for _ in range(nproc)]
        # Ranks started and not stopped since: only then can they hang (an agent still waiting
        # for its place, or between incarnations, has nothing to time out).
        self.live = False
        # A trainer asked not to be restarted (``client.request("stop_restarting")``): why.
        self.no_restarts: str | None = None
        # The timeouts in force, and what they are learned from (kept across incarnations).
        self.timeouts = Timeouts(limits.learning, limits.hang_timeout_s, limits.startup_timeout_s)

    @property
    def step(self) -> int | None:
        """The lowest step of the ranks that stepped (the node's progress)."""
        steps = [r.step for r in self.ranks if r.step is not None]
        return min(steps) if steps else None

    # --- the shell's observations ---------------------------------------------------------------

    def started(self, now: float) -> int:
        """Every local rank was started again: a new incarnation (returned)."""
        self.incarnation += 1
        self.ranks = [RankState(started_at=now) for _ in range(self.nproc)]
        self.live = True
        return self.incarnation

    def stopped(self) -> None:
        """The ranks of the current incarnation were stopped (or never started): no hang
        checks until the next ``started``."""
        self.live = False

    def progress(self, rank: int, step: int | None, now: float) -> bool:
        """A step (or, with None, a heartbeat). True: the rank's first sign of life."""
        r = self.ranks[rank]
        first = not r.progress_at
        seen = self.timeouts.seen
        if first:
            seen.startup(now - r.started_at)
        elif not r.sections:  # an interval outside sections (a section is timed on its own)
            seen.gap(now - r.progress_at)
        if step is not None:
            r.step, r.step_at = step, now
        r.progress_at = now
        return first

    def section(self, rank: int, name: str, open_: bool, timeout: float | None, now: float) -> bool:
        """A section opened (with its own hang timeout) or closed; progress as well."""
        first = self.progress(rank, None, now)  # observed before the section changes
        sections = self.ranks[rank].sections
        if open_:
            sections[name] = (now, timeout if timeout and timeout > 0 else None)
        elif (opened := sections.pop(name, None)) is not None:
            self.timeouts.seen.section(name, now - opened[0])
        return first

    def stop_restarting(self, why: str) -> None:
        """A trainer asked: the next failure or restart ends the agent instead (with the
        trainer's exit code: ``own_exit_code``)."""
        self.no_restarts = why

    def exited(self, rank: int, returncode: int, now: float) -> Decision | None:
        """A local rank's process ended (``returncode`` as asyncio gives it: -N for signal N)."""
        r = self.ranks[rank]
        if returncode == 0:
            # Progress too: the ranks still running (often silent: torch scripts print from
            # rank 0) get a whole hang timeout from here to finish as well.
            r.finished, r.progress_at = True, now
            return Finish() if all(x.finished for x in self.ranks) else None
        why = self._of(rank, f"exit {describe(returncode)}")
        return self._failure("crashed", rank, why, now, returncode)

    def tick(self, now: float) -> Decision | None:
        """Hang, startup and section checks (the shell calls it periodically).

        Progress is the node's: a step of any local rank counts for all (torch scripts often
        print from rank 0 only, and a rank stuck in a collective stops every rank's steps);
        sections are each rank's own."""
        running = [i for i, r in enumerate(self.ranks) if not r.finished]
        if not running or not self.live:
            return None
        t = self.timeouts
        for i in running:
            for name, (opened, timeout) in self.ranks[i].sections.items():
                limit = timeout if timeout is not None else t.section_s(name)
                if limit is not None and now - opened > limit:
                    how = "" if timeout is not None else " (learned)"
                    why = f"section {name!r} open for more than {round(limit, 3):g}s{how}"
                    return self._failure("hung", i, self._of(i, why), now)
        latest = max(r.progress_at for r in self.ranks)
        if not latest:
            startup_s = t.startup_s()
            if now - self.ranks[running[0]].started_at > startup_s:
                any_rank = " on any local rank" if self.nproc > 1 else ""
                why = f"no first step{any_rank} within {round(startup_s, 3):g}s"
                return self._failure("hung", running[0], why, now)
            return None
        hang_s = t.hang_s(in_section=any(self.ranks[i].sections for i in running))
        if now - latest > hang_s:
            steps = [r.step for r in self.ranks if r.step is not None]
            last = f"after {max(steps)} " if steps else ""
            where = "on any local rank " if self.nproc > 1 else ""
            why = f"no step {last}{where}for {round(hang_s, 3):g}s"
            return self._failure("hung", self._stuck_first(running), why, now)
        return None

    def _stuck_first(self, running: list[int]) -> int:
        """The rank to blame for a node-wide hang (its output is the report's): of the running
        ranks that showed progress, the one that stopped first (the others likely wait for it
        in a collective); none showed any: the first running rank."""
        stepped = [i for i in running if self.ranks[i].progress_at]
        if not stepped:
            return running[0]
        return min(stepped, key=lambda i: self.ranks[i].progress_at)

    def command(self, kind: CommandKind, epoch: int, reason: str) -> Decision:
        """A command from the controller (already verified and fenced by the client)."""
        if kind == "checkpoint":
            if epoch < self.epoch:  # e.g. asked of the members a grow joiner now joins
                return Ignore(f"checkpoint of epoch {epoch}: the ranks run at epoch {self.epoch}")
            return Forward(f"checkpoint requested (epoch {epoch}): {reason}")
        if kind == "restart" and not supersedes(epoch, self.epoch):
            return Ignore(f"restart at epoch {epoch}: the ranks run at epoch {self.epoch}")
        if kind == "fail":
            return GiveUp(ExitCode.DEVICE_FAILED, f"fail command (epoch {epoch}): {reason}")
        if kind == "stop":
            return GiveUp(ExitCode.STOPPED, f"stop command (epoch {epoch}): {reason}")
        if self.no_restarts is not None:
            why = f"restart command epoch {epoch}: {reason}; not restarted: {self.no_restarts}"
            return GiveUp(ExitCode.STOPPED, why)
        return Restart(f"restart command epoch {epoch}: {reason}", epoch)

    def preempted(self, signal_name: str = "SIGTERM") -> GiveUp:
        """SIGTERM or SIGINT to the agent: the ranks get the grace period, then the agent exits
        (the same code either way; the reason says which: Ctrl-C is no eviction)."""
        what = "preemption or eviction" if signal_name == "SIGTERM" else "interrupted"
        return GiveUp(ExitCode.PREEMPTED, f"{signal_name} to the agent ({what})")

    def joined(self, controller_epoch: int, unusable_devices: list[str]) -> GiveUp | None:
        """The controller answered a registration made while running standalone: its epochs
        apply from now on (a restart command must be newer than what it already issued)."""
        self.epoch = max(self.epoch, controller_epoch)
        if unusable_devices:
            return GiveUp(
                ExitCode.DEVICE_FAILED,
                f"device(s) {', '.join(unusable_devices)} out of service (quarantined or drained)",
            )
        return None

    def restart_epoch(self, answered: int | None) -> int:
        """The epoch a restart after a local failure runs at: the controller's answer, never
        below the current one; standalone (no answer), the current one."""
        self.epoch = max(self.epoch, answered if answered is not None else self.epoch)
        return self.epoch

    def restarting_at(self, epoch: int) -> None:
        """A restart command's epoch is applied (the ranks start again at it)."""
        self.epoch = max(self.epoch, epoch)

    # --- rules -----------------------------------------------------------------------------------

    def _of(self, rank: int, why: str) -> str:
        return f"local rank {rank}: {why}" if self.nproc > 1 else why

    def _failure(
        self, kind: FailureKind, rank: int, why: str, now: float, returncode: int | None = None
    ) -> Restart | GiveUp:
        lim = self.limits
        if self.no_restarts is not None:
            code = own_exit_code(returncode)
            why = f"{why}; not restarted: {self.no_restarts} (exit {code})"
            return GiveUp(code, why, kind, rank, returncode)
        while self.failures and now - self.failures[0] > lim.restart_window_s:
            self.failures.popleft()
        if len(self.failures) >= lim.max_restarts:
            n = lim.max_restarts
            return GiveUp(
                ExitCode.GAVE_UP,
                f"{why}; restarted {n} time{'' if n == 1 else 's'} within "
                f"{lim.restart_window_s:g}s; giving up",
                kind,
                rank,
                returncode,
            )
        self.failures.append(now)
        return Restart(why, self.epoch, kind, rank, returncode)


def own_exit_code(returncode: int | None) -> int:
    """The agent's exit code for a trainer that asked not to be restarted: its own exit code,
    128 + N for signal N (as a shell says it), 72 (``STOPPED``) for a hang the agent ended."""
    if returncode is None:
        return ExitCode.STOPPED
    return 128 - returncode if returncode < 0 else returncode


def describe_returncode(code: int) -> tuple[int | None, str]:
    """(exit code, signal name) of an asyncio returncode (negative: killed by that signal)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return None, name
    return code, ""


def describe(returncode: int) -> str:
    """``3`` or ``SIGKILL``: an asyncio returncode, in a word."""
    code, name = describe_returncode(returncode)
    return name or str(code)
