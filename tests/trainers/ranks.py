"""A plain-python local rank for ``--nproc-per-node`` tests: prints torchrun's variables, steps,
and crashes (one rank, first incarnation) or ignores SIGTERM when told."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=0, help="exit 0 after this many steps (0: never)")
p.add_argument("--crash-rank", type=int, default=-1, help="this RANK crashes at step 3, once")
p.add_argument("--step-seconds", type=float, default=0.05)
p.add_argument("--checkpoint-seconds", type=float, default=0.0, help="on SIGTERM, then exit")
p.add_argument("--ignore-sigterm", action="store_true")
p.add_argument("--crash-file", help="the crash rank crashes once this file exists (not at 3)")
p.add_argument("--crashes", type=int, default=1, help="incarnations the crash rank crashes in")
p.add_argument("--finish-rank", type=int, default=-1, help="this RANK exits 0 at step 1, once")
p.add_argument("--zombie", action="store_true", help="leave an exited child unwaited for")
p.add_argument("--long-line", type=int, default=0, help="first print one line this long")
p.add_argument("--setsid-child", action="store_true", help="leave a setsid'd grandchild behind")
args = p.parse_args()

NAMES = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
    "MARDUK_EPOCH",
    "MARDUK_JOB",
    "MARDUK_RESTART_COUNT",
    "MARDUK_DEVICES",
    "CUDA_VISIBLE_DEVICES",
    "MARDUK_AGENT_SOCKET",
    "MARDUK_WARM_START",
    "OMP_NUM_THREADS",
]
env = {k: os.environ.get(k) for k in NAMES}
rank = int(os.environ.get("RANK", "0"))
inc = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("MARDUK_RESTART_COUNT", "0")))
print("ENV " + json.dumps({**env, "pid": os.getpid()}), flush=True)
print(f"to stderr from rank {rank}", file=sys.stderr, flush=True)
if args.zombie and os.fork() == 0:
    os._exit(0)
if args.long_line:
    print("L" * args.long_line + " END-OF-LONG-LINE", flush=True)

if args.setsid_child:
    import subprocess

    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(3600)"],
        start_new_session=True,
    )
    print(f"GRANDCHILD {child.pid}", flush=True)


def on_term(*_: object) -> None:
    if args.ignore_sigterm:
        print(f"IGNORING SIGTERM rank {rank}", flush=True)
        return
    print(f"SIGTERM rank {rank}: checkpointing", flush=True)
    time.sleep(args.checkpoint_seconds)
    print(f"SAVED rank {rank}", flush=True)
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
step = 0
while True:
    step += 1
    print(f"step {step}", flush=True)
    first = inc == 0
    crash_now = os.path.exists(args.crash_file) if args.crash_file else step == 3
    if rank == args.crash_rank and crash_now and inc < args.crashes:
        print("Traceback (most recent call last):\nValueError: rank crash", file=sys.stderr)
        sys.exit(3)
    if rank == args.finish_rank and first:
        print(f"DONE rank {rank}", flush=True)
        sys.exit(0)
    waiting = args.crash_file and rank == args.crash_rank and first
    if args.steps and step >= args.steps and not waiting:
        print(f"DONE rank {rank}", flush=True)
        sys.exit(0)
    time.sleep(args.step_seconds)
