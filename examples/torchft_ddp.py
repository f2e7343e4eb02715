"""A torchft data-parallel replica group under Marduk: a small MLP, gloo, CPU, one process each.

Start a lighthouse and a controller, then one ``marduk agent run`` per replica group:

    torchft_lighthouse --min_replicas 2 --bind 127.0.0.1:29510 --heartbeat_timeout_ms 1000 &
    marduk agent run --replica g1 --devices g1-d0 --preload torch,torchft -- \\
        python examples/torchft_ddp.py --lighthouse http://127.0.0.1:29510

Each group trains on its own data (seeded by its replica id); torchft averages the gradients
across the groups in the quorum, so every group holds the same weights after each committed
step. A restart command for a group (a device failure) ends its trainer at once; the agent
starts it again; it rejoins the quorum and heals from a peer (weights, optimizer, step), no
checkpoint read. The lighthouse's timers are ``agent.torchft.LIGHTHOUSE_FLAGS`` (its docstring
says why): the healthy groups wait about 1 s for the next quorum instead of the 5 s of the
defaults. Per committed step it prints ``step S committed weights HASH loss L``, and
``healed from step A to step B`` when healing moved it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
from torch import nn, optim
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo
from torchft import Optimizer as OptimizerWrapper

from agent import torchft as marduk_ft


def weights_hash(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:12]


def average_gradients(manager: Manager, model: nn.Module) -> None:
    """Average the gradients across the groups in the quorum (what torchft's DDP wrapper does;
    its 0.2.0 comm hook fails on a step the Manager was told to abandon).

    No Work outlives this call: torchft 0.2.0's abort (``ProcessGroupWrapper.abort``, what
    Marduk's Guard calls on a peer's failure) closes gloo's connections only when the last
    reference to the process group's context goes, and a Work holds one, done or failed. A
    trainer that kept the last step's Works (a loop variable) kept its connections open while
    it waited for the next quorum, and a peer still waiting on it in a collective of that step
    waited until torchft's timeout (docs/benchmarks.md, "torchft")."""
    works = [manager.allreduce(p.grad) for p in model.parameters()]
    for work in works:
        work.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lighthouse", default=os.environ.get("TORCHFT_LIGHTHOUSE"))
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (demos)")
    p.add_argument("--min-replicas", type=int, default=1, help="groups a step needs to commit")
    p.add_argument("--timeout", type=float, default=10.0, help="torchft's collective timeout (s)")
    args = p.parse_args()
    if not args.lighthouse:
        print("no lighthouse: pass --lighthouse or set TORCHFT_LIGHTHOUSE", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    replica = marduk_ft.replica_id()
    seed = int(hashlib.sha256(replica.encode()).hexdigest()[:8], 16)

    torch.manual_seed(0)  # every group starts from the same weights
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    inner = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def load_state_dict(state: dict[str, Any]) -> None:
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    # One process per group: its own store (torchrun's agent would start it for several).
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.timeout))
    manager = Manager(
        pg=pg,
        min_replica_size=args.min_replicas,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=replica,
        lighthouse_addr=args.lighthouse,
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        hostname="127.0.0.1",
        timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=60),
    )
    guard = marduk_ft.attach(manager, pg)  # registers this group; a command ends this process
    optimizer = OptimizerWrapper(manager, inner)
    print(f"group {replica} pid {os.getpid()} joining at step {manager.current_step()}", flush=True)

    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))
    last = manager.current_step()
    while manager.current_step() < args.steps:
        x = torch.randn(32, 16, generator=gen)
        y = torch.sin(x @ target)
        optimizer.zero_grad()  # starts the quorum (heals here when behind)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        average_gradients(manager, model)
        optimizer.step()  # commits only if every group's step went well
        step = manager.current_step()
        if step != last:
            if step != last + 1:
                print(f"healed from step {last} to step {step - 1}", flush=True)
            print(
                f"step {step} committed weights {weights_hash(model)} loss {loss.item():.5f} "
                f"groups {manager.num_participants()} t {time.time():.3f}",
                flush=True,
            )
            last = step
        guard.step()
        if args.step_seconds:
            time.sleep(args.step_seconds)
    manager.shutdown(wait=False)
    print(f"finished {args.steps} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
