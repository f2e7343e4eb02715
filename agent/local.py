"""The channel between a supervised trainer's library and its ``marduk agent run``: both ends.

The supervisor listens on a unix socket (``TrainerChannel``) and gives its path to the trainer
in MARDUK_AGENT_SOCKET. A trainer that calls ``agent.connect()`` under a supervisor talks to it
(``LocalAsyncClient``) instead of registering a second time: the supervisor's registration
outlives trainer restarts.

JSON lines, one message per line, a msgspec tagged union on ``op``:

    trainer -> agent   {"op": "hello", "pid": 123, "peer_notices": true}
                       {"op": "step", "step": 42}
                       {"op": "heartbeat"}
                       {"op": "section", "name": "checkpoint", "open": true, "timeout": 120}
                       {"op": "section", "name": "checkpoint", "open": false}
                       {"op": "checkpointed", "step": 42}   (the checkpoint asked for is saved)
    agent -> trainer   {"op": "welcome", "epoch": 3}
                       {"op": "command", "command": {...a wire Command...}}

Decoding is strict (types checked; a line is capped at ``MAX_LINE`` bytes). A message that
cannot be read is counted and logged, and skipped: it never closes the channel or stops either
end. Steps and heartbeats feed the supervisor's hang detection; an open section whose timeout
passes counts as a hang (NVRx's sections: tighter timeouts around the parts you know).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final, TypeVar

import msgspec

from agent.command import Command, OnCommand
from agent.errors import AgentError
from agent.inbox import CommandInbox
from agent.options import Options
from marduk.aio import RateLimitedLog
from marduk.wire import protocol as wire

log = logging.getLogger("agent.local")

# A forwarded command as large as the controller may send fits, with room for the envelope.
MAX_LINE: Final = wire.MAX_MESSAGE_BYTES + 4096


class ChannelError(ValueError):
    """A line on the channel that is not a message this side understands."""


# --- the messages ------------------------------------------------------------------------------


class _Message(msgspec.Struct, tag_field="op", kw_only=True, omit_defaults=True):
    """Unknown fields are ignored: a newer library may add optional ones."""


class Hello(_Message, tag="hello"):
    """The trainer's library connected; ``peer_notices``: it wants ``peer_failed`` notices (the
    supervisor asks the controller for them and forwards them as they come)."""

    pid: int
    peer_notices: bool = False


class Step(_Message, tag="step"):
    step: int


class Heartbeat(_Message, tag="heartbeat"):
    pass


class Section(_Message, tag="section"):
    """A named part of the loop opened (with an optional timeout in seconds) or closed."""

    name: str
    open: bool
    timeout: float | None = None  # seconds; None: no timeout


class Checkpointed(_Message, tag="checkpointed"):
    """The checkpoint the controller asked for is saved at ``step``."""

    step: int


class Welcome(_Message, tag="welcome"):
    """The supervisor's answer to ``hello``: the epoch the trainer was started at."""

    epoch: wire.Epoch


class Forward(_Message, tag="command"):
    """A controller command, forwarded just before the supervisor stops the trainer."""

    command: wire.Command


ToAgent = Hello | Step | Heartbeat | Section | Checkpointed
ToTrainer = Welcome | Forward
M = TypeVar("M", ToAgent, ToTrainer)

_encoder = msgspec.json.Encoder()
_to_agent = msgspec.json.Decoder(ToAgent)
_to_trainer = msgspec.json.Decoder(ToTrainer)


def encode(msg: _Message) -> bytes:
    """One line of the channel."""
    return _encoder.encode(msg) + b"\n"


def decode_to_agent(line: bytes) -> ToAgent:
    """A trainer's message, or ChannelError saying what is wrong with it."""
    return _decode(_to_agent, line)  # type: ignore[no-any-return]


def decode_to_trainer(line: bytes) -> ToTrainer:
    """The supervisor's message, or ChannelError saying what is wrong with it."""
    return _decode(_to_trainer, line)  # type: ignore[no-any-return]


