"""Benchmark: 4 local ranks on one node, ``marduk agent run --nproc-per-node 4`` side by side
with ``torchrun --nproc-per-node 4``, in one run.

Contenders, all running the same bench/restart_worker.py (imports torch, joins a gloo group of
4 through torchrun's variables, ``env://``, steps); rank 0 crashes on a signal file:

* ``torchrun``: ``torchrun --standalone --nproc-per-node 4 --max-restarts N``
  (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``);
* ``marduk``: ``marduk agent run --standalone --nproc-per-node 4 --preload torch``: no
  controller, no NATS (its address is a port this benchmark holds, closed to connections);
* ``marduk-controller``: the same with a controller (and a nats-server) it registers with: each
  crash is reported, and the restart waits for the controller's answer.

Per trial (a fault ``--settle`` s after every rank is stepping): **restart** = fault -> every
rank's new process running (its first statement); **ready** = fault -> every rank has done its
first step again (imports, gloo group, first all_reduce). Targets: restart no slower than
torchrun, ready at least 5x faster.

    .venv/bin/python bench/bench_launch.py --trials 10
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench_notify import machine, source_version, start_nats_server
from bench_restart import crash_time, events, stats, wait_for

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "bench" / "restart_worker.py")
NPROC = 4
CONTENDERS = ("torchrun", "marduk", "marduk-controller")
Procs = list[subprocess.Popen[bytes]]


def incarnation_done(bench_dir: Path, inc: int) -> tuple[float, float, Counter[str]] | None:
    """(last start, last ready, how each started) of incarnation ``inc`` once all are ready."""
    evs = [e for e in events(bench_dir) if e["inc"] == inc]
    starts = {e["rank"]: e for e in evs if e["ev"] == "start"}
    ready = {e["rank"]: e["t"] for e in evs if e["ev"] == "ready"}
    if len(ready) < NPROC or len(starts) < NPROC:
        return None
    by = Counter(str(e.get("by", "?")) for e in starts.values())
    return max(e["t"] for e in starts.values()), max(ready.values()), by


def held_closed_port() -> tuple[socket.socket, int]:
    """A loopback port bound by us and never listened on: a connection to it is refused."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    return s, int(s.getsockname()[1])


def start(name: str, bench_dir: Path, env: dict[str, str]) -> Procs:
    log = open(bench_dir / f"{name}.log", "wb")  # noqa: SIM115
    if name == "torchrun":
        torchrun = str(Path(sys.executable).parent / "torchrun")
        return [
            subprocess.Popen(
                [
                    torchrun,
                    "--standalone",
                    "--nproc-per-node",
                    str(NPROC),
                    "--max-restarts",
                    "100000",
                    WORKER,
                ],
                env={**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )
        ]
    procs: Procs = []
    agent = [sys.executable, "-m", "marduk", "agent", "run", "--replica", "r0"]
    agent += ["--devices", "dev0", "--nproc-per-node", str(NPROC), "--preload", "torch"]
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
    procs.append(
        subprocess.Popen(
            [*agent, "--", sys.executable, WORKER],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    )
    return procs


def stop(name: str, procs: Procs) -> None:
    for p in reversed(procs):
        try:
            if name == "torchrun":
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


def run(name: str, args: argparse.Namespace, closed_url: str) -> dict[str, object]:
    bench_dir = Path(tempfile.mkdtemp(prefix=f"marduk-launch-{name}-"))
    env = {
        **os.environ,
        "BENCH_DIR": str(bench_dir),
        "BENCH_FRAMEWORK": "torch",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "MARDUK_ADDR": closed_url,
    }
    procs = start(name, bench_dir, env)
    restart: list[float] = []
    ready: list[float] = []
    by: Counter[str] = Counter()
    try:
        _s, last_ready, _b = wait_for(  # type: ignore[misc]
            lambda: incarnation_done(bench_dir, 0), 180, "first start"
        )
        for inc in range(args.trials):
            time.sleep(max(0.0, last_ready + args.settle - time.time()))
            (bench_dir / f"crash-{inc}").touch()
            t_fault = float(wait_for(lambda: crash_time(bench_dir, inc), 60, "crash"))  # type: ignore[arg-type]  # noqa: B023
            last_start, last_ready, started = wait_for(  # type: ignore[misc]
                lambda: incarnation_done(bench_dir, inc + 1),  # noqa: B023
                180,
                f"restart {inc + 1}",
            )
            restart.append(last_start - t_fault)
            ready.append(last_ready - t_fault)
            by.update(started)
            print(
                f"{name} trial {inc + 1}: restart {restart[-1] * 1000:.0f} ms, "
                f"ready {ready[-1] * 1000:.0f} ms, started by {dict(started)}",
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
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument(
        "--settle", type=float, default=2.0, help="seconds from every rank ready to the fault"
    )
    p.add_argument("--out", help="also write the JSON report here")
    args = p.parse_args()
    holder, port = held_closed_port()  # held for the whole run: no NATS can appear there
    results = []
    try:
        for name in args.contenders.split(","):
            if name not in CONTENDERS:
                p.error(f"unknown contender {name!r}")
            results.append(run(name, args, f"nats://127.0.0.1:{port}"))
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    finally:
        holder.close()
    report = json.dumps(
        {
            "source": source_version(),
            "machine": machine(),
            "ranks": NPROC,
            "settle_s": args.settle,
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
