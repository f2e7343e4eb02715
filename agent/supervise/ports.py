"""The agent's look-ups of the machine's ports: a free TCP port to give the ranks as
MASTER_PORT, and whether a rank listens on it yet. Kept apart from the launch contract
(agent/supervise/launch.py), which stays pure."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

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
