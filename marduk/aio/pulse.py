"""Something that happens again and again, for a task to wait for its next time.

``Pulse.notify()`` counts a beat (a record changed, a lease was seen renewed); ``wait_any``
returns at the next beat of any of several pulses, or at a deadline. A waiter that checks its
condition and then waits misses no beat in between (the count is read without an await).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence


class Pulse:
    def __init__(self) -> None:
        self.count = 0
        self._event = asyncio.Event()

    def notify(self) -> None:
        self.count += 1
        self._event.set()

    async def wait(self, since: int) -> None:
        """Until the count is past ``since``."""
        while self.count <= since:
            self._event.clear()
            await self._event.wait()


async def wait_any(pulses: Sequence[Pulse], timeout: float | None) -> None:
    """Until any of ``pulses`` beats after this call, or ``timeout`` seconds (None: no limit)."""
    if not pulses:
        if timeout is not None:
            await asyncio.sleep(timeout)
            return
        raise ValueError("wait_any: no pulse and no timeout would wait forever")
    waits = [asyncio.ensure_future(p.wait(p.count)) for p in pulses]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        for w in waits:
            with contextlib.suppress(asyncio.CancelledError):
                await w
