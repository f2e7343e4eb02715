"""The fault matrix of a torch gloo job whose ranks the controller assigns, with real processes:
two agents (``--nnodes 2:2``) each running examples/torch_elastic_trainer.py (one process group
over gloo, an all_reduce a step) and a third agent started with ``--spare`` (registered, no
trainer). In turn:

* a crash (SIGKILL) of rank 0's trainer, the process group's coordinator (MASTER_ADDR);
* a crash of rank 1's trainer;
* a device event on rank 1's device (``marduk monitor inject-failure``), within its budget;
* two faults 0.5 s apart: a crash of rank 1's trainer, then a device event on rank 0's device;
* a device event on rank 0's device past its budget (``MARDUK_DEVICE_MAX_FAILURES=1``): the
  spare takes node rank 0 (the coordinator) at the same WORLD_SIZE, the lost agent exits 71.

After each, every rank starts again at one new epoch with the expected RANK/WORLD_SIZE, resumes
from the same checkpoint (never step 0: at or after the last one saved before the fault), the
ranks print the same values at every step, and a step replayed prints what it did before the
fault; the trainers the fault replaced are gone. At the end nothing the job started is left.
How long each fault took until every rank stepped again is printed, not asserted.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests.conftest import NatsServer, health_event, marduk_cli
from tests.elastic_job import STARTED, ElasticJob
from tests.jax_mesh import left_behind

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

JOB = "tf"
STEP = re.compile(r"^step (\d+) loss (\S+) sum (\S+)")
CKPT = re.compile(r"ckpt-(\d+)\.pt$")
# A fault: when it was dealt; whether the controller joined it to the restart in flight.
Act = Callable[[], tuple[float, bool]]


class Incarnation:
    """A trainer's run since its ``start rank`` line: what it printed and when."""

    def __init__(self, job: ElasticJob, replica: str) -> None:
        timed = list(job.agents[replica].timed)
        starts = [i for i, (_, ln) in enumerate(timed) if STARTED.search(ln)]
        self.found = bool(starts)
        self.env: dict[str, int] = {}
        self.resumed_at = 0.0
        if starts:
            self.resumed_at, line = timed[starts[-1]]
            m = STARTED.search(line)
            assert m is not None
            keys = ("RANK", "WORLD_SIZE", "GROUP_RANK", "MARDUK_EPOCH", "start")
            self.env = dict(zip(keys, map(int, m.groups()), strict=True))
        self.steps: dict[int, tuple[float, str]] = {}
        for t, line in timed[starts[-1] if starts else len(timed) :]:
            if m := STEP.match(line):
                self.steps[int(m.group(1))] = (t, f"{m.group(2)} {m.group(3)}")

    @property
    def epoch(self) -> int:
        return self.env["MARDUK_EPOCH"]

    @property
    def start(self) -> int:
        return self.env["start"]


def prior(job: ElasticJob, replica: str, running: bool) -> dict[int, str]:
    """step -> "loss sum" the agent's trainers printed, before its current incarnation's start
    if it is ``running`` one (a step replayed by several incarnations is the same in each: same
    data, same restored state)."""
    lines = list(job.agents[replica].all)
    starts = [i for i, ln in enumerate(lines) if STARTED.search(ln)]
    out: dict[int, str] = {}
    for line in lines[: starts[-1] if starts and running else len(lines)]:
        if m := STEP.match(line):
            out.setdefault(int(m.group(1)), f"{m.group(2)} {m.group(3)}")
    return out


def last_checkpoint(ckpt: Path) -> int:
    steps = (int(m.group(1)) for p in ckpt.glob("ckpt-*.pt") if (m := CKPT.search(p.name)))
    return max(steps, default=0)


