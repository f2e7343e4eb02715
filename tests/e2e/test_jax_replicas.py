"""The JAX example under ``marduk agent run``, two replicas x two workers: a device failure
restarts exactly the right trainers, which resume from their checkpoints (the step continues,
the loss stays sane); with scope job all four restart, once."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.processes import Proc, agent_run, controller, inject

pytestmark = pytest.mark.e2e


@pytest.fixture
def jax_env(env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    # Two CPU devices per trainer: the example runs data parallel over them.
    return {
        **env,
        "MARDUK_CKPT_DIR": str(tmp_path / "ckpt"),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }


def jax_agent(env: dict[str, str], job: str, replica: str, worker: int, scope: str) -> Proc:
    return agent_run(
        env,
        *("--job", job, "--replica", replica, "--worker", str(worker), "--scope", scope),
        *("--devices", f"{job}-{replica}-d{worker}", "--grace", "10"),
        *("--startup-timeout", "180"),  # the default --preload: jax, in the fork server
        cmd=[
            sys.executable,
            "examples/jax_trainer.py",
            "--steps",
            "100000",
            "--ckpt-every",
            "5",
            "--step-seconds",
            "0.05",
        ],
    )


def losses(p: Proc) -> list[tuple[int, float]]:
    out = []
    for line in p.all:
        m = re.match(r"step (\d+) loss ([0-9.eE+-]+)", line)
        if m:
            out.append((int(m.group(1)), float(m.group(2))))
    return out


def advance(p: Proc, steps: int) -> None:
    """Wait until ``p`` has trained ``steps`` more steps than it has so far."""
    p.expect(f"step {losses(p)[-1][0] + steps} loss", timeout=120)


def assert_resumed(p: Proc, epoch: int) -> None:
    assert any("2 device(s) cpu" in ln for ln in p.all)
    saved = int(p.expect("checkpointed step", timeout=60).split()[2])
    resumed = p.expect("resuming at step", timeout=120)
    assert f"epoch {epoch}" in resumed and int(resumed.split()[-1]) == saved >= 10
    p.expect(f"step {saved + 2} loss", timeout=120)
    first_loss = losses(p)[0][1]
    after = [loss for step, loss in losses(p) if step == saved + 1][-1]
    assert after < first_loss  # continued training, not from scratch


def test_replica_scope_restarts_exactly_the_failed_replica(jax_env: dict[str, str]) -> None:
    env = jax_env
    ctl = controller(env)
    agents = {(r, w): jax_agent(env, "rep", r, w, "replica") for r in ("r1", "r2") for w in (0, 1)}
    try:
        for a in agents.values():
            a.expect("step 12 loss", timeout=120)
        inject(env, "rep-r1-d1")  # a device of r1's worker 1: both workers of r1 restart
        assert_resumed(agents[("r1", 0)], epoch=1)
        assert_resumed(agents[("r1", 1)], epoch=1)
        for w in (0, 1):
            r2 = agents[("r2", w)]
            advance(r2, 10)  # r2 kept training through all of it...
            assert sum("resuming at step" in ln for ln in r2.all) == 1  # ...never restarted
    finally:
        for a in agents.values():
            a.stop()
        ctl.stop()


def test_job_scope_restarts_all_four_once(jax_env: dict[str, str]) -> None:
    env = jax_env
    ctl = controller(env)
    agents = [jax_agent(env, "mesh", r, w, "job") for r in ("r1", "r2") for w in (0, 1)]
    try:
        for a in agents:
            a.expect("step 12 loss", timeout=120)
        inject(env, "mesh-r2-d0")
        for a in agents:
            assert_resumed(a, epoch=1)
        for a in agents:
            advance(a, 10)  # a window for any second restart to show
        assert [sum("resuming at step" in ln for ln in a.all) for a in agents] == [2, 2, 2, 2]
    finally:
        for a in agents:
            a.stop()
        ctl.stop()


def test_preemption_notice_checkpoints_and_a_new_pod_resumes_there(
    jax_env: dict[str, str],
) -> None:
    """Pathways-style: the notice asks for a checkpoint; training goes on; the VM then goes
    away (SIGKILL, no grace); a new pod with the same replica id resumes from that step."""
    import asyncio
    import signal
    import time

    from monitor_cli import client as monitor

    ctl = controller(jax_env)
    p = jax_agent(jax_env, "pre", "r1", 0, "replica")
    try:
        p.expect("resuming at step 0", timeout=180)
        p.expect("step 1 loss", timeout=120)
        advance(p, 3)
        t0 = time.monotonic()
        reply = asyncio.run(
            monitor.publish_health(
                jax_env["MARDUK_ADDR"], "marduk", "pre-r1-d0", "preempting", reason="GCE TERMINATE"
            )
        )
        assert [a.kind for a in reply.actions] == ["checkpoint"]
        line = p.expect("on request", timeout=60)
        took = time.monotonic() - t0
        saved = int(line.split()[4])
        print(f"notice -> checkpoint saved: {took * 1000:.0f} ms (step {saved})")
        advance(p, 2)  # not a restart: it trains on
        assert sum("resuming at step" in x for x in p.all) == 1
        p.stop(signal.SIGKILL)  # the VM goes away
        again = jax_agent(jax_env, "pre", "r1", 0, "replica")
        resumed = again.expect("resuming at step", timeout=180)
        assert int(resumed.split()[-1]) >= saved
        again.stop()
    finally:
        p.stop()
        ctl.stop()
