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
on two nodes of loopback, one process each, a membership change each way:

* ``marduk``: ``marduk agent run --scope job --nnodes 1:2`` per node and a controller
  (``--device-max-failures 0``, ``--grow-settle 1``, ``--resize-interval 1``,
  ``--grow-checkpoint-timeout 0``: the trainer has no checkpoint to wait for). **shrink** = a
  device failure of the last node's device -> the other node's first step at world size 1;
  **grow** = a new agent's start -> both nodes' first step at world size 2.
* ``torchrun``: ``torchrun --nnodes 1:2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT
  --max-restarts 100`` per node (``--rdzv-conf last_call_timeout=S`` for each ``--last-call``;
  ``default``: torchrun's 30 s). torchrun sees no device: a node is lost by SIGKILL of its
  torchrun and worker. **shrink** = the kill -> the survivor's first step at world size 1;
  **grow** = a new node's start -> both nodes' first step at world size 2.

The nats-server and the rendezvous endpoint use a port picked free just before (bound, then
released: the one short race of the run); every other port is bound by its user. Every process
started is stopped at the end (a torchrun node with its worker, which runs in a session of its
own).

    .venv/bin/python bench/bench_membership.py --trials 3 --out bench/results/membership.json
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
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_notify import machine, source_version

from tests.conftest import free_port
from tests.jax_mesh import MeshJob, TimedProc, left_behind, mesh_env
from tests.processes import Proc, controller

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


def gloo_ready(procs: list[TimedProc], t: float, world: int) -> float | None:
    """When the last of ``procs`` made its first step at world size ``world`` after ``t``."""
    last = 0.0
    for p in procs:
        seen, stepped = False, None
        for at, line in list(p.timed):
            if at <= t:
                continue
            m = RANKS.search(line)
            if m:
                seen = int(m.group(2)) == world
                continue
            if seen and GLOO_STEP.match(line):
                stepped = at
                break
        if stepped is None:
            return None
        last = max(last, stepped)
    return last


class MardukGloo:
    def __init__(self, work: Path) -> None:
        self.env = {
            "MARDUK_ADDR": f"nats://127.0.0.1:{free_port()}",
            "MARDUK_STATE_DIR": str(work / "state-gloo"),
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "MARDUK_DEVICE_MAX_FAILURES": "0",
            "MARDUK_GROW_SETTLE": "1",
            "MARDUK_RESIZE_INTERVAL": "1",
            "MARDUK_GROW_CHECKPOINT_TIMEOUT": "0",
        }
        self.ctl: Proc = controller(self.env)
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
                *("--nnodes", "1:2", "--local-addr", "127.0.0.1"),
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

    def stop(self) -> None:
        for p in self.nodes.values():
            p.stop()
        self.ctl.stop()


class TorchrunGloo:
    def __init__(self, last_call: str) -> None:
        self.port = free_port()
        self.last_call = last_call
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
        if self.last_call != "default":
            conf.append(f"last_call_timeout={self.last_call}")
        self.nodes[i] = TimedProc(
            [
                *(self.torchrun, "--nnodes", "1:2", "--nproc-per-node", "1"),
                *("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}"),
                *("--rdzv-id", "gloo", "--max-restarts", "100", "--rdzv-conf", ",".join(conf)),
                *(GLOO, "--step-seconds", "0.05"),
            ],
            # torch >= 2.4 shares the rendezvous TCPStore for the workers' bootstrap, but a rank 0
            # that kept its place never writes the new round's master address, so a node joining
            # later waits on it and the round's rank assignment times out (role_info/0, /1).
            {
                "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": "1",
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
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
    """Seconds from ``t`` to every node's first step at world size ``world``."""
    nodes = list(cluster.nodes.values())
    ready = wait_for(lambda: gloo_ready(nodes, t, world), 90, f"world size {world}")
    return float(ready) - t  # type: ignore[arg-type]


def gloo_run(name: str, cluster: MardukGloo | TorchrunGloo, trials: int, settle: float) -> dict:  # type: ignore[type-arg]
    """Two nodes, then ``trials`` times: lose the newest node (shrink), add one (grow)."""
    out: dict[str, list[float]] = {"shrink": [], "grow": []}
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
            out["shrink"].append(back(cluster, t, 1))
            time.sleep(settle)
            t = time.time()
            cluster.add()
            out["grow"].append(back(cluster, t, 2))
            print(
                f"{name} trial {trial}: shrink {out['shrink'][-1]:.2f}s, "
                f"grow {out['grow'][-1]:.2f}s",
                flush=True,
            )
    except (TimeoutError, AssertionError) as e:
        # Kept in the report with each node's last lines: why this contender did not get there.
        error = f"{e}: " + " | ".join(
            f"node {i} (exit {n.proc.poll()}): {''.join(n.all[-8:])}" for i, n in cluster.every
        )
        print(f"{name}: {error}", flush=True)
    finally:
        cluster.stop()
    return {**out, **({"error": error} if error else {})}


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
    p.add_argument("--parts", default="jax,torch")
    p.add_argument("--settle", type=float, default=0.5, help="seconds stepping before a fault")
    p.add_argument(
        "--last-call",
        default="default,1",
        help="torchrun's last_call_timeout values to run, comma-separated (default: its own)",
    )
    p.add_argument("--out", default="")
    args = p.parse_args()
    os.chdir(ROOT)
    work = Path(tempfile.mkdtemp(prefix="bench_membership_"))
    load = os.getloadavg()
    report: dict[str, object] = {
        "source": source_version(),
        "machine": machine(),
        "args": vars(args),
        "load_at_start": load,
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
            torch: dict[str, object] = {}
            torch["marduk"] = gloo_run("marduk", MardukGloo(work), args.trials, args.settle)
            for lc in args.last_call.split(","):
                name = f"torchrun last_call={lc}"
                torch[name] = gloo_run(name, TorchrunGloo(lc), args.trials, args.settle)
            report["torch"] = {
                name: {
                    k: v if k == "error" else {**summary(v), "trials": [round(x, 3) for x in v]}
                    for k, v in r.items()  # type: ignore[attr-defined]
                    if k == "error" or v
                }
                for name, r in torch.items()
            }
    finally:
        Proc.reap_all()
        shutil.rmtree(work, ignore_errors=True)
    report["load_at_end"] = os.getloadavg()
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
        for name, r in report["torch"].items():
            if "shrink" not in r or "grow" not in r:
                print(f"{name:26s} did not complete: {r.get('error', '')[:300]}")
                continue
            print(
                f"{name:26s} shrink median {r['shrink']['median_s']:.2f}s "
                f"(max {r['shrink']['max_s']:.2f}), grow median {r['grow']['median_s']:.2f}s "
                f"(max {r['grow']['max_s']:.2f})"
            )


if __name__ == "__main__":
    main()
