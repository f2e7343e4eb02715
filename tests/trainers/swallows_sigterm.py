"""A local rank that swallows SIGTERM, as JAX's preemption service does once jax.distributed is
initialized, and ends on a forwarded restart (``agent.jax.exit_on_restart``). ``--crash-rank R``:
that RANK crashes at step 5 of the first incarnation. ``--no-library``: it never connects, as
a trainer with no Marduk code (only SIGKILL ends it)."""

from __future__ import annotations

import argparse
import os
import signal
import time

import agent
import agent.jax
from agent.channel.handoff import Handoff

p = argparse.ArgumentParser()
p.add_argument("--crash-rank", type=int, default=-1)
p.add_argument("--no-library", action="store_true")
args = p.parse_args()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
rank, given = int(os.environ["RANK"]), Handoff.from_env()
client = None if args.no_library else agent.connect(on_command=agent.jax.exit_on_restart)
print(f"rank {rank} epoch {given.epoch} incarnation {given.restart_count}", flush=True)
for step in range(1, 100_000):
    print(f"step {step}", flush=True)
    if client is not None:
        client.step(step)
    if rank == args.crash_rank and step == 5 and given.restart_count == 0:
        os._exit(3)
    time.sleep(0.05)
