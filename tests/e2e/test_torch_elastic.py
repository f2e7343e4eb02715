"""A torch gloo job shrinks and grows back, with real processes: two agents whose ranks the
controller assigns (``--nnodes 1:2``) each run examples/torch_elastic_trainer.py (a process group
over gloo, an all_reduce a step). A device of one goes past its budget: the other goes on alone
(RANK 0, WORLD_SIZE 1) from the checkpoint; then a new agent registers: the controller asks for
a checkpoint, the trainer saves it and confirms, and the job restarts with two ranks (the new
agent at RANK 1), both from that checkpoint or a later one, never step 0, values agreeing."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.conftest import NatsServer, marduk_cli
from tests.elastic_job import ElasticJob

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

STEP = re.compile(r"^step (\d+) loss (\S+) sum (\S+)")
SAVED = re.compile(r"checkpoint saved at step (\d+) on request")


def steps(job: ElasticJob, replica: str, after: int) -> dict[int, str]:
    """step -> "loss sum" of the agent's trainer output after line ``after``."""
    out: dict[int, str] = {}
    for line in job.agents[replica].all[after:]:
        if m := STEP.match(line):
            out[int(m.group(1))] = f"{m.group(2)} {m.group(3)}"
    return out


def test_a_torch_gloo_job_shrinks_then_grows_back_from_its_checkpoint(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    env = {
        "MARDUK_ADDR": nats_server.url,
        "PYTHONUNBUFFERED": "1",
        "MARDUK_CKPT_DIR": str(tmp_path / "ckpt"),
        "MARDUK_DEVICE_MAX_FAILURES": "0",
        "MARDUK_RESIZE_INTERVAL": "2",
        "MARDUK_GROW_SETTLE": "1",
        "MARDUK_GROW_CHECKPOINT_TIMEOUT": "120",  # the trainer confirms: never waited out
    }
    trainer = ("examples/torch_elastic_trainer.py", "--step-seconds", "0.1", "--ckpt-every", "5")
    job = ElasticJob(env, tmp_path, "lin", "1:2", trainer, controllers=1)
    try:
        for r in ("node0", "node1"):
            job.start(r)
        by_rank = job.formed(("node0", "node1"), timeout=180)
        lost, healthy = by_rank[1], by_rank[0]
        assert [s["RANK"] for s in (job.starts(healthy)[-1], job.starts(lost)[-1])] == ["0", "1"]
        job.wait({healthy: (0, 2), lost: (1, 2)})
        mark = job.mark(healthy)
        eventually(lambda: len(steps(job, healthy, 0)) >= 12, job)

        r = marduk_cli("monitor", "inject-failure", f"lin-{lost}", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        job.wait({healthy: (0, 1)})
        [alone] = job.starts(healthy, mark)
        assert (alone["RANK"], alone["WORLD_SIZE"]) == ("0", "1")
        assert alone["start"] > 0  # from the checkpoint, not step 0
        assert job.agents[lost].proc.wait(timeout=60) == 71
        eventually(lambda: len(steps(job, healthy, mark)) >= 5, job)
        mark = job.mark(healthy)

        job.start("node2")
        job.wait({healthy: (0, 2), "node2": (1, 2)})
        [before, grown] = [job.starts(healthy, mark)[-1], job.starts("node2")[-1]]
        assert (before["RANK"], before["WORLD_SIZE"]) == ("0", "2")
        assert (grown["RANK"], grown["WORLD_SIZE"]) == ("1", "2")
        saved = [
            int(m.group(1)) for ln in job.agents[healthy].all[mark:] if (m := SAVED.search(ln))
        ]
        assert saved, job.output()  # the grow's checkpoint, confirmed
        assert before["start"] == grown["start"] >= saved[0] > alone["start"]
        eventually(lambda: len(steps(job, "node2", 0)) >= 5, job)
        since = max(i for i, ln in enumerate(job.agents[healthy].all) if "start rank" in ln)
        a, b = steps(job, healthy, since), steps(job, "node2", 0)
        common = set(a) & set(b)
        assert common and all(a[s] == b[s] for s in common), (a, b)
        assert min(b) == grown["start"] + 1
        job.check_epochs_forward()
        print(
            f"torch gloo: shrink 2 -> 1 resumed at step {alone['start']}; grow 1 -> 2 after the "
            f"checkpoint at step {saved[0]}, resumed at step {grown['start']}"
        )
    finally:
        job.stop()


def eventually(predicate, job: ElasticJob, timeout: float = 120) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(job.output())
        time.sleep(0.2)
