"""One ``jax.distributed`` mesh over two agents whose ranks the controller assigns
(``marduk agent run --nnodes 2:2``, no ``--node-rank``): the controller forms the membership
once both registered; after a trainer crash (SIGKILL), a device failure (``marduk monitor
inject-failure``) and a SIGKILL of the coordinator's trainer, both processes initialize
``jax.distributed`` again at the new epoch's coordinator port (never the previous one), resume
from their checkpoint (not step 0) and agree on every value."""

from __future__ import annotations

import itertools
import re
import time
from pathlib import Path

import pytest

from tests.conftest import marduk_cli
from tests.jax_mesh import MeshJob, mesh_env, resumed

pytestmark = pytest.mark.e2e

PLACED = re.compile(r"epoch (\d+): node rank (\d+) of (\d+), ranks .* coordinator (\S+):(\d+)")


def placements(job: MeshJob, agent: int) -> list[tuple[int, int, str, int]]:
    """(epoch, node rank, coordinator host, port) of each start of ``agent``'s ranks."""
    out = []
    for line in job.agents[agent].all:
        m = PLACED.search(line)
        if m:
            out.append((int(m.group(1)), int(m.group(2)), m.group(4), int(m.group(5))))
    return out


def test_the_controller_assigns_the_ranks_and_moves_the_coordinator_each_epoch(
    env: dict[str, str], tmp_path: Path
) -> None:
    job = MeshJob(mesh_env(env, tmp_path / "ckpt"), job="elastic", n=2, ranks_from_controller=True)
    try:
        now = job.wait_stepping(0, -1, timeout=180, steps=12)
        first = [placements(job, a)[-1] for a in range(2)]
        assert sorted(p[1] for p in first) == [0, 1], first  # one node rank each
        assert len({(p[0], p[2], p[3]) for p in first}) == 1, first  # one membership
        by_agent = {a: int(placements(job, a)[-1][1]) for a in range(2)}
        assert {inc.epoch for inc in now} == {first[0][0]}  # at the membership's epoch

        def fault(name: str, act) -> None:  # type: ignore[no-untyped-def]
            nonlocal now
            time.sleep(0.3)  # a few more steps (and a checkpoint) in this incarnation
            epoch = now[0].epoch
            now = resumed(job, name, act(), epoch)

        coordinator = next(a for a, rank in by_agent.items() if rank == 0)
        other = 1 - coordinator
        fault("crash of the non-coordinator", lambda: job.crash(other))

        def inject() -> float:
            t = time.time()
            r = marduk_cli("monitor", "inject-failure", job.device(other), env=job.env)
            assert r.returncode == 0, r.stdout + r.stderr
            return t

        fault("device failure (inject-failure)", inject)
        fault("crash of the coordinator", lambda: job.crash(coordinator))

        ports = [p[3] for p in placements(job, coordinator)]
        epochs = [p[0] for p in placements(job, coordinator)]
        print("coordinator ports by epoch:", list(zip(epochs, ports, strict=True)))
        assert len(ports) >= 4
        assert all(a != b for a, b in itertools.pairwise(ports)), ports
        # The ranks never moved: the same node ranks at every epoch.
        for a in range(2):
            assert {p[1] for p in placements(job, a)} == {by_agent[a]}
    finally:
        job.stop()
