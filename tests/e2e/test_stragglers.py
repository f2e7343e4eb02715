"""Stragglers under ``marduk agent run``: three supervised trainers whose libraries hand their
summaries to their supervisors, which relay them; one made 1.5x slower, then back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import NatsServer, eventually_sync, marduk_cli
from tests.elastic_job import ElasticJob
from tests.processes import Proc, agent_run, controller

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(120)
def test_a_supervised_slow_rank_is_named_by_device_then_cleared(
    env: dict[str, str], tmp_path: Path
) -> None:
    env = {**env, "MARDUK_STRAGGLER_WARMUP": "1", "MARDUK_PERF_WINDOW": "0.5"}
    ctl = controller(env)
    flag = tmp_path / "slow"
    procs: list[Proc] = []
    watch = Proc([sys.executable, "-m", "marduk", "monitor", "watch", "--json"], env)
    try:
        watch.expect("watching controller events")
        for r in range(3):
            procs.append(
                agent_run(
                    {**env, "SLOW_FLAG": str(flag) if r == 1 else ""},
                    *("--job", "perf", "--replica", f"r{r}", "--devices", f"gpu-{r}"),
                    *("--preload", "none"),
                    cmd=[sys.executable, "tests/trainers/lib_trainer.py", "--mode", "compute"],
                )
            )
        for _ in procs:
            watch.expect('"trainer_started"', timeout=30)
        flag.touch()
        line = watch.expect('"straggler_detected"', timeout=40)
        event = json.loads(line[line.index("{") :])
        assert (event["replica"], event["device"]) == ("r1", "gpu-1")
        assert event["straggler"]["devices"] == ["gpu-1"]
        flag.unlink()
        line = watch.expect('"straggler_cleared"', timeout=40)
        assert json.loads(line[line.index("{") :])["replica"] == "r1"
    finally:
        for p in procs:
            p.stop()
        watch.stop()
        ctl.stop()


@pytest.mark.timeout(180)
def test_a_slow_gloo_rank_is_named_by_its_device(env: dict[str, str], tmp_path: Path) -> None:
    """Four torch gloo ranks under one ``marduk agent run`` (an all_reduce every step, so every
    rank's step takes the slowest one's time): the marked compute section tells rank 2 apart,
    and the event names its device (LOCAL_RANK 2 of 4 devices)."""
    pytest.importorskip("torch", reason="torch (CPU) is not installed: pip install torch")
    flag = tmp_path / "slow"
    env = {
        **env,
        "MARDUK_STRAGGLER_WARMUP": "1",
        "MARDUK_PERF_WINDOW": "0.5",
        "SLOW_FLAG": str(flag),
        "SLOW_RANK": "2",
    }
    ctl = controller(env)
    watch = Proc([sys.executable, "-m", "marduk", "monitor", "watch", "--json"], env)
    a = None
    try:
        watch.expect("watching controller events")
        a = agent_run(
            env,
            *("--job", "gloo", "--replica", "r0", "--devices", "g0,g1,g2,g3"),
            *("--nproc-per-node", "4", "--preload", "torch", "--grace", "3"),
            cmd=[sys.executable, "tests/trainers/gloo_perf.py"],
        )
        for _ in range(4):
            a.expect("RANKS rank=", timeout=90)
        watch.expect('"trainer_started"', timeout=30)
        flag.touch()
        line = watch.expect('"straggler_detected"', timeout=60)
        event = json.loads(line[line.index("{") :])
        assert event["straggler"]["rank"] == 2 and event["straggler"]["section"] == "compute"
        assert event["device"] == "g2" and event["straggler"]["devices"] == ["g2"]
        flag.unlink()
        line = watch.expect('"straggler_cleared"', timeout=60)
        assert json.loads(line[line.index("{") :])["straggler"]["rank"] == 2
    finally:
        if a is not None:
            a.stop()
        watch.stop()
        ctl.stop()


def job_perf(env: dict[str, str], job: str) -> dict | None:  # type: ignore[type-arg]
    """The job's row of ``marduk monitor top --once --json`` (None: no fresh ranks yet)."""
    r = marduk_cli("monitor", "top", "--once", "--json", "--job", job, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return next((j for j in json.loads(r.stdout)["jobs"] if j["job"] == job), None)


@pytest.mark.timeout(300)
def test_with_the_drain_action_a_spare_takes_the_slow_nodes_ranks(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    """Two gloo nodes whose ranks the controller assigns (``--nnodes 2:2``) and a spare, under
    ``--straggler-action drain``: node1's device turns 1.5x slower, it is detected, drained (the
    path of ``marduk monitor drain``), the spare takes node1's node rank, and the job's step
    time, which the slow rank set for both (an all_reduce a step), comes back down."""
    pytest.importorskip("torch", reason="torch (CPU) is not installed: pip install torch")
    flag = tmp_path / "slow"
    env = {
        "MARDUK_ADDR": nats_server.url,
        "PYTHONUNBUFFERED": "1",
        "MARDUK_STRAGGLER_WARMUP": "1",
        "MARDUK_PERF_WINDOW": "0.5",
        "MARDUK_STRAGGLER_ACTION": "drain",
        "MARDUK_STRAGGLER_ACT_AFTER": "0",
        "MARDUK_RESIZE_INTERVAL": "2",
        "SLOW_FLAG": str(flag),
        "SLOW_DEVICE": "sd-node1",
    }
    job = ElasticJob(env, tmp_path, "sd", "2:2", ("tests/trainers/gloo_perf.py",), controllers=1)
    watch = Proc([sys.executable, "-m", "marduk", "monitor", "watch", "--json"], env)
    try:
        watch.expect("watching controller events", timeout=30)
        for r in ("node0", "node1"):
            job.start(r, "--preload", "torch", "--grace", "3")
        by_rank = job.formed(("node0", "node1"), timeout=180)  # as test_torch_elastic
        slow_rank = next(k for k, v in by_rank.items() if v == "node1")
        job.start("node2", "--spare", "--preload", "torch", "--grace", "3")
        eventually_sync(lambda: (p := job_perf(env, "sd")) is not None and p["ranks"] == 2, 60)
        flag.touch()
        line = watch.expect('"straggler_detected"', timeout=60)
        assert json.loads(line[line.index("{") :])["device"] == "sd-node1"
        slow = job_perf(env, "sd")
        assert slow is not None
        line = watch.expect('"straggler_acted"', timeout=30)
        acted = json.loads(line[line.index("{") :])
        assert (acted["replica"], acted["device"]) == ("node1", "sd-node1"), acted
        job.wait({"node0": (1 - slow_rank, 2), "node2": (slow_rank, 2)}, timeout=90)
        assert job.agents["node1"].proc.wait(timeout=60) != 0  # its node is out of the job

        def recovered() -> bool:
            p = job_perf(env, "sd")
            return (
                p is not None
                and p["ranks"] == 2
                and not p["stragglers"]
                and p["step_p50"] < 0.9 * slow["step_p50"]
            )

        eventually_sync(recovered, timeout=60, interval=0.5)
        print(f"step p50 {slow['step_p50'] * 1e3:.1f} ms slow -> back: {job_perf(env, 'sd')}")
    finally:
        watch.stop()
        job.stop()
