"""``agent.jax``: join a ``jax.distributed`` job under ``marduk agent run`` in one line.

    import agent, agent.jax
    agent.jax.initialize()                                   # jax.distributed, from the agent
    client = agent.connect(on_command=agent.jax.exit_on_restart)

``initialize`` calls ``jax.distributed.initialize`` with what the agent hands every rank
(torchrun's variables, agent/supervise/launch.py): the coordinator ``MASTER_ADDR:MASTER_PORT``,
``num_processes=WORLD_SIZE``, ``process_id=RANK``. With ``--nnodes MIN:MAX`` (no
``--node-rank``) they come from the controller's membership of the epoch: node ranks it
assigned and a coordinator port node 0's agent picked, never the previous epoch's; with
``--nnodes N --node-rank I`` the agents derive ``MASTER_PORT`` from the restart epoch. Either
way a restarted rank never reaches the previous incarnation's coordinator
(docs/architecture.md, "jax.distributed jobs").

``exit_on_restart``: once ``jax.distributed`` is initialized, JAX's preemption service catches
SIGTERM (it only marks a preemption sync point, see ``reached_preemption_sync_point``), so a
trainer stopped for a restart keeps running until the agent sends SIGKILL (after
``--restart-grace``, 0.5 s: its peers are stopping too, so the sync point never comes). The
agent tells the library why it stops the trainer just before the signal; this callback ends
the process at once for a restart, fail or stop (the mesh is broken: the state of this
incarnation is dropped and the next one restores the last checkpoint). A preemption is still a
SIGTERM without a command: the trainer saves at JAX's sync point.

Imported only by trainers that ask for it (``import agent`` does not import jax).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.library.command import Command

# How a trainer ended by ``exit_on_restart`` exits (EX_TEMPFAIL: "try again"); the agent is
# stopping it anyway and does not count it as a crash.
RESTART_EXIT_CODE = 75


@dataclass(frozen=True, slots=True)
class Distributed:
    """The arguments of ``jax.distributed.initialize`` for this process."""

    coordinator_address: str
    num_processes: int
    process_id: int


def distributed_args(env: Mapping[str, str] | None = None) -> Distributed:
    """``jax.distributed.initialize``'s arguments from torchrun's variables (ValueError naming
    what is missing)."""
    env = os.environ if env is None else env
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE") if not env.get(v)]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} not set: run under `marduk agent run --scope job --nnodes "
            "MIN:MAX` (or --nnodes N --node-rank I, or --nproc-per-node), or set torchrun's "
            "variables"
        )
    host = env["MASTER_ADDR"]
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6
    return Distributed(
        coordinator_address=f"{host}:{int(env['MASTER_PORT'])}",
        num_processes=int(env["WORLD_SIZE"]),
        process_id=int(env["RANK"]),
    )


def initialize(**kwargs: Any) -> Distributed:
    """``jax.distributed.initialize`` with the coordinator, process count and process id the
    agent handed over; ``kwargs`` go to it as they are (e.g. ``initialization_timeout``).

    A process other than the coordinator first waits until the coordinator's port accepts
    connections (polled every few milliseconds): after a restart the ranks start together,
    and a client that tries before rank 0 listens is put in gRPC's reconnect backoff (about
    1 s: ``initialize`` took 1.0-1.1 s instead of 0.01-0.1 s), and every process waits for it
    in ``initialize``'s barrier."""
    import jax

    args = distributed_args()
    if args.process_id != 0:
        wait_for_coordinator(args.coordinator_address, kwargs.get("initialization_timeout", 300))
    jax.distributed.initialize(
        coordinator_address=args.coordinator_address,
        num_processes=args.num_processes,
        process_id=args.process_id,
        **kwargs,
    )
    return args


def wait_for_coordinator(address: str, timeout: float, interval: float = 0.005) -> bool:
    """Until ``host:port`` accepts a TCP connection (True), or ``timeout`` seconds (False:
    ``jax.distributed.initialize`` then waits and reports on its own)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(interval)


def exit_on_restart(command: Command) -> None:
    """``on_command`` for ``agent.connect``: end the process at once when the agent is about to
    stop it for a restart (or ``fail``/``stop``); a ``checkpoint`` request passes on."""
    if command.kind == "checkpoint":
        return
    print(
        f"marduk: {command.kind} at epoch {command.epoch} ({command.reason}): exiting now",
        flush=True,
    )
    sys.stderr.flush()
    os._exit(RESTART_EXIT_CODE)
