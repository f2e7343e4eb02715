"""Named background tasks whose failure is never lost, and a loop that restarts a task.

``TaskSet`` holds its tasks (the event loop keeps only weak references to them), names them and
hands an exception nobody awaits to the owner's policy (count and log, record, or treat as
fatal), like kopf's guarded tasks; ``stop`` cancels them and names those that would not stop;
``drain`` lets them finish first, within a grace period, then cancels and names the stuck ones
(kopf's reactor stops its root tasks the same way, then gives the tasks they spawned a grace).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, NoReturn, TypeVar

from marduk.aio.backoff import Backoff

log = logging.getLogger("marduk.aio")

T = TypeVar("T")
OnError = Callable[[asyncio.Task[Any], BaseException], None]
OnReturn = Callable[[asyncio.Task[Any]], None]


class TaskSet:
    """Background tasks named ``prefix + name``; ``on_error(task, exception)`` for one that
    raised (cancelling is not an error) and, for tasks that must never end, ``on_return(task)``
    for one that returned."""

    def __init__(
        self, on_error: OnError, *, prefix: str = "", on_return: OnReturn | None = None
    ) -> None:
        self.on_error = on_error
        self.on_return = on_return
        self.prefix = prefix
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        task = asyncio.create_task(coro, name=self.prefix + name)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        error = task.exception()  # retrieved: never "exception was never retrieved"
        if error is not None:
            self.on_error(task, error)
        elif self.on_return is not None:
            self.on_return(task)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    def __len__(self) -> int:
        return len(self._tasks)

    def cancel(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    async def drain(self, grace_s: float, *, cancel_s: float | None = None) -> list[str]:
        """Let the tasks finish within ``grace_s``, then ``stop`` those still running: cancel
        them and wait ``cancel_s`` (None: until they end). The names of those stuck at the
        grace, which are logged (and those that would not stop even then, by ``stop``)."""
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]  # never itself
        if not tasks:
            return []
        _, pending = await asyncio.wait(tasks, timeout=grace_s)
        stuck = sorted(t.get_name() for t in pending)
        if stuck:
            log.warning(
                "%d task(s) still running after a %gs grace, cancelled: %s",
                len(stuck),
                grace_s,
                ", ".join(stuck),
            )
        await self.stop(cancel_s)
        return stuck

    async def stop(self, grace_s: float | None = None) -> list[str]:
        """Cancel every task and wait ``grace_s`` (None: until they end); the names of those
        still running (logged), which a task that swallows its cancellation would be."""
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]  # never itself
        for task in tasks:
            task.cancel()
        if not tasks:
            return []
        _, pending = await asyncio.wait(tasks, timeout=grace_s)
        stuck = sorted(t.get_name() for t in pending)
        if stuck:
            log.warning("tasks that would not stop within %gs: %s", grace_s, ", ".join(stuck))
        return stuck


async def restart_forever(
    factory: Callable[[], Awaitable[None]],
    backoff: Backoff,
    on_stop: Callable[[BaseException | None, float], None],
    *,
    healthy_after_s: float = 60.0,
) -> NoReturn:
    """Run ``factory()`` again whenever it ends, after ``backoff``'s pause; until cancelled.

    ``on_stop(error, pause)`` hears of each end (``error`` None: it returned) before the pause.
    A run that lasted ``healthy_after_s`` worked: the backoff starts over.
    """
    loop = asyncio.get_running_loop()
    while True:
        began = loop.time()
        error: BaseException | None = None
        try:
            await factory()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            error = e
        if loop.time() - began > healthy_after_s:
            backoff.reset()
        pause = backoff.next()
        on_stop(error, pause)
        await asyncio.sleep(pause)
