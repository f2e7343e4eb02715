"""A torch gloo trainer that snapshots every step into the agent's local store and restores from
it (agent/library/snapshots.py): tests/e2e/test_local_snapshots.py runs two ranks of it.

Each step all-reduces ``step * (rank + 1)`` over the ranks and updates ``w = w * 0.9 + sum +
rank`` (float64; ``expected`` is the uninterrupted run's value), snapshots ``{"w": w}`` and
prints ``step N value V``. At start it prints ``start rank R pid P resuming at S from SOURCE``
(SOURCE: local, persistent or nothing); at a restart, fail or stop the library writes the last
snapshot first, then ``on_command`` prints ``notice: saved step N`` and ends the process.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import agent
import agent.jax
from agent.snapshots import torch_min


def expected(step: int, rank: int, world: int) -> float:
    """The value an uninterrupted run prints at ``step``."""
    w = 0.0
    for s in range(1, step + 1):
        w = w * 0.9 + float(s * sum(r + 1 for r in range(world))) + rank
    return w


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--step-seconds", type=float, default=0.1)
    p.add_argument("--mib", type=float, default=1.0, help="padding in the state (MiB)")
    args = p.parse_args()
    client: agent.Client

    def on_command(command: agent.Command) -> None:
        s = client.snapshots
        print(f"notice: saved step {s.last_written if s else None}", flush=True)
        agent.jax.exit_on_restart(command)

    client = agent.connect(on_command=on_command)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    got = client.restore(agree=torch_min)
    pad = torch.zeros(int(args.mib * (1 << 20)) // 8, dtype=torch.float64)
    w = torch.zeros(4, dtype=torch.float64)
    start = 0
    if got is not None:
        w, start = got.state["w"].clone(), got.step
    print(
        f"start rank {rank} pid {os.getpid()} resuming at {start} from "
        f"{got.source if got else 'nothing'}",
        flush=True,
    )
    step = start
    while True:
        step += 1
        t = torch.tensor([float(step * (rank + 1))], dtype=torch.float64)
        dist.all_reduce(t)
        w = w * 0.9 + t + rank
        client.snapshot(step, {"w": w, "pad": pad})
        client.step(step)
        print(f"step {step} value {float(w[0])!r}", flush=True)
        time.sleep(args.step_seconds)


if __name__ == "__main__":
    main()
