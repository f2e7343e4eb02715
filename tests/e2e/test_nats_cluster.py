"""A real 3-node JetStream cluster loses nothing when one node is SIGKILLed.

nats-py only, no Marduk controller: what is proved here is the ground Marduk stands on with
``--kv-replicas 3`` and ``MARDUK_ADDR`` listing every node. A key-value bucket configured as
Marduk's state bucket and a stream standing in for the health stream, both with 3 replicas, keep
every acknowledged write when any one node dies, including the node the client is connected
to; the client moves to another node, new writes succeed, and the restarted node rejoins.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType, StreamConfig
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError
from nats.js.kv import KeyValue

from tests.nats_cluster import NatsCluster, nats_cluster

__all__ = ["nats_cluster"]  # the fixture, imported for pytest

pytestmark = pytest.mark.e2e

T = TypeVar("T")
BUCKET = "cluster_state"
STREAM = "cluster_health"
SUBJECT = "cluster.health"
# How long the cluster may take to elect new leaders after a kill or to catch a node up. Raft
# election timeouts in nats-server are several seconds; this is a deadline, not a wait.
RECOVERY_S = 30.0

# While the cluster elects a new leader for a stream (after its leader was killed) JetStream
# requests time out, get 503, or find no responder (only a stream's leader takes its
# publishes); while the client reconnects they time out too. Those are the only errors we
# retry; anything else fails the test at once.
TRANSIENT = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    NoStreamResponseError,
    ServiceUnavailableError,
)


async def retrying(op: Callable[[], Awaitable[T]], timeout: float = RECOVERY_S) -> T:
    """``op()``, retried on transient cluster errors until ``timeout`` runs out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await op()
        except TRANSIENT:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def eventually(
    predicate: Callable[[], Awaitable[bool]], what: str, timeout: float = RECOVERY_S
) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not reached within {timeout:g}s")
        await asyncio.sleep(0.02)


class Writer:
    """A client on every node's URL, writing to an R3 bucket and an R3 stream."""

    def __init__(self, nc: NATS, js: JetStreamContext, kv: KeyValue) -> None:
        self.nc, self.js, self.kv = nc, js, kv
        self.written = 0
        self.disconnects = 0

    async def write(self, n: int) -> None:
        """``n`` more writes to both; each returns only once JetStream has acknowledged it."""
        for _ in range(n):
            i = self.written
            await retrying(lambda i=i: self.kv.put(f"k{i}", f"v{i}".encode()))  # type: ignore[misc]
            # A publish that timed out may still have been stored: the message id makes the
            # retry a duplicate JetStream drops, so the stream holds each event once.
            await retrying(
                lambda i=i: self.js.publish(  # type: ignore[misc]
                    SUBJECT, f"e{i}".encode(), headers={"Nats-Msg-Id": f"e{i}"}
                )
            )
            self.written += 1

    async def check_all(self) -> None:
        """Every acknowledged write is readable, in order, none lost or doubled."""
        for i in range(self.written):
            entry = await retrying(lambda i=i: self.kv.get(f"k{i}"))  # type: ignore[misc]
            assert entry.value == f"v{i}".encode()
        info = await retrying(lambda: self.js.stream_info(STREAM))
        assert info.state.messages == self.written
        for seq in range(1, self.written + 1):
            msg = await retrying(lambda seq=seq: self.js.get_msg(STREAM, seq))  # type: ignore[misc]
            assert msg.data == f"e{seq - 1}".encode()


@pytest.fixture
async def writer(nats_cluster: NatsCluster) -> AsyncIterator[Writer]:
    box: list[Writer] = []

    async def disconnected() -> None:
        if box:
            box[0].disconnects += 1

    async def quiet(e: Exception) -> None:
        """nats-py's default error callback prints a traceback per failed reconnect."""

    nc = await nats.connect(
        nats_cluster.servers,
        reconnect_time_wait=0.1,
        max_reconnect_attempts=-1,
        disconnected_cb=disconnected,
        error_cb=quiet,
    )
    # Short request timeouts: a request lost in a leader change is retried sooner.
    js = nc.jetstream(timeout=1.0)
    # As Marduk's StateStore makes its bucket, with --kv-replicas 3.
    kv = await js.create_key_value(
        KeyValueConfig(bucket=BUCKET, history=1, storage=StorageType.FILE, replicas=3)
    )
    await js.add_stream(
        StreamConfig(name=STREAM, subjects=[SUBJECT], storage=StorageType.FILE, num_replicas=3)
    )
    w = Writer(nc, js, kv)
    box.append(w)
    yield w
    await nc.close()


async def all_current(js: JetStreamContext, cluster: NatsCluster) -> bool:
    """Both streams have a leader and every other node as a current, online replica."""
    for stream in (STREAM, f"KV_{BUCKET}"):
        try:
            info = await js.stream_info(stream)
        except TRANSIENT:
            return False
        c = info.cluster
        if c is None or not c.leader:
            return False
        followers = {p.name for p in c.replicas or [] if p.current and not p.offline}
        if {c.leader} | followers != {n.name for n in cluster.nodes}:
            return False
    return True


