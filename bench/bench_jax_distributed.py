"""Benchmark: a ``jax.distributed`` mesh under Marduk, from a fault to every rank stepping again.

A controller and ``--nproc`` agents (``marduk agent run --scope job --nnodes N --node-rank I``,
default grace), each running one process of examples/jax_distributed_trainer.py: one global
mesh (gloo collectives, 2 CPU devices a process). Faults, in turn, ``--trials`` times each:

* ``device``: a failed health event for the last rank's device (published durably, as monitors
  do; timed from the publish);
* ``crash0``: SIGKILL to rank 0's trainer (the coordinator);
* ``crash1``: SIGKILL to rank 1's trainer;
* ``double``: crash of rank 1, then 0.5 s later a device event on rank 0 (timed from the second).

Per fault: **back** = the fault -> the last rank's first step of the new incarnation (the mesh
formed again, the checkpoint restored, the step compiled). It is broken down, for the slowest
rank, by the line times the harness records: **stopped** = the fault -> the agent starts the new
trainer (controller decision, command, the old trainer ended), **joined** = -> the mesh is formed
and the state restored (``resuming at step``: the trainer's start, the library,
``jax.distributed.initialize``), **stepped** = -> its first step (compiling or loading the step).

    .venv/bin/python bench/bench_jax_distributed.py --trials 5

BENCH_KEEP=1 keeps the run's directory (checkpoints, compiled steps, the controller's state).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import free_port
from tests.jax_mesh import MeshJob, left_behind, mesh_env

FAULTS = ("device", "crash0", "crash1", "double")


def started_after(job: MeshJob, rank: int, t: float) -> float | None:
    for at, line in job.agents[rank].timed:
        if at > t and "trainer started: pid" in line:
            return at
    return None


def one(job: MeshJob, fault: str) -> dict[str, float]:
    epoch = job.epoch()
    last = job.n - 1
    if fault == "device":
        t = job.device_failed(last)
    elif fault == "crash0":
        t = job.crash(0)
    elif fault == "crash1":
        t = job.crash(1)
    else:
        job.crash(1)
        time.sleep(0.5)
        t = job.device_failed(0)
    now = job.wait_stepping(t, epoch, timeout=120)
    first = [inc.first_step_at or 0.0 for inc in now]
    slow = max(range(job.n), key=lambda r: first[r])
    started = started_after(job, slow, t)
    return {
        "back": max(first) - t,
        "stopped": (started or t) - t,
        "joined": now[slow].resumed_at - t,
        "stepped": first[slow] - t,
        "epochs": now[0].epoch - epoch,
        "resumed_at_step": now[0].start,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2, help="processes in the mesh (agents)")
    p.add_argument("--faults", default=",".join(FAULTS))
    p.add_argument("--settle", type=float, default=1.0, help="seconds stepping between faults")
    p.add_argument("--out", default="", help="write the results as JSON here")
    args = p.parse_args()
    os.chdir(ROOT)
    work = Path(tempfile.mkdtemp(prefix="bench_jaxd_"))
    env = {
        "MARDUK_ADDR": f"nats://127.0.0.1:{free_port()}",
        "MARDUK_STATE_DIR": str(work / "state"),
        "PYTHONUNBUFFERED": "1",
        # Every trial fails the same devices again: lift the controller's device budget and
        # flap damping (3 each by default, then `fail` and quarantine, as in production).
        "MARDUK_DEVICE_MAX_FAILURES": "1000",
        "MARDUK_FLAP_LIMIT": "1000",
    }
    # Every fault is a failure of some node: lift the budget (3 by default) for many trials.
    job = MeshJob(
        mesh_env(env, work / "ckpt"),
        job="bench",
        n=args.nproc,
        agent_args=("--max-restarts", "1000"),
    )
    results: dict[str, list[dict[str, float]]] = {}
    load = os.getloadavg()
    try:
        t0 = time.time()
        job.wait_stepping(0, -1, timeout=300, steps=10)
        print(f"{args.nproc} processes stepping {time.time() - t0:.1f}s after start", flush=True)
        for trial in range(args.trials):
            for fault in args.faults.split(","):
                time.sleep(args.settle)
                r = one(job, fault)
                results.setdefault(fault, []).append(r)
                print(
                    f"trial {trial} {fault:7s} back {r['back']:.2f}s (stopped {r['stopped']:.2f}, "
                    f"joined {r['joined']:.2f}, stepped {r['stepped']:.2f}; "
                    f"+{r['epochs']:.0f} epoch(s), resumed at step {r['resumed_at_step']:.0f})",
                    flush=True,
                )
        ignored = sum("ignored SIGTERM" in ln for a in job.agents for ln in a.all)
    finally:
        job.stop()
        if not os.environ.get("BENCH_KEEP"):
            shutil.rmtree(work, ignore_errors=True)
    pids = [p for r in range(job.n) for p in job.pids(r)]
    summary = {
        fault: {
            k: round(statistics.median(r[k] for r in rs), 3)
            for k in ("back", "stopped", "joined", "stepped")
        }
        | {"max_back": round(max(r["back"] for r in rs), 3), "trials": len(rs)}
        for fault, rs in results.items()
    }
    print("\nmedians (s):")
    for fault, s in summary.items():
        print(f"  {fault:7s} {s}")
    print(
        f"'ignored SIGTERM' lines: {ignored}; processes left behind: {len(left_behind(pids))}; "
        f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
        f"at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"args": vars(args), "summary": summary, "trials": results, "load": load}, indent=1
            )
        )


if __name__ == "__main__":
    main()
