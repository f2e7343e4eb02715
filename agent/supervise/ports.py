"""The agent's look-ups of the machine's ports: a free TCP port to give the ranks as
MASTER_PORT, and whether a rank listens on it yet. Kept apart from the launch contract
(agent/supervise/launch.py), which stays pure."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable

from agent.supervise.launch import LaunchError, LaunchSpec

log = logging.getLogger("agent.supervisor")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host if host not in ("localhost", "") else "127.0.0.1", 0))
        return int(s.getsockname()[1])


def coordinator_ports(count: int = 2, exclude: frozenset[int] = frozenset()) -> list[int]:
    """Free ports (on every address) for the controller to choose the job's coordinator port
    from, if this node becomes rank 0; ``exclude``: the port in use."""
    out: list[int] = []
    while len(out) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        if port not in exclude and port not in out:
            out.append(port)
    return out


def listening(port: int) -> bool:
    """Some process of this network namespace listens on TCP ``port`` (/proc/net/tcp{,6})."""
    suffix = f":{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)  # the header
                for line in f:
                    fields = line.split(None, 4)
                    if len(fields) > 3 and fields[3] == "0A" and fields[1].endswith(suffix):
                        return True
        except OSError:
            continue
    return False


def check_master(spec: LaunchSpec) -> None:
    """On one node, a free MASTER_PORT is picked on ``master_addr`` at each start: it must be
    an address of this machine (LaunchError, one line, if not)."""
    if spec.fixed_port(0) is None:
        try:
            free_port(spec.master_addr)
        except OSError as e:
            raise LaunchError(
                f"--master-addr {spec.master_addr}: not an address of this machine "
                f"({e.strerror}); on one node rank 0 listens there"
            ) from None


def port_for_incarnation(spec: LaunchSpec, epoch: int) -> int:
    """MASTER_PORT for the incarnation started at restart epoch ``epoch``: the spec's
    (``LaunchSpec.fixed_port``), else a free one on ``master_addr``."""
    port = spec.fixed_port(epoch)
    return port if port is not None else free_port(spec.master_addr)


MASTER_WAIT_S = 2.0  # at most, for rank 0 to listen on MASTER_PORT before the others start


class MasterFirst:
    """Rank 0 hosts the rendezvous store at MASTER_PORT (torch's env://) on one node: once it
    listened there after stepping, the next incarnations start the other ranks once it
    listens, instead of them trying it too early and backing off for up to a second."""

    def __init__(self, applies: bool) -> None:
        self.applies = applies  # several local ranks, one node
        self.port = 0  # MASTER_PORT of the current incarnation
        self.wanted = False  # start rank 0 first, the others once it listens

    def stepped(self, rank: int) -> None:
        if rank == 0 and self.applies:
            self.wanted = listening(self.port)

    async def wait(self) -> None:
        """Until rank 0 listens, ``MASTER_WAIT_S`` at most (then no more waiting for it)."""
        deadline = time.monotonic() + MASTER_WAIT_S
        while not listening(self.port):
            if time.monotonic() > deadline:
                log.info("rank 0 did not listen on MASTER_PORT within %gs", MASTER_WAIT_S)
                self.wanted = False
                return
            await asyncio.sleep(0.002)


COORDINATOR_WAIT_S = 2.0  # at most, for the coordinator to accept before this node starts
PROBE_EVERY_S = 0.005  # between connect probes of the coordinator while waiting for it
PROBE_TIMEOUT_S = 0.25  # one connect probe (a refused one returns at once)


def coordinator_first(applies: bool, node_rank: int, nnodes: int, learned: bool) -> bool:
    """Whether this node's trainers start only once the coordinator's address:port accepts:
    for a job across nodes (``applies``: its ranks static or the controller's), on a node that
    does not host the coordinator, and once this agent saw the coordinator accept there in an
    earlier incarnation (``learned``): a job whose trainers never listen there never waits."""
    return applies and nnodes > 1 and node_rank != 0 and learned


def keep_waiting(
    accepted: bool,
    waited_s: float,
    limit_s: float = COORDINATOR_WAIT_S,
    *,
    previous_seen_s: float = 0.0,
    stopping_s: float = 0.0,
) -> bool:
    """While waiting for the coordinator: True to probe again, False to start (it accepted,
    or ``limit_s`` passed: start anyway).

    ``limit_s`` counts from the last time the previous incarnation's coordinator was seen still
    accepting (``previous_seen_s`` into the wait): its agent is still stopping it, so the new
    one cannot listen yet (rank 0's agent starts it once the old one is gone, and a client that
    tried meanwhile would sit in gRPC's reconnect backoff, which grows past 10 s). That wait is
    at most ``stopping_s``, the longest a stop may take (this agent's ``--grace``)."""
    return not accepted and waited_s <= min(previous_seen_s, stopping_s) + limit_s


async def accepts(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """``host:port`` accepts a TCP connection (closed at once, nothing sent).

    Harmless to the servers that listen there, checked with 50 such probes before a real
    client (torch 2.13, jax 0.10.2): torch's TCPStore server (libuv backend) takes a client
    that closes before its validation message as a disconnect, and its log
    (TORCH_CPP_LOG_LEVEL=INFO) is the same as without the probes; JAX's coordination service
    (gRPC) drops a connection closed before the HTTP/2 preface, and its log (GRPC_VERBOSITY=info,
    TF_CPP_MIN_LOG_LEVEL=0) is the same as without them. Both then served a client's set/get."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


class CoordinatorFirst:
    """Across nodes, rank 0's trainer hosts the rendezvous store at the coordinator's
    address:port (torch's TCPStore, JAX's coordination service): a rank of another node that
    tries it before it listens backs off (torch: about 0.6 s; gRPC, JAX's: 1 s, then 1.6 times
    longer each try). Once this agent saw it accept after stepping, the next incarnations start
    this node's trainers once it accepts: while the previous incarnation's coordinator still
    accepts (its agent is stopping it: up to ``stopping_s``), and then ``COORDINATOR_WAIT_S``
    at most (then start anyway, and unlearn it)."""

    def __init__(
        self,
        applies: bool,
        stopping_s: float = 0.0,
        superseded: Callable[[], bool] = lambda: False,
    ) -> None:
        self.applies = applies  # a job across nodes, with static ranks or the controller's
        self.stopping_s = stopping_s  # the longest the coordinator's agent may take to stop it
        # A newer command arrived: the incarnation about to start is stopped at once, and its
        # coordinator (rank 0 moved on to the newer epoch) may never listen.
        self.superseded = superseded
        self.node_rank = 0
        self.nnodes = 1
        self.addr = ""
        self.port = 0  # the coordinator's, at the current incarnation
        self.previous: tuple[str, int] | None = None  # the incarnation's before, if elsewhere
        self.learned = False  # it accepted there after a local rank stepped

    def placed(self, nnodes: int, node_rank: int, addr: str, port: int) -> None:
        moved = self.port != 0 and (addr, port) != (self.addr, self.port)
        self.previous = (self.addr, self.port) if moved else None
        self.nnodes, self.node_rank, self.addr, self.port = nnodes, node_rank, addr, port

    @property
    def wanted(self) -> bool:
        return coordinator_first(self.applies, self.node_rank, self.nnodes, self.learned)

    def should_learn(self, rank: int) -> bool:
        return rank == 0 and self.applies and self.nnodes > 1 and self.node_rank != 0

    async def learn(self) -> None:
        """After local rank 0 stepped: whether the coordinator accepts (it then has for the
        whole incarnation: the store lives as long as rank 0's trainer)."""
        self.learned = await accepts(self.addr, self.port)

    async def wait(self) -> bool:
        """Until the coordinator accepts (True), or ``keep_waiting`` says to start anyway
        (False; no more waiting for it until it is seen accepting again), or a newer command
        supersedes the incarnation (False: still learned)."""
        start = time.monotonic()
        previous_seen = 0.0
        while True:
            if self.superseded():
                return False
            accepted = await accepts(self.addr, self.port)
            waited = time.monotonic() - start
            if not accepted and self.previous is not None and await accepts(*self.previous):
                previous_seen = waited
            if not keep_waiting(
                accepted, waited, previous_seen_s=previous_seen, stopping_s=self.stopping_s
            ):
                break
            await asyncio.sleep(PROBE_EVERY_S)
        if not accepted:
            log.info(
                "coordinator %s:%d did not accept within %gs: starting anyway",
                self.addr,
                self.port,
                COORDINATOR_WAIT_S,
            )
            self.learned = False
        return accepted
