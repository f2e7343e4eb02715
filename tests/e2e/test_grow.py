"""A shrunk job grows back, with real processes: a ``jax.distributed`` mesh of two agents whose
ranks the controller assigns (``--nnodes 1:2``) loses one (its device past the budget: shrink to
one process, as in test_spares.py); then a new agent registers. The controller asks for a
checkpoint, the trainer saves it and keeps training, and once it is confirmed the job restarts
with two processes: the new agent at node rank 1, both resume from that checkpoint (or a later
one: training went on meanwhile), never step 0, and their values agree."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.conftest import marduk_cli
from tests.e2e.test_membership import placements
from tests.jax_mesh import MeshJob, mesh_env

pytestmark = pytest.mark.e2e

SAVED = re.compile(r"checkpoint saved at step (\d+) on request")


def first_line(job: MeshJob, agent: int, pattern: str, after: float) -> tuple[float, str]:
    for t, line in list(job.agents[agent].timed):
        if t >= after and re.search(pattern, line):
            return t, line
    raise AssertionError(f"{pattern!r} not seen:\n{''.join(job.agents[agent].all[-30:])}")


def test_a_new_agent_grows_the_shrunk_mesh_back_after_a_checkpoint(
    env: dict[str, str], tmp_path: Path
) -> None:
    e = {
        **mesh_env(env, tmp_path / "ckpt"),
        "MARDUK_DEVICE_MAX_FAILURES": "0",
        "MARDUK_RESIZE_INTERVAL": "2",
        "MARDUK_GROW_SETTLE": "1",
        "MARDUK_GROW_CHECKPOINT_TIMEOUT": "30",
    }
    job = MeshJob(e, job="grow", n=2, ranks_from_controller=True, min_nodes=1)
    try:
        now = job.wait_stepping(0, -1, timeout=180, steps=12)
        t = time.time()
        r = marduk_cli("monitor", "inject-failure", job.device(1), env=job.env)
        assert r.returncode == 0, r.stdout + r.stderr
        job.running = [0]
        [alone] = job.wait_stepping(t, now[0].epoch, timeout=60, steps=10)
        assert job.agents[1].proc.wait(timeout=30) == 71

        t_start = time.time()
        new = job.join("node2")
        job.running = [0, new]
        grown = job.wait_stepping(t_start, alone.epoch, timeout=120)
        t_registered, _ = first_line(job, new, "its trainers not started", t_start)
        t_saved, line = first_line(job, 0, SAVED.pattern, t_registered)
        # Its fork server warmed up first: the grow never keeps the member waiting for it.
        t_warm, _ = first_line(job, new, "the fork server is ready", t_start)
        assert t_warm <= t_saved
        m = SAVED.search(line)
        assert m is not None
        saved = int(m.group(1))
        assert {inc.start for inc in grown} == {grown[0].start}  # one checkpoint for both
        assert saved <= grown[0].start and grown[0].start > alone.start > 0
        assert placements(job, new)[-1][1] == 1 and placements(job, 0)[-1][1] == 0
        assert any("process 1/2:" in ln for ln in job.agents[new].all)
        common = set.intersection(*(set(inc.steps) for inc in grown))
        assert common
        for step in common:
            assert len({inc.steps[step][1] for inc in grown}) == 1, f"ranks disagree at {step}"
        back = [inc.first_step_at - t_registered for inc in grown if inc.first_step_at]
        print(
            f"grow 1 -> 2: epoch {alone.epoch} -> {grown[0].epoch}; the new agent registered "
            f"{t_registered - t_start:.2f}s after its start; checkpoint saved at step {saved} "
            f"{t_saved - t_registered:.2f}s after its registration (--grow-settle 1); every "
            f"rank stepping {max(back):.2f}s after it ({', '.join(f'{b:.2f}' for b in back)}), "
            f"resumed at step {grown[0].start}"
        )
    finally:
        job.stop()
