"""What ``marduk agent run`` tells the controller (``marduk.<job>.report``): its status at the
running epoch, and a crash or hang with its diagnosis (agent/supervise/signatures.py). The
reports' contents are pure (``failure_report``, ``restart_for_others``); ``Reporter`` sends
them through the controller link, which does nothing while no controller is joined."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from agent.library.client import Options
from agent.supervise.controller_link import (
    REPORT_TIMEOUT_S,
    STOPPING_REPORT_TIMEOUT_S,
    ControllerLink,
)
from agent.supervise.rank_facts import Rank
from agent.supervise.signatures import Diagnosis, diagnose
from agent.supervise.supervision import (
    ExitCode,
    Finish,
    GiveUp,
    Restart,
    Supervision,
    describe_returncode,
)
from marduk.wire import protocol as wire

log = logging.getLogger("agent.supervisor")


def failure_report(
    failure: str,
    decision: Restart | GiveUp,
    diagnosis: Diagnosis | None,
    tail: Sequence[str],
    nproc: int,
) -> tuple[str, dict[str, object]]:
    """The log line of a crash or hang, and the report's fields."""
    rc = decision.returncode
    code, sig = describe_returncode(rc) if rc is not None else (None, "")
    d = diagnosis
    where = f"exit code {code}" if code is not None else (sig or "killed")
    who = "trainer" if nproc == 1 else f"local rank {decision.rank}"
    line = f"{who} {failure} ({where})" + (f": {d.failure_class} - {d.summary}" if d else "")
    summary = d.summary if d else (decision.why if failure == "hung" else "")
    fields: dict[str, object] = {
        "exit_code": code,
        "signal": sig,
        "failure_class": d.failure_class if d else "",
        "action": d.action if d else "",
        "summary": summary,
        "lines": list(d.lines) if d else list(tail)[-5:],
    }
    return line, fields


def answered_epoch(epoch: int, reply: wire.ReportReply | None) -> int | None:
    """The epoch the controller says to restart at (None: no controller answered)."""
    if reply is None:
        return None
    return max([epoch, *(a.epoch for a in reply.actions)])


def restart_for_others(
    opts: Options, epoch: int, decision: Restart, *, command_id: str, issued_at: float
) -> wire.Command:
    """The restart the other local ranks' libraries are told of when one of them failed."""
    return wire.Command(
        command_id=command_id,
        job=opts.job,
        replica=opts.replica,
        scope=opts.scope,
        kind="restart",
        epoch=epoch,
        reason=f"local rank {decision.rank} {decision.failure}",
        issued_at=issued_at,
    )


class Reporter:
    """Reports at the core's epoch, incarnation and step; quicker to give up once stopping."""

    def __init__(
        self,
        opts: Options,
        link: ControllerLink,
        core: Supervision,
        ranks: Sequence[Rank],
        stopping: Callable[[], bool],
    ) -> None:
        self._opts = opts
        self._link = link
        self._core = core
        self._ranks = ranks
        self._stopping = stopping

    def diagnose(self, rank: int | None) -> Diagnosis | None:
        return diagnose(self._ranks[rank].tail) if rank is not None else None

    async def failure(self, status: str, failure: str, decision: Restart | GiveUp) -> int | None:
        """Report a crash or hang; return the epoch the controller says to restart at (None:
        no controller answered)."""
        tail = list(self._ranks[decision.rank].tail) if decision.rank is not None else []
        line, fields = failure_report(
            failure, decision, self.diagnose(decision.rank), tail, len(self._ranks)
        )
        log.error("%s", line)
        reply = await self.report(status, **fields)  # type: ignore[arg-type]
        return answered_epoch(self._core.epoch, reply)

    async def report(self, status: wire.ReportStatus, **fields: object) -> wire.ReportReply | None:
        """Report to the controller, when one is joined (None: no answer)."""
        o = self._opts
        report = wire.Report(
            job=o.job,
            replica=o.replica,
            worker=o.worker,
            status=status,
            epoch=self._core.epoch,
            incarnation=max(self._core.incarnation, 0),
            step=self._core.step,
            timeouts=self._core.timeouts.describe(),
            **fields,  # type: ignore[arg-type]
        )
        timeout = STOPPING_REPORT_TIMEOUT_S if self._stopping() else REPORT_TIMEOUT_S
        return await self._link.report(report, timeout)

    async def running(self) -> None:
        await self.report("running")

    async def progress_loop(self, interval_s: float) -> None:
        """Report progress (last step and when) while the trainers run."""
        while True:
            await asyncio.sleep(interval_s)
            stepped = [r for r in self._core.ranks if r.step is not None]
            if any(r.running for r in self._ranks) and stepped:
                age = time.monotonic() - min(r.step_at for r in stepped)
                await self.report("running", step_at=time.time() - age)

    def say_end(self, decision: GiveUp, *, stopping: bool) -> None:
        """The one line of a give-up: said before the trainers are stopped (``stopping``), or
        by ``ended``."""
        if decision.failure is not None:  # past --max-restarts: the reason says so
            log.error("%s", decision.why)
        elif decision.code == ExitCode.PREEMPTED:
            if stopping:
                ended = "stopping the trainers"
            elif self._core.incarnation < 0:
                ended = "no trainer had started"
            else:
                ended = "the trainers are stopped"
            log.warning("%s: %s", decision.why, ended)
        elif decision.code == ExitCode.STOPPED:
            log.warning("%s", decision.why)
        else:
            log.error("%s; giving up", decision.why)

    async def ended(
        self, decision: Finish | GiveUp, command: object | None, *, said: bool = False
    ) -> int:
        """The agent ends: say why (unless ``said``: ``say_end`` did), and its exit code.
        ``command``: the command that decided it (None: the core did, or the controller just
        joined says the devices are out)."""
        if isinstance(decision, Finish):
            log.info(
                "trainer finished (exit 0)" if len(self._ranks) == 1 else "every rank finished"
            )
            await self.report("exited", exit_code=0)
            await self._link.close(deregister=True, reason="trainer exited 0")
            return ExitCode.OK
        if not said:
            self.say_end(decision, stopping=False)
        if decision.code == ExitCode.PREEMPTED:
            await self.report("preempted", summary=decision.why)
        elif decision.code == ExitCode.STOPPED:
            pass
        elif decision.failure is not None:
            await self.failure("gave_up", decision.failure, decision)
        else:
            await self.report("gave_up", summary=decision.why)
            if command is None:  # the controller we joined says our devices are out
                await self._link.close(deregister=True, reason=decision.why)
        return int(decision.code)