def test_a_torch_gloo_job_recovers_from_every_fault_from_its_checkpoint(
    tmp_path: Path, nats_server: NatsServer
) -> None:
    ckpt = tmp_path / "ckpt"
    env = {
        "MARDUK_ADDR": nats_server.url,
        "PYTHONUNBUFFERED": "1",
        "MARDUK_CKPT_DIR": str(ckpt),
        # One device failure is restarted in place; a second on the same device is past the
        # budget: its member is replaced by the spare.
        "MARDUK_DEVICE_MAX_FAILURES": "1",
    }
    trainer = ("examples/torch_elastic_trainer.py", "--step-seconds", "0.1", "--ckpt-every", "5")
    job = ElasticJob(env, tmp_path, JOB, "2:2", trainer, controllers=1)
    everything: set[int] = set()  # every process the job started, for the end
    timings: list[tuple[str, float]] = []
    try:
        t0 = time.time()
        for r in ("node0", "node1"):
            job.start(r)
        job.start("spare0", "--spare")
        by_rank = job.formed(("node0", "node1"), timeout=180)
        want = {by_rank[0]: (0, 2), by_rank[1]: (1, 2)}
        now = stepping(job, want, after=0.0, epoch_above=-1, steps=8)
        assert not job.starts("spare0")  # registered, holding: no trainer
        print(f"torch gloo 2:2: stepping {time.time() - t0:.1f}s after start, epoch {now[0].epoch}")

        def fault(name: str, *acts: Act, then: dict[str, tuple[int, int]] | None = None) -> None:
            """``acts`` 0.5 s apart; then every replica of ``then`` (default: the same) runs
            again with its (RANK, WORLD_SIZE), started after the last act (or the one before, if
            the last joined the restart in flight instead of ordering one)."""
            nonlocal now, want
            # A checkpoint of this incarnation first: the resume must be from it, not earlier.
            eventually(lambda: last_checkpoint(ckpt / JOB) > now[0].start, job)
            old = {p for r in want for p in job.pids(r, trainers_only=True)}
            saved = last_checkpoint(ckpt / JOB)
            epoch = now[0].epoch
            after = 0.0
            for i, act in enumerate(acts):
                if i:
                    time.sleep(0.5)
                t, joined = act()
                after = after if joined else t
            want = then or want
            now = stepping(job, want, after=after, epoch_above=epoch)
            starts = {inc.start for inc in now}
            assert len(starts) == 1, f"{name}: the ranks restored different checkpoints {starts}"
            start = starts.pop()
            # What every agent's trainers printed before (the spare: nothing; the lost: all).
            before = {r: v for r in job.agents if (v := prior(job, r, r in want))}
            seen = max(max(v) for v in before.values())
            assert 0 < saved <= start <= seen, (name, saved, start, seen)
            common = set.intersection(*(set(inc.steps) for inc in now))
            for step in common:
                assert len({inc.steps[step][1] for inc in now}) == 1, f"{name}: step {step} differs"
            replayed = {s for s in common if all(s in v for v in before.values())}
            for step in replayed:
                was = {v[step] for v in before.values()} | {now[0].steps[step][1]}
                assert len(was) == 1, (name, step, was)
            # Each rank's first step of the new incarnation, from the fault it answers.
            back = [min(t for t, _ in inc.steps.values()) - after for inc in now]
            timings.append((name, max(back)))
            print(
                f"{name}: epoch {epoch} -> {now[0].epoch}, last checkpoint {saved}, resumed at "
                f"step {start}, every rank stepping {max(back):.2f}s after the fault "
                f"({', '.join(f'{b:.2f}' for b in back)}); {len(replayed)} step(s) replayed "
                "identically"
            )
            current = {job.pids(r, trainers_only=True)[-1] for r in want}
            gone = lambda: not left_behind(sorted(old - current))  # noqa: E731
            eventually(gone, job, timeout=30)

        def crash(replica: str) -> Act:
            def act() -> tuple[float, bool]:
                pid = job.pids(replica, trainers_only=True)[-1]
                t = time.time()
                psutil.Process(pid).kill()
                return t, False

            return act

        def inject(replica: str) -> Act:
            def act() -> tuple[float, bool]:
                t = time.time()
                r = marduk_cli("monitor", "inject-failure", f"{JOB}-{replica}", env=env)
                assert r.returncode == 0, r.stdout + r.stderr
                # The times below count from the CLI's launch: its start-up is in them.
                print(
                    f"inject-failure {JOB}-{replica}: answered {time.time() - t:.2f}s after launch"
                )
                return t, False

            return act

        rank0, rank1 = by_rank[0], by_rank[1]
        fault("crash of rank 0 (the coordinator)", crash(rank0))
        fault("crash of rank 1", crash(rank1))
        fault("device event on rank 1", inject(rank1))
        with Publisher(nats_server.url) as publish:
            fault(
                "crash of rank 1, device event on rank 0 0.5s later",
                crash(rank1),
                lambda: publish(f"{JOB}-{rank0}"),
            )
        # Rank 0's device again: past its budget. The spare takes node rank 0 (the coordinator)
        # at the same world size; the member that held it exits 71.
        lost = rank0
        swapped = {"spare0": (0, 2), rank1: (1, 2)}
        fault("device past its budget on rank 0: the spare swaps in", inject(lost), then=swapped)
        assert job.agents[lost].proc.wait(timeout=60) == 71
        placed = job.placed("spare0")
        assert placed and placed[-1][1:] == (0, 2), placed
        job.check_epochs_forward()
        # What each agent counted as a crash of its own trainer (the SIGKILLs; a peer whose
        # collective failed should have waited for the restart instead).
        crashes = {
            r: [ln.strip() for ln in a.all if "trainer crashed" in ln]
            for r, a in job.agents.items()
        }
        print("crashes seen by each agent:", crashes)
        print("resume times: " + "; ".join(f"{n}: {s:.2f}s" for n, s in timings))
        for a in job.agents.values():
            if a.proc.poll() is None:
                kids = psutil.Process(a.proc.pid).children(recursive=True)
                everything.update(p.pid for p in kids)
        everything.update(p for r in job.agents for p in job.pids(r))
    finally:
        job.stop()
    assert everything and not left_behind(sorted(everything)), left_behind(sorted(everything))
    assert not ours(nats_server.url)  # nor anything else with this job's environment


