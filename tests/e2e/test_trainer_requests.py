"""A trainer's requests (``client.request``) with real processes: "stop restarting me" ends a
standalone agent with the trainer's own exit code (a bad request and one only a controller can
answer refused on the way); "exclude my node" takes the asking node out of a ``--nnodes`` job
at the next epoch, the other node going on alone, and the controller says so as an event."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.processes import Proc, agent_run, controller

pytestmark = pytest.mark.e2e
TRAINER = [sys.executable, "tests/trainers/requests.py"]


def test_stop_restarting_ends_the_agent_with_the_trainers_exit_code(env: dict[str, str]) -> None:
    a = agent_run(
        {**env, "ASK": "reboot_me,exclude_node,stop_restarting"},
        *("--standalone", "--replica", "r1", "--devices", "d0", "--preload", "none"),
        cmd=[*TRAINER, "--exit", "7"],
    )
    assert a.proc.wait(60) == 7, "".join(a.all)
    out = "".join(a.all)
    assert "ANSWER reboot_me accepted=False code=unknown_kind" in out
    assert "ANSWER exclude_node accepted=False code=refused" in out  # standalone: no controller
    assert "ANSWER stop_restarting accepted=True" in out
    assert out.count("STARTED ") == 1 and "not restarted" in out


def test_exclude_my_node_takes_the_node_out_of_the_membership_at_the_next_epoch(
    env: dict[str, str], tmp_path: Path
) -> None:
    ctl = controller(env)
    watch = Proc([sys.executable, "-m", "marduk", "monitor", "watch"], env)
    job = ["--job", "ex", "--scope", "job", "--nnodes", "1:2", "--local-addr", "127.0.0.1"]
    nodes = [
        agent_run(
            {**env, **({"ASK": "exclude_node", "ASKED": str(tmp_path / "asked")} if n else {})},
            *job,
            *("--replica", f"node{n}", "--devices", f"ex-d{n}", "--preload", "none"),
            cmd=TRAINER,
        )
        for n in range(2)
    ]
    try:
        # The asking node's trainer ran in the membership of two (the other one's may not have
        # printed yet when the request restarts it).
        line = nodes[1].expect("STARTED ", timeout=60)
        assert "world=2" in line, "".join(nodes[1].all)
        before = int(line.split("epoch=")[1].split()[0])
        # The fail command may stop the trainer before the answer reaches it: the agent says it.
        nodes[1].expect("the controller answers exclude_node: 1 device(s) drained", timeout=30)
        watch.expect("trainer_request", timeout=15)
        # The asking node's agent leaves (71: its devices are out); the other one goes on alone.
        assert nodes[1].proc.wait(30) == 71, "".join(nodes[1].all)
        line = nodes[0].expect("world=1", timeout=30)
        assert int(line.split("epoch=")[1].split()[0]) > before, line
    finally:
        for p in (*nodes, watch, ctl):
            p.stop()
