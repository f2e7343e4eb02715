"""The status quo for bench/bench_goodput.py: a restart-everything supervisor, no Marduk.

It starts every worker of the job cold (``python TRAINER ...``) and, on any failure, stops
them all and starts them all again, as a Kubernetes Job restarting its pods or torchrun's
restart-all does: the survivors get SIGTERM and ``--grace`` seconds to checkpoint (then
SIGKILL), and only when every one is gone does the next incarnation start. A failure is a
worker that exits (any exit: a crash, or a kill -9 from the benchmark), or a device event,
which arrives as a line ``device REPLICA WORKER`` on stdin (what a node-problem detector
failing the pod would do).

    python bench/goodput_supervisor.py --job gp --replicas 2 --workers 2 --log LOG -- CMD...

Every worker gets the environment ``marduk agent run`` gives (MARDUK_JOB, MARDUK_REPLICA_ID,
MARDUK_WORKER, MARDUK_EPOCH) so the trainer names its checkpoints the same way. LOG gets one
JSON line per event (``started``, ``exited``, ``device``, ``stopping``, ``stopped``) with
its wall time. SIGTERM stops the workers (with the grace period) and exits.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child: SIGKILL when this supervisor dies (nothing outlives it)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default="gp")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--workers", type=int, default=2, help="per replica")
    p.add_argument("--grace", type=float, default=10.0)
    p.add_argument("--log", required=True)
    p.add_argument("cmd", nargs="+")
    args = p.parse_args()
    log_file = open(args.log, "a", buffering=1)  # noqa: SIM115

    def log(ev: str, **fields: object) -> None:
        log_file.write(json.dumps({"ev": ev, "t": time.time(), **fields}) + "\n")

    events: queue.Queue[tuple[str, object]] = queue.Queue()
    signal.signal(signal.SIGTERM, lambda *_: events.put(("quit", None)))

    def read_stdin() -> None:
        for line in sys.stdin:
            events.put(("device", line.split()))
        events.put(("stdin-closed", None))

    threading.Thread(target=read_stdin, daemon=True).start()
    workers = [(f"r{r}", w) for r in range(args.replicas) for w in range(args.workers)]
    incarnation = 0
    while True:
        procs: dict[tuple[str, int], subprocess.Popen[bytes]] = {}
        for replica, w in workers:
            env = {
                **os.environ,
                "MARDUK_JOB": args.job,
                "MARDUK_REPLICA_ID": replica,
                "MARDUK_WORKER": str(w),
                "MARDUK_EPOCH": str(incarnation),
            }
            proc = subprocess.Popen(args.cmd, env=env, preexec_fn=die_with_parent)
            procs[(replica, w)] = proc
            log("started", replica=replica, worker=w, pid=proc.pid, incarnation=incarnation)

            def wait(key: tuple[str, int] = (replica, w), proc: subprocess.Popen = proc) -> None:  # type: ignore[type-arg]
                proc.wait()
                events.put(("exited", (key, proc.pid, proc.returncode)))

            threading.Thread(target=wait, daemon=True).start()
        # Until the first failure of this incarnation (or the end).
        while True:
            kind, what = events.get()
            if kind == "exited":
                (replica, w), pid, code = what  # type: ignore[misc]
                log("exited", replica=replica, worker=w, pid=pid, code=code)
                if procs[(replica, w)].pid == pid:
                    break
            elif kind == "device":
                log("device", target=what)
                break
            elif kind in ("quit", "stdin-closed"):
                stop_all(procs, args.grace, log)
                return 0
        stop_all(procs, args.grace, log)
        # Drain the exits of this incarnation's workers (logged for the benchmark).
        incarnation += 1


def stop_all(procs: dict[tuple[str, int], subprocess.Popen[bytes]], grace: float, log) -> None:  # type: ignore[no-untyped-def]
    log("stopping")
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for (replica, w), proc in procs.items():
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log("gone", replica=replica, worker=w, pid=proc.pid, code=proc.returncode)
    log("stopped")


if __name__ == "__main__":
    sys.exit(main())
