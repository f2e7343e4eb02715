"""A torch.distributed (gloo, CPU) trainer that marks its compute: ``compute`` (20 ms) outside
the all_reduce, then ``step``. Rank ``SLOW_RANK``, or any rank on the device ``SLOW_DEVICE``
(one of its MARDUK_DEVICES), computes 1.5x longer while the file ``SLOW_FLAG`` exists (a
throttling device, mid-run)."""

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
if "GROUP_RANK" in os.environ:  # a --nnodes job: the placement, as tests/elastic_job.py reads it
    print(
        f"start rank {rank}/{dist.get_world_size()} (group rank {os.environ['GROUP_RANK']}), "
        f"epoch {os.environ.get('MARDUK_EPOCH', '0')}, resuming at step 0",
        flush=True,
    )
flag, slow_rank = os.environ.get("SLOW_FLAG", ""), int(os.environ.get("SLOW_RANK", "-1"))
on_slow_device = os.environ.get("SLOW_DEVICE", "-") in os.environ.get("MARDUK_DEVICES", "").split(
    ","
)
step = 0
while True:
    slow = (rank == slow_rank or on_slow_device) and flag and os.path.exists(flag)
    with client.section("compute"):
        time.sleep(0.02 * (1.5 if slow else 1.0))
    t = torch.ones(1)
    dist.all_reduce(t)  # everyone waits for the slowest here: its step time is everyone's
    step += 1
    client.step(step)
