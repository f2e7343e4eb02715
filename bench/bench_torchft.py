"""Benchmark: a torchft job under faults, torchft alone side by side with torchft under Marduk.

The job: three replica groups of examples/torchft_ddp.py (gloo, CPU, ``--step-seconds 0.1``,
``--timeout`` ``--ft-timeout``: torchft's collective timeout; one process each) and torchft's
own lighthouse (``torchft_lighthouse --min_replicas 2``). Configurations (``--configs``), one
after the other in one run, named ``alone``, ``marduk`` or ``front`` and the lighthouse's timers:

* ``alone``: each group under ``torchrun --standalone --nproc-per-node 1 --max-restarts N``
  (the restart loop torchft's own examples use), no controller; the trainer is
  bench/torchft_alone.py (the example with ``attach`` a no-op); lighthouse defaults
  (``--heartbeat_timeout_ms 5000 --join_timeout_ms 60000 --quorum_tick_ms 100``).
* ``marduk``: each group under ``marduk agent run --preload torch,torchft --hang-timeout H``
  and a controller (``--no-embedded``, on a nats-server of the run's own); the example as it is
  (``agent.torchft.attach``); lighthouse defaults.
* ``front``: as ``marduk``, with torchft's lighthouse behind ``marduk torchft-lighthouse``
  (agent/torchft_front: a group's heartbeats stop at the controller's restart or fail for it)
  and ``TORCHFT_QUORUM_RETRIES=600`` in the trainers' environment; ``-hbMS`` is the front's
  ``--heartbeat-timeout-ms`` (1000 unless given), ``-innerMS`` its ``--inner-timeout-ms``
  (torchft's lighthouse's own, 100 unless given); ``-join``/``-tick`` go to that lighthouse.
* a suffix sets a lighthouse timer: ``-hb1000`` (``--heartbeat_timeout_ms 1000``), ``-join100``
  (``--join_timeout_ms 100``), ``-tick20`` (``--quorum_tick_ms 20``). The default list: each of
  alone and marduk with the defaults, ``-hb1000`` (``agent.torchft.LIGHTHOUSE_FLAGS``),
  ``-hb500`` and ``-hb1000-join100-tick20`` (the stall target; quorums may rotate after a
  return: look at ``whole_s``), and ``front``.

Faults (``--faults``), ``--trials`` of each per configuration, the failed group rotating over
g1, g2, g3, each ``--settle`` s after the job is whole again: ``device`` (with Marduk: a
``failed`` health event for the group's device, published as ``marduk monitor inject-failure``
does, and the controller's restart command ends the trainer; alone: torchft cannot see a device
event, so the trainer is SIGKILLed, as a dead GPU would), ``crash`` (the group's trainer
SIGKILLed) and ``hang`` (the trainer SIGSTOPped: it stops stepping and heartbeating without
dying, its sockets stay open; with Marduk its agent's hang detection ends it after
``--hang-timeout`` s without a step; alone nothing does: it is SIGKILLed after
``--hang-window`` s and reported as never back).

Per trial, from the trainers' ``step S committed weights H ... groups N t T`` lines:
**stall**: the healthy groups' longest wait for a committed step, from the fault (or their last
commit after it) until 2 s after the failed group is back; **lost**: steps a healthy group would
have committed at its pre-fault rate from the fault to the failed group's return, less those it
committed (mean of the two), and steps the failed group missed (the others' commits between its
last one and its first after healing); **back**: fault -> the failed group's first committed step
in its new trainer, at another group's step with its weights (healed from a peer);
**whole**: fault -> the first step all three groups committed together (``groups 3``: the job
whole again; a short join timeout can keep quorums rotating after a return, see
docs/benchmarks.md); **healthy_new_trainers**: restarts of the healthy groups (a hang detection
taking them for hung); **healthy_refused_quorums**: quorum answers the healthy groups' Guards
refused because they still held the failed group's dead incarnation (under Marduk);
**healthy_late_notices**: notices that came once such an answer was read, too late to refuse it.

``--quiet S``: before the faults, S s without any (configurations with a tightened lighthouse
timer only, unless ``--quiet-all``): any committed step with fewer than 3 groups or any new
trainer is a false failure. ``--goodput S``: after the trials, S s with a fault every
``--goodput-every`` s (crash and device alternating): committed steps per second of the job,
and each group's drops from a 3-group step to a smaller one (``rotation``: more drops than
faults, quorums that kept changing after a return).
The machine's 1-minute load average is sampled every 5 s per configuration (``load1``).

Every port is held by the process that uses it: nats-server (``-p -1``), the lighthouse
(``--bind 127.0.0.1:0``, read from its log), torchrun (``--standalone``), and each trainer's
store and Manager (port 0). Every process is started in a session of its own and ended with
its group (SIGTERM to the benchmark too); trainers seen, stopped ones included, are SIGKILLed if
still alive at the end.

    .venv/bin/python bench/bench_torchft.py --trials 3 --quiet 60 --out bench/results/torchft.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import signal
import socket
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
# Configuration names: ``alone`` or ``marduk``, then ``-hbMS`` (the lighthouse's
# --heartbeat_timeout_ms, 5000 unless given), ``-joinMS`` (its --join_timeout_ms, 60000) and
# ``-tickMS`` (its --quorum_tick_ms, 100).
# ``front``: under Marduk, torchft's lighthouse behind ``marduk torchft-lighthouse`` (-hbMS: the
# front's --heartbeat-timeout-ms, 1000 unless given; -innerMS: --inner-timeout-ms, 100).
CONFIG = re.compile(
    r"(alone|marduk|front)(?:-hb(\d+))?(?:-join(\d+))?(?:-tick(\d+))?(?:-inner(\d+))?"
)
CONFIGS = (
    *(
        f"{who}{timers}"
        for who in ("alone", "marduk")
        for timers in ("", "-hb1000", "-hb500", "-hb1000-join100-tick20")  # LIGHTHOUSE_FLAGS
    ),
    "front",
)
FAULTS = ("device", "crash", "hang")
COMMITTED = re.compile(r"step (\d+) committed weights (\w+) loss \S+ groups (\d+) t ([0-9.]+)")
JOINING = re.compile(r"group (\S+) pid (\d+) joining at step (\d+)")
REFUSED = "told failed: not configured"  # agent.torchft.Guard refusing a quorum answer
LATE = "in the quorum being configured"  # its notice after that answer was read: too late


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
    def __init__(
        self, config: str, run_dir: Path, hang_timeout: float = 0.0, ft_timeout: float = 10.0
    ) -> None:
        m = CONFIG.fullmatch(config)
        if m is None:
            raise ValueError(f"unknown configuration {config!r}")
        self.config = config
        self.front = m.group(1) == "front"
        self.marduk = m.group(1) in ("marduk", "front")
        self.hb_ms = int(m.group(2) or (1000 if self.front else 5000))
        self.inner_ms = int(m.group(5) or 100)
        self.join_ms = int(m.group(3) or 60000)
        self.tick_ms = int(m.group(4) or 100)
        self.hang_timeout = hang_timeout  # `marduk agent run --hang-timeout` (0: its default)
        self.ft_timeout = ft_timeout  # the trainers' --timeout: torchft's collective timeout
        self.stopped: list[int] = []  # trainers SIGSTOPped by a hang fault
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
        addr = self.start_front(env) if self.front else self.start_lighthouse()
        trainer = ["--lighthouse", addr, "--step-seconds", "0.1", "--timeout", str(self.ft_timeout)]
        if self.front:  # a quorum call cut by a restarting front is retried (docs/operations.md)
            env["TORCHFT_QUORUM_RETRIES"] = "600"
        for g in GROUPS:
            if self.marduk:
                args = [
                    *(sys.executable, "-m", "marduk", "agent", "run", "--job", JOB),
                    *("--replica", g, "--devices", f"{JOB}-{g}-d0"),
                    *("--preload", "torch,torchft", "--grace", "5", "--startup-timeout", "120"),
                    *("--max-restarts", "100000"),
                    *(("--hang-timeout", str(self.hang_timeout)) if self.hang_timeout else ()),
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

    def start_lighthouse(self) -> str:
        lh = Proc(
            [
                *(str(BIN / "torchft_lighthouse"), "--min_replicas", "2"),
                *("--bind", "127.0.0.1:0", "--heartbeat_timeout_ms", str(self.hb_ms)),
                *("--join_timeout_ms", str(self.join_ms), "--quorum_tick_ms", str(self.tick_ms)),
            ],
            self.env,
            self.dir / "lighthouse.log",
        )
        self.procs.append(lh)
        said = until("the lighthouse", lambda: [x for x in lh.lines if "listening on" in x], 30)
        port = str(said[0]).rsplit(":", 1)[1].strip()  # type: ignore[index]
        return f"http://127.0.0.1:{port}"

    def start_front(self, env: dict[str, str]) -> str:
        """``marduk torchft-lighthouse`` (its lighthouse's timers: the front's; a -join or -tick
        suffix is passed on to torchft's lighthouse)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        extra = [
            *(("--join_timeout_ms", str(self.join_ms)) if self.join_ms != 60000 else ()),
            *(("--quorum_tick_ms", str(self.tick_ms)) if self.tick_ms != 100 else ()),
        ]
        front = Proc(
            [
                *(sys.executable, "-m", "marduk", "torchft-lighthouse", "--job", JOB),
                *("--min-replicas", "2", "--bind", f"127.0.0.1:{port}"),
                *(
                    "--heartbeat-timeout-ms",
                    str(self.hb_ms),
                    "--inner-timeout-ms",
                    str(self.inner_ms),
                ),
                *(("--", *extra) if extra else ()),
            ],
            {**env, "RUST_LOG": self.env["RUST_LOG"]},  # its lighthouse's log, as the others'
            self.dir / "front.log",
        )
        self.procs.append(front)
        until("the front", lambda: any("serving:" in x for x in front.lines), 60)
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        seen = [pid for p in self.groups.values() for pid in p.trainer_pids()]
        for pid in self.stopped:  # a hung trainer ignores SIGTERM until it runs again
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
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
        if kind == "hang":  # stops stepping, does not die: sockets open, no heartbeat
            os.kill(pid, signal.SIGSTOP)
            self.stopped.append(pid)
        else:
            os.kill(pid, signal.SIGKILL)
        return t

    def unhang(self) -> None:
        """End the trainers a hang fault stopped (alone: nothing else ever will; torchrun then
        starts the next one)."""
        for pid in self.stopped:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.stopped.clear()

    def healed(self, g: str, incarnation: int) -> Commit | None:
        """The failed group's first commit in ``incarnation``, once another group committed
        that step too (with the same weights, checked against every group that did: with a
        short join timeout a healthy straggler may skip that step and heal past it)."""
        mine = [c for c in self.groups[g].commits() if c.incarnation >= incarnation]
        if not mine:
            return None
        first = mine[0]
        seen = False
        for h, p in self.groups.items():
            if h == g:
                continue
            theirs = [c for c in p.commits() if c.step == first.step]
            if theirs and theirs[-1].weights != first.weights:
                raise AssertionError(f"{g} healed to other weights: {first} vs {h} {theirs[-1]}")
            seen = seen or bool(theirs)
        return first if seen else None

    def whole_since(self, t0: float) -> float | None:
        """When the job was whole again after ``t0``: the time of the first step that all three
        groups committed together (``groups 3``, none of them healing), or None."""
        steps = [
            {c.step: c.t for c in p.commits() if c.t > t0 and c.groups == 3}
            for p in self.groups.values()
        ]
        common = set(steps[0]).intersection(*steps[1:])
        if not common:
            return None
        first = min(common)
        return max(s[first] for s in steps)

    def trial(self, kind: str, g: str, hang_window: float = 20.0) -> dict[str, object]:
        """One fault of group ``g``. A ``hang`` that nothing ends within ``hang_window`` s
        (torchft alone: no restart loop sees a stopped process) is ended then, by SIGKILL;
        its ``back_s`` is None, and the figures cover the window."""
        failed = self.groups[g]
        before = failed.commits()
        incarnation = len(failed.trainer_pids())  # the next trainer's index
        others = {h: len(p.trainer_pids()) for h, p in self.groups.items() if h != g}
        seen = {h: len(p.lines) for h, p in self.groups.items() if h != g}
        last_step = before[-1].step
        t0 = self.fault(kind, g)
        back: Commit | None = None
        try:
            wait = hang_window if kind == "hang" else 120
            back = until(f"{g} back, healed", lambda: self.healed(g, incarnation), wait)  # type: ignore[assignment]
        except TimeoutError:
            if kind != "hang":
                raise
        end = back.t if back is not None else t0 + hang_window
        if back is None:
            self.unhang()
            returned = until(f"{g} back after SIGKILL", lambda: self.healed(g, incarnation), 120)
            assert isinstance(returned, Commit)
            last_step = returned.step  # the next trial's group is another one anyway
        self.stopped.clear()
        healthy = [p for h, p in self.groups.items() if h != g]
        until(
            "the healthy groups commit past the return",
            lambda: all(sum(c.t > end + 2 for c in p.commits()) >= 1 for p in healthy),
            60,
        )
        try:
            whole = until("the job whole again", lambda: self.whole_since(t0), 60)
        except TimeoutError:
            whole = None
        stalls, lost = [], []
        for p in healthy:
            ts = [c.t for c in p.commits()]
            pre = [t for t in ts if t <= t0]
            after = [t for t in ts if t > t0]
            # ... and the first commit past the window (a stall may outlast it).
            window = (
                pre[-1:]
                + [t for t in after if t <= end + 2]
                + [t for t in after if t > end + 2][:1]
            )
            stalls.append(max(b - max(a, t0) for a, b in itertools.pairwise(window)))
            recent = pre[-21:]
            step_s = statistics.median(b - a for a, b in itertools.pairwise(recent))
            committed = sum(t0 < t <= end for t in ts)
            lost.append(max(0.0, (end - t0) / step_s - committed))
        return {
            "fault": kind,
            "group": g,
            "stall_s": round(max(stalls), 3),
            "healthy_lost_steps": round(statistics.mean(lost), 1),
            "failed_lost_steps": back.step - last_step - 1 if back is not None else None,
            "back_s": round(back.t - t0, 3) if back is not None else None,
            "back_step": back.step if back is not None else None,
            "whole_s": round(float(whole) - t0, 3) if whole is not None else None,  # type: ignore[arg-type]
            # Restarts of the healthy groups (a hang detection that took them for hung).
            "healthy_new_trainers": sum(
                len(self.groups[h].trainer_pids()) - n for h, n in others.items()
            ),
            # Quorum answers the healthy groups' Guards refused (issued with the failed group
            # just before it died: agent/torchft.py); 0 for torchft alone.
            "healthy_refused_quorums": self._said(REFUSED, seen),
            # Notices that came once such an answer was read (its configure may wait for the
            # failed group until torchft's timeout: nothing reaches that wait).
            "healthy_late_notices": self._said(LATE, seen),
        }

    def _said(self, text: str, since: dict[str, int]) -> int:
        """Lines with ``text`` in the groups' output past the line counts ``since``."""
        return sum(text in line for h, n in since.items() for line in self.groups[h].lines[n:])

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
            self.fault(("crash", "device")[faults % 2], GROUPS[faults % 3])
            faults += 1
        time.sleep(max(0.0, seconds - (time.time() - t_start)))
        steps = top() - s_start
        # Quorum rotation: a group's committed steps going from 3 groups to fewer more often
        # than there were faults (one such drop per fault: the failed group leaves, comes back).
        drops = {
            g: sum(
                a.groups == 3 and b.groups < 3
                for a, b in itertools.pairwise(c for c in p.commits() if c.t > t_start)
            )
            for g, p in self.groups.items()
        }
        return {
            "seconds": seconds,
            "faults": faults,
            "every_s": every,
            "job_steps": steps,
            "steps_per_s": round(steps / seconds, 2),
            "drops_to_fewer_groups": drops,
            "rotation": any(n > faults for n in drops.values()),
        }


