"""Between two incarnations of the ranks: a device check in a fresh process before restarting
onto a device that may be broken (agent/supervise/preflight.py) and the node's checks
(agent/supervise/start_checks.py), and the cleanup (stale lockfiles, the user's command, the
GPUs' memory released: agent/supervise/reclaim.py)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping

from agent.supervise.preflight import run_check
from agent.supervise.reclaim import clean_up
from agent.supervise.start_checks import FAILURE_CLASS, NodeHealth
from agent.supervise.supervisor_config import SupervisorConfig
from marduk.wire import protocol as wire

log = logging.getLogger("agent.supervisor")

Report = Callable[..., Awaitable[wire.ReportReply | None]]


def failed_lines(lines: list[str]) -> list[str]:
    """What a failed device check says of the failure: its ``PREFLIGHT FAIL`` lines, else its
    last three."""
    return [x for x in lines if x.startswith("PREFLIGHT FAIL")] or lines[-3:]


class BetweenIncarnations:
    def __init__(
        self,
        config: SupervisorConfig,
        devices: list[str],
        stats: Counter[str],
        report: Report,
        health: NodeHealth,
    ) -> None:
        self._config = config
        self._devices = devices
        self._stats = stats
        self._report = report
        self._health = health

    async def preflight(self, env: Mapping[str, str], after: str) -> bool:
        """Check the devices in a fresh process, then the node (when enabled), before
        restarting onto them after a device-class failure.

        False: a device is broken, or the node failed its checks; it was reported (gave_up,
        failure class ``preflight`` or ``node_check``; an unhealthy member is taken out of its
        job first) and the agent exits 71 so the pod goes back to the scheduler instead of
        restarting into it.
        """
        if not await self._check_devices(env, after):
            return False
        reason = await self._health.check(f"after {after}")
        if not reason:
            return True
        await self._health.mark(reason)  # a member: the controller retires it, a spare steps in
        await self._report(
            "gave_up",
            failure_class=FAILURE_CLASS,
            action="check_node",
            summary=f"node checks failed after {after}",
            lines=[reason],
        )
        return False

    async def _check_devices(self, env: Mapping[str, str], after: str) -> bool:
        c = self._config
        if not c.preflight:
            return True
        t0 = time.monotonic()
        ok, lines = await run_check(dict(env), c.preflight_expect, c.preflight_timeout_s)
        took = time.monotonic() - t0
        self._stats["preflight.ok" if ok else "preflight.failed"] += 1
        if ok:
            log.info("device check after %s passed in %.2fs", after, took)
            return True
        failed = failed_lines(lines)
        log.error("device check after %s failed in %.2fs: %s", after, took, " | ".join(failed))
        await self._report(
            "gave_up",
            failure_class="preflight",
            action="check_device",
            summary=f"device check failed after {after}",
            lines=[x[:4000] for x in failed[-20:]],
        )
        return False

    async def cleanup(self) -> None:
        """Remove stale lockfiles, run the user's cleanup command, wait for the GPUs' memory
        to be released."""
        c = self._config
        await clean_up(
            c.stale_files,
            c.cleanup_cmd,
            self._devices,
            reclaim_timeout_s=c.reclaim_timeout_s,
            reclaim_tolerance_mib=c.reclaim_tolerance_mib,
        )
