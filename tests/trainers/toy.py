"""A configurable stand-in trainer for supervisor tests (no jax: fast to start)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=0, help="exit 0 after this many steps (0: never)")
p.add_argument("--crash-at", type=int, default=-1)
p.add_argument("--crash-line", default="ValueError: toy crash", help="the last line printed")
p.add_argument("--crash-incarnations", type=int, default=1, help="crash only in the first N")
p.add_argument("--hang-at", type=int, default=-1)
p.add_argument("--step-seconds", type=float, default=0.05)
args = p.parse_args()

inc = int(os.environ.get("MARDUK_RESTART_COUNT", "0"))
tag = f"{os.environ.get('MARDUK_REPLICA_ID')}/{os.environ.get('MARDUK_WORKER')}"
print(f"START {tag} epoch={os.environ.get('MARDUK_EPOCH')} inc={inc}", flush=True)


def on_term(*_: object) -> None:
    print(f"SIGTERM {tag}: checkpointing", flush=True)
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
step = 0
while True:
    step += 1
    print(f"step {step}", flush=True)
    if step == args.crash_at and inc < args.crash_incarnations:
        print(f"Traceback (most recent call last):\n{args.crash_line}", file=sys.stderr, flush=True)
        sys.exit(3)
    if step == args.hang_at and inc == 0:
        time.sleep(3600)
    if args.steps and step >= args.steps:
        print(f"DONE {tag}", flush=True)
        sys.exit(0)
    time.sleep(args.step_seconds)
