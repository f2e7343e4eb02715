"""The typed trainer<->agent channel (agent/channel/messages.py): both ends over a real unix socket, and
what a malformed message does (counted, skipped, never fatal). No controller, no processes."""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections import Counter
from collections.abc import AsyncIterator

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.channel import messages
from agent.channel.messages import (
    MAX_LINE,
    ChannelError,
    Checkpointed,
    ForwardedCommand,
    Heartbeat,
    Section,
    Step,
    TrainerHello,
    Welcome,
    decode_to_agent,
    decode_to_trainer,
    encode,
)
from agent.library.client import AgentError, Options
from agent.library.local_client import LocalAsyncClient
from agent.supervise.trainer_channel import TrainerChannel
from marduk.wire import protocol as wire
from tests.conftest import eventually

pytestmark = pytest.mark.timeout(30)

# JSON values shaped like the channel's messages, and not.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["op", "step", "name", "open", "epoch", "command"]), inner
        )
        | st.fixed_dictionaries(
            {"op": st.sampled_from(["hello", "step", "section", "welcome", "command", "x"])},
            optional={"step": inner, "name": inner, "open": inner, "command": inner, "pid": inner},
        )
    ),
    max_leaves=12,
)

COMMAND = wire.Command(command_id="c1", job="j", replica="r1", kind="restart", epoch=4)


def test_the_lines_are_the_documented_ones() -> None:
    # The module docstring documents these; an older library speaks them.
    assert encode(TrainerHello(pid=123)) == b'{"op":"hello","pid":123}\n'
    assert encode(Step(step=42)) == b'{"op":"step","step":42}\n'
    assert encode(Heartbeat()) == b'{"op":"heartbeat"}\n'
    assert encode(Section(name="checkpoint", open=True, timeout=120)) == (
        b'{"op":"section","name":"checkpoint","open":true,"timeout":120}\n'
    )
    assert encode(Section(name="checkpoint", open=False)) == (
        b'{"op":"section","name":"checkpoint","open":false}\n'
    )
    assert encode(Checkpointed(step=42)) == b'{"op":"checkpointed","step":42}\n'
    assert encode(Welcome(epoch=3)) == b'{"op":"welcome","epoch":3}\n'
    forwarded = decode_to_trainer(encode(ForwardedCommand(command=COMMAND))[:-1])
    assert forwarded == ForwardedCommand(command=COMMAND)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        (b"not json", "malformed message"),
        (b'{"op":"launch"}', "invalid message"),
        (b'{"step":1}', "invalid message"),  # no op
        (b'{"op":"step","step":"1"}', "Expected `int`, got `str`"),
        (b'{"op":"step"}', "missing required field `step`"),
        (b'{"op":"section","name":"s"}', "missing required field `open`"),
        (b'{"op":"welcome","epoch":1}', "invalid message"),  # the other direction's
        (b"[" * 5000 + b"]" * 5000, "invalid message"),
        (b'{"op":"step","step":' + b"[" * 5000 + b"]" * 5000 + b"}", "message"),
        (b'{"op":"step","step":1,"x":"\xff"}', "malformed message"),
        (b"x" * (MAX_LINE + 1), f"exceeds {MAX_LINE}"),
    ],
    # Long lines by their size: the id goes into PYTEST_CURRENT_TEST, too long for a child's
    # environment (E2BIG) were a test ever to start one.
    ids=lambda v: f"{len(v)}-bytes" if isinstance(v, bytes) and len(v) > 80 else None,
)
def test_a_malformed_message_is_a_clear_channel_error(line: bytes, says: str) -> None:
    with pytest.raises(ChannelError, match=says):
        decode_to_agent(line)


def test_unknown_fields_are_ignored_for_a_newer_peer() -> None:
    assert decode_to_agent(b'{"op":"step","step":7,"loss":0.1}') == Step(step=7)


@pytest.fixture
async def channel() -> AsyncIterator[tuple[TrainerChannel, list[messages.ToAgent]]]:
    got: list[messages.ToAgent] = []

    async def on_message(msg: messages.ToAgent) -> None:
        if isinstance(msg, Step) and msg.step < 0:
            raise RuntimeError("a handler bug")
        got.append(msg)

    with tempfile.TemporaryDirectory(prefix="marduk-test-") as d:  # short: AF_UNIX paths are
        path = os.path.join(d, "agent.sock")
        server = TrainerChannel(path, on_message, epoch=lambda: 5, stats=Counter())
        await server.start()
        assert os.stat(path).st_mode & 0o777 == 0o600
        try:
            yield server, got
        finally:
            server.close()
        assert os.listdir(d) == []  # the socket is removed


