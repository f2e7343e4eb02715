"""Standby controllers announce themselves; the leader lists those it heard from lately.

A standby publishes its ``ControllerInfo`` on ``<prefix>.ctl.standby`` about once a second; the
leader (subscribed while it serves: ``Takeover.subscribe``) keeps the last announcement of each
and shows those of the last few seconds in ``monitor status`` and ``marduk_standbys``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from nats.aio.msg import Msg

from marduk.controller.context import Context
from marduk.errors import ProtocolError
from marduk.wire.protocol import ControllerInfo, Standby, decode, encode

ANNOUNCE_EVERY_S = 1.0
HEARD_WITHIN_S = 3.0
"""A standby heard from within this long is live (it announces itself every second)."""


class Standbys:
    """A standby's announcements (``announce_loop``) and what the leader heard of them.

    Handed the controller's ``info`` (what it announces)."""

    def __init__(self, ctx: Context, *, info: Callable[[], ControllerInfo]) -> None:
        self._ctx = ctx
        self._info = info
        self._heard: dict[str, tuple[ControllerInfo, float]] = {}

    async def announce_loop(self) -> None:
        """Standbys announce themselves to the leader about once a second (for status)."""
        while True:
            await asyncio.sleep(ANNOUNCE_EVERY_S)
            nc = self._ctx.connected()
            if nc is None or self._ctx.leading():
                continue
            with contextlib.suppress(Exception):
                await nc.publish(
                    self._ctx.subjects.standby, encode(Standby(controller=self._info()))
                )

    def live(self) -> list[ControllerInfo]:
        """Standbys heard from in the last ``HEARD_WITHIN_S``."""
        now = time.monotonic()
        self._heard = {k: v for k, v in self._heard.items() if now - v[1] < HEARD_WITHIN_S}
        return [info for info, _ in self._heard.values()]

    async def on_announcement(self, msg: Msg) -> None:
        try:
            info = decode(msg.data, Standby).controller
        except ProtocolError as e:
            self._ctx.logs.reject("standby", e.reason, str(e), msg.subject)
            return
        if info.controller_id != self._ctx.controller_id:
            self._heard[info.controller_id] = (info, time.monotonic())
