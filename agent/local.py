"""The channel between a supervised trainer's library and its ``marduk agent run``.

The supervisor listens on a unix socket and gives its path to the trainer in
MARDUK_AGENT_SOCKET. A trainer that calls ``agent.connect()`` under a supervisor talks to it
instead of registering a second time: the supervisor's registration outlives trainer restarts.

JSON lines, one message per line:

    trainer -> agent   {"op": "hello", "pid": 123}
                       {"op": "step", "step": 42}
                       {"op": "heartbeat"}
                       {"op": "section", "name": "checkpoint", "open": true, "timeout": 120}
                       {"op": "section", "name": "checkpoint", "open": false}
                       {"op": "checkpointed", "step": 42}   (the checkpoint asked for is saved)
    agent -> trainer   {"op": "welcome", "epoch": 3}
                       {"op": "command", "command": {...a wire Command...}}

Steps and heartbeats feed the supervisor's hang detection; an open section whose timeout passes
counts as a hang (seed 004's sections: tighter timeouts around the parts you know).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Callable
from typing import Any

from agent.client import Command, CommandInbox, OnCommand, Options
from marduk import protocol as wire

log = logging.getLogger("agent.local")
MAX_LINE = 64 * 1024


class LocalAsyncClient(CommandInbox):
    """The AsyncClient interface, served by the local supervisor instead of the controller."""

    def __init__(
        self,
        opts: Options,
        socket_path: str,
        on_command: OnCommand | None = None,
        *,
        deliver: Callable[[Command], None] | None = None,
    ) -> None:
        super().__init__(opts, on_command, deliver)
        self.socket_path = socket_path
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        from agent.client import AgentError

        try:
            reader, self._writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.socket_path, limit=MAX_LINE), self.opts.timeout
            )
            await self._send({"op": "hello", "pid": os.getpid()})
            welcome = json.loads(await asyncio.wait_for(reader.readline(), self.opts.timeout))
        except (OSError, TimeoutError, ValueError) as e:
            raise AgentError(
                f"cannot reach the local agent at {self.socket_path}: {e or type(e).__name__}"
            ) from None
        self.fence = self.fence.adopt(int(welcome.get("epoch", 0)))
        self.state = "registered"
        self._reader_task = asyncio.create_task(self._read(reader))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                line = await reader.readline()
            except (OSError, ValueError) as e:
                self._record(f"local agent channel failed: {e}")
                break
            if not line:
                break
            try:
                msg = json.loads(line)
                if msg.get("op") == "command":
                    cmd = wire.decode(json.dumps(msg["command"]).encode(), wire.Command)
                    self._accept(cmd)
            except (ValueError, KeyError, TypeError) as e:
                self.stats["bad_commands"] += 1
                self._record(f"dropped a bad message from the local agent: {e}")
        if self.state != "closed":
            self.state = "disconnected"

    async def _send(self, msg: dict[str, Any]) -> None:
        if self._writer is None or self._writer.is_closing():
            return
        try:
            self._writer.write(json.dumps(msg).encode() + b"\n")
            await self._writer.drain()
        except (OSError, RuntimeError) as e:
            self._record(f"cannot reach the local agent: {e}")

    # --- the AsyncClient interface ---------------------------------------------------------------

    async def checkpoint_saved(self, step: int) -> bool:
        """Tell the supervisor; it reports ``checkpointed`` to the controller."""
        self._checkpoint = None
        await self._send({"op": "checkpointed", "step": int(step)})
        return True

    async def ack(self, command: Command | None = None) -> bool:
        """Clears ``failed``; the supervisor confirms epochs to the controller itself."""
        self._clear_failure(command)
        return True

    async def step(self, step: int) -> None:
        await self._send({"op": "step", "step": int(step)})

    async def heartbeat(self) -> None:
        await self._send({"op": "heartbeat"})

    async def section(self, name: str, open_: bool, timeout: float | None = None) -> None:
        msg: dict[str, Any] = {"op": "section", "name": name, "open": open_}
        if timeout is not None:
            msg["timeout"] = float(timeout)
        await self._send(msg)

    async def close(self, *, deregister: bool = True, reason: str = "closed") -> None:
        if self.state == "closed":
            return
        self.state = "closed"
        if self._reader_task is not None:
            self._reader_task.cancel()
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
                await self._writer.wait_closed()
