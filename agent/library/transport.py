"""How the library reaches its commands: the interface both async clients provide, and the
choice between them.

``AsyncClient`` (agent/library/nats_client.py) registers with the controller over NATS;
``LocalAsyncClient`` (agent/channel/messages.py) talks to the ``marduk agent run`` that started the
trainer. ``connect`` and the synchronous ``Client`` use either through ``AgentClient``, so
neither implementation needs to know the other (nor the facade that wraps them).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from typing import Protocol

from agent.channel.requests import Answered
from agent.library.command import Command, OnCommand
from agent.library.inbox import State
from agent.library.local_client import LocalAsyncClient
from agent.library.nats_client import AsyncClient
from agent.library.options import Options
from agent.library.params import LiveParams, ParamsView
from agent.library.perf import PerfRecorder


class AgentClient(Protocol):
    """What the trainer's side of the library offers, on an asyncio loop."""

    opts: Options
    state: State
    stats: Counter[str]
    errors: deque[str]
    perf: PerfRecorder  # the window's step and section times (agent/library/perf.py)
    last_step: int | None
    last_progress: float
    live: LiveParams
    on_stop: Callable[[Command], int | None] | None

    @property
    def failed(self) -> bool: ...
    @property
    def last_failure(self) -> Command | None: ...
    @property
    def epoch(self) -> int: ...
    @property
    def checkpoint_requested(self) -> bool: ...
    @property
    def params(self) -> ParamsView: ...

    async def start(self) -> None: ...
    async def close(self, *, deregister: bool = True, reason: str = "closed") -> None: ...
    async def wait(self, timeout: float | None = None) -> Command | None: ...
    async def step(self, step: int) -> None: ...
    async def heartbeat(self) -> None: ...
    async def section(self, name: str, open_: bool, timeout: float | None = None) -> None: ...
    async def checkpoint_saved(self, step: int) -> bool: ...
    async def ack(self, command: Command | None = None) -> bool: ...
    async def params_applied(
        self, version: int, rejected: dict[str, str] | None = None
    ) -> bool: ...
    async def request(
        self, kind: str, device: str | None = None, reason: str = "", timeout: float = 10.0
    ) -> Answered: ...
    def _record(self, message: str) -> None: ...


def open_client(
    opts: Options, on_command: OnCommand | None, deliver: Callable[[Command], None] | None
) -> AgentClient:
    """Under ``marduk agent run`` (``opts.agent_socket``), talk to it; else to the controller."""
    if opts.agent_socket:
        return LocalAsyncClient(opts, opts.agent_socket, on_command, deliver=deliver)
    return AsyncClient(opts, on_command, deliver=deliver)
