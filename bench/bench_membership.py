"""Benchmark: a member out of service -> every rank stepping again; Marduk and torchrun elastic.

Part ``jax``: the 2-process ``jax.distributed`` mesh of tests/jax_mesh.py (two agents whose
ranks the controller assigns, examples/jax_distributed_trainer.py, gloo collectives, 2 CPU
devices a process) with a controller started with ``--device-max-failures 1``. Per trial, two
fresh jobs:

* ``swap``: ``--nnodes 2:2`` plus a third agent started with ``--spare``; the first device
  failure of member 1 restarts the job in place (**in-place**, within the budget), the second
  retires the member and the spare takes its node rank (**swap**);
* ``shrink``: ``--nnodes 1:2``, no spare; the same two failures: in place, then the job goes on
  with one process (**shrink**).

A device failure is a ``failed`` health event published durably, as monitors do, from this
process (timed from the publish). **ready** = the fault -> every rank's first step of the
incarnation that replaced it. Broken down for the slowest rank from the agent's ``trainer
started`` line and the trainer's own ``first step ... after main`` line: **stop** = the fault
-> the agent starts the new trainer (the decision, the command, the old trainer gone),
**start** = -> the trainer's ``main`` (the interpreter, importing jax), **library** =
``agent.connect``, **init** = ``jax.distributed.initialize``, **mesh+restore** = the mesh, the
agreed checkpoint restored, **first step** = looking up (or compiling) the step and running it.

Part ``torch``: tests/trainers/gloo.py (``init_process_group("gloo")``, an all_reduce a step)
on two nodes of loopback, one process each, a membership change each way, at each **damping**
(``--damping``): the wait a user chooses before a job grows, set alike for both contenders.

* ``marduk``: ``marduk agent run --scope job --nnodes 1:MAX`` per node and a controller
  (``--device-max-failures 0``, ``--grow-checkpoint-timeout 0``: the trainer has no checkpoint
  to wait for) with ``--grow-settle S --resize-interval S``. **shrink** = a device failure of the
  last node's device -> the other node's first step at world size 1; **grow** = a new agent's
  start -> both nodes' first step at world size 2.
* ``torchrun``: ``torchrun --nnodes 1:MAX --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT
  --max-restarts 100`` per node with ``--rdzv-conf last_call_timeout=S``. torchrun sees no
  device: a node is lost by SIGKILL of its torchrun and worker. **shrink** = the kill -> the
  survivor's first step at world size 1; **grow** = a new node's start -> both nodes' first
  step at world size 2.

Dampings (``DAMPING``): ``1`` (both 1 s), ``min`` (the smallest each accepts: Marduk's settle
and interval 0; c10d reads ``last_call_timeout`` as a positive whole number of seconds, so 1),
``default`` (neither set: Marduk's settle 30 s and resize interval 60 s, torchrun's 30 s), ``30``
(all three 30 s). MAX
is 2 unless ``--max-nodes`` says more: at MAX the c10d round closes as soon as the second node
joins, so ``last_call_timeout`` only damps a grow that stays below MAX.

Each grow is broken down from the lines of the processes (arrival times at this process):
Marduk from the controller's (``registered``, ``grow_started``, ``member_added``) and the
agents' (``restart command epoch E``, ``trainer started``) and the trainers' (``RANKS``, first
step); torchrun from its agents' INFO lines (``LOGLEVEL=INFO``: ``Detected N new nodes``,
``Rendezvous'ing worker group``, ``Rendezvous complete``) and the trainers'. The load of the
machine (``uptime``, and the busiest processes this run did not start) is sampled throughout.

The nats-server and the rendezvous endpoint use a port picked free just before (bound, then
released: the one short race of the run); every other port is bound by its user. Every process
started is stopped at the end (a torchrun node with its worker, which runs in a session of its
own).

    .venv/bin/python bench/bench_membership.py --trials 3 --out bench/results/membership.json
    .venv/bin/python bench/bench_membership.py --parts torch --damping 1,min,default \
        --trials 3 --long-trials 2 --out bench/results/membership_damping.json
"""

