"""The supervisor's link to the controller: register at start, or keep trying in the background
and join when it answers; report; acknowledge commands; close.

``marduk agent run`` (agent/supervise/supervisor.py) works with a controller or without one
(standalone, local restarts only). While none is joined, ``report`` answers None and ``ack`` does
nothing, so the supervision shell applies its decisions the same way in both modes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from prometheus_client import CollectorRegistry

from agent.library.client import AsyncClient, Command, Options
from marduk.errors import MardukError
from marduk.shell.metrics import StatsCollector
from marduk.transport.credentials import redact
from marduk.wire import protocol as wire

# The supervisor's log: what operators read and filter on for the agent.
log = logging.getLogger("agent.supervisor")

JOIN_TIMEOUT_S = 5.0  # at most, per attempt to register in the background
REPORT_TIMEOUT_S = 5.0  # for the controller's answer to a report
STOPPING_REPORT_TIMEOUT_S = 1.0  # the same after SIGTERM: the grace is the trainers'


class ControllerLink:
    """One registration of this node with the controller, however many ranks it runs."""

    def __init__(
        self,
        opts: Options,
        *,
        on_command: Callable[[Command], None],
        registry: CollectorRegistry,
        join_interval_s: float,
        spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]],
    ) -> None:
        self.opts = opts
        self.client: AsyncClient | None = None
        self._on_command = on_command
        self._registry = registry
        self._join_interval_s = join_interval_s
        self._spawn = spawn
        self._join_task: asyncio.Task[None] | None = None
        self._collector: StatsCollector | None = None
        # Told when the job's live parameters change (the supervisor forwards them).
        self.on_params: Callable[[Any], None] | None = None

    async def connect(self, on_unreachable: Callable[[str], None] | None = None) -> AsyncClient:
        """Register now, within the options' timeout (MardukError: no controller answered);
        ``on_unreachable`` is told at once why NATS cannot be reached, if it cannot."""
        self.client = await self._register(self.opts, on_unreachable)
        return self.client

    def join_in_background(self, on_joined: Callable[[AsyncClient], Awaitable[None]]) -> None:
        """Standalone: try to reach the controller until it answers; then ``on_joined``."""
        self._join_task = self._spawn(self._join(on_joined), "join")

    async def _register(
        self, opts: Options, on_unreachable: Callable[[str], None] | None = None
    ) -> AsyncClient:
        client = AsyncClient(opts, on_command=self._on_command, deliver=lambda _c: None)
        client.live.on_params = self.on_params
        await client.start(on_unreachable=on_unreachable)
        # The library client's counters (commands, dropped forgeries, ...) are exported too.
        if self._collector is not None:
            self._registry.unregister(self._collector)
        self._collector = StatsCollector(client.stats, lambda: [])
        self._registry.register(self._collector)
        return client

    async def move(self, job: str) -> None:
        """A job claimed this spare of a pool (``AsyncClient.claimed_by``): from now on it is
        that job's worker, registered under it (same replica and worker). Keeps trying until
        the job's controller answers (the claim is durable; a failover costs a retry)."""
        pool = self.opts.job
        log.warning(
            "this spare of pool %s is claimed by job %s: registering there, for good", pool, job
        )
        old, self.client = self.client, None
        if old is not None:
            await old.close(deregister=False)
        self.opts.job = job
        said = False
        while True:
            try:
                self.client = await self._register(self.opts)
                return
            except MardukError as e:
                if "may not publish" in str(e) and not said:  # a credential of one job
                    log.error(
                        "this spare's NATS credential may not register under job %s (%s): a "
                        "spare of a pool needs an agent credential valid for every job that "
                        "may claim it (docs/operations.md, Pools of spares)",
                        job,
                        e,
                    )
                    said = True
                elif not said:
                    log.warning("registering under job %s failed (%s); still trying", job, e)
                    said = True
                await asyncio.sleep(self._join_interval_s)

    async def _join(self, on_joined: Callable[[AsyncClient], Awaitable[None]]) -> None:
        opts = dataclasses.replace(self.opts, timeout=min(self.opts.timeout, JOIN_TIMEOUT_S))
        said = False
        while True:
            try:
                client = await self._register(opts)
            except MardukError as e:
                if not said:
                    log.info("no controller at %s yet (%s); still trying", redact(opts.addr), e)
                    said = True
                await asyncio.sleep(self._join_interval_s)
                continue
            self.client = client
            log.warning(
                "joined the controller at %s (epoch %d): it decides restarts from now on",
                redact(opts.addr),
                client.epoch,
            )
            await on_joined(client)
            return

    async def report(
        self, report: wire.Report, timeout: float = REPORT_TIMEOUT_S
    ) -> wire.ReportReply | None:
        """The controller's answer; None with no controller, or when it was not delivered
        within ``timeout``."""
        if self.client is None:
            return None
        if not self.client.connected:
            # Not sent rather than buffered by nats-py and delivered on reconnect, after the
            # ranks restarted locally: a stale crash report would restart the scope again.
            # The controller hears from this node when it registers again.
            log.warning("report %s not sent: no connection to NATS", report.status)
            return None
        try:
            return await self.client.report(report, timeout)
        except MardukError as e:
            log.warning("report %s not delivered: %s", report.status, e)
            return None

    async def ack(self, command: Command) -> None:
        if self.client is not None:
            await self.client.ack(command)

    def params(self) -> wire.JobParams | None:
        """The job's live parameters as last received (None: none set, or no controller)."""
        return self.client.live.doc if self.client is not None else None

    async def params_applied(
        self, version: int, rejected: dict[str, str], ranks: list[wire.RankApplied] | None = None
    ) -> None:
        if self.client is not None:
            await self.client.params_applied(version, rejected, ranks)

    async def close(self, *, deregister: bool, reason: str = "closed") -> None:
        """Stop trying to join; close the registration (``deregister``: the worker is gone)."""
        if self._join_task is not None:
            self._join_task.cancel()
        if self.client is not None:
            await self.client.close(deregister=deregister, reason=reason)
