"""Benchmark: how fast a job of 8 workers is back after a fault, Marduk side by side with peers.

Contenders, all running bench/restart_worker.py (imports torch, joins a gloo group of 8, steps):

* ``marduk``: 8 ``marduk agent run`` (scope job, 4 replicas x 2 workers, ``--preload torch``:
  trainers forked from each agent's fork server) and a controller; rank 0 crashes.
* ``marduk-standby``: the same with ``--no-fork-server`` (one prestarted trainer per rank,
  started after the trainer's first step; the name is the one the recorded results carry).
* ``marduk-device``: as ``marduk``; the fault is a device health event for one of rank 0's
  devices.
* ``torchrun``: ``torchrun --standalone --nproc-per-node 8 --max-restarts N``; rank 0 crashes.
* ``plain``: a minimal restart-all supervisor (kill all, start all), the floor for restarting
  without pre-spawned processes.

Scenarios:

* ``isolated``: a fault ``--settle`` seconds after the job is ready again;
* ``back-to-back``: a fault ``--gap`` (0.3) s after the previous restart (every worker's new
  process running), or as soon after as rank 0 is stepping again, ``--trials`` times in a row;
* ``first``: a fault ``--gap`` s after every worker of a fresh job has started its first
  trainer (a fresh job per trial). A worker whose agent has not started one yet cannot restart:
  faulting earlier measured its first start, not a restart.

Per trial: **restart** = fault -> every worker's new process running (its first statement);
**ready** = fault -> every worker has done its first step again (imports, backend, rendezvous).
The fault time is the crash event (rank 0 logs it just before exiting) or the health event's
publish. Every port is held by the process that uses it: nats-server, the rendezvous stores and
torchrun's (``--standalone``) bind port 0 and say which they got.

Needs torch: ``.venv/bin/pip install torch==2.13.0`` (the CPU build).

    .venv/bin/python bench/bench_restart.py --scenario back-to-back --trials 10

BENCH_AGENT_LOG_LEVEL=info logs the agents to the run's marduk.log; BENCH_KEEP=1 keeps the
run's directory (events, logs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import restart_breakdown
from bench_notify import machine, source_version, start_nats_server

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "bench" / "restart_worker.py")
REPLICAS, PER = 4, 2
WORLD = REPLICAS * PER
CONTENDERS = ("plain", "torchrun", "marduk", "marduk-standby", "marduk-device")
SCENARIOS = ("isolated", "back-to-back", "first")
Procs = list[subprocess.Popen[bytes]]


def events(bench_dir: Path) -> list[dict]:  # type: ignore[type-arg]
    out = []
    for f in bench_dir.glob("events-*.jsonl"):
        for line in f.read_text().splitlines():
            if line.strip():
                out.append(json.loads(line))
    return out


def wait_for(pred: Callable[[], object], timeout: float, what: str, every: float = 0.005) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"timed out waiting for {what}")


def incarnation_done(bench_dir: Path, inc: int) -> tuple[float, float, Counter[str]] | None:
    """(last start, last ready, how each started) of incarnation ``inc`` once every rank is
    ready in it."""
    evs = [e for e in events(bench_dir) if e["inc"] == inc]
    starts = {e["rank"]: e for e in evs if e["ev"] == "start"}
    ready = {e["rank"]: e["t"] for e in evs if e["ev"] == "ready"}
    if len(ready) < WORLD or len(starts) < WORLD:
        return None
    by = Counter(str(e.get("by", "?")) for e in starts.values())
    return max(e["t"] for e in starts.values()), max(ready.values()), by


def back_after(bench_dir: Path, t_fault: float) -> tuple[float, float, Counter[str]] | None:
    """(last start, last ready, how each started) once every rank has started a process after
    ``t_fault`` and stepped in it: each rank's first start after the fault, whatever its
    incarnation number (an agent that registered late starts straight at the new epoch)."""
    evs = sorted(events(bench_dir), key=lambda e: e["t"])
    starts: dict[int, dict] = {}  # type: ignore[type-arg]
    ready: dict[int, float] = {}
    for e in evs:
        rank = e["rank"]
        if e["ev"] == "start" and e["t"] > t_fault and rank not in starts:
            starts[rank] = e
        elif (
            e["ev"] == "ready"
            and rank in starts
            and rank not in ready
            and e["inc"] == starts[rank]["inc"]
        ):
            ready[rank] = e["t"]
    if len(ready) < WORLD:
        return None
    by = Counter(str(e.get("by", "?")) for e in starts.values())
    return max(e["t"] for e in starts.values()), max(ready.values()), by


def crash_time(bench_dir: Path, inc: int) -> float | None:
    for e in events(bench_dir):
        if e["ev"] == "crash" and e["inc"] == inc:
            return float(e["t"])
    return None


def read_port(path: Path, proc: subprocess.Popen[bytes], timeout: float = 60) -> int:
    """The port a process bound (0: its pick) and wrote to ``path``."""

    def port() -> int | None:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        text = path.read_text() if path.exists() else ""  # written whole (renamed into place)
        return int(text) if text.isdigit() else None

    return int(wait_for(port, timeout, f"the port in {path}"))  # type: ignore[arg-type]


# --- contenders ------------------------------------------------------------------------------

# A rendezvous store on a port of its own choosing (0), up for the whole run; it writes the
# port to argv[1] (torchrun's agent hosts one the same way).
STORE_HOLDER = r"""
import os, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, int(sys.argv[2]), is_master=True, wait_for_workers=False)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(store.port))
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(10**7)
"""


def start_marduk(bench_dir: Path, env: dict[str, str], extra: list[str]) -> Procs:
    breakdown = bool(os.environ.get("BENCH_BREAKDOWN"))  # each agent logs to its own file
    server, url = start_nats_server(bench_dir)
    (bench_dir / "url").write_text(url)
    env = {
        **env,
        "MARDUK_ADDR": url,
        # Every trial fails the same device: lift its failure budget, which would
        # otherwise (rightly) escalate the 4th failure within the hour to `fail`.
        "MARDUK_DEVICE_MAX_FAILURES": "1000000",
        "MARDUK_STATE_DIR": str(bench_dir / "state"),
        "BENCH_WORKERS_PER_REPLICA": str(PER),
        "BENCH_WORLD": str(WORLD),
    }
    log = open(bench_dir / "marduk.log", "wb")  # noqa: SIM115
    procs: Procs = [server]
    if env.get("BENCH_FRAMEWORK") != "jax":
        store = subprocess.Popen(
            [sys.executable, "-c", STORE_HOLDER, str(bench_dir / "store.port"), str(WORLD)],
            stdout=log,
            stderr=log,
        )
        procs.append(store)
        env["BENCH_STORE_PORT"] = str(read_port(bench_dir / "store.port", store))
    procs.append(
        subprocess.Popen(
            [sys.executable, "-m", "marduk", "controller", "--no-embedded"],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=log,
        )
    )
    wait_for(
        lambda: b"serving prefix" in (bench_dir / "marduk.log").read_bytes(), 30, "the controller"
    )
    preload = "jax" if env.get("BENCH_FRAMEWORK") == "jax" else "torch"
    for r in range(REPLICAS):
        for w in range(PER):
            procs.append(
                subprocess.Popen(
                    [
                        *(sys.executable, "-m", "marduk", "agent", "run", "--job", "bench"),
                        *("--replica", f"r{r}", "--worker", str(w), "--devices", f"dev-{r}-{w}"),
                        *("--scope", "job", "--preload", preload, "--grace", "2"),
                        *(
                            "--max-restarts",
                            "100000",
                            "--log-level",
                            "info"
                            if breakdown
                            else os.environ.get("BENCH_AGENT_LOG_LEVEL", "warning"),
                        ),
                        *extra,
                        *("--", sys.executable, WORKER),
                    ],
                    env=env,
                    cwd=ROOT,
                    stdout=subprocess.DEVNULL,
                    stderr=open(bench_dir / f"agent-r{r}-{w}.log", "wb")  # noqa: SIM115
                    if breakdown
                    else log,
                )
            )
    return procs


def start_torchrun(bench_dir: Path, env: dict[str, str]) -> Procs:
    env = {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    torchrun = str(Path(sys.executable).parent / "torchrun")
    log = open(bench_dir / "torchrun.log", "wb")  # noqa: SIM115
    return [
        subprocess.Popen(
            [
                *(torchrun, "--standalone", "--nproc-per-node", str(WORLD)),
                *("--max-restarts", "100000", WORKER),
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
    ]


# Kill all, start all; the workers rendezvous through a store this supervisor hosts on a port
# of its own choosing, keyed by incarnation.
PLAIN = r"""
import os, signal, subprocess, sys
worker, world = sys.argv[1], int(sys.argv[2])
env = {**os.environ, "BENCH_PLAIN": "1", "WORLD_SIZE": str(world)}
if os.environ.get("BENCH_FRAMEWORK") != "jax":
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    env["BENCH_STORE_PORT"] = str(store.port)
inc = 0
while True:
    env["BENCH_INCARNATION"] = str(inc)
    procs = {subprocess.Popen([sys.executable, worker], env={**env, "RANK": str(r)},
                              stdout=subprocess.DEVNULL).pid: r for r in range(world)}
    while True:
        pid, status = os.wait()
        if pid in procs and status != 0:
            break
    for p in procs:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            os.waitpid(p, 0)
        except ChildProcessError:
            pass
    inc += 1
