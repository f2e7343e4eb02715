"""The trivial worker every contender in bench_restart.py runs (torch + a gloo group, or jax).

Records, as JSON lines in $BENCH_DIR/events-<rank>.jsonl: ``start`` (the first statement of the
process: the trainer is running; ``by`` says how Marduk started it: zygote, standby (a
prestarted trainer) or cold), ``ready`` (first step done: imports, backend and rendezvous
included) and ``crash`` (rank 0 exits 1 when $BENCH_DIR/crash-<incarnation> appears).
BENCH_INC=faults: the incarnation is the number of crash files there at the start
(bench_launch.py --nnodes, where torchrun's restart counts differ per node).

BENCH_FRAMEWORK=jax: import jax and run one jitted step instead (no collective: each rank is
ready on its own).
"""

import time

T_START = time.time()

import json
import os
import sys

env = os.environ
bench_dir = env["BENCH_DIR"]
if "TORCHELASTIC_RUN_ID" in env:  # torchrun
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    inc = int(env["TORCHELASTIC_RESTART_COUNT"])
    init, key = "env://", ""
elif "BENCH_PLAIN" in env:  # the plain supervisor
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    inc = int(env["BENCH_INCARNATION"])
    init, key = "store", f"inc-{inc}"
else:  # marduk agent run: replicas r0..rN-1 x workers
    replica, worker = int(env["MARDUK_REPLICA_ID"][1:]), int(env["MARDUK_WORKER"])
    per = int(env["BENCH_WORKERS_PER_REPLICA"])
    rank, world = replica * per + worker, int(env["BENCH_WORLD"])
    inc = int(env["MARDUK_RESTART_COUNT"])
    init, key = "store", f"epoch-{env['MARDUK_EPOCH']}"

if env.get("BENCH_INC") == "faults":
    # Across nodes torchrun counts restarts per node (a node restarted for another's failure
    # keeps its count): the incarnation is the number of faults injected before this start.
    inc = sum(1 for name in os.listdir(bench_dir) if name.startswith("crash-"))

log_path = os.path.join(bench_dir, f"events-{rank}.jsonl")


def log(ev: str, t: float, **extra: object) -> None:
    with open(log_path, "a") as f:
        f.write(json.dumps({"ev": ev, "t": t, "rank": rank, "inc": inc, **extra}) + "\n")


log("start", T_START, by=env.get("MARDUK_WARM_START", "cold"))
if env.get("BENCH_FRAMEWORK") == "jax":
    import jax
    import jax.numpy as jnp

    jax.jit(lambda x: x @ x)(jnp.ones((64, 64))).block_until_ready()
else:
    import torch
    import torch.distributed as dist

    if init == "store":
        # Rendezvous through a long-lived store (as torchrun's agent hosts one), keyed by epoch
        # (Marduk) or incarnation (plain).
        from datetime import timedelta

        store = dist.TCPStore(
            "127.0.0.1",
            int(env["BENCH_STORE_PORT"]),
            world,
            is_master=False,
            timeout=timedelta(seconds=120),
        )
        prefixed = dist.PrefixStore(key, store)
        dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world)
    else:
        dist.init_process_group("gloo", init_method=init)
    t = torch.ones(1)
    dist.all_reduce(t)  # the first step: every rank is in the group
log("ready", time.time())
step = 0
while True:
    step += 1
    print(f"step {step}", flush=True)
    if rank == 0 and os.path.exists(os.path.join(bench_dir, f"crash-{inc}")):
        log("crash", time.time())
        sys.stdout.flush()
        os._exit(1)
    time.sleep(0.02)
