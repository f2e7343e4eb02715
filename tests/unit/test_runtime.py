"""The process edge (marduk/shell/runtime.py): a command's exit code once its work is done; a task it
left behind that will not end does not hold the exit up."""

from __future__ import annotations

import asyncio

import pytest

from marduk.shell.runtime import run_to_exit


class Exited(Exception):
    pass


def test_a_task_that_ignores_its_cancellation_does_not_hold_up_the_exit() -> None:
    exits: list[int] = []
    left: list[asyncio.Future[None]] = []

    async def stubborn() -> None:  # as nats-py cut short while it connects: retries on
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(60)  # this test's own loop shutdown cancels it once more

    async def command() -> int:
        left.append(asyncio.ensure_future(stubborn()))
        await asyncio.sleep(0)
        return 3

    def hard_exit(code: int) -> None:
        exits.append(code)
        raise Exited

    with pytest.raises(Exited):
        run_to_exit(command(), linger_s=0.05, hard_exit=hard_exit)
    assert exits == [3]


def test_tasks_that_end_when_cancelled_let_the_command_return_its_code() -> None:
    ended: list[str] = []
    left: list[asyncio.Future[None]] = []

    async def background() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            ended.append("cancelled")

    async def command() -> int:
        left.append(asyncio.ensure_future(background()))
        await asyncio.sleep(0)
        return 3

    assert run_to_exit(command(), linger_s=5.0, hard_exit=pytest.fail) == 3
    assert ended == ["cancelled"]
