"""A ``jax.distributed`` job under Marduk, for the e2e test and bench/bench_jax_distributed.py.

A controller and N agents (``marduk agent run --scope job --nnodes N --node-rank I``), each
running one process of examples/jax_distributed_trainer.py (or another trainer taking its
arguments); one global mesh over all of them.
Every output line is kept with the wall time it arrived, so a fault's cost can be read off:
from the fault to every rank's first step of the incarnation that replaced it.
"""

from __future__ import annotations

import asyncio
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from agent.supervise.launch import PORT_SPAN
from tests.ports import free_port_base
from tests.processes import Proc, controller

EXAMPLE = "examples/jax_distributed_trainer.py"
RESUMED = re.compile(r"process (\d+)/(\d+): .* epoch (\d+), resuming at step (\d+)")
STEP = re.compile(r"^step (\d+) loss (\S+) sum (\S+)")
STARTED = re.compile(r"(?:trainer started|fork server started): pids? (\d+)")


class TimedProc(Proc):
    """A Proc that also keeps each line's arrival time (``time.time()``)."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.timed: list[tuple[float, str]] = []
        super().__init__(args, env)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.timed.append((time.time(), line))
            self.all.append(line)
            self.lines.put(line)


@dataclass
class Incarnation:
    """One process of the mesh, as its output shows it."""

    epoch: int
    start: int  # the checkpoint step it resumed from
    resumed_at: float  # when it printed that (mesh formed, state restored)
    steps: dict[int, tuple[float, str]]  # step -> (arrival time, "loss X sum Y")

    @property
    def first_step_at(self) -> float | None:
        return min((t for t, _ in self.steps.values()), default=None)


def mesh_env(env: dict[str, str], ckpt: Path) -> dict[str, str]:
    return {
        **env,
        "MARDUK_CKPT_DIR": str(ckpt),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
    }


class MeshJob:
    """A controller and ``n`` agents, one mesh process each (default grace: none given)."""

    def __init__(
        self,
        env: dict[str, str],
        job: str = "mesh",
        n: int = 2,
        step_seconds: float = 0.02,
        agent_args: tuple[str, ...] = (),
        *,
        ranks_from_controller: bool = False,
        spares: int = 0,
        min_nodes: int | None = None,
        trainer: tuple[str, ...] = (EXAMPLE,),
    ) -> None:
        self.env, self.job, self.n = env, job, n
        self.trainer = trainer  # the script, then the arguments only it takes
        self.ranks_from_controller = ranks_from_controller
        # The agents whose processes form the mesh now (a swap replaces one by a spare).
        self.running = list(range(n))
        self.devices = [f"{job}-d{i}" for i in range(n)] + [f"{job}-s{i}" for i in range(spares)]
        self.ctl = controller(env)
        base = free_port_base(PORT_SPAN)
        nnodes = f"{min_nodes or n}:{n}"
        if ranks_from_controller:
            # No --node-rank: the controller assigns the ranks and the coordinator per epoch.
            placement = [
                ["--replica", f"node{i}", "--nnodes", nnodes, "--local-addr", "127.0.0.1"]
                for i in range(n)
            ]
            placement += [  # hot spares: registered, no trainer until a member is lost
                [
                    *("--replica", f"spare{i}", "--nnodes", nnodes),
                    *("--local-addr", "127.0.0.1", "--spare"),
                ]
                for i in range(spares)
            ]
        else:
            placement = [
                [
                    *("--replica", "r0", "--worker", str(i)),
                    *("--nnodes", str(n), "--node-rank", str(i)),
                    *("--master-addr", "127.0.0.1", "--master-port", str(base)),
                ]
                for i in range(n)
            ]
        self.agent_args = agent_args
        self.nnodes = nnodes
        self.step_seconds = step_seconds
        self.agents = [self._agent(i, placement[i]) for i in range(len(placement))]

    def _agent(self, i: int, placement: list[str]) -> TimedProc:
        return TimedProc(
            [
                sys.executable,
                "-m",
                "marduk",
                "agent",
                "run",
                *("--job", self.job, "--scope", "job", "--devices", self.device(i)),
                *placement,
                *self.agent_args,
                "--",
                sys.executable,
                self.trainer[0],
                *("--steps", "1000000", "--ckpt-every", "5"),
                *("--step-seconds", str(self.step_seconds)),
                *self.trainer[1:],
            ],
            self.env,
        )

    def join(self, name: str) -> int:
        """Start one more agent of a job whose ranks the controller assigns (not a spare); its
        index in ``agents``."""
        assert self.ranks_from_controller
        self.devices.append(f"{self.job}-{name}")
        i = len(self.agents)
        placement = ["--replica", name, "--nnodes", self.nnodes, "--local-addr", "127.0.0.1"]
        self.agents.append(self._agent(i, placement))
        return i

    def device(self, rank: int) -> str:
        return self.devices[rank]

    # --- what the output says ---------------------------------------------------------------

    def incarnations(self, rank: int) -> list[Incarnation]:
        out: list[Incarnation] = []
        for t, line in list(self.agents[rank].timed):
            m = RESUMED.search(line)
            if m:
                # Static ranks: agent i runs process i; the controller's may be any.
                assert self.ranks_from_controller or int(m.group(1)) == rank, line
                out.append(Incarnation(int(m.group(3)), int(m.group(4)), t, {}))
                continue
            m = STEP.match(line)
            if m and out:
                out[-1].steps.setdefault(int(m.group(1)), (t, f"{m.group(2)} {m.group(3)}"))
        return out

    def pids(self, rank: int) -> list[int]:
        """Every trainer and fork server pid agent ``rank`` has started so far."""
        return [int(m.group(1)) for line in self.agents[rank].all if (m := STARTED.search(line))]

    def has_trainer(self, rank: int) -> bool:
        return any("trainer started: pid" in ln for ln in self.agents[rank].all)

    def trainer_pid(self, rank: int) -> int:
        lines = [ln for ln in self.agents[rank].all if "trainer started: pid" in ln]
        return int(lines[-1].split("pid ")[1].split(",")[0])

    def stepping(self, after: float, epoch_above: int, steps: int = 3) -> list[Incarnation]:
        """Every rank's incarnation once all run at one epoch above ``epoch_above``, resumed
        after ``after`` and ``steps`` steps in (None for a rank until then)."""
        last = []
        for rank in self.running:
            inc = self.incarnations(rank)
            if not inc or inc[-1].resumed_at <= after or inc[-1].epoch <= epoch_above:
                return []
            if len(inc[-1].steps) < steps:
                return []
            last.append(inc[-1])
        return last if len({i.epoch for i in last}) == 1 else []

    def wait_stepping(
        self, after: float, epoch_above: int, timeout: float = 60, steps: int = 3
    ) -> list[Incarnation]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for a in (self.agents[r] for r in self.running):
                if a.proc.poll() is not None:
                    raise AssertionError(f"an agent exited:\n{''.join(a.all[-40:])}")
            found = self.stepping(after, epoch_above, steps)
            if found:
                return found
            time.sleep(0.05)
        tails = "\n".join(
            f"--- rank {i}\n{''.join(a.all[-30:])}" for i, a in enumerate(self.agents)
        )
        raise AssertionError(f"the mesh did not step again above epoch {epoch_above}:\n{tails}")

    def epoch(self) -> int:
        return max(inc[-1].epoch for r in self.running if (inc := self.incarnations(r)))

    # --- faults -------------------------------------------------------------------------------

    def crash(self, rank: int) -> float:
        """SIGKILL rank ``rank``'s trainer; the time it was sent."""
        pid = self.trainer_pid(rank)
        t = time.time()
        psutil.Process(pid).kill()
        return t

    def device_failed(self, rank: int, state: str = "failed") -> float:
        """A health event (``state``) for rank ``rank``'s device, published durably as
        monitors do; the time it was published (connected already)."""
        import nats

        from tests.conftest import health_event

        async def go() -> float:
            nc = await nats.connect(self.env["MARDUK_ADDR"])
            try:
                t = time.time()
                reply = await health_event(nc, self.device(rank), state)
                assert reply.actions, reply
                return t
            finally:
                await nc.close()

        return asyncio.run(go())

    def stop(self) -> None:
        for a in self.agents:
            a.stop()
        self.ctl.stop()