from __future__ import annotations

import argparse
import asyncio
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
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_notify import machine, source_version

from tests.conftest import free_port
from tests.jax_mesh import MeshJob, TimedProc, left_behind, mesh_env
from tests.processes import Proc

GLOO = "tests/trainers/gloo.py"
FIRST = re.compile(
    r"first step (\S+)s after main: library (\S+)s, distributed init (\S+)s, "
    r"mesh and restore (\S+)s, first step (\S+)s"
)
RANKS = re.compile(r"RANKS rank=(\d+) world=(\d+)")
GLOO_STEP = re.compile(r"^step (\d+) sum=")
PHASES = ("stop", "start", "library", "init", "mesh+restore", "first step")


def wait_for(pred: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")


def publish_failure(url: str, device: str) -> float:
    """A ``failed`` health event, published durably as monitors do; its publish time."""
    import nats

    from tests.conftest import health_event

    async def go() -> float:
        nc = await nats.connect(url)
        try:
            t = time.time()
            reply = await health_event(nc, device)
            assert reply.actions, reply
            return t
        finally:
            await nc.close()

    return asyncio.run(go())


# --- part jax ----------------------------------------------------------------------------------


def breakdown(job: MeshJob, agent: int, t: float, first_step_at: float) -> dict[str, float]:
    """Where the slowest rank's time went after the fault at ``t`` (seconds)."""
    timed = list(job.agents[agent].timed)
    started = next(at for at, ln in timed if at > t and "trainer started: pid" in ln)
    m = next(m for at, ln in timed if at > t and (m := FIRST.search(ln)))
    total, library, init, restore, first = (float(x) for x in m.groups())
    main_at = first_step_at - total
    return {
        "stop": started - t,
        "start": main_at - started,
        "library": library,
        "init": init,
        "mesh+restore": restore,
        "first step": first,
    }


def measure(job: MeshJob, t: float, epoch: int) -> dict[str, object]:
    now = job.wait_stepping(t, epoch, timeout=120)
    first = {r: inc.first_step_at or 0.0 for r, inc in zip(job.running, now, strict=True)}
    slow = max(first, key=lambda r: first[r])
    return {
        "ready": max(first.values()) - t,
        "per_rank": {str(r): round(v - t, 3) for r, v in first.items()},
        "slowest_agent": slow,
        "breakdown": {k: round(v, 3) for k, v in breakdown(job, slow, t, first[slow]).items()},
        "resumed_at_step": now[0].start,
        "world": len(now),
    }


def jax_trial(kind: str, trial: int, work: Path, settle: float) -> dict[str, dict[str, object]]:
    env = {
        "MARDUK_ADDR": f"nats://127.0.0.1:{free_port()}",
        "MARDUK_STATE_DIR": str(work / f"state-{kind}{trial}"),
        "PYTHONUNBUFFERED": "1",
        "MARDUK_DEVICE_MAX_FAILURES": "1",
    }
    swap = kind == "swap"
    job = MeshJob(
        mesh_env(env, work / f"ckpt-{kind}{trial}"),
        job=f"{kind}{trial}",
        n=2,
        ranks_from_controller=True,
        spares=1 if swap else 0,
        min_nodes=None if swap else 1,
    )
    lost, out = 1, {}
    try:
        now = job.wait_stepping(0, -1, timeout=300, steps=12)
        time.sleep(settle)
        t = publish_failure(env["MARDUK_ADDR"], job.device(lost))
        out["in-place"] = measure(job, t, now[0].epoch)
        old_pid = job.trainer_pid(lost)
        time.sleep(settle)
        epoch = job.epoch()
        t = publish_failure(env["MARDUK_ADDR"], job.device(lost))
        job.running = [0, 2] if swap else [0]
        out[kind] = measure(job, t, epoch)
        assert job.agents[lost].proc.wait(timeout=30) == 71, "the lost member's agent exit"
        assert not left_behind([old_pid])
    finally:
        pids = [p for r in range(len(job.agents)) for p in job.pids(r)]
        job.stop()
        assert not left_behind(pids), left_behind(pids)
    return out


# --- part torch --------------------------------------------------------------------------------

# Damping -> (Marduk's --grow-settle, its --resize-interval, torchrun's last_call_timeout); None:
# the contender's default (Marduk 30 s and 60 s, torchrun 30 s).
DAMPING: dict[str, tuple[float | None, float | None, int | None]] = {
    "1": (1.0, 1.0, 1),
    "min": (0.0, 0.0, 1),  # c10d: int(last_call_timeout) > 0 (dynamic_rendezvous.py)
    "default": (None, None, None),
    "30": (30.0, 30.0, 30),  # torchrun's default; Marduk's settle default, interval 30 not 60
}
LONG = ("default", "30")  # run --long-trials times
MARDUK_GROW = ("register", "wait", "checkpoint", "restart", "init", "first step")
TORCHRUN_GROW = ("detect", "stop", "rendezvous", "start+init", "first step")


def gloo_ready(procs: list[TimedProc], t: float, world: int) -> float | None:
    """When the last of ``procs`` made its first step at world size ``world`` after ``t``."""
    marks = [gloo_marks(p, t, world) for p in procs]
    if any(m is None for m in marks):
        return None
    return max(m[1] for m in marks if m is not None)


def gloo_marks(p: TimedProc, t: float, world: int) -> tuple[float, float] | None:
    """(its ``RANKS`` line, its first step) at world size ``world`` after ``t``."""
    ranks = None
    for at, line in list(p.timed):
        if at <= t:
            continue
        m = RANKS.search(line)
        if m:
            ranks = at if int(m.group(2)) == world else None
            continue
        if ranks is not None and GLOO_STEP.match(line):
            return ranks, at
    return None


def first_line(p: Proc, t: float, pattern: str) -> tuple[float, re.Match[str]] | None:
    """The first line of ``p`` after ``t`` that ``pattern`` matches: (arrival, match)."""
    rx = re.compile(pattern)
    for at, line in list(p.timed):  # type: ignore[attr-defined]
        if at > t and (m := rx.search(line)):
            return at, m
    return None


class LoadSampler:
    """``uptime``'s load averages every ``every`` seconds, with the CPU share of the busiest
    processes this run did not start (another engineer's tests on a shared machine)."""

    def __init__(self, every: float = 5.0) -> None:
        self.every = every
        self.samples: list[dict[str, object]] = []
        self._stop = threading.Event()
        self._procs: dict[int, psutil.Process] = {}
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> LoadSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def mark(self, label: str) -> None:
        self.samples.append({**self._sample(), "mark": label})

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(self._sample())

    def _sample(self) -> dict[str, object]:
        ours = {os.getpid()}
        try:
            ours |= {c.pid for c in psutil.Process().children(recursive=True)}
        except psutil.Error:
            pass
        busy = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if proc.pid not in self._procs:
                self._procs[proc.pid] = proc
                try:
                    proc.cpu_percent(None)  # the first call only starts the count
                except psutil.Error:
                    pass
                continue
            try:
                pct = self._procs[proc.pid].cpu_percent(None)
            except psutil.Error:
                continue
            if pct >= 20 and proc.pid not in ours:
                cmd = " ".join(proc.info["cmdline"] or [])[:80]
                busy.append((round(pct), cmd))
        uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=False)
        return {
            "t": round(time.time(), 1),
            "load": [round(x, 2) for x in os.getloadavg()],
            "uptime": uptime.stdout.strip(),
            "others_busy": sorted(busy, reverse=True)[:4],
        }

    def summary(self, since: float, until: float) -> dict[str, object]:
        got = [s for s in self.samples if since <= float(s["t"]) <= until]  # type: ignore[arg-type]
        loads = [float(s["load"][0]) for s in got]  # type: ignore[index]
        others = sum(1 for s in got if s["others_busy"])
        return {
            "load1_median": round(statistics.median(loads), 2) if loads else None,
            "load1_max": round(max(loads), 2) if loads else None,
            "samples": len(got),
            "samples_with_others_busy": others,
        }