class Load:
    """The machine's 1-minute load average, sampled every 5 s while a configuration runs (the
    machine may be shared: the figures say how loaded it was)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(5)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        s = self.samples or [os.getloadavg()[0]]
        return {
            "min": round(min(s), 2),
            "median": round(statistics.median(s), 2),
            "max": round(max(s), 2),
        }


def run_config(config: str, run_dir: Path, args: argparse.Namespace) -> dict[str, object]:
    job = Job(config, run_dir, hang_timeout=args.hang_timeout, ft_timeout=args.ft_timeout)
    t_start = time.monotonic()
    load = Load()
    out: dict[str, object] = {}
    try:
        job.start()
        out |= {
            "config": config,
            "marduk": job.marduk,
            "front": job.front,
            "heartbeat_timeout_ms": job.hb_ms,
            "inner_timeout_ms": job.inner_ms if job.front else None,
            "join_timeout_ms": job.join_ms,
            "quorum_tick_ms": job.tick_ms,
            "hang_timeout_s": (job.hang_timeout or None) if job.marduk else None,
            "startup_s": round(time.monotonic() - t_start, 1),
        }
        print(f"{config}: three groups in one quorum after {out['startup_s']} s", file=sys.stderr)
        time.sleep(args.warmup)
        if args.quiet and (args.quiet_all or job.hb_ms < 5000 or job.join_ms < 60000):
            out["quiet"] = job.quiet(args.quiet)
            print(f"{config}: quiet {out['quiet']}", file=sys.stderr)
        trials: list[dict[str, object]] = []
        faults = args.faults.split(",")
        for k in range(args.trials):
            for kind in faults:
                time.sleep(args.settle)
                trials.append(job.trial(kind, GROUPS[(len(trials)) % 3], args.hang_window))
                print(f"{config} {k + 1}: {json.dumps(trials[-1])}", file=sys.stderr, flush=True)
        out["trials"] = trials
        out["summary"] = {
            kind: {
                key: stats(
                    [float(v) for t in trials if t["fault"] == kind and (v := t[key]) is not None]
                )  # type: ignore[arg-type]
                for key in (
                    "stall_s",
                    "healthy_lost_steps",
                    "failed_lost_steps",
                    "back_s",
                    "whole_s",
                )
            }
            for kind in faults
        }
        out["never_back"] = {
            kind: sum(t["back_s"] is None for t in trials if t["fault"] == kind) for kind in faults
        }
        if args.goodput:
            out["goodput"] = job.goodput(args.goodput, args.goodput_every)
            print(f"{config}: goodput {out['goodput']}", file=sys.stderr, flush=True)
        return out
    finally:
        out["load1"] = load.stop()
        job.stop()


def table(results: list[dict]) -> str:  # type: ignore[type-arg]
    rows = [
        "| config | fault | healthy stall p50 / max | healthy steps lost p50 / max "
        "| failed group's steps lost p50 | failed group back p50 / max "
        "| job whole again p50 / max |",
        "|---|---|---|---|---|---|---|",
    ]

    def fmt(s: dict[str, float], unit: str = "", digits: int = 2) -> str:
        if not s.get("n"):
            return "-"
        return f"{s['p50']:.{digits}f} / {s['max']:.{digits}f}{unit}"

    for r in results:
        for kind, s in r["summary"].items():
            never = r.get("never_back", {}).get(kind, 0)
            back = fmt(s["back_s"], " s")
            if never:
                back = f"never ({never} of {never + s['back_s']['n']}, SIGKILLed after the window)"
            rows.append(
                f"| {r['config']} | {kind} "
                f"| {fmt(s['stall_s'], ' s')} "
                f"| {fmt(s['healthy_lost_steps'], digits=1)} "
                f"| {s['failed_lost_steps']['p50'] if s['failed_lost_steps'].get('n') else '-'} "
                f"| {back} | {fmt(s['whole_s'], ' s')} |"
            )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--configs", default=",".join(CONFIGS), help="alone|marduk[-hbMS][-joinMS], commas"
    )
    p.add_argument("--faults", default=",".join(FAULTS), help="of device, crash, hang")
    p.add_argument(
        "--ft-timeout",
        type=float,
        default=3.0,
        help="the trainers' --timeout (torchft's collective timeout; a collective pending with "
        "a hung group ends there)",
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=4.0,
        help="marduk agent run --hang-timeout for the marduk configurations (0: its default); "
        "above --ft-timeout, or a hang in a collective may restart the healthy groups too",
    )
    p.add_argument(
        "--hang-window",
        type=float,
        default=20.0,
        help="s a hung group is given to come back before it is SIGKILLed (torchft alone)",
    )
    p.add_argument("--trials", type=int, default=3, help="faults of each kind per configuration")
    p.add_argument("--warmup", type=float, default=10.0, help="s from the job whole to its run")
    p.add_argument("--settle", type=float, default=3.0, help="s from the last return to a fault")
    p.add_argument("--quiet", type=float, default=0.0, help="s without faults first (see above)")
    p.add_argument("--quiet-all", action="store_true", help="--quiet for every configuration")
    p.add_argument("--goodput", type=float, default=0.0, help="s of the goodput run (0: none)")
    p.add_argument("--goodput-every", type=float, default=25.0)
    p.add_argument("--out", help="also write the JSON report here")
    args = p.parse_args()
    # SIGTERM (a timeout, an operator) unwinds like Ctrl-C: every job's processes are ended.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    run_dir = Path(tempfile.mkdtemp(prefix="marduk-torchft-"))
    results = []
    try:
        for config in args.configs.split(","):
            if not CONFIG.fullmatch(config):
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
        "hang_timeout_s": args.hang_timeout,
        "ft_timeout_s": args.ft_timeout,
        "hang_window_s": args.hang_window,
        "results": results,
    }
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
