"""The controller checks a micro request's reply subject before answering: nats-py's micro
``Request`` has no public accessor for it, so ``edge.reply_subject`` reads the private message.
These tests fail if nats-py moves it, or if ``respond()`` stops answering on that same subject."""

from __future__ import annotations

from typing import Any

from nats.aio.msg import Msg
from nats.micro.request import Request

from marduk.controller.edge import reply_subject


class _Client:
    """Records what ``Request.respond`` publishes (nats-py's client is not needed for that)."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes, **_: Any) -> None:
        self.published.append((subject, data))


def _request(reply: str) -> tuple[Request, _Client]:
    client = _Client()
    msg = Msg(_client=client, subject="marduk.j.register", reply=reply, data=b"{}")  # type: ignore[arg-type]
    return Request(msg), client


async def test_the_reply_subject_checked_is_the_one_respond_answers_on() -> None:
    request, client = _request("_INBOX.agent.abc")
    assert reply_subject(request) == "_INBOX.agent.abc"
    await request.respond(b"ok")
    assert client.published == [("_INBOX.agent.abc", b"ok")]


async def test_respond_would_write_to_any_subject_so_the_check_matters() -> None:
    """Why the edge looks first: micro itself answers on whatever the caller named."""
    request, client = _request("$KV.marduk_state.lease")
    assert reply_subject(request) == "$KV.marduk_state.lease"
    await request.respond(b"x")
    assert client.published == [("$KV.marduk_state.lease", b"x")]


def test_no_reply_subject_reads_as_empty() -> None:
    request, _ = _request("")
    assert reply_subject(request) == ""
