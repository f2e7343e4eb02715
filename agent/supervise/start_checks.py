"""The node's checks before a start (``marduk agent run --node-check-endpoint``,
``--storage-check``, ``--check-mounts``): before the first start, and before each restart after
a device-class failure (where ``--preflight`` checks the devices:
agent/supervise/between_incarnations.py).

A node that fails them is unusable, as a drained one is. Where the controller assigns the node
ranks (``--nnodes MIN:MAX``), it registers saying so and why (``Rendezvous.unhealthy``): it takes
no rank and is no spare, and a member is retired at once (a spare takes its ranks; its agent
exits 71). One that failed before its first start waits, checking again every
``--check-interval``, and registers as healthy once it passes. Elsewhere (static ranks, one
node) nobody else can take its place: it reports ``gave_up`` (failure class ``node_check``) and
exits 71, so the pod goes back to the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass

import msgspec

from agent.library.options import Options
from agent.supervise.controller_link import ControllerLink
from agent.supervise.node_check import Endpoint, ask, request_line
from agent.supervise.run_config import CHECK_INTERVAL_S, CHECK_TIMEOUT_S
from agent.supervise.storage_probe import StoragePath, run_probe

log = logging.getLogger("agent.supervisor")

FAILURE_CLASS = "node_check"  # of the gave_up report of a node that failed its checks


@dataclass(frozen=True, slots=True)
class CheckSpec:
    """What to check before a start (nothing: no check)."""

    endpoint: Endpoint | None = None
    storage: tuple[StoragePath, ...] = ()
    check_mounts: bool = False
    timeout_s: float = CHECK_TIMEOUT_S  # each check's (the service's answer, the storage probe)
    interval_s: float = CHECK_INTERVAL_S  # between checks of a node waiting unhealthy

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None or bool(self.storage) or self.check_mounts


class NodeHealth:
    """Runs the checks, says what failed, and tells the controller (see the module)."""

    def __init__(
        self, spec: CheckSpec, opts: Options, link: ControllerLink, stats: Counter[str]
    ) -> None:
        self.spec = spec
        self._opts = opts
        self._link = link
        self._stats = stats

    @property
    def kept_out(self) -> bool:
        """Can the controller keep this node out (it assigns the node ranks)?"""
        return self._opts.rendezvous is not None

    async def check(self, when: str, *, said: str | None = None) -> str:
        """Every check, at once; why the node is unhealthy ("" when it is not, or when nothing
        is checked). The verdict is logged with its reason, unless it is ``said`` already."""
        spec = self.spec
        if not spec.enabled:
            return ""
        node, storage = await asyncio.gather(self._node_check(), self._storage_check())
        failures = node + storage
        self._stats["node_checks.failed" if failures else "node_checks.passed"] += 1
        reason = "; ".join(failures)[:4000]
        if reason == said:
            pass
        elif failures:
            log.error("this node failed its checks %s: %s", when, reason)
        else:
            log.info("this node passed its checks %s", when)
        return reason

    async def _node_check(self) -> list[str]:
        endpoint = self.spec.endpoint
        if endpoint is None:
            return []
        o = self._opts
        answer = await ask(
            endpoint, request_line(o.job, o.replica, o.worker, o.host), self.spec.timeout_s
        )
        self._stats[f"node_check.{answer.verdict}"] += 1
        if answer.verdict == "unhealthy":
            return [f"node check: {answer.reason}"]
        if answer.verdict != "healthy":
            # The service being down is not the node being bad (as in NVRx): counted, said.
            log.warning(
                "node check service at %s %s (%s): counting this node as healthy",
                endpoint,
                "unreachable" if answer.verdict == "unreachable" else "answered nonsense",
                answer.reason,
            )
        return []

    async def _storage_check(self) -> list[str]:
        spec = self.spec
        if not spec.storage and not spec.check_mounts:
            return []
        failed = await run_probe(list(spec.storage), spec.check_mounts, spec.timeout_s)
        self._stats["storage_check.failed" if failed else "storage_check.passed"] += 1
        return [f"storage: {x}" for x in failed]

    async def mark(self, reason: str) -> None:
        """Say in this node's registration that it is unhealthy, and why ("" : healthy again);
        registered again at once when a controller is joined."""
        r = self._opts.rendezvous
        if r is None or r.unhealthy == reason:
            return
        self._opts.rendezvous = msgspec.structs.replace(r, unhealthy=reason)
        client = self._link.client
        if client is not None:
            client.opts.rendezvous = self._opts.rendezvous
            await client.reregister()

    async def recheck(self) -> None:
        """A node kept out before its first start: check again every ``interval_s`` until it
        passes, then register as healthy (it may take a rank, or be a spare, from then on)."""
        while self._opts.rendezvous is not None and self._opts.rendezvous.unhealthy:
            await asyncio.sleep(self.spec.interval_s)
            reason = await self.check("again", said=self._opts.rendezvous.unhealthy)
            await self.mark(reason)  # healthy: it may take ranks from now on