"""


def start_plain(bench_dir: Path, env: dict[str, str]) -> Procs:
    return [
        subprocess.Popen(
            [sys.executable, "-c", PLAIN, WORKER, str(WORLD)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
    ]


def start(name: str, bench_dir: Path, env: dict[str, str]) -> Procs:
    if name == "plain":
        return start_plain(bench_dir, env)
    if name == "torchrun":
        return start_torchrun(bench_dir, env)
    return start_marduk(bench_dir, env, ["--no-fork-server"] if name == "marduk-standby" else [])


def stop(name: str, procs: Procs) -> None:
    for p in reversed(procs):
        try:
            if name in ("torchrun", "plain"):
                os.killpg(p.pid, signal.SIGTERM)
            else:
                p.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def inject(url: str, device: str) -> float:
    """Publish a health event; return its publish time."""
    import asyncio

    import nats

    from marduk.wire import protocol as wire

    async def go() -> float:
        nc = await nats.connect(url)
        t = time.time()
        await nc.publish(
            "marduk.health", wire.encode(wire.DeviceHealth(device=device, state="failed"))
        )
        await nc.flush()
        await nc.close()
        return t

    return asyncio.run(go())


# --- driver ------------------------------------------------------------------------------------


class Trials:
    def __init__(self, name: str) -> None:
        self.name = name
        self.restart: list[float] = []
        self.ready: list[float] = []
        self.by: Counter[str] = Counter()
        self.breakdown: dict[str, float] = {}

    def fault_and_measure(self, bench_dir: Path, inc: int, at: float) -> tuple[float, float]:
        """Fault incarnation ``inc`` at wall time ``at`` (or as soon after as it can be);
        return the next incarnation's (last start, ready)."""
        time.sleep(max(0.0, at - time.time()))
        if self.name == "marduk-device":
            url = (bench_dir / "url").read_text()
            t_fault = inject(url, "dev-0-0")
        else:
            (bench_dir / f"crash-{inc}").touch()
            t_fault = float(wait_for(lambda: crash_time(bench_dir, inc), 60, "crash"))  # type: ignore[arg-type]
        last_start, last_ready, by = wait_for(  # type: ignore[misc]
            lambda: back_after(bench_dir, t_fault), 180, f"restart {inc + 1}"
        )
        self.restart.append(last_start - t_fault)
        self.ready.append(last_ready - t_fault)
        self.by.update(by)
        print(
            f"{self.name} trial {len(self.restart)}: restart {self.restart[-1] * 1000:.0f} ms, "
            f"ready {self.ready[-1] * 1000:.0f} ms, started by {dict(by)}",
            file=sys.stderr,
            flush=True,
        )
        return last_start, last_ready

    def result(self, scenario: str) -> dict[str, object]:
        return {
            "contender": self.name,
            "scenario": scenario,
            "trials": len(self.restart),
            **stats("restart", self.restart),
            **stats("ready", self.ready),
            "started_by": dict(self.by),
            **({"breakdown_p50_ms": self.breakdown} if self.breakdown else {}),
        }


