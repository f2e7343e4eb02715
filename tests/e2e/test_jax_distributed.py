"""One ``jax.distributed`` mesh over two processes, each under its own ``marduk agent run
--scope job`` with the default grace: a device event, a crash of rank 0 (the coordinator), a
crash of rank 1, and two faults 0.5 s apart. After each, both processes form the mesh again at
the new epoch (the coordinator on that epoch's port), resume from the same checkpoint (never
step 0), and print the same values as each other and as before the fault; the old trainers are
gone. A preemption notice: both save the same step on request and train on. At the end SIGTERM
to both agents (a preemption): both save at JAX's preemption sync point, the same step.

Twice: with examples/jax_distributed_trainer.py (Marduk's library, ``exit_on_restart``), and
with tests/trainers/jax_sync_point.py, which has no Marduk code. Timings are printed; asserted
only as "back well before the grace would have run out" (bench/bench_jax_distributed.py
measures them)."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import eventually_sync
from tests.jax_mesh import Incarnation, MeshJob, left_behind, mesh_env, resumed
from tests.processes import Proc, agent_run, controller

pytestmark = pytest.mark.e2e

# Back well before the default 30 s grace would have run out (the mesh steps again within
# about 1-2 s here; a loaded 2-core CI machine is slower, but nowhere near this).
BACK_WITHIN_S = 15.0
SYNC_POINT_TRAINER = "tests/trainers/jax_sync_point.py"


def survive_every_fault(job: MeshJob, within_s: float = 60) -> dict[str, float]:
    """A device event, a crash of rank 0 (the coordinator), of rank 1, and a crash of rank 1
    then a device event on rank 0 0.5 s later: after each, the mesh steps again within
    ``within_s`` (checked by ``resumed``). Returns each fault's time to every rank stepping
    again."""
    t0 = time.time()
    now = job.wait_stepping(0, -1, timeout=180, steps=12)
    print(f"job stepping {time.time() - t0:.1f}s after start")
    backs: dict[str, float] = {}

    def fault(name: str, *actions: tuple[str, int]) -> None:
        nonlocal now
        time.sleep(0.3)  # a few more steps (and a checkpoint) in this incarnation
        epoch = now[0].epoch
        t_fault = 0.0
        for i, (kind, rank) in enumerate(actions):
            if i:
                time.sleep(0.5)
            t_fault = job.crash(rank) if kind == "crash" else job.device_failed(rank)
        now = resumed(job, name, t_fault, epoch, timeout=within_s)
        backs[name] = max(stepping_again(now)) - t_fault

    fault("device event on rank 1", ("device", 1))
    fault("rank 0 crash", ("crash", 0))
    fault("rank 1 crash", ("crash", 1))
    fault("rank 1 crash + device event on rank 0 0.5s later", ("crash", 1), ("device", 0))
    return backs


def stepping_again(now: list[Incarnation]) -> list[float]:
    return [i.first_step_at for i in now if i.first_step_at is not None]


def preempt(job: MeshJob) -> None:
    """A preemption: SIGTERM to every agent; each trainer saves at JAX's sync point, the same
    step on every process, within the grace, and exits 143."""
    for a in job.agents:
        a.proc.send_signal(signal.SIGTERM)
    codes = [a.proc.wait(60) for a in job.agents]
    saved = [[ln for ln in a.all if "at the preemption sync point" in ln] for a in job.agents]
    assert all(len(s) == 1 for s in saved), saved
    assert len({s[0] for s in saved}) == 1  # the same step on every process
    assert codes == [143, 143]


def test_one_mesh_over_two_agents_survives_every_fault(env: dict[str, str], tmp_path: Path) -> None:
    job = MeshJob(mesh_env(env, tmp_path / "ckpt"), job="mesh", n=2)
    try:
        survive_every_fault(job)
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

        preempt(job)
    finally:
        job.stop()
    pids = [p for r in range(job.n) for p in job.pids(r)]
    assert pids and not left_behind(pids)


def test_a_trainer_with_no_marduk_code_is_back_as_fast_after_every_fault(
    env: dict[str, str], tmp_path: Path
) -> None:
    """The same faults, the default grace, a trainer with no ``agent`` import that stops as JAX
    trainers do (JAX's preemption service takes SIGTERM; every step asks for the preemption
    sync point, which needs every process): a restart the agent did not cause is not waited out
    (``--restart-grace``), and a non-coordinator's new process starts once the new coordinator
    listens, not into gRPC's reconnect backoff. Before, a crash of rank 1 took 40 s (the sync
    point never came: ``trainer ignored SIGTERM for 30s``, then 10 s of backoff).

    A preemption still gets the whole grace: SIGTERM to both agents, and the save at the sync
    point takes 3 s (longer than ``--restart-grace``): both save the same step and exit 143."""
    job = MeshJob(
        mesh_env(env, tmp_path / "ckpt"),
        job="plain",
        n=2,
        trainer=(SYNC_POINT_TRAINER, "--save-seconds", "3"),
    )
    try:
        backs = survive_every_fault(job, within_s=BACK_WITHIN_S)
        print("every rank stepping again:", {k: round(v, 2) for k, v in backs.items()})
        assert not any("ignored SIGTERM" in ln for a in job.agents for ln in a.all)

        before = [len(a.all) for a in job.agents]
        preempt(job)
        after = [ln for a, n in zip(job.agents, before, strict=True) for ln in a.all[n:]]
        assert not any("SIGKILL" in ln for ln in after), after
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


def test_a_local_crash_ends_a_sibling_with_no_library_after_the_restart_grace(
    env: dict[str, str],
) -> None:
    """The same with ranks that never connect to the library: the controller answers the crash
    with a new epoch (the scope restarts), so the sibling that swallows SIGTERM gets
    ``--restart-grace``, not the default 30 s."""
    ctl = controller(env)
    a = agent_run(
        env,
        *("--job", "local", "--replica", "r0", "--scope", "job", "--devices", "local-d0"),
        *("--nproc-per-node", "2", "--preload", "none"),
        cmd=[
            *(sys.executable, "tests/trainers/swallows_sigterm.py"),
            *("--crash-rank", "1", "--no-library"),
        ],
    )
    try:
        a.expect("local rank 1 crashed", timeout=60)
        t0 = time.monotonic()
        started = ("rank 0 epoch 1 incarnation 1", "rank 1 epoch 1 incarnation 1")
        eventually_sync(
            lambda: all(any(s in ln for ln in a.all) for s in started), timeout=BACK_WITHIN_S
        )
        print(f"crash -> both ranks started again: {time.monotonic() - t0:.2f}s")
        assert any("after SIGTERM for a restart; SIGKILL" in ln for ln in a.all)
        assert not any("ignored SIGTERM" in ln for ln in a.all)
    finally:
        a.proc.send_signal(signal.SIGTERM)  # (swallowed for good: a second signal ends it)
        time.sleep(0.5)
        a.stop()
        ctl.stop()


@pytest.mark.timeout(180)
def test_a_slow_rank_of_a_mesh_is_named_by_its_device_then_cleared(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Two ``jax.distributed`` processes (one mesh, a jitted step with collectives each step),
    each marking its own compute: process 1's device turns 1.5x slower mid-run;
    ``straggler_detected`` names that device after three slow windows, ``straggler_cleared``
    once it is back."""
    flag = tmp_path / "slow"
    e = {
        **mesh_env(env, tmp_path / "ckpt"),
        "MARDUK_STRAGGLER_WARMUP": "1",
        "MARDUK_PERF_WINDOW": "0.5",
        "SLOW_FLAG": str(flag),
        "SLOW_DEVICE": "jperf-d1",
    }
    job = MeshJob(e, job="jperf", n=2, trainer=("tests/trainers/jax_perf.py",))
    watch = Proc([sys.executable, "-m", "marduk", "monitor", "watch", "--json"], e)
    try:
        watch.expect("watching controller events", timeout=30)
        job.wait_stepping(0, -1, timeout=120, steps=40)
        t = time.time()
        flag.touch()
        line = watch.expect('"straggler_detected"', timeout=40)
        event = json.loads(line[line.index("{") :])
        assert (event["device"], event["straggler"]["section"]) == ("jperf-d1", "compute")
        assert event["straggler"]["devices"] == ["jperf-d1"]
        assert event["straggler"]["windows"] == 3  # three slow windows in a row, not more
        took = time.time() - t
        flag.unlink()
        line = watch.expect('"straggler_cleared"', timeout=40)
        assert json.loads(line[line.index("{") :])["device"] == "jperf-d1"
        print(f"jax mesh: straggler_detected {took:.1f}s after the slowdown (windows of 0.5 s)")
    finally:
        watch.stop()
        job.stop()