async def test_the_supervisor_end_skips_bad_lines_and_keeps_serving(
    channel: tuple[TrainerChannel, list[messages.ToAgent]],
) -> None:
    server, got = channel
    reader, writer = await asyncio.open_unix_connection(server.path, limit=MAX_LINE)
    writer.write(encode(TrainerHello(pid=1)))
    assert decode_to_trainer((await reader.readline())[:-1]) == Welcome(epoch=5)
    writer.write(b"garbage\n" + b'{"op":"step","step":"x"}\n' + encode(Step(step=1)))
    # A line far over the cap, sent in pieces: skipped whole, the next line is read.
    for _ in range(3):
        writer.write(b"y" * MAX_LINE)
        await writer.drain()
    writer.write(b"\n" + encode(Step(step=-1)) + encode(Heartbeat()))
    await writer.drain()
    await eventually(lambda: len(got) == 2)
    assert got == [Step(step=1), Heartbeat()]
    assert server.stats == Counter({"channel_bad_messages": 3, "channel_errors": 1})
    # Still connected: a forwarded command reaches it.
    await server.forward(COMMAND)
    assert decode_to_trainer((await reader.readline())[:-1]) == ForwardedCommand(command=COMMAND)
    writer.close()


async def test_the_library_end_talks_to_the_supervisor_end(
    channel: tuple[TrainerChannel, list[messages.ToAgent]],
) -> None:
    server, got = channel
    client = LocalAsyncClient(options(), server.path)
    await client.start()
    try:
        assert client.state == "registered" and client.epoch == 5  # the welcome's epoch
        await client.step(9)
        await client.heartbeat()
        await client.section("ckpt", True, timeout=2)
        await client.section("ckpt", False)
        await client.checkpoint_saved(9)
        await eventually(lambda: len(got) == 5)
        assert got == [
            Step(step=9),
            Heartbeat(),
            Section(name="ckpt", open=True, timeout=2.0),
            Section(name="ckpt", open=False),
            Checkpointed(step=9),
        ]
        await server.forward(COMMAND)  # epoch 4, below the welcome's: stale
        await server.forward(msgspec.structs.replace(COMMAND, epoch=6))
        command = await client.wait(5)
        assert command is not None and (command.kind, command.epoch) == ("restart", 6)
        assert client.stats["dropped_stale"] == 1
    finally:
        await client.close()


async def test_the_library_end_counts_a_bad_message_and_stays_connected() -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()  # hello
        writer.write(encode(Welcome(epoch=1)))
        writer.write(b'{"op":"command","command":{"kind":"reboot"}}\n')
        writer.write(encode(Welcome(epoch=2)))  # not expected now
        writer.write(b"z" * (MAX_LINE + 10) + b"\n")
        writer.write(encode(ForwardedCommand(command=COMMAND)))
        await writer.drain()
        await reader.read()

    with tempfile.TemporaryDirectory(prefix="marduk-test-") as d:
        path = os.path.join(d, "agent.sock")
        server = await asyncio.start_unix_server(serve, path)
        client = LocalAsyncClient(options(), path)
        try:
            await client.start()
            command = await client.wait(5)
            assert command is not None and command.epoch == 4
            assert client.stats["bad_commands"] == 3 and client.state == "registered"
            assert any("unexpected Welcome" in e for e in client.errors)
            assert any("invalid message" in e for e in client.errors)
        finally:
            await client.close()
            server.close()


@pytest.mark.parametrize(
    ("answer", "says"),
    [
        (b'{"op":"step","step":1}\n', "invalid message"),
        (b'{"op":"command","command":{}}\n', "invalid message"),
        (b"", "closed the connection before its welcome"),
    ],
)
async def test_a_supervisor_that_answers_nonsense_is_a_clear_connect_error(
    answer: bytes, says: str
) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        writer.write(answer)
        await writer.drain()
        writer.close()

    with tempfile.TemporaryDirectory(prefix="marduk-test-") as d:
        path = os.path.join(d, "agent.sock")
        server = await asyncio.start_unix_server(serve, path)
        try:
            with pytest.raises(AgentError, match=f"cannot reach the local agent at .*{says}"):
                await LocalAsyncClient(options(), path).start()
        finally:
            server.close()


def options() -> Options:
    return Options(
        job="j", replica="r1", worker=0, devices=["a"], addr="", prefix="marduk",
        scope="replica", timeout=5, incarnation=0, epoch=0,
    )  # fmt: skip


@given(st.binary(max_size=512) | st.builds(lambda v: msgspec.json.encode(v), json_values))
def test_any_bytes_decode_to_a_message_or_a_channel_error(line: bytes) -> None:
    for decode in (decode_to_agent, decode_to_trainer):
        try:
            decode(line)
        except ChannelError:
            pass
