"""SIGTERM/SIGINT for ``marduk agent run``: noted at once, whatever the agent is doing
(connecting, starting, stopping, reporting), so that nothing starts after it; a second signal
cuts the trainers' grace period short."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger("agent.supervisor")
T = TypeVar("T")

CANCEL_WAIT_S = 1.0  # at most, for work cut short by SIGTERM to end


class Signals:
    """The first signal sets ``signalled`` and calls ``on_first`` with its name; the next ones
    set ``hurry``."""

    def __init__(self, on_first: Callable[[str], None]) -> None:
        self.signalled = asyncio.Event()
        self.hurry = asyncio.Event()
        self.name = "SIGTERM"  # of the first signal, once there was one
        self._on_first = on_first

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.handle, sig)

    def handle(self, sig: signal.Signals) -> None:
        if self.signalled.is_set():
            log.warning("%s again: the trainers get no more grace (SIGKILL)", sig.name)
            self.hurry.set()
            return
        self.name = sig.name
        self.signalled.set()
        self._on_first(sig.name)

    async def or_signal(self, coro: Coroutine[Any, Any, T]) -> T | None:
        """``coro``'s result, or None when SIGTERM/SIGINT came first (it is cancelled)."""
        if self.signalled.is_set():
            coro.close()
            return None
        work = asyncio.ensure_future(coro)
        signalled = asyncio.ensure_future(self.signalled.wait())
        await asyncio.wait({work, signalled}, return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        if work.done():
            return work.result()
        work.cancel()
        # Not forever: a library may hold on to its cancellation (nats-py while connecting).
        await asyncio.wait([work], timeout=CANCEL_WAIT_S)
        return None
