"""The process edge: choose the event loop (uvloop where available), run a coroutine, and end a
command's process with its exit code even when a library will not let go of a task."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("marduk.runtime")


def run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux and macOS
        return asyncio.run(coro)
    return uvloop.run(coro)


def run_to_exit(
    coro: Coroutine[Any, Any, int],
    linger_s: float,
    hard_exit: Callable[[int], object] | None = None,
) -> int:
    """``run(coro)`` for a command whose result is its exit code, then end what is left.

    Tasks still running when ``coro`` is done are cancelled and given ``linger_s``. One that
    holds on to its cancellation (nats-py cut short while it connects keeps retrying, up to
    its connect timeout) would keep the event loop's shutdown, and the exit a SIGTERM asked
    for, waiting: then the process exits at once with the code, its logs flushed. (Closing the
    loop under such a task instead would leave its coroutine to be finalized against a closed
    loop, and interpreter exit would still wait for worker threads.) ``hard_exit``: how to end
    it (tests pass their own)."""
    return run(_then_end_the_rest(coro, linger_s, hard_exit or _exit_now))


def _exit_now(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _then_end_the_rest(
    coro: Coroutine[Any, Any, int], linger_s: float, hard_exit: Callable[[int], object]
) -> int:
    code = await coro
    current = asyncio.current_task()
    stray = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
    for task in stray:
        task.cancel()
    if stray:
        _done, pending = await asyncio.wait(stray, timeout=linger_s)
        if pending:
            log.debug("%d task(s) ignored their cancellation; exiting anyway", len(pending))
            hard_exit(code)
    return code
