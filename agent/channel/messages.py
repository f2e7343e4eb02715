"""The trainer channel's messages: between a supervised trainer's library and its ``marduk agent
run``.

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
                       {"op": "perf", "summary": {...a wire PerfSummary...}}   (once a window)
                       {"op": "request", "id": 1, "kind": "exclude_node", "reason": "..."}
                       {"op": "saved", "step": 42}   (at a forwarded stop: the last step written)
    agent -> trainer   {"op": "welcome", "epoch": 3}
                       {"op": "command", "command": {...a wire Command...}}
                       {"op": "answer", "id": 1, "accepted": true, "detail": "..."}

Decoding is strict (types checked; a line is capped at ``MAX_LINE`` bytes). A message that
cannot be read is counted and logged, and skipped: it never closes the channel or stops either
end. Steps and heartbeats feed the supervisor's hang detection; an open section whose timeout
passes counts as a hang (NVRx's sections: tighter timeouts around the parts you know).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, Final, TypeVar

import msgspec

from marduk.wire import protocol as wire

# A forwarded command as large as the controller may send fits, with room for the envelope.
MAX_LINE: Final = wire.MAX_MESSAGE_BYTES + 4096


class ChannelError(ValueError):
    """A line on the channel that is not a message this side understands."""


# --- the messages ------------------------------------------------------------------------------


class Message(msgspec.Struct, tag_field="op", kw_only=True, omit_defaults=True):
    """Unknown fields are ignored: a newer library may add optional ones."""


class TrainerHello(Message, tag="hello"):
    """The trainer's library connected; ``peer_notices``: it wants ``peer_failed`` notices (the
    supervisor asks the controller for them and forwards them as they come)."""

    pid: int
    peer_notices: bool = False


class Step(Message, tag="step"):
    step: int


class Heartbeat(Message, tag="heartbeat"):
    pass


class Section(Message, tag="section"):
    """A named part of the loop opened (with an optional timeout in seconds) or closed."""

    name: str
    open: bool
    timeout: float | None = None  # seconds; None: no timeout


class Checkpointed(Message, tag="checkpointed"):
    """The checkpoint the controller asked for is saved at ``step``."""

    step: int


class SavedAtNotice(Message, tag="saved"):
    """At a forwarded ``restart``, ``fail`` or ``stop``: the trainer's snapshots have written
    the last step taken (``step``, the newest in the local store; None: none), so the
    supervisor need not wait longer before stopping it (agent/library/snapshots.py)."""

    step: int | None = None


class Perf(Message, tag="perf"):
    """One window's step and section times (agent/library/perf.py): the supervisor
    publishes it to the controller under its own registration's names."""

    summary: wire.PerfSummary


class Welcome(Message, tag="welcome"):
    """The supervisor's answer to ``hello``: the epoch the trainer was started at, and the
    job's live parameters if any were set (the trainer starts with them)."""

    epoch: wire.Epoch
    params: wire.JobParams | None = None


class ForwardedCommand(Message, tag="command"):
    """A controller command, forwarded just before the supervisor stops the trainer."""

    command: wire.Command


class ForwardedParams(Message, tag="params"):
    """The job's live parameters (decisions.md #20), as the controller sent them, each time a
    newer version comes (the first ones come with the welcome)."""

    params: wire.JobParams


class ParamsApplied(Message, tag="params_applied"):
    """The trainer runs ``version`` of the parameters, except the keys in ``rejected``; the
    supervisor says so to the controller."""

    version: int
    rejected: dict[str, str] = {}


class Request(Message, tag="request"):
    """``client.request(kind, ...)``: the trainer asks the agent (and through it the
    controller) about itself; answered by an ``answer`` with the same ``id``. ``kind`` is any
    string here, so that one the agent does not know is refused with a reason, not dropped."""

    id: int
    kind: str
    device: str | None = None
    reason: str = ""


class Answer(Message, tag="answer"):
    """The agent's answer to the trainer's ``request`` ``id``: done (``accepted``) or refused,
    and why, in ``detail``."""

    id: int
    accepted: bool
    detail: str = ""


ToAgent = (
    TrainerHello
    | Step
    | Heartbeat
    | Section
    | Checkpointed
    | ParamsApplied
    | Perf
    | Request
    | SavedAtNotice
)
ToTrainer = Welcome | ForwardedCommand | ForwardedParams | Answer
M = TypeVar("M", ToAgent, ToTrainer)

_encoder = msgspec.json.Encoder()
_to_agent = msgspec.json.Decoder(ToAgent)
_to_trainer = msgspec.json.Decoder(ToTrainer)


def encode(msg: Message) -> bytes:
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