class MardukGloo:
    name = "marduk"

    def __init__(self, work: Path, damping: str, max_nodes: int) -> None:
        settle, interval, _ = DAMPING[damping]
        self.env = {
            "MARDUK_ADDR": f"nats://127.0.0.1:{free_port()}",
            "MARDUK_STATE_DIR": str(work / f"state-gloo-{damping}"),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "MARDUK_DEVICE_MAX_FAILURES": "0",
            "MARDUK_GROW_CHECKPOINT_TIMEOUT": "0",
        }
        if settle is not None:
            self.env["MARDUK_GROW_SETTLE"] = f"{settle:g}"
        if interval is not None:
            self.env["MARDUK_RESIZE_INTERVAL"] = f"{interval:g}"
        self.max_nodes = max_nodes
        # Timed, for the grow's breakdown (its ``registered``, ``grow_started`` lines).
        self.ctl = TimedProc([sys.executable, "-m", "marduk", "controller"], self.env)
        self.ctl.expect("serving prefix")
        self.nodes: dict[int, TimedProc] = {}
        self.every: list[tuple[int, TimedProc]] = []
        self.count = 0

    def add(self) -> TimedProc:
        i = self.count
        self.count += 1
        self.nodes[i] = TimedProc(
            [
                *(sys.executable, "-m", "marduk", "agent", "run", "--job", "gloo"),
                *("--scope", "job", "--devices", f"gloo-d{i}", "--replica", f"node{i}"),
                *("--nnodes", f"1:{self.max_nodes}", "--local-addr", "127.0.0.1"),
                *("--", sys.executable, GLOO, "--step-seconds", "0.05"),
            ],
            self.env,
        )
        self.every.append((i, self.nodes[i]))
        return self.nodes[i]

    def lose(self, i: int) -> float:
        t = publish_failure(self.env["MARDUK_ADDR"], f"gloo-d{i}")
        node = self.nodes.pop(i)
        assert node.proc.wait(timeout=60) == 71, "the lost member's agent exit"
        return t

    def grow_breakdown(self, t: float, new: int, ready: float) -> dict[str, float]:
        """Where the grow that node ``new`` (started at ``t``) made took its time, along the
        path the job waited on: the new agent's start and registration, the damping wait
        (settle, resize interval, the 0.25 s tick), the checkpoint asked for, the restart
        (the members' stop and both forks), gloo's init, the first step."""
        ctl, job = self.ctl, "gloo"
        reg = first_line(ctl, t, rf"controller: registered {job}/node{new}/0")
        assert reg is not None, "no registration of the new node"
        grow = first_line(ctl, reg[0], r"controller: grow_started ")
        added = first_line(ctl, reg[0], rf"controller: member_added {job}/node{new}/0")
        assert grow is not None and added is not None, "no grow in the controller's log"
        new_place = first_line(self.nodes[new], t, r"epoch (\d+): node rank")
        assert new_place is not None
        epoch = new_place[1].group(1)
        started, ranks, stops = [], [], []
        for node in self.nodes.values():
            s = first_line(node, t, rf"trainer started: pid \d+, epoch {epoch}\b")
            marks = gloo_marks(node, t, 2)
            assert s is not None and marks is not None
            started.append(s[0])
            ranks.append(marks[0])
            stopped = first_line(
                node, t, rf"WARNING\s+agent\.supervisor: restart command epoch {epoch}:"
            )
            if stopped is not None:
                stops.append(stopped[0] - added[0])
        return {
            "register": reg[0] - t,
            "wait": grow[0] - reg[0],
            "checkpoint": added[0] - grow[0],
            "restart": max(started) - added[0],
            "init": max(ranks) - max(started),
            "first step": ready - max(ranks),
            "member stop": max(stops, default=0.0),
        }

    def stop(self) -> None:
        for p in self.nodes.values():
            p.stop()
        self.ctl.stop()


