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
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

from agent.client import Command, OnCommand, Options, State
from marduk import protocol as wire

log = logging.getLogger("agent.local")
MAX_LINE = 64 * 1024


class LocalAsyncClient:
    """The AsyncClient interface, served by the local supervisor instead of the controller."""

    def __init__(
        self,
        opts: Options,
        socket_path: str,
        on_command: OnCommand | None = None,
        *,
        deliver: Callable[[Command], None] | None = None,
    ) -> None:
        self.opts = opts
        self.socket_path = socket_path
        self.state: State = "connecting"
        self.stats: Counter[str] = Counter()
        self.errors: deque[str] = deque(maxlen=50)
        self._on_command = on_command
        self._deliver = deliver
        self._queue: asyncio.Queue[Command] = asyncio.Queue()
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._received_epoch = opts.epoch
        self._pending_failure: Command | None = None

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
        self._received_epoch = max(self._received_epoch, int(welcome.get("epoch", 0)))
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

    def _accept(self, c: wire.Command) -> None:
        if c.epoch <= self._received_epoch:
            self.stats["dropped_stale"] += 1
            return
        self._received_epoch = c.epoch
        command = Command.from_wire(c, time.time())
        self.stats[f"commands.{c.kind}"] += 1
        if command.is_failure:
            self._pending_failure = command
        if self._deliver is not None:
            self._deliver(command)
        else:
            self._queue.put_nowait(command)
        if self._on_command is not None:
            try:
                self._on_command(command)
            except Exception as e:
                self._record(f"on_command callback raised {type(e).__name__}: {e}")

    def _record(self, message: str) -> None:
        self.errors.append(f"{time.strftime('%H:%M:%S')} {message}")
        log.warning("%s", message)

    async def _send(self, msg: dict[str, Any]) -> None:
        if self._writer is None or self._writer.is_closing():
            return
        try:
            self._writer.write(json.dumps(msg).encode() + b"\n")
            await self._writer.drain()
        except (OSError, RuntimeError) as e:
            self._record(f"cannot reach the local agent: {e}")

    # --- the AsyncClient interface ---------------------------------------------------------------

    async def wait(self, timeout: float | None = None) -> Command | None:
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None

    @property
    def failed(self) -> bool:
        return self._pending_failure is not None

    @property
    def last_failure(self) -> Command | None:
        return self._pending_failure

    @property
    def epoch(self) -> int:
        return self._received_epoch

    async def ack(self, command: Command | None = None) -> bool:
        """Clears ``failed``; the supervisor confirms epochs to the controller itself."""
        command = command or self._pending_failure
        pending = self._pending_failure
        if command is not None and pending is not None and command.epoch >= pending.epoch:
            self._pending_failure = None
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