def _decode(decoder: msgspec.json.Decoder[Any], line: bytes) -> Any:
    if len(line) > MAX_LINE:
        raise ChannelError(f"message of {len(line)} bytes exceeds {MAX_LINE}")
    try:
        # msgspec checks the UTF-8 only of the strings it keeps (not of unknown fields).
        str(line, "utf-8")
        return decoder.decode(line)
    except msgspec.ValidationError as e:
        raise ChannelError(f"invalid message: {e}") from None
    except Exception as e:  # the peer's bytes (malformed JSON, not UTF-8, nested too deeply)
        raise ChannelError(f"malformed message: {type(e).__name__}: {e}") from None


async def read_line(reader: asyncio.StreamReader) -> bytes | None:
    """The next line (its newline stripped), or None at the end of the stream.

    A line longer than ``MAX_LINE`` (the reader's limit) is skipped whole and raises
    ChannelError; so does a last line cut off without its newline. Either way the next call
    reads on from the next line.
    """
    try:
        return (await reader.readuntil(b"\n"))[:-1]
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise ChannelError(f"message cut off after {len(e.partial)} bytes") from None
    except asyncio.LimitOverrunError as e:
        consumed = e.consumed
    skipped = 0
    with contextlib.suppress(asyncio.IncompleteReadError):  # the end came first: next call sees it
        while True:
            skipped += len(await reader.readexactly(consumed))
            try:
                skipped += len(await reader.readuntil(b"\n"))
                break
            except asyncio.LimitOverrunError as more:
                consumed = more.consumed
    raise ChannelError(f"message of more than {MAX_LINE} bytes ({skipped} skipped)")


async def messages(
    reader: asyncio.StreamReader, decode: Callable[[bytes], M], bad: Callable[[str], None]
) -> AsyncIterator[M]:
    """The messages on ``reader`` until its end; each line that is not one goes to ``bad``."""
    while True:
        try:
            line = await read_line(reader)
            if line is None:
                return
            msg = decode(line)
        except ChannelError as e:
            bad(str(e))
            continue
        yield msg


# --- the supervisor's end ----------------------------------------------------------------------


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
        line = encode(Forward(command=command))
        for writer in list(self._trainers):
            with contextlib.suppress(OSError, RuntimeError, TimeoutError):
                writer.write(line)
                await asyncio.wait_for(writer.drain(), 1.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._trainers.add(writer)
        try:
            async for msg in messages(reader, decode_to_agent, self._bad):
                if isinstance(msg, Hello):
                    writer.write(encode(Welcome(epoch=self._epoch())))
                    await writer.drain()
                    if not msg.peer_notices:
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

    def _bad(self, why: str) -> None:
        self.stats["channel_bad_messages"] += 1
        self._bad_lines.log(
            "bad", logging.WARNING, "bad message from the trainer's library, skipped: %s", why
        )


# --- the trainer's end -------------------------------------------------------------------------


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
        try:
            reader, self._writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.socket_path, limit=MAX_LINE), self.opts.timeout
            )
            await self._send(Hello(pid=os.getpid(), peer_notices=self.opts.peer_notices))
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
        self._reader_task = asyncio.create_task(self._read(reader), name="marduk-agent-local")

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            async for msg in messages(reader, decode_to_trainer, self._bad):
                if isinstance(msg, Forward):
                    self._accept(msg.command)
                else:
                    self._bad(f"unexpected {type(msg).__name__}")
        except OSError as e:
            self._record(f"local agent channel failed: {e}")
        if self.state != "closed":
            self.state = "disconnected"

    def _bad(self, why: str) -> None:
        self.stats["bad_commands"] += 1
        self._record(f"dropped a bad message from the local agent: {why}")

    async def _send(self, msg: _Message) -> None:
        if self._writer is None or self._writer.is_closing():
            return
        try:
            self._writer.write(encode(msg))
            await self._writer.drain()
        except (OSError, RuntimeError) as e:
            self._record(f"cannot reach the local agent: {e}")

    # --- the AsyncClient interface ---------------------------------------------------------------

    async def checkpoint_saved(self, step: int) -> bool:
        """Tell the supervisor; it reports ``checkpointed`` to the controller."""
        self._checkpoint = None
        await self._send(Checkpointed(step=int(step)))
        return True

    async def ack(self, command: Command | None = None) -> bool:
        """Clears ``failed``; the supervisor confirms epochs to the controller itself."""
        self._clear_failure(command)
        return True

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
