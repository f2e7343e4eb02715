"""Benchmark: a torchft job under faults, torchft alone side by side with torchft under Marduk.

The job: three replica groups of examples/torchft_ddp.py (gloo, CPU, ``--step-seconds 0.1``,
one process each) and torchft's own lighthouse (``torchft_lighthouse --min_replicas 2``).
Configurations, one after the other in one run:

* ``alone``: each group under ``torchrun --standalone --nproc-per-node 1 --max-restarts N``
  (the restart loop torchft's own examples use), no controller; the trainer is
  bench/torchft_alone.py (the example with ``attach`` a no-op); lighthouse defaults
  (``--heartbeat_timeout_ms 5000``).
* ``alone-hb1000``: the same with ``--heartbeat_timeout_ms 1000``.
* ``marduk``: each group under ``marduk agent run --preload torch,torchft`` and a controller
  (``--no-embedded``, on a nats-server of the run's own); the example as it is
  (``agent.torchft.attach``); lighthouse defaults.
* ``marduk-hb1000``: the same with ``--heartbeat_timeout_ms 1000``.

Faults, ``--trials`` of each per configuration, the failed group rotating over g1, g2, g3,
each ``--settle`` s after the job is whole again: ``device`` (with Marduk: a ``failed`` health
event for the group's device, published as ``marduk monitor inject-failure`` does, and the
controller's restart command ends the trainer; alone: torchft cannot see a device event, so the
trainer is SIGKILLed, as a dead GPU would) and ``crash`` (the group's trainer SIGKILLed).

Per trial, from the trainers' ``step S committed weights H ... groups N t T`` lines:
**stall**: the healthy groups' longest wait for a committed step, from the fault (or their last
commit after it) until 2 s after the failed group is back; **lost**: steps a healthy group would
have committed at its pre-fault rate from the fault to the failed group's return, less those it
committed (mean of the two), and steps the failed group missed (the others' commits between its
last one and its first after healing); **back**: fault -> the failed group's first committed step
in its new trainer, at the others' step with their weights (healed from a peer).

``--quiet S``: before the faults, S s without any (configurations with a tightened heartbeat
timeout only, unless ``--quiet-all``): any committed step with fewer than 3 groups or any new
trainer is a false failure. ``--goodput S``: after the trials, S s with a fault every
``--goodput-every`` s (crash and device alternating): committed steps per second of the job.

Every port is held by the process that uses it: nats-server (``-p -1``), the lighthouse
(``--bind 127.0.0.1:0``, read from its log), torchrun (``--standalone``), and each trainer's
store and Manager (port 0). Every process is started in a session of its own and ended with
its group; trainers seen are SIGKILLed if still alive at the end.

    .venv/bin/python bench/bench_torchft.py --trials 3 --out bench/results/torchft.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench_notify import machine, source_version, start_nats_server
from bench_restart import inject, wait_for

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
JOB = "ft"
GROUPS = ("g1", "g2", "g3")
CONFIGS = {  # name: (under Marduk, lighthouse heartbeat timeout ms)
    "alone": (False, 5000),
    "alone-hb1000": (False, 1000),
    "marduk": (True, 5000),
    "marduk-hb1000": (True, 1000),
}
FAULTS = ("device", "crash")
COMMITTED = re.compile(r"step (\d+) committed weights (\w+) loss \S+ groups (\d+) t ([0-9.]+)")
JOINING = re.compile(r"group (\S+) pid (\d+) joining at step (\d+)")


@dataclass(frozen=True)
class Commit:
    incarnation: int
    step: int
    weights: str
    groups: int
    t: float


class Proc:
    """A child process in a session of its own; its output lines collected by a thread."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = open(log, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            args,
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            self.log.write(line)

    def commits(self) -> list[Commit]:
        out, incarnation = [], -1
        for line in list(self.lines):
            if JOINING.search(line):
                incarnation += 1
            m = COMMITTED.search(line)
            if m:
                step, weights, groups, t = m.groups()
                out.append(Commit(incarnation, int(step), weights, int(groups), float(t)))
        return out

    def trainer_pids(self) -> list[int]:
        return [int(m.group(2)) for line in list(self.lines) if (m := JOINING.search(line))]

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def until(what: str, check: Callable[[], object], timeout: float) -> object:
    return wait_for(check, timeout, what, every=0.05)  # each check parses every line so far


def stats(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "p50": round(statistics.median(values), 3),
        "max": round(max(values), 3),
        "min": round(min(values), 3),
    }


