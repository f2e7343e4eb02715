"""A real JAX training loop for Marduk's end-to-end tests and demos.

A small MLP fitted to synthetic data from a fixed seed, data parallel over every local device
jax has (CPU works; several CPU devices with XLA_FLAGS=--xla_force_host_platform_device_count=N,
where N divides the batch of 256). It logs
``step N loss X``, checkpoints every ``--ckpt-every`` steps and on SIGTERM (the grace period
``marduk agent run`` gives before a restart or on preemption), and resumes from the latest
checkpoint at start, so a restarted trainer continues where it left off. It uses JAX's
persistent compilation cache (``--compile-cache-dir``, default beside the checkpoints), so a
restarted trainer loads its step function instead of compiling it again, and it logs what its
restart cost it: ``restore X ms, first step Y ms``. With ``--events DIR`` it also appends one JSON
line per moment of its life (entered main, restore, each step, each checkpoint, SIGTERM) with
its wall time to ``DIR/JOB-REPLICA-WORKER.jsonl``: bench/bench_goodput.py measures from them.

    marduk agent run --replica r1 --devices d1 -- python examples/jax_trainer.py --steps 200
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from agent.channel.handoff import Handoff


def init_params(key: jax.Array, sizes: list[int]) -> list[tuple[jax.Array, jax.Array]]:
    params = []
    for n_in, n_out in itertools.pairwise(sizes):
        key, sub = jax.random.split(key)
        params.append((jax.random.normal(sub, (n_in, n_out)) / jnp.sqrt(n_in), jnp.zeros(n_out)))
    return params


def forward(params: list[tuple[jax.Array, jax.Array]], x: jax.Array) -> jax.Array:
    for w, b in params[:-1]:
        x = jnp.tanh(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def loss_fn(params: list[tuple[jax.Array, jax.Array]], x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((forward(params, x) - y) ** 2)


def live_params(client, args, lr: float, log_every: int) -> tuple[float, int, int]:  # type: ignore[no-untyped-def]
    """``lr`` and ``log_every`` from the job's live parameters (the command line's when unset);
    a value the loop cannot use is refused, with why, and the one in force kept."""
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


@jax.jit
def train_step(params, x, y, lr):  # type: ignore[no-untyped-def]
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
    return params, loss


class Timeline:
    """``--events DIR``: ``timeline("step", step=5)`` appends ``{"ev": "step", "t": <wall time>,
    "pid": ..., "step": 5}`` to DIR/WHO.jsonl, one line per call (off without --events)."""

    def __init__(self, events_dir: str | None, who: str) -> None:
        self.file = None
        if events_dir:
            Path(events_dir).mkdir(parents=True, exist_ok=True)
            # Line-buffered and appending: every incarnation adds whole lines to one file.
            self.file = open(Path(events_dir) / f"{who}.jsonl", "a", buffering=1)  # noqa: SIM115

    def __call__(self, ev: str, **fields: object) -> None:
        if self.file is not None:
            line = {"ev": ev, "t": time.time(), "pid": os.getpid(), **fields}
            self.file.write(json.dumps(line) + "\n")


def save(
    ckpt_dir: Path,
    step: int,
    params: list[tuple[jax.Array, jax.Array]],
    timeline: Timeline | None = None,
) -> None:
    t0 = time.time()
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    flat = {f"p{i}": np.asarray(a) for i, a in enumerate(jax.tree_util.tree_leaves(params))}
    tmp = ckpt_dir / f".ckpt-{step}.npz"
    np.savez(tmp, step=step, **flat)
    tmp.rename(ckpt_dir / f"ckpt-{step:08d}.npz")  # atomic: a crash never leaves half a file
    if timeline is not None:
        timeline("saved", step=step, t0=t0)


def restore(ckpt_dir: Path, params):  # type: ignore[no-untyped-def]
    ckpts = sorted(ckpt_dir.glob("ckpt-*.npz"))
    if not ckpts:
        return 0, params
    data = np.load(ckpts[-1])
    leaves, treedef = jax.tree_util.tree_flatten(params)
    restored = [jnp.asarray(data[f"p{i}"]) for i in range(len(leaves))]
    return int(data["step"]), jax.tree_util.tree_unflatten(treedef, restored)


def main() -> int:
    p = argparse.ArgumentParser(description="JAX example trainer")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (demos)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=1, help="print the loss every N steps")
    p.add_argument("--events", default=None, help="append timed JSON events to DIR/WHO.jsonl")
    p.add_argument(
        "--compile-cache-dir",
        default=None,
        help="JAX's persistent compilation cache (default: CKPT_DIR/jax-cache; 'none': off)",
    )
    args = p.parse_args()
    given = Handoff.from_env()  # what `marduk agent run` tells its trainer (MARDUK_*)
    who = f"{given.job or 'default'}-{given.replica or 'solo'}-{given.worker or 0}"
    ckpt_root = Path(args.ckpt_dir or os.environ.get("MARDUK_CKPT_DIR", ".marduk/ckpt"))
    ckpt_dir = ckpt_root / who
    timeline = Timeline(args.events, who)
    timeline("begin")  # imports done (a trainer forked from a fork server has them already)
    cache = args.compile_cache_dir or str(ckpt_root / "jax-cache")
    if cache != "none":
        # Cache every program, however small and fast to compile (the defaults skip programs
        # compiled in under a second, which is all of this one on CPU): a restart then loads
        # the step function instead of compiling it again. Workers may share the directory.
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

    key = jax.random.PRNGKey(0)  # fixed seed: every incarnation sees the same data
    kx, kw, kp = jax.random.split(key, 3)
    x = jax.random.normal(kx, (256, 8))
    y = jnp.sin(x @ jax.random.normal(kw, (8, 1)))
    params = init_params(kp, [8, 32, 1])
    t_restore = time.perf_counter()
    timeline("restore")
    start, params = restore(ckpt_dir, params)
    # Data parallel over every local device: the batch is split along the mesh's "data" axis,
    # the parameters are replicated; jit inserts the gradient all-reduce.
    devices = jax.local_devices()
    mesh = Mesh(np.array(devices), ("data",))
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    y = jax.device_put(y, NamedSharding(mesh, P("data")))
    params = jax.device_put(params, NamedSharding(mesh, P()))
    jax.block_until_ready(params)
    restore_ms = (time.perf_counter() - t_restore) * 1000
    timeline("restored", step=start)
    print(
        f"{who}: {len(devices)} device(s) {devices[0].platform}, "
        f"epoch {given.epoch}, resuming at step {start}",
        flush=True,
    )

    state = {"step": start, "params": params}

    def on_sigterm(*_: object) -> None:
        timeline("sigterm")
        save(ckpt_dir, state["step"], state["params"], timeline)
        print(f"checkpointed step {state['step']} on SIGTERM", flush=True)
        timeline("exit")
        # Not sys.exit: its SystemExit is raised wherever the main thread is, and a bare
        # `except:` there (jax's compile path has some) swallows it: seen in a first step, the
        # trainer then trained on through the whole grace period until SIGKILL.
        os._exit(0)

    signal.signal(signal.SIGTERM, on_sigterm)
    # Under `marduk agent run`, the library talks to the agent: a preemption notice arrives as
    # a checkpoint request, saved at the next step while training goes on.
    client = None
    if given.supervised:
        import agent

        client = agent.connect()
    # Live parameters (`marduk monitor set JOB lr=0.01 log_every=10`): read at each step
    # boundary, applied from this step on, acknowledged; a restarted trainer starts with them.
    lr, log_every, applied = args.lr, args.log_every, 0
    for step in range(start + 1, args.steps + 1):
        if client is not None and client.params.version != applied:
            lr, log_every, applied = live_params(client, args, lr, log_every)
        t_step = time.perf_counter()
        params, loss = train_step(params, x, y, lr)
        state["step"], state["params"] = step, params
        if step % log_every == 0:
            print(f"step {step} loss {float(loss):.6f}", flush=True)
        timeline("step", step=step)
        if step == start + 1:  # compiled, or loaded from the compilation cache
            first_ms = (time.perf_counter() - t_step) * 1000
            print(f"restore {restore_ms:.1f} ms, first step {first_ms:.1f} ms", flush=True)
        if step % args.ckpt_every == 0:
            save(ckpt_dir, step, params, timeline)
        if client is not None:
            client.step(step)
            if client.checkpoint_requested:
                save(ckpt_dir, step, params, timeline)
                print(f"checkpoint saved at step {step} on request", flush=True)
                client.checkpoint_saved(step)
        if args.step_seconds:
            time.sleep(args.step_seconds)
    save(ckpt_dir, args.steps, params)
    print(f"finished {args.steps} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