def ours(addr: str) -> list[int]:
    """Processes whose environment points at ``addr`` (the test's agents, controllers and every
    process they started inherit MARDUK_ADDR)."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("MARDUK_ADDR") == addr and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


class Publisher:
    """A device health event published as monitors do, on a connection made beforehand (so two
    faults can be 0.5 s apart: the CLI's start-up would take longer than that)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.loop = asyncio.new_event_loop()

    def __enter__(self) -> Callable[[str], tuple[float, bool]]:
        import nats

        self.nc = self.loop.run_until_complete(nats.connect(self.url))
        return self.publish

    def publish(self, device: str) -> tuple[float, bool]:
        """When; whether the controller joined it to the restart in flight (no new epoch)."""
        t = time.time()
        reply = self.loop.run_until_complete(health_event(self.nc, device))
        assert reply.actions, reply
        return t, all(a.coalesced for a in reply.actions)

    def __exit__(self, *exc: object) -> None:
        self.loop.run_until_complete(self.nc.close())
        self.loop.close()


def stepping(
    job: ElasticJob,
    want: dict[str, tuple[int, int]],
    after: float,
    epoch_above: int,
    steps: int = 3,
    timeout: float = 120,
) -> list[Incarnation]:
    """Every replica of ``want`` once each runs a trainer at one epoch above ``epoch_above``,
    with its (RANK, WORLD_SIZE), started (process group up) after ``after``, ``steps`` steps in."""
    found: list[Incarnation] = []

    def ready() -> bool:
        nonlocal found
        found = [Incarnation(job, r) for r in want]
        return (
            all(inc.found and inc.resumed_at > after for inc in found)
            and len({inc.epoch for inc in found}) == 1
            and found[0].epoch > epoch_above
            and all(
                (inc.env["RANK"], inc.env["WORLD_SIZE"], inc.env["GROUP_RANK"]) == (*rw, rw[0])
                for inc, rw in zip(found, want.values(), strict=True)
            )
            and all(len(inc.steps) >= steps for inc in found)
        )

    eventually(ready, job, timeout)
    return found


def eventually(predicate: Callable[[], bool], job: ElasticJob, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        for r, a in job.agents.items():
            code = a.proc.poll()
            if code is not None and code != 71:
                raise AssertionError(f"agent {r} exited {code}:\n{job.output()}")
        if time.monotonic() > deadline:
            raise AssertionError(job.output())
        time.sleep(0.1)