class TorchrunGloo:
    name = "torchrun"

    def __init__(self, damping: str, max_nodes: int) -> None:
        self.port = free_port()
        self.last_call = DAMPING[damping][2]
        self.max_nodes = max_nodes
        self.nodes: dict[int, TimedProc] = {}
        self.every: list[tuple[int, TimedProc]] = []
        self.count = 0
        self.torchrun = str(Path(sys.executable).parent / "torchrun")

    def add(self) -> TimedProc:
        i = self.count
        self.count += 1
        # On one host the c10d backend's own guess (does the endpoint name this machine?) says
        # "host the store" to every node; node 0 (never the one lost) hosts it, the others join.
        conf = [f"is_host={'true' if i == 0 else 'false'}"]
        if self.last_call is not None:
            conf.append(f"last_call_timeout={self.last_call}")
        self.nodes[i] = TimedProc(
            [
                *(self.torchrun, "--nnodes", f"1:{self.max_nodes}", "--nproc-per-node", "1"),
                *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}"),
                *("--rdzv-id", "gloo", "--max-restarts", "100", "--rdzv-conf", ",".join(conf)),
                *(GLOO, "--step-seconds", "0.05"),
            ],
            # torch >= 2.4 shares the rendezvous TCPStore for the workers' bootstrap, but a rank 0
            # that kept its place never writes the new round's master address, so a node joining
            # later waits on it and the round's rank assignment times out (role_info/0, /1).
            # LOGLEVEL=INFO: the agents' lines the breakdown reads.
            {
                "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": "1",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                "LOGLEVEL": "INFO",
            },
        )
        self.every.append((i, self.nodes[i]))
        return self.nodes[i]

    def lose(self, i: int) -> float:
        """SIGKILL node ``i`` whole: its torchrun and its worker (torchrun starts each worker in
        a session of its own, so the node's process group alone would leave it running)."""
        node = self.nodes.pop(i)
        procs = kill_tree(node.proc.pid, signal.SIGKILL)
        t = time.time()
        psutil.wait_procs(procs, timeout=10)
        node.proc.wait()
        Proc.live.discard(node)
        return t

    def grow_breakdown(self, t: float, new: int, ready: float) -> dict[str, float]:
        """The grow node ``new`` made (started at ``t``), from the torchrun agents' lines: the
        new torchrun's start until the member's agent sees it waiting (its interpreter and
        imports, joining the wait list, the member's monitor poll), the member's workers
        stopped, the rendezvous round (``last_call_timeout`` below MAX), the new workers'
        interpreter, import of torch and gloo init, the first step."""
        members = [n for i, n in self.nodes.items() if i != new]
        seen = [first_line(n, t, r"Detected \d+ new nodes") for n in members]
        assert all(seen), "no member saw the new node"
        detect = max(s[0] for s in seen if s)
        again = [first_line(n, detect, r"Rendezvous'ing worker group") for n in members]
        assert all(again)
        stopped = max(a[0] for a in again if a)
        done = [first_line(n, t, r"Rendezvous complete for workers") for n in self.nodes.values()]
        assert all(done)
        rdzv = max(d[0] for d in done if d)
        marks = [gloo_marks(n, t, 2) for n in self.nodes.values()]
        ranks = max(m[0] for m in marks if m)
        return {
            "detect": detect - t,
            "stop": stopped - detect,
            "rendezvous": rdzv - stopped,
            "start+init": ranks - rdzv,
            "first step": ready - ranks,
        }

    def stop(self) -> None:
        for node in self.nodes.values():
            psutil.wait_procs(kill_tree(node.proc.pid, signal.SIGTERM), timeout=20)
            psutil.wait_procs(kill_tree(node.proc.pid, signal.SIGKILL), timeout=5)
            node.proc.wait()
            Proc.live.discard(node)


