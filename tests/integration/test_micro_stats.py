"""What `nats micro stats` shows of the controller's endpoints (a real nats-server)."""

from __future__ import annotations

import json
from typing import Any

import nats
import nats.errors
import pytest

from marduk.controller import Controller
from marduk.wire import protocol as wire
from tests.conftest import NatsServer, eventually


async def _stats(nc: Any) -> dict[str, dict[str, Any]]:
    stats = json.loads((await nc.request("$SRV.STATS.marduk", b"", timeout=5)).data)
    return {e["name"]: e for e in stats["endpoints"]}


async def test_an_operator_request_is_timed_whole_by_micro_stats(
    controller: Controller, nats_server: NatsServer
) -> None:
    """The operators' endpoints are awaited by micro: the time a forget takes (its commit,
    records written) is in `processing_time`, and its answer comes through the micro request."""
    s = controller.subjects
    nc = await nats.connect(nats_server.url)
    try:
        before = await _stats(nc)
        assert before["forget"]["num_requests"] == 0
        msg = await nc.request(s.forget, wire.encode(wire.Forget(job="nobody")), timeout=5)
        assert wire.decode(msg.data, wire.ForgetReply).removed == []
        msg = await nc.request(s.query, wire.encode(wire.Query()), timeout=5)
        assert (
            wire.decode(msg.data, wire.QueryReply).controller.controller_id
            == controller.controller_id
        )
        junk = await nc.request(s.query, b"{not json", timeout=5)
        assert (
            wire.decode(junk.data, wire.ErrorReply).code == "malformed"
        )  # the wire answer as before
        after = await _stats(nc)
    finally:
        await nc.close()
    assert after["forget"]["num_requests"] == 1
    assert after["forget"]["processing_time"] > 0  # ns: the decision and its commit
    assert after["query"]["num_requests"] == 2
    assert after["query"]["average_processing_time"] > 0
    # A rejected request is answered with an ErrorReply (the wire contract), not raised: micro
    # counts no error; the endpoint's data does, by code.
    assert after["query"]["num_errors"] == 0
    assert after["query"]["data"]["errors"] == {"malformed": 1}
    assert after["query"]["data"]["num_completed"] == 2
    assert after["forget"]["data"]["num_errors"] == 0


async def test_a_concurrent_endpoint_counts_its_real_work_in_the_stats_data(
    controller: Controller, nats_server: NatsServer
) -> None:
    """The agents' endpoints hand each request to a task of its own, so micro's own figures time
    only the hand-off and count no error: the endpoint's `data` counts what each request came
    to (answered, rejected by code, not answered at all) and times it from decoding to answer."""
    s = controller.subjects
    good = wire.encode(wire.Registration(job="j", replica="r", devices=["GPU-0"]))
    elsewhere = wire.encode(wire.Registration(job="other", replica="r", devices=["GPU-1"]))
    nc = await nats.connect(nats_server.url)
    try:
        reply = await nc.request(s.register("j"), good, timeout=5)
        assert wire.decode(reply.data, wire.RegisterReply).outcome == "new"
        junk = await nc.request(s.register("j"), b"{not json", timeout=5)
        assert wire.decode(junk.data, wire.ErrorReply).code == "malformed"
        wrong = await nc.request(s.register("j"), elsewhere, timeout=5)
        assert wire.decode(wrong.data, wire.ErrorReply).code == "subject_mismatch"
        # Not an inbox: refused, and nothing is written there (a confused deputy otherwise).
        spy = await nc.subscribe("marduk.ctl.hello")
        await nc.publish(s.register("j"), good, reply="marduk.ctl.hello")
        await eventually(lambda: controller.stats["rejected.reply_subject"] == 1)
        stats = await _stats(nc)
        with pytest.raises(nats.errors.TimeoutError):
            await spy.next_msg(timeout=0.2)
    finally:
        await nc.close()
    register = stats["register"]
    assert register["num_requests"] == 4
    assert register["num_errors"] == 0  # micro's own: nothing was raised
    data = register["data"]
    assert data["num_completed"] == 4 and data["in_flight"] == 0
    assert data["num_errors"] == 3
    assert data["errors"] == {"malformed": 1, "reply_subject": 1, "subject_mismatch": 1}
    assert data["num_unanswered"] == 1  # the one with no inbox to answer on
    assert data["last_error"] == "reply_subject: not an inbox: marduk.ctl.hello"
    # The whole work of each (decode, decision, records written, answer), in ns: more than the
    # hand-off micro timed.
    assert data["processing_time"] > 0 and data["average_processing_time"] > 0
    assert data["processing_time"] > register["processing_time"]
    # Endpoints that saw nothing say so.
    assert stats["ack"]["data"]["num_completed"] == 0
    assert stats["ack"]["data"]["errors"] == {}
