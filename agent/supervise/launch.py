"""torchrun's contract for ``marduk agent run --nproc-per-node N``: what each local rank is told,
and where its output goes.

An existing ``torchrun`` command line works by changing the launcher::

    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 8 --master-addr h0 train.py --lr 3
    marduk agent run --nnodes 2 --node-rank 1 --nproc-per-node 8 --master-addr h0 train.py --lr 3

Each local rank gets torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_RANK``, ``ROLE_WORLD_SIZE``,
``ROLE_NAME``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``,
``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_RUN_ID``). Either every agent knows its node
rank (``--node-rank``), as with torchrun's ``static`` backend (``--rdzv-endpoint host:port``
names the master), or, with ``--nnodes MIN:MAX`` and no ``--node-rank``, the controller is the
rendezvous: each epoch's membership (marduk/core/membership.py) gives the node rank, world size and
coordinator (``LaunchSpec.placed``). Pure: the look-ups of the
machine's ports are agent/supervise/ports.py's.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from agent.channel import handoff

DEFAULT_MASTER_PORT = 29500  # torchrun's, for multi-node jobs that do not name one
# Across nodes, MASTER_PORT is base + epoch % PORT_SPAN: every agent of the job derives the same
# port from the restart epoch, and a restarted rank never reaches the previous incarnation's
# coordinator (still running on another node for a few milliseconds, or being stopped there).
PORT_SPAN = 16


class LaunchError(ValueError):
    """A launch option that cannot work (one clear line for the user)."""


class Std(enum.IntFlag):
    """Streams of a rank, as torchrun numbers them in ``--redirects`` and ``--tee``."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    """Where this node's ranks sit in the job."""

    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port per incarnation (one node only)
    # all: every rank sees every device of the node (JAX: one process per host; torchrun's
    # way, the script picks cuda:LOCAL_RANK); split: each rank gets its share, and
    # CUDA_VISIBLE_DEVICES names it.
    rank_devices: Literal["all", "split"] = "all"
    role: str = "default"
    run_id: str = "none"
    max_restarts: int = 0
    # --nnodes MIN:MAX (or N) without --node-rank: the controller assigns the node rank and
    # names the coordinator at each epoch (``placed``); ``nnodes`` is MAX until then.
    min_nodes: int = 0  # 0: ranks are static (--node-rank)

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise LaunchError("--nproc-per-node and --nnodes must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(f"--node-rank {self.node_rank} is not in [0, {self.nnodes})")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise LaunchError(f"--master-port {self.master_port} is not a port")
        if (
            self.nnodes > 1
            and not self.from_controller
            and (self.master_port or 0) + PORT_SPAN > 65536
        ):
            raise LaunchError(
                f"--master-port {self.master_port}: across nodes the coordinator moves over "
                f"{PORT_SPAN} ports from it (one per restart epoch); pick one below "
                f"{65536 - PORT_SPAN + 1}"
            )

    @property
    def from_controller(self) -> bool:
        """Node rank, world size and coordinator come from the controller's membership."""
        return self.min_nodes > 0

    def placed(self, nnodes: int, node_rank: int, master_addr: str, master_port: int) -> LaunchSpec:
        """This node's place in an epoch's membership (the controller's): the spec whose
        torchrun variables say it (``env``; ``fixed_port`` is the membership's port)."""
        return dataclasses.replace(
            self,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
        )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc_per_node + local_rank

    def rank_devices_of(self, devices: list[str], local_rank: int) -> list[str]:
        """The devices local rank ``local_rank`` may use."""
        if self.rank_devices == "all":
            return list(devices)
        share = len(devices) // self.nproc_per_node
        return devices[local_rank * share : (local_rank + 1) * share]

    def check_devices(self, devices: list[str]) -> None:
        n = self.nproc_per_node
        if self.rank_devices == "split" and (not devices or len(devices) % n):
            raise LaunchError(
                f"--rank-devices split needs a multiple of {n} devices (one share per local "
                f"rank), not {len(devices)}: {','.join(devices) or 'none'}"
            )

    def env(
        self, local_rank: int, devices: list[str], restart_count: int, master_port: int
    ) -> dict[str, str]:
        """torchrun's variables for one local rank (with devices split: its devices)."""
        rank = self.global_rank(local_rank)
        out = {
            "RANK": str(rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.nproc_per_node),
            "GROUP_RANK": str(self.node_rank),
            "GROUP_WORLD_SIZE": str(self.nnodes),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "ROLE_NAME": self.role,
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            "TORCHELASTIC_RUN_ID": self.run_id,
        }
        if self.rank_devices == "split":
            mine = self.rank_devices_of(devices, local_rank)
            out[handoff.DEVICES] = ",".join(mine)
            out["CUDA_VISIBLE_DEVICES"] = ",".join(cuda_ids(devices, mine))
        return out

    def thread_env(self, environ: Mapping[str, str]) -> dict[str, str]:
        """``OMP_NUM_THREADS=1`` for several ranks a node when the user set none, as torchrun
        does: N ranks each with a thread per core oversubscribe the CPUs."""
        if self.nproc_per_node > 1 and "OMP_NUM_THREADS" not in environ:
            return {"OMP_NUM_THREADS": "1"}
        return {}

    def fixed_port(self, epoch: int) -> int | None:
        """MASTER_PORT for the incarnation started at restart epoch ``epoch``, where the spec
        fixes it; None on one node without ``--master-port``: a free port per incarnation
        (agent/supervise/ports.py), as torchrun's rendezvous picks, so a restart never waits on the
        old socket.

        Across nodes: ``base + epoch % PORT_SPAN`` (base: ``--master-port``, else 29500). The
        agents of a job share its epoch, so they all compute the same port without talking;
        the previous epoch's coordinator (rank 0 of the old incarnation, which another node
        may not have stopped yet) listens on another port, so a new rank never joins it, and
        the new coordinator never binds a port the old one holds or left in TIME_WAIT (the
        same port comes back only PORT_SPAN epochs later).
        """
        if self.from_controller:
            return self.master_port  # the membership's, once ``placed``
        if self.nnodes > 1:
            return (self.master_port or DEFAULT_MASTER_PORT) + epoch % PORT_SPAN
        return self.master_port


def cuda_ids(devices: list[str], mine: list[str]) -> list[str]:
    """CUDA_VISIBLE_DEVICES for ``mine``: NVIDIA UUIDs as they are (CUDA takes them), other
    ids by their position among the node's devices (CUDA ordinals)."""
    return [d if d.startswith(("GPU-", "MIG-")) else str(devices.index(d)) for d in mine]


def parse_endpoint(endpoint: str) -> tuple[str, int | None]:
    """``host[:port]`` of ``--rdzv-endpoint``."""
    host, sep, port = endpoint.rpartition(":")
    if not sep:
        return endpoint, None
    if not port.isdigit():
        raise LaunchError(f"--rdzv-endpoint {endpoint!r}: the port must be a number")
    return host.strip("[]"), int(port)


def parse_nnodes(value: str) -> tuple[int, int]:
    """``N`` or torchrun's elastic range ``MIN:MAX``: (MIN, MAX)."""
    lo, colon, hi = value.partition(":")
    try:
        n, m = int(lo), int(hi if colon else lo)  # '2:' is no range (torchrun refuses it too)
    except ValueError:
        raise LaunchError(f"--nnodes {value!r}: a number, or MIN:MAX (both given)") from None
    if not 1 <= n <= m:
        raise LaunchError(f"--nnodes {value}: MIN:MAX with 1 <= MIN <= MAX")
    return n, m


def parse_std(value: str, nproc: int, option: str) -> dict[int, Std]:
    """``--redirects``/``--tee``: ``3`` for every local rank, or ``0:1,1:2`` per rank."""
    try:
        if ":" not in value:
            return dict.fromkeys(range(nproc), _std(value))
        out = dict.fromkeys(range(nproc), Std.NONE)
        for part in value.split(","):
            rank, _, std = part.partition(":")
            if not 0 <= int(rank) < nproc:
                raise LaunchError(
                    f"{option} {value!r}: local rank {rank} of {nproc} (0-{nproc - 1})"
                )
            out[int(rank)] = _std(std)
        return out
    except LaunchError:
        raise
    except ValueError:
        raise LaunchError(
            f"{option} {value!r}: 0 (none), 1 (stdout), 2 (stderr), 3 (both), or "
            "LOCAL_RANK:N,... such as 0:1,1:2"
        ) from None


def _std(text: str) -> Std:
    n = int(text)
    if not 0 <= n <= int(Std.OUT | Std.ERR):
        raise ValueError(text)
    return Std(n)


@dataclass(frozen=True, slots=True)
class LogSpec:
    """Where each local rank's stdout and stderr go: the agent's console (prefixed by the rank
    when there are several), and files under ``log_dir`` (``--redirects``: only there;
    ``--tee``: there too)."""

    log_dir: str | None = None
    redirects: dict[int, Std] = field(default_factory=dict)
    tee: dict[int, Std] = field(default_factory=dict)
    local_ranks_filter: frozenset[int] | None = None  # None: every rank on the console
    prefix_template: str | None = None  # torchrun's ${role_name} ${rank} ${local_rank}

    def to_console(self, local_rank: int, stream: Std) -> bool:
        if self.redirects.get(local_rank, Std.NONE) & stream:
            return False
        return self.local_ranks_filter is None or local_rank in self.local_ranks_filter

    def to_file(self, local_rank: int, stream: Std) -> bool:
        both = self.redirects.get(local_rank, Std.NONE) | self.tee.get(local_rank, Std.NONE)
        return bool(both & stream)

    def prefix(self, spec: LaunchSpec, local_rank: int) -> bytes:
        if self.prefix_template is None:
            return b""
        text = string.Template(self.prefix_template).safe_substitute(
            role_name=spec.role, rank=spec.global_rank(local_rank), local_rank=local_rank
        )
        return text.encode()

    def path(self, run_dir: str, attempt: int, local_rank: int, stream: Std) -> str:
        """``<run_dir>/attempt_<n>/<local_rank>/stdout.log`` (torchrun's layout)."""
        name = "stdout.log" if stream == Std.OUT else "stderr.log"
        return os.path.join(run_dir, f"attempt_{attempt}", str(local_rank), name)

    @property
    def wants_files(self) -> bool:
        return any(self.redirects.values()) or any(self.tee.values())


def default_prefix_template(nproc_per_node: int, environ: Mapping[str, str]) -> str | None:
    """``[rank3]:`` before each line when a node runs several ranks (torchrun's
    TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE in ``environ``, when set, instead)."""
    template = environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
    if template:
        return template
    return "[rank${rank}]:" if nproc_per_node > 1 else None
