"""Benchmark: snapshots into the node-local store (agent/library/snapshots.py), side by side in
one run with this machine's memcpy bandwidth and the status quo (a synchronous save every 100
steps).

A synthetic train state of ``--mib`` MiB (float32 numpy arrays in ``--leaves`` parameters, as a
host-resident state or a GPU state's host copy would be) and a training loop whose step takes
``--step-s`` seconds of device time (a sleep: the host thread waits on the device as a GPU
trainer's does). Measured in the same process, one after another:

* memcpy: ``np.copyto`` of the whole state into a buffer already faulted in (best of 5);
* snapshot every step: how long ``snapshot()`` blocks the step (the copy to the staging buffer),
  and whether the background write keeps up (``superseded``: snapshots replaced before written);
  with ``copy=False`` too (immutable arrays: nothing copied on the step);
* restore: ``restore()`` from the store (tmpfs: a copy-on-write mapping) with every page touched,
  and restore then load into the model's arrays (a copy, as ``load_state_dict`` does), against
  memcpy; and ``np.load`` of the same state saved with ``np.savez`` on the same tmpfs;
* the status quo's stall: a synchronous ``np.savez`` of the state to ``--persist`` (local disk).

ETTR at one failure a minute is computed from these figures and ``--restart-s`` (the restart
itself, docs/benchmarks.md), printed with its formula: local snapshots every step lose the
restart, the step in flight and the restore; periodic saves every 100 steps lose the restart,
on average half the interval, the restore from storage, and stall every 100th step.

    .venv/bin/python bench/bench_local_ckpt.py                  # 1 GiB, 1 s steps
    .venv/bin/python bench/bench_local_ckpt.py --mib 256 --steps 10
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

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from agent.library.snapshot_format import Identity
from agent.library.snapshots import Snapshots


def state_of(mib: float, leaves: int) -> dict[str, np.ndarray]:
    n = int(mib * (1 << 20)) // 4 // leaves
    rng = np.random.default_rng(0)
    return {f"layer{i}": rng.random(n, dtype=np.float32) for i in range(leaves)}


def memcpy_gbps(state: dict[str, np.ndarray]) -> float:
    dst = {k: np.empty_like(v) for k, v in state.items()}
    for k in state:  # fault the pages in
        np.copyto(dst[k], state[k])
    nbytes = sum(v.nbytes for v in state.values())
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for k in state:
            np.copyto(dst[k], state[k])
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def snapshot_loop(
    s: Snapshots, state: dict[str, np.ndarray], steps: int, step_s: float, copy: bool
) -> dict[str, float]:
    blocked = []
    before = dict(s.stats)
    t_start = time.perf_counter()
    for step in range(1, steps + 1):
        time.sleep(step_s)  # the device computes the step
        for v in state.values():  # the step changes the state in place (one element: cheap)
            v[0] += 1.0
        t0 = time.perf_counter()
        s.snapshot(step, state, copy=copy)
        blocked.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t_start
    s.flush(60)
    first, rest = blocked[0], blocked[1:] or blocked
    return {
        "first_blocked_s": first,  # the staging buffers' first use faults their pages in
        "median_blocked_s": statistics.median(rest),
        "max_blocked_s": max(rest),
        "overhead_pct": 100 * statistics.mean(rest) / step_s,
        "wall_s": wall,
        "written": s.stats["snapshots.written"] - before.get("snapshots.written", 0),
        "superseded": s.stats["snapshots.superseded"] - before.get("snapshots.superseded", 0),
    }


def restore_gbps(
    s: Snapshots, state: dict[str, np.ndarray], trials: int = 3
) -> tuple[float, float]:
    """GB/s of ``restore()`` with every page of the state touched (so all of it is mapped and
    resident), and of a restore then loaded into the model's arrays (a copy, as
    ``load_state_dict`` does), best of ``trials``."""
    nbytes = sum(v.nbytes for v in state.values())
    best, best_load = float("inf"), float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        got = s.restore()
        assert got is not None
        for v in got.state.values():
            v.view(np.uint8)[::4096].sum()
        best = min(best, time.perf_counter() - t0)
        del got
        t0 = time.perf_counter()
        got = s.restore()
        assert got is not None
        for k, v in got.state.items():
            np.copyto(state[k], v)
        best_load = min(best_load, time.perf_counter() - t0)
        del got
    return nbytes / best / 1e9, nbytes / best_load / 1e9


def npz(state: dict[str, np.ndarray], directory: Path) -> tuple[float, float]:
    """Seconds to save the state with np.savez (synchronous) and to np.load it back."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "ckpt.npz"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        np.savez(f, **state)
        f.flush()
        os.fsync(f.fileno())
    save = time.perf_counter() - t0
    t0 = time.perf_counter()
    with np.load(path) as z:
        loaded = {k: z[k] for k in z.files}
    load = time.perf_counter() - t0
    del loaded
    path.unlink()
    return save, load


