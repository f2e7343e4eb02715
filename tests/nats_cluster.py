"""A real N-node nats-server cluster on loopback, JetStream on every node, for tests.

Each node is a ``nats-server -c FILE`` process with its own client port, route port, JetStream
store and log under a per-node directory. Routes go to every peer; the cluster name is shared.
``start()`` returns once every node listens, the JetStream meta group has a leader and counts
every node as a current peer (seen in each node's ``/jsz``), and every node answers
``$JS.API.INFO``.

    cluster = NatsCluster(tmp_path)
    await cluster.start()
    nc = await nats.connect(cluster.servers)  # cluster.urls: the same, as MARDUK_ADDR
    cluster.kill(cluster.node_of(nc))         # SIGKILL the node this client is connected to
    await cluster.restart(i)                  # same ports, same store: it rejoins
    cluster.stop()
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS

from marduk.transport.children import die_with_parent
from marduk.transport.embedded import find_binary, listening
from tests.conftest import free_port

CLUSTER_NAME = "marduk-test"


class NatsNode:
    """One member of a :class:`NatsCluster`: its ports, directory and process."""

    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.port = free_port()
        self.route_port = free_port()
        self.monitor_port = free_port()
        self.dir = root / name
        self.config = self.dir / "nats.conf"
        self.store = self.dir / "jetstream"
        self.log = self.dir / "nats-server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def write_config(self, peers: list[NatsNode]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        routes = ", ".join(f'"nats-route://127.0.0.1:{p.route_port}"' for p in peers)
        # server_name must be unique and stable across restarts: JetStream's Raft groups
        # know their peers by it, and a restarted node rejoins under the same name.
        self.config.write_text(
            f'server_name: "{self.name}"\n'
            f'listen: "127.0.0.1:{self.port}"\n'
            f'log_file: "{self.log}"\n'
            # Monitoring: /jsz shows the JetStream meta group, which no client API does.
            f'http: "127.0.0.1:{self.monitor_port}"\n'
            "jetstream {\n"
            f'  store_dir: "{self.store}"\n'
            "  max_memory_store: 64MB\n"
            "  max_file_store: 1GB\n"
            "}\n"
            "cluster {\n"
            f'  name: "{CLUSTER_NAME}"\n'
            f'  listen: "127.0.0.1:{self.route_port}"\n'
            f"  routes: [{routes}]\n"
            "}\n"
        )

    def spawn(self) -> None:
        self.proc = subprocess.Popen(
            [find_binary(), "-c", str(self.config)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # A killed test run does not leave servers behind.
            preexec_fn=die_with_parent,
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:])


class NatsCluster:
    """``size`` nats-server processes on 127.0.0.1, routed to each other, JetStream on each."""

    def __init__(self, root: Path, size: int = 3) -> None:
        self.nodes = [NatsNode(f"n{i + 1}", root) for i in range(size)]
        for node in self.nodes:
            node.write_config([p for p in self.nodes if p is not node])

    @property
    def urls(self) -> str:
        """Every node's client URL, comma-separated: the form MARDUK_ADDR takes."""
        return ",".join(n.url for n in self.nodes)

    @property
    def servers(self) -> list[str]:
        """The same URLs as a list, which is what ``nats.connect`` takes."""
        return [n.url for n in self.nodes]

    def url(self, i: int) -> str:
        return self.nodes[i].url

    def name(self, i: int) -> str:
        return self.nodes[i].name

    def index(self, server_name: str) -> int:
        """The index of the node called ``server_name`` (as JetStream cluster info names it)."""
        for i, node in enumerate(self.nodes):
            if node.name == server_name:
                return i
        raise KeyError(server_name)

    def node_of(self, nc: NATS) -> int:
        """The index of the node ``nc`` is connected to now (matched by client port)."""
        url = nc.connected_url
        if url is None or not nc.is_connected:
            raise RuntimeError("client is not connected")
        for i, node in enumerate(self.nodes):
            if url.port == node.port:
                return i
        raise RuntimeError(f"client is connected to {url.netloc}, not a node of this cluster")

    async def start(self, timeout: float = 30.0) -> NatsCluster:
        """Start every node; return once each listens and JetStream answers on each."""
        for node in self.nodes:
            node.spawn()
        try:
            await self.wait_ready(range(len(self.nodes)), timeout)
        except BaseException:
            self.stop()
            raise
        return self

    async def wait_ready(self, indices: range | list[int], timeout: float = 30.0) -> None:
        """Wait until the given nodes listen, the JetStream meta group is complete, and each
        given node answers ``$JS.API.INFO``."""
        deadline = time.monotonic() + timeout
        for i in indices:
            node = self.nodes[i]
            while not listening("127.0.0.1", node.port, 0.1):
                self._check(node, deadline, "did not listen")
                await asyncio.sleep(0.02)
        # A meta leader alone is not enough: two nodes elect one before the third has joined,
        # and an R3 stream created then fails with "no suitable peers for placement".
        while not await self.meta_complete():
            for i in indices:
                self._check(self.nodes[i], deadline, "did not join the JetStream meta group")
            await asyncio.sleep(0.02)
        for i in indices:
            node = self.nodes[i]
            while not await _jetstream_answers(node.url):
                self._check(node, deadline, "JetStream did not answer")
                await asyncio.sleep(0.02)

    async def meta(self, i: int) -> dict[str, Any]:
        """Node ``i``'s view of the JetStream meta group (``meta_cluster`` of its ``/jsz``)."""
        url = f"http://127.0.0.1:{self.nodes[i].monitor_port}/jsz"
        body = await asyncio.to_thread(_get, url)
        meta: dict[str, Any] = json.loads(body).get("meta_cluster") or {}
        return meta

    async def meta_complete(self) -> bool:
        """Every running node follows one meta leader that counts all nodes, and the leader
        sees every running node as current."""
        running = [i for i, n in enumerate(self.nodes) if n.alive()]
        try:
            views = [await self.meta(i) for i in running]
        except OSError:
            return False
        leaders = {v.get("leader") for v in views}
        if len(leaders) != 1 or None in leaders or "" in leaders:
            return False
        if any(v.get("cluster_size") != len(self.nodes) for v in views):
            return False
        (leader,) = leaders
        if leader not in {self.nodes[i].name for i in running}:
            return False
        current = {
            r["name"]
            for r in views[running.index(self.index(leader))].get("replicas") or []
            if r.get("current")
        }
        return current >= {self.nodes[i].name for i in running} - {leader}

    def _check(self, node: NatsNode, deadline: float, what: str) -> None:
        if node.proc is not None and node.proc.poll() is not None:
            raise RuntimeError(
                f"nats-server {node.name} exited with code {node.proc.returncode}: "
                f"{node.log_tail()}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(f"nats-server {node.name} {what} in time: {node.log_tail()}")

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` and wait for it: no goodbye to peers or clients."""
        node = self.nodes[i]
        proc, node.proc = node.proc, None
        if proc is not None:
            proc.kill()
            proc.wait()

    async def restart(self, i: int, timeout: float = 30.0) -> None:
        """Start node ``i`` again on its ports and store; return once JetStream answers on it."""
        node = self.nodes[i]
        if node.alive():
            raise RuntimeError(f"nats-server {node.name} is running")
        node.spawn()
        await self.wait_ready([i], timeout)

    def stop(self) -> None:
        """Terminate, wait, then kill every node. Safe to call twice."""
        for node in self.nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.terminate()
        for node in self.nodes:
            proc, node.proc = node.proc, None
            if proc is None:
                continue
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=1.0) as r:
        return bytes(r.read())


async def _jetstream_answers(url: str) -> bool:
    """True once this one server answers ``$JS.API.INFO``: clustered, that needs a meta leader."""
    try:
        nc = await nats.connect(
            url, allow_reconnect=False, connect_timeout=1, error_cb=_quiet, max_reconnect_attempts=1
        )
    except Exception:
        return False
    try:
        await nc.jetstream(timeout=0.25).account_info()
        return True
    except Exception:
        # Before the meta group has a leader the server answers 503 or not at all.
        return False
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


async def _quiet(e: Exception) -> None:
    """nats-py's default error callback prints a traceback per failed attempt."""


@pytest.fixture
async def nats_cluster(tmp_path: Path) -> AsyncIterator[NatsCluster]:
    """A started 3-node cluster, stopped when the test ends."""
    cluster = NatsCluster(tmp_path / "cluster")
    await cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
