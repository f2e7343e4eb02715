"""Real small objects to build one part of the controller with (``marduk.controller.context``):
no ``Controller``, no server. Each part is handed a ``Context`` and a few callables; a test
gives it these and looks at what they recorded."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Coroutine
from typing import Any

from nats.aio.client import Client as NATS

from marduk.controller.commit import NotServing
from marduk.controller.context import Context, Logs
from marduk.controller.settings import ControllerSettings
from marduk.wire.subjects import Subjects


class Shell:
    """What a part asks of the whole, recorded: the step-downs asked for, the tasks started."""

    def __init__(self, *, leading: bool = True) -> None:
        self.leading = leading
        self.stepped_down: list[str] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.stats: Counter[str] = Counter()

    def context(self, settings: ControllerSettings | None = None) -> Context:
        settings = settings or ControllerSettings()
        return Context(
            settings=settings,
            subjects=Subjects(settings.prefix),
            controller_id="test-controller",
            stats=self.stats,
            logs=Logs(self.stats),
            leading=lambda: self.leading,
            spawn=self.spawn,
            step_down=self.stepped_down.append,
            connection=_not_connected,
        )

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=name)
        self.tasks.append(task)
        return task


def _not_connected() -> NATS:
    raise NotServing("no connection in this test")