def kill_tree(pid: int, sig: int) -> list[psutil.Process]:
    """Send ``sig`` to ``pid`` and every descendant of it; the processes signalled."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    return procs


def back(cluster: MardukGloo | TorchrunGloo, t: float, world: int) -> float:
    """When every node made its first step at world size ``world`` after ``t``."""
    nodes = list(cluster.nodes.values())
    # 150 s: a default damping waits 60 s (Marduk's interval) or 15 + 30 s (torchrun's shrink).
    ready = wait_for(lambda: gloo_ready(nodes, t, world), 150, f"world size {world}")
    return float(ready)  # type: ignore[arg-type]


def gloo_run(cluster: MardukGloo | TorchrunGloo, label: str, trials: int, settle: float) -> dict:  # type: ignore[type-arg]
    """Two nodes, then ``trials`` times: lose the newest node (shrink), add one (grow)."""
    out: dict[str, list[float]] = {"shrink": [], "grow": []}
    grow_breakdowns: list[dict[str, float]] = []
    error = ""
    try:
        t0 = time.time()
        cluster.add()
        time.sleep(2)  # the first node hosts torchrun's rendezvous store
        cluster.add()
        wait_for(lambda: gloo_ready(list(cluster.nodes.values()), t0, 2), 180, "two nodes")
        for trial in range(trials):
            time.sleep(settle)
            t = cluster.lose(max(cluster.nodes))
            out["shrink"].append(back(cluster, t, 1) - t)
            time.sleep(settle)
            t = time.time()
            cluster.add()
            ready = back(cluster, t, 2)
            out["grow"].append(ready - t)
            parts = cluster.grow_breakdown(t, max(cluster.nodes), ready)
            grow_breakdowns.append({k: round(v, 3) for k, v in parts.items()})
            print(
                f"{label} trial {trial}: shrink {out['shrink'][-1]:.2f}s, "
                f"grow {out['grow'][-1]:.2f}s {grow_breakdowns[-1]}",
                flush=True,
            )
    except (TimeoutError, AssertionError) as e:
        # Kept in the report with each node's last lines: why this contender did not get there.
        error = f"{e}: " + " | ".join(
            f"node {i} (exit {n.proc.poll()}): {''.join(n.all[-8:])}" for i, n in cluster.every
        )
        print(f"{label}: {error}", flush=True)
    finally:
        cluster.stop()
    result: dict[str, object] = {
        k: {**summary(v), "trials": [round(x, 3) for x in v]} for k, v in out.items() if v
    }
    if grow_breakdowns:
        result["grow_breakdown"] = grow_breakdowns
        result["grow_breakdown_median_s"] = {
            k: round(statistics.median(b[k] for b in grow_breakdowns), 3)
            for k in grow_breakdowns[0]
        }
    if error:
        result["error"] = error
    return result


def torch_part(args: argparse.Namespace, work: Path, load: LoadSampler) -> dict[str, object]:
    """Each damping in turn, Marduk then torchrun, each with fresh processes."""
    out: dict[str, object] = {}
    for damping in args.damping.split(","):
        trials = args.long_trials if damping in LONG else args.trials
        settle, interval, last_call = DAMPING[damping]
        row: dict[str, object] = {
            "marduk_grow_settle_s": settle if settle is not None else "default (30)",
            "marduk_resize_interval_s": interval if interval is not None else "default (60)",
            "torchrun_last_call_timeout_s": last_call if last_call is not None else "default (30)",
        }
        for name in ("marduk", "torchrun"):
            since = time.time()
            load.mark(f"{damping} start")
            cluster: MardukGloo | TorchrunGloo = (
                MardukGloo(work, damping, args.max_nodes)
                if name == "marduk"
                else TorchrunGloo(damping, args.max_nodes)
            )
            label = f"{cluster.name} damping={damping}"
            row[cluster.name] = gloo_run(cluster, label, trials, args.settle)
            load.mark(f"{damping} {cluster.name} end")
            row[cluster.name]["load"] = load.summary(since, time.time())  # type: ignore[index]
        out[damping] = row
    return out


# --- report ------------------------------------------------------------------------------------


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median_s": round(statistics.median(values), 3),
        "min_s": round(min(values), 3),
        "max_s": round(max(values), 3),
        "n": len(values),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--long-trials", type=int, default=2, help="trials at a damping of LONG")
    p.add_argument("--parts", default="jax,torch")
    p.add_argument("--settle", type=float, default=0.5, help="seconds stepping before a fault")
    p.add_argument(
        "--damping",
        default="1,min,default",
        help=f"torch part: the dampings to run, comma-separated, of {', '.join(DAMPING)}",
    )
    p.add_argument("--max-nodes", type=int, default=2, help="torch part: --nnodes 1:MAX")
    p.add_argument("--out", default="")
    args = p.parse_args()
    os.chdir(ROOT)
    work = Path(tempfile.mkdtemp(prefix="bench_membership_"))
    load = LoadSampler().start()
    load.mark("start")
    report: dict[str, object] = {
        "source": source_version(),
        "machine": machine(),
        "args": vars(args),
        "load_at_start": os.getloadavg(),
    }
    try:
        if "jax" in args.parts:
            jax: dict[str, list[dict[str, object]]] = {"in-place": [], "swap": [], "shrink": []}
            for trial in range(args.trials):
                for kind in ("swap", "shrink"):
                    for name, r in jax_trial(kind, trial, work, args.settle).items():
                        jax[name].append(r)
                        print(
                            f"jax {kind} job {trial}: {name} ready {r['ready']:.2f}s "
                            f"{r['breakdown']}",
                            flush=True,
                        )
            report["jax"] = {
                name: {
                    **summary([float(r["ready"]) for r in rs]),  # type: ignore[arg-type]
                    "breakdown_median_s": {
                        k: round(statistics.median(r["breakdown"][k] for r in rs), 3)  # type: ignore[index]
                        for k in PHASES
                    },
                    "trials": rs,
                }
                for name, rs in jax.items()
            }
        if "torch" in args.parts:
            report["torch"] = torch_part(args, work, load)
    finally:
        Proc.reap_all()
        shutil.rmtree(work, ignore_errors=True)
        load.mark("end")
        load.stop()
    report["load_at_end"] = os.getloadavg()
    report["load"] = {
        **load.summary(0, time.time()),
        "trace": load.samples,
    }
    print_table(report)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


def print_table(report: dict) -> None:  # type: ignore[type-arg]
    if "jax" in report:
        print("\njax.distributed mesh, 2 processes: device out of service -> every rank stepping")
        print(
            f"{'change':10s} {'median':>7s} {'min':>6s} {'max':>6s}  "
            + " ".join(f"{p:>12s}" for p in PHASES)
        )
        for name, s in report["jax"].items():
            b = s["breakdown_median_s"]
            print(
                f"{name:10s} {s['median_s']:7.2f} {s['min_s']:6.2f} {s['max_s']:6.2f}  "
                + " ".join(f"{b[p]:12.2f}" for p in PHASES)
            )
    if "torch" in report:
        print("\ntorch gloo trainer, 2 nodes: a node lost / a node added -> every rank stepping")
        for damping, row in report["torch"].items():
            grows = {}
            for name in ("marduk", "torchrun"):
                r = row[name]
                label = f"{name} damping={damping}"
                if "shrink" not in r or "grow" not in r:
                    print(f"{label:26s} did not complete: {r.get('error', '')[:300]}")
                    continue
                grows[name] = r["grow"]["median_s"]
                print(
                    f"{label:26s} shrink median {r['shrink']['median_s']:.2f}s "
                    f"(max {r['shrink']['max_s']:.2f}), grow median {r['grow']['median_s']:.2f}s "
                    f"(max {r['grow']['max_s']:.2f}), load1 median {r['load']['load1_median']} "
                    f"max {r['load']['load1_max']}"
                )
                print(f"{'':26s} grow breakdown (median): {r['grow_breakdown_median_s']}")
            if len(grows) == 2:
                ratio = grows["torchrun"] / grows["marduk"]
                print(f"{'':26s} grow: torchrun / Marduk = {ratio:.2f}x")


if __name__ == "__main__":
    main()
