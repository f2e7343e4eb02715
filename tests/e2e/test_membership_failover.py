"""The leader controller SIGKILLed in the middle of a membership change, with real processes: a
nats-server, two ``marduk controller`` processes (one leads, one is a hot standby) and agents
whose ranks the controller assigns (``--nnodes``), each running a plain-python rank that prints
torchrun's variables at every start (tests/trainers/ranks.py).

* **swap**: a member's device fails past the budget; the leader gives its ranks to the spare
  and is killed right after (its ``member_replaced`` line);
* **grow**: a shrunk job gets a new agent; the leader asks for the checkpoint and is killed
  right after (its ``grow_started`` line), before the larger membership goes out.

The standby takes over; the job must end with the right membership (the spare holding the lost
member's node rank; the grown membership), every agent at one epoch, no agent's epochs going
backwards, and no trainer of a healthy member restarted more than once for the change.
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import NatsServer, marduk_cli
from tests.elastic_job import ElasticJob
from tests.processes import Proc, status

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]


def kill_on(leader: Proc, line: str) -> float:
    """SIGKILL the leader as soon as it logs ``line``; when."""
    seen = leader.expect(line, timeout=90)
    leader.proc.send_signal(signal.SIGKILL)
    t = time.time()
    leader.proc.wait(10)
    print(f"leader SIGKILLed after: {seen.strip()}")
    return t


def job_info(env: dict[str, str], job: str) -> dict[str, Any]:
    [info] = [j for j in status(env)["jobs"] if j["job"] == job]
    return info  # type: ignore[no-any-return]


def env_for(nats_server: NatsServer, **settings: str) -> dict[str, str]:
    return {"MARDUK_ADDR": nats_server.url, "PYTHONUNBUFFERED": "1", **settings}


def test_the_leader_killed_right_after_a_swap_the_standby_finishes_it(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    env = env_for(nats_server, MARDUK_DEVICE_MAX_FAILURES="0")
    job = ElasticJob(env, tmp_path, "swapfo", "2:2")
    try:
        lead, standby = job.leader()
        for r in ("node0", "node1"):
            job.start(r)
        job.start("spare0", "--spare")
        by_rank = job.formed(("node0", "node1"))
        lost, healthy = by_rank[1], by_rank[0]
        assert not job.starts("spare0")
        mark = {r: job.mark(r) for r in job.agents}
        r = marduk_cli("monitor", "inject-failure", f"swapfo-{lost}", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        kill_on(lead, "member_replaced")
        standby.expect("serving prefix", timeout=60)

        job.wait({healthy: (0, 2), "spare0": (1, 2)})
        assert job.agents[lost].proc.wait(timeout=60) == 71
        time.sleep(3)  # nothing more happens: no second restart from the new leader
        job.wait({healthy: (0, 2), "spare0": (1, 2)}, timeout=5)
        assert len(job.starts(healthy, mark[healthy])) == 1, job.output()
        assert len(job.starts("spare0", mark["spare0"])) == 1, job.output()
        job.check_epochs_forward()
        info = job_info(env, "swapfo")
        assert (info["nodes"], info["holding"], info["spares"]) == (2, ["spare0/0"], [])
        shown = marduk_cli("monitor", "status", env=env)
        print(shown.stdout)
        assert "spare0/0 holding" in shown.stdout
    finally:
        job.stop()


def test_the_leader_killed_mid_grow_the_standby_finishes_it(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    env = env_for(
        nats_server,
        MARDUK_DEVICE_MAX_FAILURES="0",
        MARDUK_RESIZE_INTERVAL="2",
        MARDUK_GROW_SETTLE="1",
        # ranks.py never confirms a checkpoint: the grow waits this long, the leader dies in it.
        MARDUK_GROW_CHECKPOINT_TIMEOUT="15",
    )
    job = ElasticJob(env, tmp_path, "growfo", "1:2")
    try:
        lead, standby = job.leader()
        for r in ("node0", "node1"):
            job.start(r)
        by_rank = job.formed(("node0", "node1"))
        lost, healthy = by_rank[1], by_rank[0]
        r = marduk_cli("monitor", "inject-failure", f"growfo-{lost}", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        job.wait({healthy: (0, 1)})
        assert job.agents[lost].proc.wait(timeout=60) == 71
        mark = job.mark(healthy)

        job.start("node2")
        kill_on(lead, "grow_started")
        standby.expect("serving prefix", timeout=60)
        job.agents["node2"].expect("its trainers not started", timeout=60)
        assert not job.starts("node2")  # the larger membership did not go out before the kill
        # The new leader shows the grow it read from the store (unless it is finished already).
        shown = marduk_cli("monitor", "status", env=env)
        print(shown.stdout)
        assert re.search(r"growfo +1 +1:2 .*(checkpoint|applying)", shown.stdout), shown.stdout

        job.wait({healthy: (0, 2), "node2": (1, 2)})
        time.sleep(3)
        job.wait({healthy: (0, 2), "node2": (1, 2)}, timeout=5)
        assert len(job.starts(healthy, mark)) == 1, job.output()
        assert len(job.starts("node2")) == 1, job.output()
        job.check_epochs_forward()
        info = job_info(env, "growfo")
        assert (info["nodes"], info["world_size"], info["joining"]) == (2, 2, [])
        took_over = [ln for ln in standby.all if re.search("serving prefix|grow_|member_", ln)]
        print("".join(took_over))
        assert any("member_added" in ln for ln in took_over)
    finally:
        job.stop()
