"""The supervisor's end of the trainer channel (agent/channel/messages.py): a unix socket."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

from agent.channel.messages import (
    MAX_LINE,
    Answer,
    ForwardedCommand,
    ForwardedParams,
    Request,
    ToAgent,
    TrainerHello,
    Welcome,
    decode_to_agent,
    encode,
    messages,
)
from marduk.aio import RateLimitedLog
from marduk.wire import protocol as wire

log = logging.getLogger("agent.trainer_channel")


class TrainerChannel:
    """The unix socket a supervisor serves its trainers on.

    Each trainer's ``hello`` is answered with ``welcome`` at ``epoch()``; its other messages go
    to ``on_message``. ``forward`` sends a command to every trainer connected. Bad messages are
    counted in ``stats["channel_bad_messages"]`` and logged (a few a minute), never fatal.
    """

    def __init__(
        self,
        path: str,
        on_message: Callable[[ToAgent], Awaitable[None]],
        epoch: Callable[[], int],
        stats: Counter[str],
    ) -> None:
        self.path = path
        self._on_message = on_message
        self._epoch = epoch
        self.stats = stats
        self._server: asyncio.Server | None = None
        self._trainers: set[asyncio.StreamWriter] = set()
        # The job's live parameters to hand a trainer at its welcome (None: none set).
        self.params: Callable[[], wire.JobParams | None] = lambda: None
        # Who answers the trainer's requests (``client.request``); None: refused, as unserved.
        self.on_request: Callable[[Request], Awaitable[Answer]] | None = None
        self._answering: set[asyncio.Task[None]] = set()
        self._bad_lines = RateLimitedLog(
            log, more="(more bad messages from the trainer this minute are counted, not logged)"
        )

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, self.path, limit=MAX_LINE)
        os.chmod(self.path, 0o600)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    async def forward(self, command: wire.Command) -> None:
        """Tell the trainer's library (if it connected) why it is about to be stopped."""
        await self._to_all(encode(ForwardedCommand(command=command)))

    async def forward_params(self, params: wire.JobParams) -> None:
        """A newer version of the job's live parameters, to every trainer connected."""
        await self._to_all(encode(ForwardedParams(params=params)))

    async def _to_all(self, line: bytes) -> None:
        for writer in list(self._trainers):
            with contextlib.suppress(OSError, RuntimeError, TimeoutError):
                writer.write(line)
                await asyncio.wait_for(writer.drain(), 1.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._trainers.add(writer)
        try:
            async for msg in messages(reader, decode_to_agent, self._bad):
                if isinstance(msg, TrainerHello):
                    # A new incarnation starts with the job's current live parameters.
                    writer.write(encode(Welcome(epoch=self._epoch(), params=self.params())))
                    await writer.drain()
                    if not msg.peer_notices:
                        continue
                if isinstance(msg, Request):
                    # Answered in a task: a request may wait seconds for the controller, and
                    # the trainer's steps on this channel must not wait behind it.
                    task = asyncio.create_task(self._answer(msg, writer))
                    self._answering.add(task)
                    task.add_done_callback(self._answering.discard)
                    continue
                try:
                    await self._on_message(msg)
                except Exception:  # the supervisor's bug: logged, the channel goes on
                    self.stats["channel_errors"] += 1
                    log.exception("handling %r from the trainer's library", msg)
        except OSError:
            pass  # the trainer went away
        finally:
            self._trainers.discard(writer)
            writer.close()

    async def _answer(self, req: Request, writer: asyncio.StreamWriter) -> None:
        try:
            if self.on_request is None:
                answer = Answer(id=req.id, accepted=False, detail="this agent takes no requests")
            else:
                answer = await self.on_request(req)
        except Exception:  # the supervisor's bug: logged, the trainer still gets an answer
            self.stats["channel_errors"] += 1
            log.exception("answering %r from the trainer's library", req)
            answer = Answer(id=req.id, accepted=False, detail="the agent failed to answer")
        with contextlib.suppress(OSError, RuntimeError, TimeoutError):
            writer.write(encode(answer))
            await asyncio.wait_for(writer.drain(), 1.0)

    def _bad(self, why: str) -> None:
        self.stats["channel_bad_messages"] += 1
        self._bad_lines.log(
            "bad", logging.WARNING, "bad message from the trainer's library, skipped: %s", why
        )


class TrainerChannels:
    """One channel per local rank (its index passed to ``on_message``), opened, forwarded to
    and closed together."""

    def __init__(self) -> None:
        self.channels: list[TrainerChannel] = []

    async def open(
        self,
        paths: Sequence[str],
        on_message: Callable[[int, ToAgent], Awaitable[None]],
        epoch: Callable[[], int],
        stats: Counter[str],
    ) -> None:
        for index, path in enumerate(paths):
            channel = TrainerChannel(path, functools.partial(on_message, index), epoch, stats)
            await channel.start()
            self.channels.append(channel)

    def connected(self) -> list[bool]:
        """Whether each rank's library is connected."""
        return [bool(c._trainers) for c in self.channels]

    async def forward(self, command: wire.Command) -> None:
        """To every trainer connected, rank by rank."""
        for channel in self.channels:
            await channel.forward(command)

    def hand_params(self, params: Callable[[], wire.JobParams | None]) -> None:
        """Where each channel reads the parameters it hands a trainer at its welcome."""
        for channel in self.channels:
            channel.params = params

    def hand_requests(self, on_request: Callable[[int, Request], Awaitable[Answer]]) -> None:
        """Who answers each rank's requests (its index passed first)."""
        for index, channel in enumerate(self.channels):
            channel.on_request = functools.partial(on_request, index)

    async def forward_params(self, params: wire.JobParams) -> None:
        for channel in self.channels:
            await channel.forward_params(params)

    def close(self) -> None:
        for channel in self.channels:
            channel.close()
