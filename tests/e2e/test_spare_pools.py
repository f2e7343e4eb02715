"""A pool of hot spares shared by two jobs, with real processes: a nats-server, two ``marduk
controller`` processes (one leads, one is a hot standby), jobs ``ja`` and ``jb`` of two agents
each (``--nnodes 2:2 --spare-pool pool1``) and one spare of the pool (``--spare --spare-pool
pool1``), each running a plain-python rank that prints torchrun's variables at every start
(tests/trainers/ranks.py).

A member of ``ja`` goes past its device budget; the leader claims the pool spare for ``ja`` and
is SIGKILLed right after (its ``spare_claimed`` line), before or while the spare moves to the
job. The standby takes over: the spare must hold the lost member's node rank in ``ja`` (same
world size), the lost member exit 71, ``jb`` run on untouched, and status show the pool with its
spare claimed by ``ja``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import NatsServer, eventually_sync, marduk_cli
from tests.e2e.test_membership_failover import env_for, job_info, kill_on
from tests.elastic_job import ElasticJob
from tests.processes import status

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

POOL = "pool1"


def test_a_pool_spare_takes_a_lost_members_ranks_and_the_standby_finishes_the_claim(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    env = env_for(nats_server, MARDUK_DEVICE_MAX_FAILURES="0")
    ja = ElasticJob(env, tmp_path, "ja", "2:2")
    jb = ElasticJob(env, tmp_path, "jb", "2:2", controllers=0)
    pool = ElasticJob(env, tmp_path, POOL, "1:2", controllers=0)
    try:
        lead, standby = ja.leader()
        for r in ("a0", "a1"):
            ja.start(r, "--spare-pool", POOL)
        for r in ("b0", "b1"):
            jb.start(r, "--spare-pool", POOL)
        spare = pool.start("spare0", "--spare", "--spare-pool", POOL)
        by_rank = ja.formed(("a0", "a1"))
        ranks_b = jb.formed(("b0", "b1"))
        assert not pool.starts("spare0")
        eventually_free(env)
        lost, healthy = by_rank[1], by_rank[0]
        mark = {r: ja.mark(r) for r in ja.agents}
        mark_b = {r: jb.mark(r) for r in jb.agents}

        r = marduk_cli("monitor", "inject-failure", f"ja-{lost}", env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        kill_on(lead, "spare_claimed")
        standby.expect("serving prefix", timeout=60)

        ja.agents["spare0"] = spare  # the job's worker now
        ja.wait({healthy: (0, 2), "spare0": (1, 2)})
        assert ja.agents[lost].proc.wait(timeout=60) == 71
        spare.expect("claimed by job ja", timeout=5)
        time.sleep(3)  # nothing more happens: no second restart from the new leader
        ja.wait({healthy: (0, 2), "spare0": (1, 2)}, timeout=5)
        assert len(ja.starts(healthy, mark[healthy])) == 1, ja.output()
        assert len(ja.starts("spare0")) == 1, ja.output()
        assert ja.starts("spare0")[0]["MARDUK_JOB"] == "ja"  # its trainer is the job's
        ja.check_epochs_forward()
        # jb ran on: no start since before the failure, both still members.
        assert all(not jb.starts(r, mark_b[r]) for r in jb.agents), jb.output()
        jb.wait({ranks_b[0]: (0, 2), ranks_b[1]: (1, 2)}, timeout=5)

        info = job_info(env, "ja")
        assert (info["nodes"], info["holding"], info["claimed"]) == (2, ["spare0/0"], ["spare0/0"])
        shown = job_info(env, POOL)
        assert (shown["is_pool"], shown["spares"], shown["claimed"]) == (
            True,
            [],
            ["spare0/0 by ja"],
        )
        text = marduk_cli("monitor", "status", env=env)
        print(text.stdout)
        assert "pool1 (pool)" in text.stdout and "spare0/0 by ja claimed" in text.stdout
    finally:
        ja.agents.pop("spare0", None)
        for job in (ja, jb, pool):
            job.stop()


def eventually_free(env: dict[str, str]) -> None:
    """The pool shows its spare free."""

    def free() -> bool:
        pools = [j for j in status(env)["jobs"] if j["job"] == POOL]
        return bool(pools) and pools[0]["spares"] == ["spare0/0"]

    eventually_sync(free, timeout=60)
