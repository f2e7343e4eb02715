"""A torch.distributed (gloo) trainer for a job whose ranks the controller assigns, torchrun's
elastic form (``--nnodes MIN:MAX``): it shrinks when a node is lost and grows back when one
joins, restoring its checkpoint onto whatever world size it is started with::

    marduk agent run --job lin --scope job --nnodes 1:2 --local-addr 127.0.0.1 \\
        --devices lin-d0 --replica node0 -- python examples/torch_elastic_trainer.py

Each start is a new process group (``init_process_group("gloo")`` from torchrun's variables,
which the agent sets from the epoch's membership). It prints ``start rank R/W (group rank G),
epoch E, resuming at step S`` and every step ``step N loss X sum Y``.

The model is a linear regression over one fixed global batch of 64 rows; each rank takes its
share of the rows (64 / WORLD_SIZE), sums its gradient and the ranks all-reduce the sums, so a
step computes the same update at any world size: the values after a resize continue those
before it. Rank 0 writes ``ckpt-<step>.pt`` (``--ckpt-dir``, default ``$MARDUK_CKPT_DIR/JOB``;
written to a temporary name and renamed) every ``--ckpt-every`` steps, and at the step after
the controller asks for one (the ``checkpoint`` command a grow sends; every rank confirms it
with ``checkpoint_saved``). At start rank 0 picks the latest checkpoint and broadcasts its step,
so every rank restores the same one.

A restart ends the process at once (``agent.jax.exit_on_restart``: nothing jax-specific, it
exits on any command but ``checkpoint``); a collective that fails because a peer died waits a
moment for that restart instead of exiting 1 (a crash of its own would count against this
node's restart budget).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import agent
import agent.jax
from agent.channel.handoff import Handoff

BATCH = 64  # the global batch: divisible by every world size this example runs at
PEER_LOSS_WAIT_S = 3.0


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 8, generator=g)
    return x, x @ torch.randn(8, 1, generator=g)


def latest(ckpt_dir: Path) -> int:
    return max((int(p.stem.split("-")[1]) for p in ckpt_dir.glob("ckpt-*.pt")), default=0)


def save(ckpt_dir: Path, step: int, w: torch.Tensor) -> None:
    if dist.get_rank() != 0:
        return
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir / f".ckpt-{step}-{os.getpid()}.pt"
    torch.save({"step": step, "w": w}, tmp)
    tmp.rename(ckpt_dir / f"ckpt-{step:08d}.pt")  # atomic


def start_step(ckpt_dir: Path) -> int:
    """Rank 0's latest checkpoint, the same for every rank."""
    t = torch.tensor([latest(ckpt_dir) if dist.get_rank() == 0 else 0])
    dist.broadcast(t, 0)
    return int(t.item())


def main() -> int:
    p = argparse.ArgumentParser(description="torch gloo trainer for --nnodes MIN:MAX")
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (demos)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=1, help="print the loss every N steps")
    args = p.parse_args()
    given = Handoff.from_env()
    ckpt_dir = Path(
        args.ckpt_dir
        or os.path.join(os.environ.get("MARDUK_CKPT_DIR", ".marduk/ckpt"), given.job or "default")
    )
    client = agent.connect(on_command=agent.jax.exit_on_restart) if given.supervised else None
    try:
        return train(args, given, ckpt_dir, client)
    except Exception:
        # A collective failed: a peer is gone. Wait a moment for the restart the controller is
        # ordering (exit_on_restart ends the process) rather than report a crash of our own.
        traceback.print_exc()
        sys.stdout.flush()
        if client is not None:
            client.wait(PEER_LOSS_WAIT_S)
        os._exit(1)


def live_params(client, args, lr: float, log_every: int) -> tuple[float, int, int]:  # type: ignore[no-untyped-def]
    """``lr`` and ``log_every`` from the job's live parameters (the command line's when unset);
    a value the loop cannot use is refused, with why, and the one in force kept. Every rank
    reads the same version: the job's values, the same for each replica unless one was set
    its own with ``--replica``."""
    live, rejected = client.params, {}
    new_lr, new_every = live.get("lr", args.lr), live.get("log_every", args.log_every)
    if isinstance(new_lr, int | float) and not isinstance(new_lr, bool) and new_lr > 0:
        lr = float(new_lr)
    else:
        rejected["lr"] = f"{new_lr!r} is not a positive number"
    if isinstance(new_every, int) and not isinstance(new_every, bool) and new_every >= 1:
        log_every = new_every
    else:
        rejected["log_every"] = f"{new_every!r} is not a positive integer"
    client.params_applied(live.version, rejected=rejected)
    print(f"params version {live.version}: lr {lr} log_every {log_every}", flush=True)
    return lr, log_every, live.version


def train(args, given: Handoff, ckpt_dir: Path, client) -> int:  # type: ignore[no-untyped-def]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # env://
    rank, world = dist.get_rank(), dist.get_world_size()
    start = start_step(ckpt_dir)
    w = torch.zeros(8, 1)
    if start:
        w = torch.load(ckpt_dir / f"ckpt-{start:08d}.pt")["w"]
    print(
        f"start rank {rank}/{world} (group rank {os.environ.get('GROUP_RANK')}), epoch "
        f"{given.epoch}, resuming at step {start}",
        flush=True,
    )
    x, y = data()
    share = BATCH // world
    x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
    asked = False
    # Live parameters (`marduk monitor set JOB lr=0.01 log_every=10`): read at each step
    # boundary, applied from this step on, acknowledged; a restarted trainer starts with them.
    lr, log_every, applied = args.lr, args.log_every, 0
    for step in range(start + 1, args.steps + 1):
        if client is not None and client.params.version != applied:
            lr, log_every, applied = live_params(client, args, lr, log_every)
        err = x @ w - y
        # One all_reduce a step: the gradient's sum, the squared error's sum, and whether any
        # rank was asked for a checkpoint (every rank then saves at this step).
        packed = torch.cat([(2 * x.T @ err).flatten(), (err**2).sum().view(1)])
        packed = torch.cat([packed, torch.tensor([float(asked)])])
        dist.all_reduce(packed)
        w = w - lr * packed[:8].view(8, 1) / BATCH
        loss = float(packed[8]) / BATCH
        if step % log_every == 0:
            print(f"step {step} loss {loss:.6f} sum {float(w.sum()):.6f}", flush=True)
        if packed[9] > 0:
            save(ckpt_dir, step, w)
            print(f"checkpoint saved at step {step} on request", flush=True)
            if asked and client is not None:
                client.checkpoint_saved(step)
        elif step % args.ckpt_every == 0:
            save(ckpt_dir, step, w)
        asked = client is not None and client.checkpoint_requested
        if client is not None:
            client.step(step)
        if args.step_seconds:
            time.sleep(args.step_seconds)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
