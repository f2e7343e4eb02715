"""Stragglers under ``marduk agent run``: three supervised trainers whose libraries hand their
summaries to their supervisors, which relay them; one made 1.5x slower, then back."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

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
