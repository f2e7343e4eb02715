"""Marduk on a real 3-node NATS JetStream cluster.

Buckets and the health stream with 3 replicas, two controllers (leader and hot standby). Killing
any node, the one the leader is connected to included, loses nothing that was accepted, and
targeted notices work again once JetStream has re-elected its stream leaders.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent.library.client import connect_async
from marduk.controller import Controller, ControllerSettings
from monitor_cli import client as monitor
from tests.conftest import eventually
from tests.nats_cluster import NatsCluster, nats_cluster

__all__ = ["nats_cluster"]  # the fixture, imported for pytest
pytestmark = pytest.mark.e2e


def settings(cluster: NatsCluster, tmp_path: Path, name: str) -> ControllerSettings:
    return ControllerSettings(
        addr=cluster.urls, embedded=False, state_dir=tmp_path / name, kv_replicas=3
    )


@pytest.mark.parametrize("victim", ["leader's node", "another node"])
async def test_losing_a_node_loses_nothing_and_notices_keep_working(
    nats_cluster: NatsCluster, tmp_path: Path, victim: str
) -> None:
    a = Controller(settings(nats_cluster, tmp_path, "a"))
    b = Controller(settings(nats_cluster, tmp_path, "b"))
    await asyncio.gather(a.start(), b.start())
    await eventually(lambda: a.serving.is_set() or b.serving.is_set(), timeout=20)
    assert not (a.serving.is_set() and b.serving.is_set())
    r1 = await connect_async("r1", ["d1"], addr=nats_cluster.urls, timeout=20)
    r2 = await connect_async("r2", ["d2"], addr=nats_cluster.urls, timeout=20)
    try:
        reply = await monitor.publish_health(nats_cluster.urls, "marduk", "d1", "failed")
        assert [x.replica for x in reply.actions] == ["r1"]
        first = await r1.wait(10)
        assert first is not None and first.epoch == 1
        await r1.ack()

        leader = a if a.serving.is_set() else b
        assert leader.nc is not None
        node = nats_cluster.node_of(leader.nc)
        if victim == "another node":
            node = (node + 1) % 3
        nats_cluster.kill(node)

        # Notices work again: the monitor retries until the stream has a leader and a
        # controller serves (seconds: a JetStream election, then the lease).
        reply = await monitor.publish_health(
            nats_cluster.urls, "marduk", "d2", "failed", timeout=60
        )
        assert [x.replica for x in reply.actions] == ["r2"]
        got = await r2.wait(10)
        assert got is not None and got.devices == ("d2",)
        # Nothing accepted was lost: the map, and r1's epoch, survived.
        status = await monitor.query(nats_cluster.urls, "marduk", "map", timeout=10)
        assert {w.replica for w in status.workers} == {"r1", "r2"}
        assert {w.replica: w.epoch for w in status.workers}["r1"] == 1
        reply = await monitor.publish_health(nats_cluster.urls, "marduk", "d1", "failed")
        again = await r1.wait(10)
        assert again is not None and again.epoch > first.epoch
        # Still exactly one serving.
        assert [c.serving.is_set() for c in (a, b)].count(True) == 1
    finally:
        await r1.close()
        await r2.close()
        await asyncio.gather(a.stop(), b.stop())


async def test_a_controller_started_before_jetstream_has_a_quorum_waits_for_it(
    nats_cluster: NatsCluster, tmp_path: Path
) -> None:
    """A controller started with its cluster (one node of three up: JetStream has no quorum and
    cannot answer) waits for JetStream instead of exiting, and serves once it is back."""
    nats_cluster.kill(1)
    nats_cluster.kill(2)
    c = Controller(settings(nats_cluster, tmp_path, "c"))
    starting = asyncio.create_task(c.start())
    try:
        await asyncio.sleep(6.0)  # past one JetStream API timeout (5 s): it would have exited
        assert not starting.done(), starting.exception() if starting.done() else None
        await asyncio.gather(nats_cluster.restart(1), nats_cluster.restart(2))
        await asyncio.wait_for(starting, 40)
        await eventually(c.serving.is_set, timeout=20)
    finally:
        if not starting.done():
            starting.cancel()
        await c.stop()
