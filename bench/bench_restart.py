"""Benchmark: how fast a job of 8 workers is back after a fault, Marduk side by side with peers.

Contenders, all running bench/restart_worker.py (imports torch, joins a gloo group of 8, steps):

* ``marduk-crash``: 8 ``marduk agent run`` (scope job, 4 replicas x 2 workers, pre-spawned
  trainers with torch preloaded) and a controller; rank 0 crashes.
* ``marduk-device``: the same; the fault is a device health event for one of rank 0's devices.
* ``torchrun``: ``torchrun --nproc-per-node 8 --max-restarts N``; rank 0 crashes.
* ``plain``: a minimal restart-all supervisor (kill all, start all), the floor for restarting
  without pre-spawned processes.

Per trial: **restart** = fault -> every worker's new process running (its first statement);
**ready** = fault -> every worker has done its first step again (imports, backend, rendezvous).
The fault time is the crash event (rank 0 logs it just before exiting) or the health event's
publish.

Needs torch: ``.venv/bin/pip install torch==2.13.0`` (the CPU build).

    .venv/bin/python bench/bench_restart.py --trials 20
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "bench" / "restart_worker.py")
REPLICAS, PER = 4, 2
WORLD = REPLICAS * PER


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def events(bench_dir: Path) -> list[dict]:  # type: ignore[type-arg]
    out = []
    for f in bench_dir.glob("events-*.jsonl"):
        for line in f.read_text().splitlines():
            if line.strip():
                out.append(json.loads(line))
    return out


def wait_for(pred: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.005)
    raise TimeoutError(f"timed out waiting for {what}")


def incarnation_done(bench_dir: Path, inc: int) -> tuple[float, float] | None:
    """(last start, last ready) of incarnation ``inc`` once every rank is ready in it."""
    evs = [e for e in events(bench_dir) if e["inc"] == inc]
    starts = {e["rank"]: e["t"] for e in evs if e["ev"] == "start"}
    ready = {e["rank"]: e["t"] for e in evs if e["ev"] == "ready"}
    if len(ready) < WORLD or len(starts) < WORLD:
        return None
    return max(starts.values()), max(ready.values())


def crash_time(bench_dir: Path, inc: int) -> float | None:
    for e in events(bench_dir):
        if e["ev"] == "crash" and e["inc"] == inc:
            return float(e["t"])
    return None


# --- contenders ------------------------------------------------------------------------------


def start_marduk(bench_dir: Path, env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    store_port = free_port()
    env = {
        **env,
        # Every trial fails the same device: lift its failure budget, which would
        # otherwise (rightly) escalate the 4th failure within the hour to `fail`.
        "MARDUK_DEVICE_MAX_FAILURES": "1000000",
        "MARDUK_STATE_DIR": str(bench_dir / "state"),
        "BENCH_WORKERS_PER_REPLICA": str(PER),
        "BENCH_WORLD": str(WORLD),
        "BENCH_STORE_PORT": str(store_port),
    }
    log = open(bench_dir / "marduk.log", "wb")  # noqa: SIM115
    # The workers' rendezvous store, up for the whole run (torchrun's agent hosts its own).
    store = subprocess.Popen(
        [sys.executable, "-c", STORE_HOLDER, str(store_port), str(WORLD)], stdout=log, stderr=log
    )
    ctl = subprocess.Popen(
        [sys.executable, "-m", "marduk", "controller"], env=env, cwd=ROOT, stdout=log, stderr=log
    )
    wait_for(
        lambda: b"serving prefix" in (bench_dir / "marduk.log").read_bytes(), 30, "the controller"
    )
    procs = [ctl, store]
    for r in range(REPLICAS):
        for w in range(PER):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "marduk",
                        "agent",
                        "run",
                        "--job",
                        "bench",
                        "--replica",
                        f"r{r}",
                        "--worker",
                        str(w),
                        "--devices",
                        f"dev-{r}-{w}",
                        "--scope",
                        "job",
                        "--preload",
                        "torch",
                        "--grace",
                        "2",
                        "--max-restarts",
                        "100000",
                        "--log-level",
                        "warning",
                        "--",
                        sys.executable,
                        WORKER,
                    ],
                    env=env,
                    cwd=ROOT,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                )
            )
    return procs


def start_torchrun(bench_dir: Path, env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    env = {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    torchrun = str(Path(sys.executable).parent / "torchrun")
    log = open(bench_dir / "torchrun.log", "wb")  # noqa: SIM115
    return [
        subprocess.Popen(
            [
                torchrun,
                "--nnodes",
                "1",
                "--nproc-per-node",
                str(WORLD),
                "--max-restarts",
                "100000",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{free_port()}",
                WORKER,
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
        )
    ]


STORE_HOLDER = r"""
import sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), int(sys.argv[2]), is_master=True,
                      wait_for_workers=False)