async def leader_of(js: JetStreamContext, stream: str) -> str | None:
    try:
        info = await js.stream_info(stream)
    except TRANSIENT:
        return None
    return info.cluster.leader if info.cluster else None


async def move_leaders(w: Writer, name: str, timeout: float = 20.0) -> None:
    """Make node ``name`` the leader of both streams, so that killing it forces elections.

    A stepdown with a preferred server (nats-server 2.11+) hands leadership over at once; it is
    asked again if the handover has not happened within a couple of seconds.
    """
    for stream in (STREAM, f"KV_{BUCKET}"):
        deadline = time.monotonic() + timeout
        answer: object = None
        while (leader := await leader_of(w.js, stream)) != name:
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} does not lead {stream}: {leader=}, {answer=}")
            if leader is None:  # mid-election, or the request was lost in the handover
                continue
            try:
                reply = await w.nc.request(
                    f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}",
                    json.dumps({"placement": {"preferred": name}}).encode(),
                    timeout=1.0,
                )
                answer = reply.data
            except TRANSIENT as e:
                answer = e
            handover = time.monotonic() + 2.0
            while time.monotonic() < handover:
                if await leader_of(w.js, stream) != leader:
                    break
                await asyncio.sleep(0.02)


async def test_the_cluster_is_three_routed_jetstream_nodes(
    nats_cluster: NatsCluster, writer: Writer
) -> None:
    assert nats_cluster.urls == ",".join(nats_cluster.url(i) for i in range(3))
    await eventually(lambda: all_current(writer.js, nats_cluster), "3 current replicas")
    for i, node in enumerate(nats_cluster.nodes):
        nc = await nats.connect(node.url, allow_reconnect=False)
        try:
            # nats-py has no public accessor for the INFO it got; server_name is in it.
            assert nc._server_info["server_name"] == node.name
            assert nats_cluster.node_of(nc) == i
            # A node tells its clients the URLs of the peers it learned over its routes.
            peers = {n.port for n in nats_cluster.nodes if n is not node}
            await eventually(
                lambda nc=nc, peers=peers: _discovered(nc, peers),  # type: ignore[misc]
                f"{node.name} advertises its peers",
                timeout=5,
            )
        finally:
            await nc.close()


async def _discovered(nc: NATS, ports: set[int]) -> bool:
    await nc.flush()
    return {u.port for u in nc.discovered_servers} >= ports


async def test_killing_the_clients_node_loses_nothing(
    nats_cluster: NatsCluster, writer: Writer
) -> None:
    await writer.write(20)
    victim = nats_cluster.node_of(writer.nc)
    # The worst case: the node the client is on also leads both streams.
    await move_leaders(writer, nats_cluster.name(victim))

    t0 = time.monotonic()
    nats_cluster.kill(victim)
    await eventually(
        lambda: _connected_elsewhere(writer.nc, nats_cluster, victim), "client moved to a peer"
    )
    t_reconnect = time.monotonic() - t0
    assert writer.disconnects == 1
    await writer.check_all()
    await writer.write(20)
    t_writes = time.monotonic() - t0
    await writer.check_all()

    t0 = time.monotonic()
    await nats_cluster.restart(victim)
    await eventually(lambda: all_current(writer.js, nats_cluster), "restarted node current")
    t_rejoin = time.monotonic() - t0
    await writer.write(5)
    await writer.check_all()
    print(
        f"\nkilled {nats_cluster.name(victim)} (the client's node): reconnected {t_reconnect:.2f}s, "
        f"writes again {t_writes:.2f}s; rejoined current {t_rejoin:.2f}s"
    )


async def test_killing_another_node_keeps_the_client_where_it_is(
    nats_cluster: NatsCluster, writer: Writer
) -> None:
    await writer.write(20)
    home = nats_cluster.node_of(writer.nc)
    victim = (home + 1) % len(nats_cluster.nodes)
    # The victim leads both streams, so that new leaders must be elected while the client stays.
    await move_leaders(writer, nats_cluster.name(victim))

    t0 = time.monotonic()
    nats_cluster.kill(victim)
    await writer.write(20)
    t_writes = time.monotonic() - t0
    await writer.check_all()
    assert nats_cluster.node_of(writer.nc) == home
    assert writer.disconnects == 0

    t0 = time.monotonic()
    await nats_cluster.restart(victim)
    await eventually(lambda: all_current(writer.js, nats_cluster), "restarted node current")
    t_rejoin = time.monotonic() - t0
    await writer.check_all()
    print(
        f"\nkilled {nats_cluster.name(victim)} (not the client's node): "
        f"writes again {t_writes:.2f}s; rejoined current {t_rejoin:.2f}s"
    )


async def _connected_elsewhere(nc: NATS, cluster: NatsCluster, victim: int) -> bool:
    return nc.is_connected and cluster.node_of(nc) != victim
