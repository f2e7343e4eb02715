"""A job whose node ranks the controller assigns (``marduk agent run --nnodes MIN:MAX``), with
real processes, for end-to-end tests: controllers (one leads, the others stand by) against one
nats-server, an agent per node, and what each agent's trainers say of their ranks at each start.
"""

from __future__ import annotations

import itertools
import json
import re
import sys
from pathlib import Path
from typing import Any

from tests.conftest import eventually_sync, marduk_cli
from tests.jax_mesh import TimedProc
from tests.processes import Proc, external_controller, status

RANKS = "tests/trainers/ranks.py"
PLACED = re.compile(r"epoch (\d+): node rank (\d+) of (\d+)")
STARTED = re.compile(
    r"start rank (\d+)/(\d+) \(group rank (\d+)\), epoch (\d+), resuming at step (\d+)"
)
PIDS = re.compile(r"(trainers?|fork server) started: pids? ([\d, ]+)")


class ElasticJob:
    """``controllers`` controllers against the nats-server at MARDUK_ADDR and the agents of
    one job whose ranks the controller assigns (``--nnodes``), each running ``trainer``."""

    def __init__(
        self,
        env: dict[str, str],
        tmp: Path,
        job: str,
        nnodes: str,
        trainer: tuple[str, ...] = (RANKS, "--step-seconds", "0.2"),
        controllers: int = 2,
    ) -> None:
        self.env, self.tmp, self.name, self.nnodes = env, tmp, job, nnodes
        self.trainer = trainer
        self.controllers = [
            external_controller(env, str(tmp / f"c{i}")) for i in range(controllers)
        ]
        self.agents: dict[str, TimedProc] = {}  # each output line with when it came

    def leader(self) -> tuple[Proc, Proc]:
        """(leader, standby), once one serves and the other stands by."""

        def both() -> bool:
            r = marduk_cli("monitor", "status", "--json", "--timeout", "2", env=self.env)
            return r.returncode == 0 and len(json.loads(r.stdout)["standbys"]) == 1

        eventually_sync(both, timeout=60)
        pid = status(self.env)["controller"]["pid"]
        [lead] = [c for c in self.controllers if c.proc.pid == pid]
        [standby] = [c for c in self.controllers if c is not lead]
        return lead, standby

    def start(self, replica: str, *extra: str) -> TimedProc:
        self.agents[replica] = TimedProc(
            [
                *(sys.executable, "-m", "marduk", "agent", "run", "--job", self.name),
                *("--scope", "job", "--devices", f"{self.name}-{replica}"),
                *("--replica", replica, "--nnodes", self.nnodes, "--local-addr", "127.0.0.1"),
                *extra,
                "--",
                *(sys.executable, *self.trainer),
            ],
            self.env,
        )
        return self.agents[replica]

    def starts(self, replica: str, after: int = 0) -> list[dict[str, Any]]:
        """torchrun's variables of each trainer the agent started (after line ``after``), as
        tests/trainers/ranks.py prints them (``ENV {...}``) or examples/torch_elastic_trainer.py
        (``start rank R/W ...``, once its process group is up; ``start``: the step resumed)."""
        out = []
        for line in self.agents[replica].all[after:]:
            if line.startswith("ENV "):
                out.append(json.loads(line.split("ENV ", 1)[1]))
            elif m := STARTED.search(line):
                rank, world, group, epoch, start = m.groups()
                out.append(
                    {
                        "RANK": rank,
                        "WORLD_SIZE": world,
                        "GROUP_RANK": group,
                        "MARDUK_EPOCH": epoch,
                        "start": int(start),
                    }
                )
        return out

    def pids(self, replica: str, trainers_only: bool = False) -> list[int]:
        """Every trainer (and fork server, unless ``trainers_only``) pid the agent started, in
        order (its logged ``trainer started: pid N`` / ``fork server started: pid N``)."""
        return [
            int(pid)
            for line in self.agents[replica].all
            if (m := PIDS.search(line)) and not (trainers_only and m.group(1) == "fork server")
            for pid in m.group(2).replace(",", " ").split()
        ]

    def mark(self, replica: str) -> int:
        """Where the agent's output is now (for ``starts(after=...)``)."""
        return len(self.agents[replica].all)

    def placed(self, replica: str) -> list[tuple[int, int, int]]:
        """(epoch, node rank, nodes) of each placement the agent logged."""
        out = []
        for line in self.agents[replica].all:
            if m := PLACED.search(line):
                out.append((int(m.group(1)), int(m.group(2)), int(m.group(3))))
        return out

    def formed(self, replicas: tuple[str, ...], timeout: float = 120) -> dict[int, str]:
        """Wait for ``replicas`` to run at one epoch, one node rank each (the controller gives
        them in order of registration); which replica has which node rank."""
        world = len(replicas)
        eventually_sync(
            lambda: (
                all(self.starts(r) for r in replicas)
                and any(
                    self.converged(dict(zip(replicas, [(i, world) for i in order], strict=True)))
                    for order in itertools.permutations(range(world))
                )
            ),
            timeout=timeout,
            interval=0.2,
        )
        return {int(self.starts(r)[-1]["GROUP_RANK"]): r for r in replicas}

    def converged(self, want: dict[str, tuple[int, int]]) -> bool:
        """Every agent of ``want`` runs a trainer at one epoch, with (GROUP_RANK, WORLD_SIZE)."""
        last = {r: self.starts(r)[-1] if self.starts(r) else None for r in want}
        if any(env is None for env in last.values()):
            return False
        epochs = {env["MARDUK_EPOCH"] for env in last.values() if env is not None}
        got = {
            r: (int(env["GROUP_RANK"]), int(env["WORLD_SIZE"]))
            for r, env in last.items()
            if env is not None
        }
        return len(epochs) == 1 and got == want

    def check_epochs_forward(self) -> None:
        for r in self.agents:
            epochs = [int(e["MARDUK_EPOCH"]) for e in self.starts(r)]
            assert epochs == sorted(epochs), (r, epochs)
            placed = [p[0] for p in self.placed(r)]
            assert placed == sorted(placed), (r, placed)

    def output(self) -> str:
        parts = [f"--- {r}\n{''.join(a.all[-25:])}" for r, a in self.agents.items()]
        parts += [f"--- ctl {c.proc.pid}\n{''.join(c.all[-25:])}" for c in self.controllers]
        return "\n".join(parts)

    def wait(self, want: dict[str, tuple[int, int]], timeout: float = 120) -> None:
        try:
            eventually_sync(lambda: self.converged(want), timeout=timeout, interval=0.2)
        except AssertionError:
            raise AssertionError(f"not converged to {want}:\n{self.output()}") from None

    def stop(self) -> None:
        for a in self.agents.values():
            a.stop()
        for c in self.controllers:
            c.stop()
