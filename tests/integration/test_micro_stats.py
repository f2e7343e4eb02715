"""What `nats micro stats` shows of the controller's endpoints (a real nats-server)."""

from __future__ import annotations

import json
from typing import Any

import nats

from marduk.controller import Controller
from marduk.wire.protocol import ErrorReply, Forget, ForgetReply, Query, QueryReply, decode, encode
from tests.conftest import NatsServer


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
        msg = await nc.request(s.forget, encode(Forget(job="nobody")), timeout=5)
        assert decode(msg.data, ForgetReply).removed == []
        msg = await nc.request(s.query, encode(Query()), timeout=5)
        assert decode(msg.data, QueryReply).controller.controller_id == controller.controller_id
        junk = await nc.request(s.query, b"{not json", timeout=5)
        assert decode(junk.data, ErrorReply).code == "malformed"  # the wire answer as before
        after = await _stats(nc)
    finally:
        await nc.close()
    assert after["forget"]["num_requests"] == 1
    assert after["forget"]["processing_time"] > 0  # ns: the decision and its commit
    assert after["query"]["num_requests"] == 2
    assert after["query"]["average_processing_time"] > 0
    # A rejected request is answered with an ErrorReply (the wire contract), not raised.
    assert after["query"]["num_errors"] == 0
