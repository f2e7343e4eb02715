"""Every reply fits (docs/decisions.md #12): the pager, pure, and status at scale, real."""

from __future__ import annotations

import asyncio
import json
import uuid

import nats
import pytest
from hypothesis import given
from hypothesis import strategies as st

from marduk.controller import Controller
from marduk.core.paging import page_end
from marduk.wire import protocol as wire
from marduk.wire.protocol import encode
from marduk.wire.subjects import Subjects
from tests.conftest import NatsServer, marduk_cli


@given(st.lists(st.integers(min_value=1, max_value=500), max_size=200), st.integers(1, 2000))
def test_pages_cover_every_item_once_and_fit_unless_one_item_alone_is_larger(
    sizes: list[int], budget: int
) -> None:
    start, seen = 0, []
    while start < len(sizes):
        end = page_end(sizes, start, budget)
        assert end > start  # progress: at least one item per page
        cost = sum(s + 1 for s in sizes[start:end])
        assert cost <= budget or end == start + 1
        seen.extend(range(start, end))
        start = end
    assert seen == list(range(len(sizes)))


@pytest.mark.e2e
@pytest.mark.timeout(240)
async def test_status_of_2000_replicas_with_nvml_uuids_is_paged_and_complete(
    controller: Controller, nats_server: NatsServer
) -> None:
    """About 2.5 MB of map: over NATS's 1 MiB max payload, so it must come in pages."""
    s = Subjects()
    nc = await nats.connect(nats_server.url)
    replicas = 2000
    try:
        for i in range(replicas):
            reg = wire.Registration(
                job="big",
                replica=f"r{i:04d}",
                host=f"host-{i // 4:04d}.cluster.example.com",
                devices=[f"GPU-{uuid.uuid4()}" for _ in range(8)],
                pid=10_000 + i,
            )
            msg = await nc.request(s.register("big"), encode(reg), timeout=10)
            assert wire.decode(msg.data, wire.RegisterReply).outcome == "new"
    finally:
        await nc.close()
    env = {"MARDUK_ADDR": nats_server.url}
    # In a thread: the controller runs on this test's event loop and must keep serving.
    r = await asyncio.to_thread(marduk_cli, "monitor", "status", "--json", env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout) > 1_100_000  # the whole answer is larger than one NATS message
    status = json.loads(r.stdout)
    assert len(status["workers"]) == replicas and status["total_workers"] == replicas
    assert len(status["devices"]) == replicas * 8 == status["total_devices"]
    assert len({w["replica"] for w in status["workers"]}) == replicas
    assert controller.stats["queries.pages"] >= 3
    assert controller.stats["errors.reply_too_large"] == 0
    # The human view too, piped: complete and no traceback.
    r = await asyncio.to_thread(marduk_cli, "monitor", "status", env=env, timeout=120)
    assert r.returncode == 0 and "2,000 workers, 16,000 devices" in r.stdout, r.stderr[-2000:]