def ettr(
    failure_every_s: float, step_s: float, restart_s: float, lost_s: float, stall_s: float
) -> float:
    """Useful time over wall time, one failure each ``failure_every_s`` of wall time: each
    failure costs ``restart_s + lost_s``; ``stall_s`` is the saves' stall per step on average."""
    per_failure = restart_s + lost_s
    useful_fraction = step_s / (step_s + stall_s)
    return max(0.0, (failure_every_s - per_failure) / failure_every_s) * useful_fraction


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=float, default=1024.0)
    p.add_argument("--leaves", type=int, default=16)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--step-s", type=float, default=1.0)
    p.add_argument("--store", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--persist", default=None, help="the status quo's storage (default: /tmp)")
    p.add_argument("--restart-s", type=float, default=1.0, help="the restart itself")
    p.add_argument("--every", type=int, default=100, help="the status quo's save interval")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    state = state_of(args.mib, args.leaves)
    nbytes = sum(v.nbytes for v in state.values())
    store = Path(tempfile.mkdtemp(prefix="bench-local-ckpt-", dir=args.store))
    persist = Path(tempfile.mkdtemp(prefix="bench-persist-", dir=args.persist))
    out: dict[str, object] = {"mib": nbytes / (1 << 20), "step_s": args.step_s}
    try:
        out["memcpy_gbps"] = mem = memcpy_gbps(state)
        s = Snapshots(store, Identity("bench", "bench", 0, 1, 0), flush_s=60)
        out["snapshot_copy"] = snapshot_loop(s, state, args.steps, args.step_s, copy=True)
        out["snapshot_nocopy"] = snapshot_loop(s, state, args.steps, args.step_s, copy=False)
        gbps, load_gbps = restore_gbps(s, state)
        out["restore_gbps"], out["restore_and_load_gbps"] = gbps, load_gbps
        out["restore_vs_memcpy"] = gbps / mem
        out["restore_and_load_vs_memcpy"] = load_gbps / mem
        s.close()
        shutil.rmtree(store, ignore_errors=True)
        shm = Path(tempfile.mkdtemp(prefix="bench-npz-", dir=args.store))
        _, npz_load = npz(state, shm)
        shutil.rmtree(shm, ignore_errors=True)
        out["npz_load_tmpfs_gbps"] = nbytes / npz_load / 1e9
        save, load = npz(state, persist)
        out["persist_save_s"], out["persist_load_s"] = save, load
        restore_s = nbytes / load_gbps / 1e9
        stall_local = out["snapshot_copy"]["overhead_pct"] / 100 * args.step_s  # type: ignore[index]
        local = ettr(60, args.step_s, args.restart_s, args.step_s + restore_s, stall_local)
        periodic = ettr(
            60, args.step_s, args.restart_s, args.every / 2 * args.step_s + load, save / args.every
        )
        stall_nocopy = out["snapshot_nocopy"]["overhead_pct"] / 100 * args.step_s  # type: ignore[index]
        nocopy = ettr(60, args.step_s, args.restart_s, args.step_s + restore_s, stall_nocopy)
        out["ettr_local_every_step"], out["ettr_periodic"] = local, periodic
        out["ettr_local_every_step_nocopy"] = nocopy
    finally:
        shutil.rmtree(store, ignore_errors=True)
        shutil.rmtree(persist, ignore_errors=True)
    out["machine"] = {"cpus": os.cpu_count(), "load": os.getloadavg()}
    print(json.dumps(out, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
