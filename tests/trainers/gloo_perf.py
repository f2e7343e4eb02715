"""A torch.distributed (gloo, CPU) trainer that marks its compute: ``compute`` (20 ms) outside
the all_reduce, then ``step``. Rank ``SLOW_RANK`` computes 1.5x longer while the file
``SLOW_FLAG`` exists (a throttling device, mid-run)."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import agent

dist.init_process_group("gloo", timeout=timedelta(seconds=30))  # env://: torchrun's variables
rank = dist.get_rank()
client = agent.connect()  # under `marduk agent run`: through it
print(f"RANKS rank={rank} world={dist.get_world_size()}", flush=True)
flag, slow_rank = os.environ.get("SLOW_FLAG", ""), int(os.environ.get("SLOW_RANK", "-1"))
step = 0
while True:
    slow = rank == slow_rank and flag and os.path.exists(flag)
    with client.section("compute"):
        time.sleep(0.02 * (1.5 if slow else 1.0))
    t = torch.ones(1)
    dist.all_reduce(t)  # everyone waits for the slowest here: its step time is everyone's
    step += 1
    client.step(step)