def left_behind(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (zombies are gone for this purpose)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            continue
    return alive


def resumed(
    job: MeshJob, name: str, t_fault: float, epoch_before: int, timeout: float = 60
) -> list[Incarnation]:
    """Wait for the mesh to step again after a fault (``timeout`` s at most); check it resumed
    right; print timings."""
    # (may be the ones the fault replaced; a spare taking a rank had none)
    old = [job.trainer_pid(r) for r in job.running if job.has_trainer(r)]
    now = job.wait_stepping(t_fault, epoch_before, timeout=timeout)
    # Every incarnation since the fault's: with two faults apart, the one between them may
    # have trained on and saved the checkpoint the mesh resumes from.
    first = job.running[0]  # an agent that ran before the fault too
    prior = [i for i in job.incarnations(first) if epoch_before <= i.epoch < now[0].epoch]
    before = Incarnation(epoch_before, prior[0].start, prior[0].resumed_at, {})
    for inc in prior:
        before.steps.update(inc.steps)  # a replayed step's values are the same in each
    # Process 0 saves right after printing a step; another rank stopped by the fault between
    # that step's collective and its own print never shows it: the last step any rank printed.
    last = max(
        (max(i.steps) for r in job.running for i in job.incarnations(r)
         if epoch_before <= i.epoch < now[0].epoch and i.steps),
        default=max(before.steps),
    )  # fmt: skip
    starts = {inc.start for inc in now}
    assert len(starts) == 1, f"ranks restored different checkpoints: {starts}"
    start = starts.pop()
    assert 0 < start <= last, (start, last)
    common = set.intersection(*(set(inc.steps) for inc in now))
    for step in common:
        assert len({inc.steps[step][1] for inc in now}) == 1, f"ranks disagree at step {step}"
    replayed = common & set(before.steps)
    for step in replayed:  # same data, same restored state: the same numbers again
        assert now[0].steps[step][1] == before.steps[step][1], step
    back = [inc.first_step_at - t_fault for inc in now if inc.first_step_at is not None]
    print(
        f"{name}: epoch {epoch_before} -> {now[0].epoch}, resumed at step {start}, "
        f"every rank stepping {max(back):.2f}s after the fault "
        f"({', '.join(f'{b:.2f}' for b in back)}); {len(replayed)} step(s) replayed identically"
    )
    assert not left_behind([p for p in old if p not in {job.trainer_pid(r) for r in job.running}])
    return now
