"""Benchmark: ``marduk agent run --nproc-per-node`` side by side with ``torchrun``, in one run.

One node (the default), 4 local ranks: contenders, all running the same bench/restart_worker.py
(imports torch, joins a gloo group through torchrun's variables, ``env://``, steps); rank 0
crashes on a signal file:

* ``torchrun``: ``torchrun --standalone --nproc-per-node 4 --max-restarts N``
  (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``);
* ``marduk``: ``marduk agent run --standalone --nproc-per-node 4 --preload torch``: no
  controller, no NATS (its address is a port this benchmark holds, closed to connections);
* ``marduk-controller``: the same with a controller (and a nats-server) it registers with: each
  crash is reported, and the restart waits for the controller's answer.

``--nnodes 4 --nproc-per-node 2``: a simulated 4-node job on this machine, 8 ranks:

* ``torchrun``: 4 ``torchrun --nnodes 4 --nproc-per-node 2 --rdzv-backend c10d
  --rdzv-endpoint 127.0.0.1:PORT --max-restarts N`` (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``:
  each round, node 0's agent names a free port for rank 0's store. With the shared store,
  torchrun's default, restarts failed here: only the failing node's restart count grows, the
  workers' gloo keys in the agent's store are not per round, and a rank read a peer's address
  of the previous round, "Connection refused");
* ``marduk-controller``: 4 ``marduk agent run --nnodes 4 --node-rank I --nproc-per-node 2
  --master-port PORT --scope job`` with a controller: rank 0's crash is reported, the controller
  restarts all 4 nodes. (No standalone contender: without a controller an agent restarts only
  its own ranks, and the other nodes' ranks would wait for a rank 0 that is gone.)

Ports. Every port the contenders use is the OS's pick or held by this process for the whole run.
A fixed port (torchrun's rendezvous endpoint; marduk's ``--master-port``, where rank 0's
``TCPStore`` listens anew at each restart) is bound here with ``SO_REUSEADDR`` and never listened
on, and stays bound until the run ends: the contender's listener (torch's ``TCPStore`` sets
``SO_REUSEADDR``, libuv or not) binds beside it; no process without ``SO_REUSEADDR`` can bind it
and the kernel never picks it as an ephemeral port (the gloo connections' ports), between
restarts included. A listening fd cannot be handed over instead: torchrun's c10d backend and
torch's ``env://`` take a port, not a socket (``TCPStore``'s ``master_listen_fd`` is not reachable
from either).

Per trial (a fault ``--settle`` s after every rank is stepping): **restart** = fault -> every
rank's new process running (its first statement); **ready** = fault -> every rank has done its
first step again (imports, gloo group, first all_reduce). Targets: restart no slower than
torchrun, ready at least 5x faster.

    .venv/bin/python bench/bench_launch.py --trials 10
    .venv/bin/python bench/bench_launch.py --trials 10 --nnodes 4 --nproc-per-node 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench_notify import machine, source_version, start_nats_server
from bench_restart import crash_time, events, stats, stop, wait_for

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "bench" / "restart_worker.py")
CONTENDERS = ("torchrun", "marduk", "marduk-controller")
ACROSS_NODES = ("torchrun", "marduk-controller")
Procs = list[subprocess.Popen[bytes]]


@dataclass(frozen=True)
class Job:
    nnodes: int
    nproc: int  # per node
    port: int  # held: torchrun's rendezvous endpoint (--nnodes > 1), marduk's --master-port

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc


def incarnation_done(
    bench_dir: Path, inc: int, world: int
) -> tuple[float, float, Counter[str]] | None:
    """(last start, last ready, how each started) of incarnation ``inc`` once all are ready."""
    evs = [e for e in events(bench_dir) if e["inc"] == inc]
    starts = {e["rank"]: e for e in evs if e["ev"] == "start"}
    ready = {e["rank"]: e["t"] for e in evs if e["ev"] == "ready"}
    if len(ready) < world or len(starts) < world:
        return None
    by = Counter(str(e.get("by", "?")) for e in starts.values())
    return max(e["t"] for e in starts.values()), max(ready.values()), by


def held_closed_port() -> tuple[socket.socket, int]:
    """A loopback port bound by us and never listened on: a connection to it is refused."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    return s, int(s.getsockname()[1])


