"""A controller's stop finishes the work in flight (kopf's order): nothing new comes in, the
loops stop, then a request being handled gets ``stop_grace_s`` to be answered; one still
running then is cancelled and named in the log. Against a real nats-server."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import msgspec
import nats
import pytest

from marduk.controller import Controller
from marduk.wire import protocol as wire
from marduk.wire.protocol import decode, encode
from marduk.wire.subjects import Subjects
from tests.conftest import NatsServer, controller_settings, start_serving

S = Subjects()

# (endpoint, its subject, a request, its reply): the agents' endpoints run each request in a
# task of its own; the operators' one at a time, in the subscription's handler.
ENDPOINTS: dict[str, tuple[str, msgspec.Struct, msgspec.Struct]] = {
    "deregister": (
        S.deregister("j"),
        wire.Deregistration(job="j", replica="r1"),
        wire.DeregisterReply(known=False),
    ),
    "forget": (S.forget, wire.Forget(job="j"), wire.ForgetReply(removed=["j/r1/0"])),
}


def controller_whose(
    name: str, server: NatsServer, tmp_path: Path, handler_work: asyncio.Event, grace_s: float
) -> tuple[Controller, asyncio.Event]:
    """A controller whose ``name`` handler starts (the event returned is set), waits for
    ``handler_work``, then answers ``ENDPOINTS[name]``'s reply: a request whose decision was
    committed (a stop drains the commits first) and is yet to be answered."""
    settings = controller_settings(server, tmp_path)
    settings.stop_grace_s = grace_s
    c = Controller(settings)
    started = asyncio.Event()

    async def slow(req: msgspec.Struct, subject: str) -> msgspec.Struct | None:
        started.set()
        await handler_work.wait()
        return ENDPOINTS[name][2]

    setattr(c.handlers, name, slow)  # before it serves: the routes are read when it does
    return c, started


@pytest.mark.parametrize("name", sorted(ENDPOINTS))
async def test_a_request_in_flight_at_stop_is_answered(
    nats_server: NatsServer, tmp_path: Path, name: str
) -> None:
    """Before, the connection closed under it: the client waited out its timeout."""
    subject, request, expected = ENDPOINTS[name]
    work = asyncio.Event()
    c, started = controller_whose(name, nats_server, tmp_path, work, grace_s=5.0)
    await start_serving(c)
    nc = await nats.connect(nats_server.url)
    try:
        asked = asyncio.create_task(nc.request(subject, encode(request), timeout=5))
        await asyncio.wait_for(started.wait(), 5)
        stopping = asyncio.create_task(c.stop())
        await asyncio.sleep(0.3)  # the stop is under way: unsubscribed, waiting for the work
        assert not stopping.done() and not asked.done()
        work.set()
        assert decode((await asked).data, type(expected)) == expected
        await asyncio.wait_for(stopping, 5)
    finally:
        work.set()
        await nc.close()
        await c.stop()


async def test_a_request_stuck_at_stop_is_cancelled_after_the_grace_and_named(
    nats_server: NatsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    subject, request, _ = ENDPOINTS["deregister"]
    never = asyncio.Event()
    c, started = controller_whose("deregister", nats_server, tmp_path, never, grace_s=0.3)
    await start_serving(c)
    nc = await nats.connect(nats_server.url)
    try:
        asked = asyncio.create_task(nc.request(subject, encode(request), timeout=3))
        await asyncio.wait_for(started.wait(), 5)
        caplog.set_level(logging.WARNING)
        began = time.monotonic()
        await asyncio.wait_for(c.stop(), 5)
        assert 0.3 <= time.monotonic() - began < 3.0  # the grace, then the cancel: not more
        stuck = [r.getMessage() for r in caplog.records if "grace, cancelled" in r.getMessage()]
        assert stuck == [
            "1 task(s) still running after a 0.3s grace, cancelled: request-deregistration"
        ]
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await asked  # never answered: the client asks again (the next leader)
    finally:
        await nc.close()
        await c.stop()


async def test_a_root_loop_that_will_not_stop_is_named_and_the_stop_goes_on(
    nats_server: NatsServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A loop that swallows its cancellation (a bug, or a library's wait that does) once held
    a stop for ever (a partition test's leader, 120 s): the stop waits ``stop_grace_s`` for
    the loops, names the one still running, and closes NATS all the same."""
    settings = controller_settings(nats_server, tmp_path)
    settings.stop_grace_s = 0.3
    c = await start_serving(Controller(settings))
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # swallowed

    c._spawn(stubborn(), "stubborn-loop")
    try:
        caplog.set_level(logging.WARNING)
        await asyncio.wait_for(c.stop(), 10)
        said = [r.getMessage() for r in caplog.records if "would not stop" in r.getMessage()]
        assert said == ["tasks that would not stop within 0.3s: stubborn-loop"]
        assert c.nc is None  # closed: the stop went on past the loop
    finally:
        release.set()
        await asyncio.sleep(0)
