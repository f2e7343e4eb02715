"""A hot spare takes a lost member's ranks, with real processes: a ``jax.distributed`` mesh of
two agents whose ranks the controller assigns (``--nnodes 2:2``) plus a third agent started
with ``--spare``. A device failure within its budget restarts the mesh in place (for
reference); the next one is past the budget (``--device-max-failures 1``): the spare takes the
failed member's node rank, the mesh forms again at the new epoch and resumes from the
checkpoint (not step 0), values agree, and the failed member's agent exits 71."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import marduk_cli
from tests.e2e.test_membership import placements
from tests.jax_mesh import MeshJob, left_behind, mesh_env, resumed

pytestmark = pytest.mark.e2e


def test_a_spare_takes_the_rank_of_a_member_whose_device_is_past_its_budget(
    env: dict[str, str], tmp_path: Path
) -> None:
    e = {**mesh_env(env, tmp_path / "ckpt"), "MARDUK_DEVICE_MAX_FAILURES": "1"}
    job = MeshJob(e, job="spares", n=2, ranks_from_controller=True, spares=1)
    spare, lost = 2, 1
    try:
        now = job.wait_stepping(0, -1, timeout=180, steps=12)
        assert not job.has_trainer(spare)  # registered, holding: no trainer
        # ... but its fork server is started (and imports jax) while it holds, so that the swap
        # forks the spare's first trainer as a restart forks one.
        job.agents[spare].expect("fork server started", timeout=60)
        rank_lost = placements(job, lost)[-1][1]

        def inject() -> float:
            time.sleep(0.3)  # a few more steps (and a checkpoint) in this incarnation
            t = time.time()
            r = marduk_cli("monitor", "inject-failure", job.device(lost), env=job.env)
            assert r.returncode == 0, r.stdout + r.stderr
            return t

        now = resumed(job, "in-place restart (within the budget)", inject(), now[0].epoch)
        old_pid = job.trainer_pid(lost)
        epoch = now[0].epoch
        t = inject()
        job.running = [0, spare]
        now = resumed(job, "spare swap (past the budget)", t, epoch)
        assert placements(job, spare)[-1][1] == rank_lost  # the lost member's node rank
        assert job.agents[lost].proc.wait(timeout=30) == 71
        assert not left_behind([old_pid])
    finally:
        job.stop()


def test_without_a_spare_the_mesh_shrinks_and_resumes_from_the_checkpoint(
    env: dict[str, str], tmp_path: Path
) -> None:
    """``--nnodes 1:2`` and no spare: the member past its budget leaves, the other goes on
    alone at the next epoch (world size 1: node rank 0, its own coordinator) and restores the
    checkpoint the two saved (full arrays restore onto any process count); a smaller global
    batch, so the values after it are not compared with the two-process run's."""
    e = {**mesh_env(env, tmp_path / "ckpt"), "MARDUK_DEVICE_MAX_FAILURES": "0"}
    job = MeshJob(e, job="shrink", n=2, ranks_from_controller=True, min_nodes=1)
    lost = 1
    try:
        now = job.wait_stepping(0, -1, timeout=180, steps=12)
        epoch = now[0].epoch
        time.sleep(0.3)
        t = time.time()
        r = marduk_cli("monitor", "inject-failure", job.device(lost), env=job.env)
        assert r.returncode == 0, r.stdout + r.stderr
        job.running = [0]
        [alone] = job.wait_stepping(t, epoch, timeout=60)
        assert alone.start > 0 and placements(job, 0)[-1][1] == 0
        assert any("process 0/1:" in ln for ln in job.agents[0].all)
        print(
            f"shrink 2 -> 1: epoch {epoch} -> {alone.epoch}, resumed at step {alone.start}, "
            f"stepping {(alone.first_step_at or t) - t:.2f}s after the fault"
        )
        assert job.agents[lost].proc.wait(timeout=30) == 71
    finally:
        job.stop()
