"""The trainer's end of the trainer channel (agent/channel/messages.py): the library's client
when ``marduk agent run`` supervises the trainer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable

from agent.channel.messages import (
    MAX_LINE,
    Answer,
    ChannelError,
    Checkpointed,
    ForwardedCommand,
    ForwardedParams,
    Heartbeat,
    Message,
    ParamsApplied,
    Perf,
    Request,
    SavedAtNotice,
    Section,
    Step,
    TrainerHello,
    Welcome,
    decode_to_trainer,
    encode,
    messages,
    read_line,
)
from agent.channel.requests import Answered
from agent.errors import AgentError
from agent.library.command import Command, OnCommand
from agent.library.inbox import CommandInbox
from agent.library.options import Options
from agent.library.perf import sender_for
from marduk.wire import protocol as wire

log = logging.getLogger("agent.local_client")


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
        self._answers: dict[int, asyncio.Future[Answer]] = {}  # requests waiting, by id
        self._last_request = 0

    async def start(self) -> None:
        try:
            reader, self._writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.socket_path, limit=MAX_LINE), self.opts.timeout
            )
            await self._send(TrainerHello(pid=os.getpid(), peer_notices=self.opts.peer_notices))
            line = await asyncio.wait_for(read_line(reader), self.opts.timeout)
            if line is None:
                raise ChannelError("it closed the connection before its welcome")
            welcome = decode_to_trainer(line)
            if not isinstance(welcome, Welcome):
                raise ChannelError(f"expected a welcome, got {welcome!r}")
        except (OSError, TimeoutError, ChannelError) as e:
            raise AgentError(
                f"cannot reach the local agent at {self.socket_path}: {e or type(e).__name__}"
            ) from None
        self.fence = self.fence.adopt(welcome.epoch)
        self.state = "registered"
        if welcome.params is not None:  # in ``params`` before connect returns
            self._take_params(welcome.params)
        self._reader_task = self._tasks.spawn(self._read(reader), "local")
        sender = sender_for(self.opts, self.perf, self._send_perf)
        if sender is not None:
            self._tasks.spawn(sender.run(), "perf")

    async def _send_perf(self, summary: wire.PerfSummary) -> bool:
        await self._send(Perf(summary=summary))
        return True

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            async for msg in messages(reader, decode_to_trainer, self._bad):
                if isinstance(msg, ForwardedCommand):
                    self._accept(msg.command)
                elif isinstance(msg, ForwardedParams):
                    self._take_params(msg.params)
                elif isinstance(msg, Answer):
                    waiting = self._answers.get(msg.id)
                    if waiting is not None and not waiting.done():
                        waiting.set_result(msg)
                else:
                    self._bad(f"unexpected {type(msg).__name__}")
        except OSError as e:
            self._record(f"local agent channel failed: {e}")
        if self.state != "closed":
            self.state = "disconnected"

    def _bad(self, why: str) -> None:
        self.stats["bad_commands"] += 1
        self._record(f"dropped a bad message from the local agent: {why}")

    async def _send(self, msg: Message) -> None:
        if self._writer is None or self._writer.is_closing():
            return
        try:
            self._writer.write(encode(msg))
            await self._writer.drain()
        except (OSError, RuntimeError) as e:
            self._record(f"cannot reach the local agent: {e}")

    async def _ask(self, kind: str, device: str | None, reason: str, timeout: float) -> Answered:
        """The agent decides (and asks the controller where it must): its answer."""
        if self._writer is None or self._writer.is_closing():
            return Answered(False, "not connected to the local agent", "not_connected")
        self._last_request += 1
        rid = self._last_request
        waiting: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._answers[rid] = waiting
        try:
            await self._send(Request(id=rid, kind=kind, device=device, reason=reason))
            answer = await asyncio.wait_for(waiting, timeout)
        except TimeoutError:
            return Answered(
                False, f"the local agent did not answer within {timeout:g}s", "no_answer"
            )
        finally:
            self._answers.pop(rid, None)
        code = "" if answer.accepted else "refused"
        return Answered(answer.accepted, answer.detail, code)

    # --- the AsyncClient interface ---------------------------------------------------------------

    async def _saved_at_notice(self, step: int | None) -> None:
        await self._send(SavedAtNotice(step=step))

    def _nothing_to_save(self) -> None:
        self._spawn(self._saved_at_notice(None), "saved-at-notice")

    async def checkpoint_saved(self, step: int) -> bool:
        """Tell the supervisor; it reports ``checkpointed`` to the controller."""
        self._checkpoint = None
        await self._send(Checkpointed(step=int(step)))
        return True

    async def ack(self, command: Command | None = None) -> bool:
        """Clears ``failed``; the supervisor confirms epochs to the controller itself."""
        self._clear_failure(command)
        return True

    async def params_applied(self, version: int, rejected: dict[str, str] | None = None) -> bool:
        """Tell the supervisor; it says so to the controller."""
        refused = {str(k): str(v)[:256] for k, v in (rejected or {}).items()}
        self.live.acked = (int(version), refused)
        await self._send(ParamsApplied(version=int(version), rejected=refused))
        return True

    def _take_params(self, params: wire.JobParams) -> None:
        ack = self.live.take(params, said_again=False, on_error=self._params_bug)
        if ack is not None:
            self._spawn(self.params_applied(*ack), "params-applied")

    def _params_bug(self, e: Exception) -> None:
        self.stats["errors.on_params"] += 1
        self._record(f"on_params raised {type(e).__name__}: {e}")

    async def step(self, step: int) -> None:
        await self._send(Step(step=int(step)))

    async def heartbeat(self) -> None:
        await self._send(Heartbeat())

    async def section(self, name: str, open_: bool, timeout: float | None = None) -> None:
        await self._send(
            Section(name=name, open=open_, timeout=float(timeout) if timeout else None)
        )

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
