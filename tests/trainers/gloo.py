"""A torch.distributed (gloo, CPU) trainer: every step is an all_reduce across the ranks.

Prints ``RANKS rank=R world=W`` once the process group is up and ``step N sum=S`` per step;
``--crash-rank R`` crashes that rank at step 3 of the first incarnation.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=0, help="exit 0 after this many steps (0: never)")
p.add_argument("--crash-rank", type=int, default=-1)
p.add_argument("--step-seconds", type=float, default=0.05)
args = p.parse_args()

inc = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
dist.init_process_group("gloo", timeout=timedelta(seconds=30))  # env://: torchrun's variables
rank, world = dist.get_rank(), dist.get_world_size()
print(f"RANKS rank={rank} world={world} inc={inc}", flush=True)
step = 0
while True:
    step += 1
    t = torch.ones(1)
    dist.all_reduce(t)
    print(f"step {step} sum={int(t.item())}", flush=True)
    if rank == args.crash_rank and step == 3 and inc == 0:
        print("Traceback (most recent call last):\nValueError: gloo rank crash", file=sys.stderr)
        os._exit(3)
    if args.steps and step >= args.steps:
        dist.barrier()
        dist.destroy_process_group()
        print(f"DONE rank {rank}", flush=True)
        sys.exit(0)
    time.sleep(args.step_seconds)