class Job:
    def __init__(self, config: str, run_dir: Path) -> None:
        self.config = config
        self.marduk, self.hb_ms = CONFIGS[config]
        self.dir = run_dir / config
        self.dir.mkdir(parents=True)
        self.env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "RUST_LOG": "info",
        }
        self.procs: list[Proc] = []
        self.nats: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.groups: dict[str, Proc] = {}

    def start(self) -> None:
        lh = Proc(
            [
                *(str(BIN / "torchft_lighthouse"), "--min_replicas", "2"),
                *("--bind", "127.0.0.1:0", "--heartbeat_timeout_ms", str(self.hb_ms)),
            ],
            self.env,
            self.dir / "lighthouse.log",
        )
        self.procs.append(lh)
        said = until("the lighthouse", lambda: [x for x in lh.lines if "listening on" in x], 30)
        port = str(said[0]).rsplit(":", 1)[1].strip()  # type: ignore[index]
        addr = f"http://127.0.0.1:{port}"
        trainer = ["--lighthouse", addr, "--step-seconds", "0.1"]
        env = {**self.env, "RUST_LOG": "warn"}
        if self.marduk:
            self.nats, self.url = start_nats_server(self.dir)
            env.update(
                MARDUK_ADDR=self.url,
                MARDUK_STATE_DIR=str(self.dir / "state"),
                # Every trial fails a device again: lift the budget that would escalate the
                # 4th failure within the hour to `fail`.
                MARDUK_DEVICE_MAX_FAILURES="1000000",
            )
            ctl = Proc(
                [sys.executable, "-m", "marduk", "controller", "--no-embedded"],
                env,
                self.dir / "controller.log",
            )
            self.procs.append(ctl)
            until("the controller", lambda: any("serving prefix" in x for x in ctl.lines), 60)
        for g in GROUPS:
            if self.marduk:
                args = [
                    *(sys.executable, "-m", "marduk", "agent", "run", "--job", JOB),
                    *("--replica", g, "--devices", f"{JOB}-{g}-d0"),
                    *("--preload", "torch,torchft", "--grace", "5", "--startup-timeout", "120"),
                    *("--max-restarts", "100000"),
                    *("--", sys.executable, "examples/torchft_ddp.py", *trainer),
                ]
                genv = env
            else:
                args = [
                    *(str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "1"),
                    *("--max-restarts", "100000", "bench/torchft_alone.py", *trainer),
                ]
                genv = {**env, "MARDUK_REPLICA_ID": g}
            self.groups[g] = Proc(args, genv, self.dir / f"{g}.log")
            self.procs.append(self.groups[g])
        until(
            "all three groups commit in one quorum",
            lambda: all(any(c.groups == 3 for c in p.commits()) for p in self.groups.values()),
            180,
        )

    def stop(self) -> None:
        seen = [pid for p in self.groups.values() for pid in p.trainer_pids()]
        for p in reversed(self.procs):
            p.stop()
        if self.nats is not None:
            self.nats.terminate()
            self.nats.wait(10)
        for pid in seen:  # a trainer its supervisor left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def fault(self, kind: str, g: str) -> float:
        """Fault group ``g``; return the fault's wall time."""
        if kind == "device" and self.marduk:
            return inject(self.url, f"{JOB}-{g}-d0")
        pid = self.groups[g].trainer_pids()[-1]
        t = time.time()
        os.kill(pid, signal.SIGKILL)
        return t

    def healed(self, g: str, incarnation: int) -> Commit | None:
        """The failed group's first commit in ``incarnation``, once both others committed
        that step too (with the same weights, checked)."""
        mine = [c for c in self.groups[g].commits() if c.incarnation >= incarnation]
        if not mine:
            return None
        first = mine[0]
        for h, p in self.groups.items():
            if h == g:
                continue
            theirs = [c for c in p.commits() if c.step == first.step]
            if not theirs:
                return None
            if theirs[-1].weights != first.weights:
                raise AssertionError(f"{g} healed to other weights: {first} vs {h} {theirs[-1]}")
        return first

    def trial(self, kind: str, g: str) -> dict[str, object]:
        failed = self.groups[g]
        before = failed.commits()
        incarnation = len(failed.trainer_pids())  # the next trainer's index
        last_step = before[-1].step
        t0 = self.fault(kind, g)
        back = until(f"{g} back, healed", lambda: self.healed(g, incarnation), 120)
        assert isinstance(back, Commit)
        healthy = [p for h, p in self.groups.items() if h != g]
        until(
            "the healthy groups commit past the return",
            lambda: all(sum(c.t > back.t + 2 for c in p.commits()) >= 1 for p in healthy),
            60,
        )
        stalls, lost = [], []
        for p in healthy:
            ts = [c.t for c in p.commits()]
            pre = [t for t in ts if t <= t0]
            window = pre[-1:] + [t for t in ts if t0 < t <= back.t + 2]
            stalls.append(max(b - max(a, t0) for a, b in itertools.pairwise(window)))
            recent = pre[-21:]
            step_s = statistics.median(b - a for a, b in itertools.pairwise(recent))
            committed = sum(t0 < t <= back.t for t in ts)
            lost.append(max(0.0, (back.t - t0) / step_s - committed))
        return {
            "fault": kind,
            "group": g,
            "stall_s": round(max(stalls), 3),
            "healthy_lost_steps": round(statistics.mean(lost), 1),
            "failed_lost_steps": back.step - last_step - 1,
            "back_s": round(back.t - t0, 3),
            "back_step": back.step,
        }

    def quiet(self, seconds: float) -> dict[str, object]:
        t0 = time.time()
        starts0 = sum(len(p.trainer_pids()) for p in self.groups.values())
        time.sleep(seconds)
        short = [
            (g, c.step)
            for g, p in self.groups.items()
            for c in p.commits()
            if c.t > t0 and c.groups < 3
        ]
        starts = sum(len(p.trainer_pids()) for p in self.groups.values()) - starts0
        steps = [sum(c.t > t0 for c in p.commits()) for p in self.groups.values()]
        return {
            "seconds": seconds,
            "commits_with_fewer_groups": len(short),
            "new_trainers": starts,
            "false_failure": bool(short or starts),
            "steps_per_group": steps,
        }

    def goodput(self, seconds: float, every: float) -> dict[str, object]:
        def top() -> int:
            return max(max(c.step for c in p.commits()) for p in self.groups.values())

        t_start, s_start = time.time(), top()
        faults = 0
        while time.time() - t_start + every <= seconds:
            time.sleep(every)
            self.fault(FAULTS[faults % 2], GROUPS[faults % 3])
            faults += 1
        time.sleep(max(0.0, seconds - (time.time() - t_start)))
        steps = top() - s_start
        return {
            "seconds": seconds,
            "faults": faults,
            "every_s": every,
            "job_steps": steps,
            "steps_per_s": round(steps / seconds, 2),
        }