def held_shared_port() -> tuple[socket.socket, int]:
    """A loopback port bound by us with SO_REUSEADDR, never listened on, for a contender's
    listener (which sets SO_REUSEADDR too) to bind beside: see the module's docstring."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    return s, int(s.getsockname()[1])


def start_torchrun(job: Job, log: object, env: dict[str, str]) -> Procs:
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(job.nproc)]
    torchrun += ["--max-restarts", "100000"]
    env = {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    if job.nnodes == 1:
        nodes = [["--standalone"]]
    else:
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{job.port}"]
        nodes = [["--nnodes", str(job.nnodes), *rdzv, "--rdzv-id", "bench"]] * job.nnodes
    return [
        subprocess.Popen(
            [*torchrun, *node, WORKER],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log,  # type: ignore[arg-type]
            start_new_session=True,
        )
        for node in nodes
    ]


def start(name: str, job: Job, bench_dir: Path, env: dict[str, str]) -> Procs:
    log = open(bench_dir / f"{name}.log", "wb")  # noqa: SIM115
    if name == "torchrun":
        return start_torchrun(job, log, env)
    procs: Procs = []
    agent = [sys.executable, "-m", "marduk", "agent", "run"]
    agent += ["--nproc-per-node", str(job.nproc), "--preload", "torch"]
    agent += ["--grace", "2", "--max-restarts", "100000", "--log-level", "warning"]
    if name == "marduk":
        agent.append("--standalone")
    else:
        server, url = start_nats_server(bench_dir)
        procs.append(server)
        env = {**env, "MARDUK_ADDR": url, "MARDUK_STATE_DIR": str(bench_dir / "state")}
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
            lambda: b"serving prefix" in (bench_dir / f"{name}.log").read_bytes(),
            30,
            "the controller",
        )
        agent.append("--require-controller")
    if job.nnodes == 1:
        nodes = [["--replica", "r0", "--devices", "dev0"]]
    else:
        nodes = [
            [
                *("--nnodes", str(job.nnodes), "--node-rank", str(n)),
                *("--master-port", str(job.port), "--scope", "job"),
                *("--devices", ",".join(f"n{n}d{i}" for i in range(job.nproc))),
            ]
            for n in range(job.nnodes)
        ]
    procs += [
        subprocess.Popen(
            [*agent, *node, "--", sys.executable, WORKER],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        for node in nodes
    ]
    return procs


def run(name: str, job: Job, args: argparse.Namespace, closed_url: str) -> dict[str, object]:
    bench_dir = Path(tempfile.mkdtemp(prefix=f"marduk-launch-{name}-"))
    env = {
        **os.environ,
        "BENCH_DIR": str(bench_dir),
        "BENCH_FRAMEWORK": "torch",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "MARDUK_ADDR": closed_url,
    }
    if job.nnodes > 1:
        env["BENCH_INC"] = "faults"
    procs = start(name, job, bench_dir, env)
    restart: list[float] = []
    ready: list[float] = []
    by: Counter[str] = Counter()
    try:
        _s, last_ready, _b = wait_for(  # type: ignore[misc]
            lambda: incarnation_done(bench_dir, 0, job.world), 300, "first start"
        )
        for inc in range(args.trials):
            time.sleep(max(0.0, last_ready + args.settle - time.time()))
            (bench_dir / f"crash-{inc}").touch()
            t_fault = float(wait_for(lambda: crash_time(bench_dir, inc), 60, "crash"))  # type: ignore[arg-type]  # noqa: B023
            last_start, last_ready, started = wait_for(  # type: ignore[misc]
                lambda: incarnation_done(bench_dir, inc + 1, job.world),  # noqa: B023
                300,
                f"restart {inc + 1}",
            )
            restart.append(last_start - t_fault)
            ready.append(last_ready - t_fault)
            by.update(started)
            print(
                f"{name} trial {inc + 1}: restart {restart[-1] * 1000:.0f} ms, "
                f"ready {ready[-1] * 1000:.0f} ms, started by {dict(started)}, "
                f"load {os.getloadavg()[0]:.2f}",
                file=sys.stderr,
                flush=True,
            )
    finally:
        stop(name, procs)
        if os.environ.get("BENCH_KEEP"):
            print(f"kept {bench_dir}", file=sys.stderr)
        else:
            shutil.rmtree(bench_dir, ignore_errors=True)
    return {
        "contender": name,
        "trials": len(restart),
        **stats("restart", restart),
        **stats("ready", ready),
        "started_by": dict(by),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--nnodes", type=int, default=1, help="simulated nodes (one agent each)")
    p.add_argument("--nproc-per-node", type=int, default=4)
    p.add_argument("--contenders", help="default: all of them that apply")
    p.add_argument(
        "--settle", type=float, default=2.0, help="seconds from every rank ready to the fault"
    )
    p.add_argument("--out", help="also write the JSON report here")
    args = p.parse_args()
    allowed = CONTENDERS if args.nnodes == 1 else ACROSS_NODES
    names = args.contenders.split(",") if args.contenders else list(allowed)
    for name in names:
        if name not in allowed:
            p.error(f"contender {name!r} is not one of {', '.join(allowed)} here")
    # Held for the whole run: no NATS can appear at the closed one; the shared one is where
    # the contenders' store listens (torchrun's rendezvous, marduk's MASTER_PORT).
    closed, closed_port = held_closed_port()
    shared, shared_port = held_shared_port()
    job = Job(args.nnodes, args.nproc_per_node, shared_port)
    results = []
    source = source_version()  # what runs: the code at the start
    load_start = os.getloadavg()[0]
    try:
        for name in names:
            results.append(run(name, job, args, f"nats://127.0.0.1:{closed_port}"))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    finally:
        closed.close()
        shared.close()
    report = json.dumps(
        {
            "source": source,
            "machine": machine(),
            "nnodes": job.nnodes,
            "nproc_per_node": job.nproc,
            "settle_s": args.settle,
            "load_1min_start": load_start,
            "load_1min": os.getloadavg()[0],
            "results": results,
        },
        indent=2,
    )
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")


if __name__ == "__main__":
    main()
