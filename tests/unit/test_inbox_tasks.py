"""The library's background tasks are named and guarded: a failure is recorded, never lost."""

from __future__ import annotations

import asyncio

from agent.library.client import CommandInbox, Options
from marduk.wire import protocol as wire
from tests.conftest import eventually


def inbox(on_command: object = None) -> CommandInbox:
    opts = Options(
        job="j", replica="r1", worker=0, devices=["a"], addr="", prefix="marduk",
        scope="replica", timeout=1, incarnation=0, epoch=0,
    )  # fmt: skip
    return CommandInbox(opts, on_command, None)  # type: ignore[arg-type]


async def test_a_failing_background_task_is_counted_and_recorded() -> None:
    box = inbox()

    async def broken() -> None:
        raise RuntimeError("boom")

    box._spawn(broken(), "renew")
    await eventually(lambda: box.stats["errors.task"] == 1)
    assert any("marduk-agent-renew failed: RuntimeError: boom" in e for e in box.errors)
    assert not box._tasks


async def test_an_async_on_command_that_raises_never_reaches_the_loop() -> None:
    async def on_command(_command: object) -> None:
        await asyncio.sleep(0)
        raise ValueError("callback bug")

    box = inbox(on_command)
    box._accept(wire.Command(command_id="c", job="j", replica="r1", kind="restart", epoch=1))
    await eventually(lambda: any("callback bug" in e for e in box.errors))
    assert box.failed and box.stats["commands.restart"] == 1
    assert [t.get_name() for t in asyncio.all_tasks() if "marduk" in t.get_name()] == []