def run_config(config: str, run_dir: Path, args: argparse.Namespace) -> dict[str, object]:
    job = Job(config, run_dir)
    t_start = time.monotonic()
    try:
        job.start()
        out: dict[str, object] = {
            "config": config,
            "marduk": job.marduk,
            "heartbeat_timeout_ms": job.hb_ms,
            "startup_s": round(time.monotonic() - t_start, 1),
        }
        print(f"{config}: three groups in one quorum after {out['startup_s']} s", file=sys.stderr)
        time.sleep(args.warmup)
        if args.quiet and (args.quiet_all or job.hb_ms < 5000):
            out["quiet"] = job.quiet(args.quiet)
            print(f"{config}: quiet {out['quiet']}", file=sys.stderr)
        trials = []
        for k in range(args.trials):
            for kind in FAULTS:
                time.sleep(args.settle)
                trials.append(job.trial(kind, GROUPS[(len(trials)) % 3]))
                print(f"{config} {k + 1}: {json.dumps(trials[-1])}", file=sys.stderr, flush=True)
        out["trials"] = trials
        out["summary"] = {
            kind: {
                key: stats([float(t[key]) for t in trials if t["fault"] == kind])  # type: ignore[arg-type]
                for key in ("stall_s", "healthy_lost_steps", "failed_lost_steps", "back_s")
            }
            for kind in FAULTS
        }
        if args.goodput:
            out["goodput"] = job.goodput(args.goodput, args.goodput_every)
            print(f"{config}: goodput {out['goodput']}", file=sys.stderr, flush=True)
        return out
    finally:
        job.stop()


def table(results: list[dict]) -> str:  # type: ignore[type-arg]
    rows = [
        "| config | fault | healthy stall p50 / max | healthy steps lost p50 / max "
        "| failed group's steps lost p50 | failed group back p50 / max |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        for kind, s in r["summary"].items():
            rows.append(
                f"| {r['config']} | {kind} "
                f"| {s['stall_s']['p50']:.2f} / {s['stall_s']['max']:.2f} s "
                f"| {s['healthy_lost_steps']['p50']:.1f} / {s['healthy_lost_steps']['max']:.1f} "
                f"| {s['failed_lost_steps']['p50']:.0f} "
                f"| {s['back_s']['p50']:.2f} / {s['back_s']['max']:.2f} s |"
            )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--trials", type=int, default=3, help="faults of each kind per configuration")
    p.add_argument("--warmup", type=float, default=10.0, help="s from the job whole to its run")
    p.add_argument("--settle", type=float, default=3.0, help="s from the last return to a fault")
    p.add_argument("--quiet", type=float, default=0.0, help="s without faults first (see above)")
    p.add_argument("--quiet-all", action="store_true", help="--quiet for every configuration")
    p.add_argument("--goodput", type=float, default=0.0, help="s of the goodput run (0: none)")
    p.add_argument("--goodput-every", type=float, default=25.0)
    p.add_argument("--out", help="also write the JSON report here")
    args = p.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="marduk-torchft-"))
    results = []
    try:
        for config in args.configs.split(","):
            if config not in CONFIGS:
                p.error(f"unknown configuration {config!r}")
            results.append(run_config(config, run_dir, args))
    finally:
        if os.environ.get("BENCH_KEEP"):
            print(f"kept {run_dir}", file=sys.stderr)
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    report = {
        "source": source_version(),
        "machine": machine(),
        "command": " ".join(["bench/bench_torchft.py", *sys.argv[1:]]),
        "trials_per_fault": args.trials,
        "settle_s": args.settle,
        "results": results,
    }
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