time.sleep(10**7)
"""

PLAIN = r"""
import os, signal, subprocess, sys
worker, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
inc = 0
while True:
    env = {**os.environ, "BENCH_PLAIN": "1", "BENCH_INCARNATION": str(inc),
           "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port + inc)}
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


def start_plain(bench_dir: Path, env: dict[str, str]) -> list[subprocess.Popen[bytes]]:
    return [
        subprocess.Popen(
            [sys.executable, "-c", PLAIN, WORKER, str(WORLD), str(free_port() + 100)],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
    ]


def inject(env: dict[str, str], device: str) -> float:
    """Publish a health event; return its publish time."""
    import asyncio

    import nats

    sys.path.insert(0, str(ROOT))
    from marduk import protocol as wire

    async def go() -> float:
        nc = await nats.connect(env["MARDUK_ADDR"])
        t = time.time()
        await nc.publish(
            "marduk.health", wire.encode(wire.DeviceHealth(device=device, state="failed"))
        )
        await nc.flush()
        await nc.close()
        return t

    return asyncio.run(go())


# --- driver ------------------------------------------------------------------------------------


def run(name: str, trials: int, settle: float) -> dict[str, object]:
    bench_dir = Path(tempfile.mkdtemp(prefix=f"marduk-restart-{name}-"))
    env = {
        **os.environ,
        "BENCH_DIR": str(bench_dir),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    if name.startswith("marduk"):
        env["MARDUK_ADDR"] = f"nats://127.0.0.1:{free_port()}"
    starter = {
        "marduk-crash": start_marduk,
        "marduk-device": start_marduk,
        "torchrun": start_torchrun,
        "plain": start_plain,
    }[name]
    procs = starter(bench_dir, env)
    restart, ready = [], []
    try:
        wait_for(lambda: incarnation_done(bench_dir, 0), 180, "first start")
        for k in range(trials):
            time.sleep(settle)  # pre-spawned trainers (if any) import their framework
            if name == "marduk-device":
                t_fault = inject(env, "dev-0-0")
            else:
                (bench_dir / f"crash-{k}").touch()
                t_fault = float(wait_for(lambda k=k: crash_time(bench_dir, k), 60, "crash"))  # type: ignore[misc]
            last_start, last_ready = wait_for(  # type: ignore[misc]
                lambda k=k: incarnation_done(bench_dir, k + 1), 180, f"restart {k + 1}"
            )
            restart.append(last_start - t_fault)
            ready.append(last_ready - t_fault)
            print(
                f"{name} trial {k + 1}: restart {restart[-1] * 1000:.0f} ms, "
                f"ready {ready[-1] * 1000:.0f} ms",
                file=sys.stderr,
                flush=True,
            )
    finally:
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
        shutil.rmtree(bench_dir, ignore_errors=True)
    return {
        "contender": name,
        "trials": len(restart),
        **stats("restart", restart),
        **stats("ready", ready),
    }


def stats(name: str, values: list[float]) -> dict[str, float]:
    values_ms = sorted(v * 1000 for v in values)

    def pct(p: float) -> float:
        return values_ms[min(len(values_ms) - 1, round(p / 100 * (len(values_ms) - 1)))]

    return {
        f"{name}_p50_ms": round(statistics.median(values_ms), 1),
        f"{name}_p99_ms": round(pct(99), 1),
        f"{name}_max_ms": round(values_ms[-1], 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--contenders", default="plain,torchrun,marduk-crash,marduk-device")
    p.add_argument(
        "--settle",
        type=float,
        default=8.0,
        help="seconds between trials (pre-spawned trainers import torch meanwhile)",
    )
    args = p.parse_args()
    results = []
    for name in args.contenders.split(","):
        results.append(run(name, args.trials, args.settle if name.startswith("marduk") else 1.0))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(
        json.dumps(
            {
                "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpu "
                f"python {platform.python_version()}",
                "workers": WORLD,
                "results": results,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