def job(name: str, framework: str) -> tuple[Path, dict[str, str], Procs]:
    bench_dir = Path(tempfile.mkdtemp(prefix=f"marduk-restart-{name}-"))
    env = {
        **os.environ,
        "BENCH_DIR": str(bench_dir),
        "BENCH_FRAMEWORK": framework,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    return bench_dir, env, start(name, bench_dir, env)


def first_fault(trials: Trials, args: argparse.Namespace) -> None:
    """A fresh job, faulted ``--gap`` s after every worker started its first trainer."""
    bench_dir, _env, procs = job(trials.name, args.framework)
    try:
        starts = wait_for(
            lambda: (
                s
                if len(s := {e["rank"]: e["t"] for e in events(bench_dir) if e["ev"] == "start"})
                == WORLD
                else None
            ),
            180,
            "every worker's first start",
        )
        trials.fault_and_measure(bench_dir, 0, max(starts.values()) + args.gap)  # type: ignore[union-attr]
    finally:
        stop(trials.name, procs)
        if os.environ.get("BENCH_KEEP"):
            print(f"kept {bench_dir}", file=sys.stderr)
        else:
            shutil.rmtree(bench_dir, ignore_errors=True)


def run(name: str, scenario: str, args: argparse.Namespace) -> dict[str, object]:
    trials = Trials(name)
    if scenario == "first":
        for _ in range(args.trials):
            first_fault(trials, args)
        return trials.result(scenario)
    bench_dir, _env, procs = job(name, args.framework)
    try:
        last_start, last_ready, _by = wait_for(  # type: ignore[misc]
            lambda: incarnation_done(bench_dir, 0), 180, "first start"
        )
        for k in range(args.trials):
            at = last_ready + args.settle if scenario == "isolated" else last_start + args.gap
            last_start, last_ready = trials.fault_and_measure(bench_dir, k, at)
        if os.environ.get("BENCH_BREAKDOWN") and name in ("marduk", "marduk-standby"):
            trials.breakdown = restart_breakdown.breakdown(bench_dir, args.trials)
    finally:
        stop(name, procs)
        if os.environ.get("BENCH_KEEP"):
            print(f"kept {bench_dir}", file=sys.stderr)
        else:
            shutil.rmtree(bench_dir, ignore_errors=True)
    return trials.result(scenario)


def stats(name: str, values: list[float]) -> dict[str, float]:
    values_ms = sorted(v * 1000 for v in values)

    def pct(p: float) -> float:
        return values_ms[min(len(values_ms) - 1, round(p / 100 * (len(values_ms) - 1)))]

    return {
        f"{name}_p50_ms": round(statistics.median(values_ms), 1),
        f"{name}_p99_ms": round(pct(99), 1),
        f"{name}_max_ms": round(values_ms[-1], 1),
        f"{name}_min_ms": round(values_ms[0], 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--contenders", default="torchrun,marduk")
    p.add_argument("--scenario", default="isolated,back-to-back", help=", ".join(SCENARIOS))
    p.add_argument(
        "--settle",
        type=float,
        default=2.0,
        help="isolated: seconds from the job's ready to the next fault (a prestarted trainer, "
        "--no-fork-server, needs its import time here to be warm: about 15 s for 8 on 2 cores)",
    )
    p.add_argument(
        "--gap",
        type=float,
        default=0.3,
        help="back-to-back, first: seconds from a start to the fault",
    )
    p.add_argument("--framework", choices=("torch", "jax"), default="torch")
    p.add_argument("--out", help="also write the JSON report here")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="marduk, crash faults (isolated, back-to-back): also say where each restart's time "
        "went (bench/restart_breakdown.py; the agents log at info, each to its own file)",
    )
    args = p.parse_args()
    if args.breakdown:
        os.environ["BENCH_BREAKDOWN"] = "1"
    results = []
    for scenario in args.scenario.split(","):
        if scenario not in SCENARIOS:
            p.error(f"unknown scenario {scenario!r}")
        for name in args.contenders.split(","):
            if name not in CONTENDERS:
                p.error(f"unknown contender {name!r}")
            results.append(run(name, scenario, args))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    report = json.dumps(
        {
            "source": source_version(),
            "machine": machine(),
            "workers": WORLD,
            "framework": args.framework,
            "settle_s": args.settle,
            "gap_s": args.gap,
            "results": results,
        },
        indent=2,
    )
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
