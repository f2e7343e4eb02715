"""A supervised trainer that uses the agent library: steps, sections, commands via its agent."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

import agent

p = argparse.ArgumentParser()
MODES = [
    "steps-then-stall",
    "steps-then-freeze",
    "long-section",
    "wait-command",
    "checkpoint",
    "compute",
]
p.add_argument("--mode", choices=MODES)
p.add_argument("--steps", type=int, default=20, help="steps-then-stall: this many first")
p.add_argument("--step-seconds", type=float, default=0.1, help="steps-then-stall: apart")
args = p.parse_args()

client = agent.connect()  # under `marduk agent run`: talks to it, no second registration
print(
    f"CONNECTED epoch={client.epoch} state={client.state} local={type(client._async).__name__}",
    flush=True,
)


def on_term(*_: object) -> None:
    cmd = client.last_failure or client.wait(2.0)
    print(
        f"SIGTERM command={cmd.kind if cmd else None} epoch={cmd.epoch if cmd else None}",
        flush=True,
    )
    sys.exit(0)


def idle() -> None:
    """Wait forever, returning to the interpreter every 0.1 s: Python runs a signal's handler
    only in the main thread and between bytecodes, and a SIGTERM the kernel hands to another
    thread (the library's, e.g. the first to run after a SIGCONT) does not interrupt a long
    sleep of the main thread."""
    while True:
        time.sleep(0.1)


signal.signal(signal.SIGTERM, on_term)
if args.mode == "steps-then-stall":
    for i in range(args.steps):
        client.step(i)  # not printed: only the library reports progress
        time.sleep(args.step_seconds)
    print("STALLING", flush=True)
    idle()
elif args.mode == "steps-then-freeze":  # hung without dying: the whole process stopped
    for i in range(20):
        client.step(i)
        time.sleep(0.1)
    print("FREEZING", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    idle()
elif args.mode == "long-section":
    client.step(1)
    with client.section("checkpoint", timeout=0.5):
        print("IN SECTION", flush=True)
        idle()
elif args.mode == "checkpoint":  # save when asked, keep training
    step = 0
    while True:
        step += 1
        client.step(step)
        if client.checkpoint_requested:
            print(f"CHECKPOINT SAVED step={step}", flush=True)
            client.checkpoint_saved(step)
        time.sleep(0.05)
elif args.mode == "compute":  # 20 ms of "compute" a step, 1.5x while the file SLOW_FLAG exists
    flag = os.environ.get("SLOW_FLAG", "")
    step = 0
    while True:
        with client.section("compute"):
            time.sleep(0.02 * (1.5 if flag and os.path.exists(flag) else 1.0))
        step += 1
        client.step(step)
else:
    while True:
        client.heartbeat()
        time.sleep(0.1)
