"""One ``jax.distributed`` mesh over two processes, each under its own ``marduk agent run
--scope job`` with the default grace: a device event, a crash of rank 0 (the coordinator), a
crash of rank 1, and two faults 0.5 s apart. After each, both processes form the mesh again at
the new epoch (the coordinator on that epoch's port), resume from the same checkpoint (never
step 0), and print the same values as each other and as before the fault; the old trainers are
gone. A preemption notice: both save the same step on request and train on. At the end SIGTERM
to both agents (a preemption): both save at JAX's preemption sync point, the same step. Timings are printed, not asserted (bench/bench_jax_distributed.py
measures them)."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import eventually_sync
from tests.jax_mesh import MeshJob, left_behind, mesh_env, resumed
from tests.processes import agent_run, controller

pytestmark = pytest.mark.e2e


def test_one_mesh_over_two_agents_survives_every_fault(env: dict[str, str], tmp_path: Path) -> None:
    job = MeshJob(mesh_env(env, tmp_path / "ckpt"), job="mesh", n=2)
    try:
        t0 = time.time()
        now = job.wait_stepping(0, -1, timeout=180, steps=12)
        print(f"job stepping {time.time() - t0:.1f}s after start")

        def fault(name: str, *actions: tuple[str, int]) -> None:
            nonlocal now
            time.sleep(0.3)  # a few more steps (and a checkpoint) in this incarnation
            epoch = now[0].epoch
            t_fault = 0.0
            for i, (kind, rank) in enumerate(actions):
                if i:
                    time.sleep(0.5)
                t_fault = job.crash(rank) if kind == "crash" else job.device_failed(rank)
            now = resumed(job, name, t_fault, epoch)

        fault("device event on rank 1", ("device", 1))
        fault("rank 0 crash", ("crash", 0))
        fault("rank 1 crash", ("crash", 1))
        fault("rank 1 crash + device event on rank 0 0.5s later", ("crash", 1), ("device", 0))
        assert not any("ignored SIGTERM" in ln for a in job.agents for ln in a.all)
        # The peer that lost a rank waited for the restart instead of exiting 1 on its failed
        # collective (which would count against its node's restart budget too). (JAX's own
        # coordination service may still abort it first, SIGABRT, if the controller's restart
        # is slower than its detection: a race this test tolerates and prints.)
        crashes = [[ln for ln in a.all if "trainer crashed" in ln] for a in job.agents]
        print("crashes seen by each agent:", crashes)
        assert [sum("SIGKILL" in ln for ln in c) for c in crashes] == [1, 2], crashes
        assert not any("exit code 1)" in ln for c in crashes for ln in c), crashes

        # A preemption notice (the controller's checkpoint command): every process saves the
        # same step, and the mesh trains on.
        job.device_failed(1, "preempting")
        on_request = [a.expect("on request", timeout=30) for a in job.agents]
        assert len(set(on_request)) == 1, on_request
        step = int(on_request[0].split()[4])
        for a in job.agents:
            a.expect(f"step {step + 3} loss", timeout=30)

        # A preemption: SIGTERM to every agent; each trainer saves at JAX's sync point.
        for a in job.agents:
            a.proc.send_signal(signal.SIGTERM)
        codes = [a.proc.wait(30) for a in job.agents]
        saved = [[ln for ln in a.all if "at the preemption sync point" in ln] for a in job.agents]
        assert all(len(s) == 1 for s in saved), saved
        assert len({s[0] for s in saved}) == 1  # the same step on every process
        assert codes == [143, 143]
    finally:
        job.stop()
    pids = [p for r in range(job.n) for p in job.pids(r)]
    assert pids and not left_behind(pids)


def test_a_local_crash_ends_a_sibling_that_swallows_sigterm_without_the_grace(
    env: dict[str, str],
) -> None:
    """Two ranks of one mesh under one agent, each swallowing SIGTERM (JAX's preemption
    service): when rank 1 crashes, the agent reports it first and forwards the controller's
    restart to rank 0's library, which ends it; the default 30 s grace is never waited out."""
    ctl = controller(env)
    a = agent_run(
        env,
        *("--job", "local", "--replica", "r0", "--scope", "job", "--devices", "local-d0"),
        *("--nproc-per-node", "2", "--preload", "none"),
        cmd=[sys.executable, "tests/trainers/swallows_sigterm.py", "--crash-rank", "1"],
    )
    try:
        a.expect("local rank 1 crashed", timeout=60)
        t0 = time.monotonic()
        a.expect("marduk: restart at epoch 1 (local rank 1 crashed): exiting now", timeout=20)
        started = ("rank 0 epoch 1 incarnation 1", "rank 1 epoch 1 incarnation 1")
        eventually_sync(lambda: all(any(s in ln for ln in a.all) for s in started), timeout=20)
        print(f"crash -> both ranks started again: {time.monotonic() - t0:.2f}s")
        assert not any("ignored SIGTERM" in ln for ln in a.all)
    finally:
        # These trainers swallow SIGTERM for good: a second signal ends the agent's grace.
        a.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        a.stop()
        ctl.stop()
