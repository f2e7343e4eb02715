"""A multi-process JAX trainer: one global mesh over every process (``jax.distributed``).

Each process runs under its own ``marduk agent run --scope job --nnodes N --node-rank I``; the
agent hands it torchrun's variables, and ``agent.jax.initialize()`` turns them into
``jax.distributed.initialize(MASTER_ADDR:MASTER_PORT, WORLD_SIZE, RANK)``. On CPU it runs with
gloo collectives and ``XLA_FLAGS=--xla_force_host_platform_device_count=2`` (2 devices a
process)::

    for i in 0 1; do
      XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \\
      marduk agent run --job mesh --replica r0 --worker $i --scope job --devices mesh-d$i \\
        --nnodes 2 --node-rank $i --master-addr 127.0.0.1 --master-port 29600 \\
        -- python examples/jax_distributed_trainer.py &
    done

The mesh is (data: one row per process, model: the devices of a process). A two-layer MLP's
hidden dimension is sharded over ``model`` (the train state is split across devices), the batch
over ``data``; jit inserts the collectives. Every step prints ``step N loss X sum Y`` (the loss
and the parameters' sum are global values: every process prints the same).

Checkpoints (``--ckpt-dir``, default ``$MARDUK_CKPT_DIR/JOB``): every ``--ckpt-every`` steps the
state is gathered to every process and process 0 writes ``ckpt-<step>.npz`` (numpy: ``step``
and the full, unsharded arrays ``p0``, ``p1``, ...; written to a temporary name, then renamed,
so a reader never sees half a file). At start, process 0 picks the latest checkpoint and passes
its step to the others: every process restores the same one, whatever an old incarnation wrote
meanwhile. Full arrays restore onto any process count.

Stops: a restart (a device failure, another rank's crash) ends the process at once when the
agent says so (``agent.jax.exit_on_restart``): the mesh is broken and the next incarnation
restores the last checkpoint; a collective that fails because a peer died waits a moment for
that restart rather than exiting 1 (a crash of its own would count against this node's budget).
A preemption (SIGTERM to the agent: the grace period) goes
through JAX's preemption service: every process reaches the same sync step, saves there and
exits 143. The controller's ``checkpoint`` command (a preemption notice) is agreed on across
processes at the next step; everyone saves that step and trains on.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

if TYPE_CHECKING:
    from agent.channel.handoff import Handoff

PREEMPTED_EXIT = 143  # saved at JAX's preemption sync point (SIGTERM) and exited
PEER_LOSS_WAIT_S = 3.0  # after a failed collective: how long to wait for the agent's restart

# The train state: (w1, b1, w2, b2) and how each is sharded over the mesh.
SPECS = (P(None, "model"), P("model"), P("model", None), P())


def init_state(hidden: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)  # a fixed seed: every process makes the same state
    return [
        (rng.standard_normal((8, hidden)) / np.sqrt(8)).astype(np.float32),
        np.zeros(hidden, np.float32),
        (rng.standard_normal((hidden, 1)) / np.sqrt(hidden)).astype(np.float32),
        np.zeros(1, np.float32),
    ]


def batch(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, 8)).astype(np.float32)
    y = np.sin(x @ rng.standard_normal((8, 1))).astype(np.float32)
    return x, y


def loss_fn(params, x, y):  # type: ignore[no-untyped-def]
    w1, b1, w2, b2 = params
    h = jnp.tanh(x @ w1 + b1)
    return jnp.mean((h @ w2 + b2 - y) ** 2)


def global_array(mesh: Mesh, spec: P, value: np.ndarray) -> jax.Array:
    """A global array from a value every process holds whole (each places its own shards)."""
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def latest(ckpt_dir: Path) -> int:
    steps = [int(p.stem.split("-")[1]) for p in ckpt_dir.glob("ckpt-*.npz")]
    return max(steps, default=0)


def save(ckpt_dir: Path, step: int, params: list[jax.Array]) -> None:
    """Gather the state (a collective: every process calls this); process 0 writes it."""
    full = [np.asarray(a) for a in multihost_utils.process_allgather(params, tiled=True)]
    if jax.process_index() != 0:
        return
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir / f".ckpt-{step}-{os.getpid()}.npz"
    np.savez(tmp, step=step, **{f"p{i}": a for i, a in enumerate(full)})
    tmp.rename(ckpt_dir / f"ckpt-{step:08d}.npz")  # atomic


def agree_on_start(ckpt_dir: Path) -> int:
    """The checkpoint step every process restores: process 0's latest, whatever an old
    incarnation wrote meanwhile. Passed through the coordination service's key-value store
    (a private handle of jax's) rather than ``multihost_utils.broadcast_one_to_all``, which is
    an XLA program: one more compile in every restart."""
    from jax._src import distributed

    kv = distributed.global_state.client
    if kv is None:
        return latest(ckpt_dir)
    if jax.process_index() == 0:
        kv.key_value_set("marduk/start_step", str(latest(ckpt_dir)))
    return int(kv.blocking_key_value_get("marduk/start_step", 300_000))


def executable(jitted, args, cache: Path):  # type: ignore[no-untyped-def]
    """``jitted`` compiled for ``args``, loaded from this process's own cache when it is there.

    JAX's persistent compilation cache serves only process 0 here: on CPU its key hashes a
    topology fingerprint that differs per process, and only process 0 writes it, so every
    other process compiled the step again after every restart (0.5-1.5 s on this machine, the
    largest part of a restart). Each process keeps its own serialized executable instead
    (``jax.experimental.serialize_executable``), keyed by the lowered program, its process
    index and jax's version. Loading one runs its code: keep the directory as private as the
    checkpoints."""
    import hashlib
    import pickle

    from jax.experimental import serialize_executable

    lowered = jitted.lower(*args)
    key = hashlib.sha256(
        f"{jax.__version__} {jax.process_index()} {os.environ.get('XLA_FLAGS', '')}\n".encode()
        + lowered.as_text().encode()
    ).hexdigest()[:24]
    path = cache / f"step-{jax.process_index()}-{key}.pkl"
    if path.exists():
        with open(path, "rb") as f:
            payload, in_tree, out_tree = pickle.load(f)
        return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    compiled = lowered.compile()
    cache.mkdir(parents=True, exist_ok=True)
    tmp = cache / f".{path.name}.{os.getpid()}"
    with open(tmp, "wb") as f:
        pickle.dump(serialize_executable.serialize(compiled), f)
    tmp.rename(path)  # atomic, as the checkpoints
    return compiled


def restore(ckpt_dir: Path, step: int, hidden: int) -> list[np.ndarray]:
    if step == 0:
        return init_state(hidden)
    with np.load(ckpt_dir / f"ckpt-{step:08d}.npz") as data:
        return [data[f"p{i}"] for i in range(len(SPECS))]


def main() -> int:
    p = argparse.ArgumentParser(description="multi-process JAX example trainer")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (demos)")
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument(
        "--executable-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep each process's compiled step under CKPT_DIR/executables (see executable())",
    )
    args = p.parse_args()
    t_begin = time.time()
    # (Marduk's library is imported here, not at the top: tests/trainers/jax_sync_point.py
    # reuses this module's model and checkpoints as a trainer with no Marduk code at all.)
    import agent
    import agent.jax
    from agent.channel.handoff import Handoff

    given = Handoff.from_env()
    ckpt_dir = Path(
        args.ckpt_dir
        or os.path.join(os.environ.get("MARDUK_CKPT_DIR", ".marduk/ckpt"), given.job or "default")
    )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_compilation_cache_dir", str(ckpt_dir / "jax-cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

    # The library first: a restart ordered while jax.distributed.initialize waits for its peers
    # ends this process at once (JAX's preemption service, installed by initialize, swallows
    # the agent's SIGTERM from then on).
    client = agent.connect(on_command=agent.jax.exit_on_restart) if given.supervised else None
    t_connect = time.time()
    try:
        return train(args, given, ckpt_dir, client, t_begin, t_connect)
    except Exception:
        # A collective failed: a peer is gone ("Gloo all-reduce failed ... Connection closed
        # by peer"). Never a normal exit: it runs jax.distributed.shutdown(), a barrier with the
        # dead peer that waits up to its shutdown timeout (300 s) while JAX's preemption
        # service swallows the agent's SIGTERM. Under the agent, wait a moment for the restart
        # the controller is ordering (exit_on_restart ends the process): exiting 1 at once would
        # be reported as a crash of this node too and count against its restart budget.
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        if client is not None:
            client.wait(PEER_LOSS_WAIT_S)
        os._exit(1)


def train(  # type: ignore[no-untyped-def]
    args, given: Handoff, ckpt_dir: Path, client, t_begin: float, t_connect: float
) -> int:
    import agent.jax

    where = agent.jax.initialize()
    me = where.process_id
    t_init = time.time()

    devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
    mesh = Mesh(devices, ("data", "model"))
    start = agree_on_start(ckpt_dir)
    params = [
        global_array(mesh, s, v)
        for s, v in zip(SPECS, restore(ckpt_dir, start, args.hidden), strict=True)
    ]
    x_np, y_np = batch(64 * jax.process_count())
    x, y = global_array(mesh, P("data"), x_np), global_array(mesh, P("data"), y_np)
    out = NamedSharding(mesh, P())

    # One program a step (each is compiled again after a restart, see docs/benchmarks.md):
    # the update, the values every process prints, and the agreement on the controller's
    # checkpoint request (``flags``: each device's process asked -> every process saves).
    @jax.jit
    def train_step(params, x, y, flags):  # type: ignore[no-untyped-def]
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        params = [w - args.lr * g for w, g in zip(params, grads, strict=True)]
        total = jax.lax.with_sharding_constraint(sum(jnp.sum(w) for w in params), out)
        return params, loss, total, jax.lax.with_sharding_constraint(jnp.max(flags), out)

    print(
        f"process {me}/{jax.process_count()}: {jax.device_count()} devices, mesh "
        f"{dict(mesh.shape)}, coordinator {where.coordinator_address}, epoch {given.epoch}, "
        f"resuming at step {start}",
        flush=True,
    )
    t_restored = time.time()
    flags_spec = P(("data", "model"))
    step_fn = train_step
    if args.executable_cache:
        no_flags = global_array(mesh, flags_spec, np.zeros(jax.device_count(), np.int32))
        step_fn = executable(train_step, (params, x, y, no_flags), ckpt_dir / "executables")
    asked = False
    for step in range(start + 1, args.steps + 1):
        flags = global_array(mesh, flags_spec, np.full(jax.device_count(), int(asked), np.int32))
        params, loss, total, anyone = step_fn(params, x, y, flags)
        print(f"step {step} loss {float(loss):.6f} sum {float(total):.6f}", flush=True)
        if step == start + 1:
            # ("distributed init", not jax's function name: the agent's failure signatures read
            # "jax.distributed" in a crashed trainer's last lines as an initialisation failure.)
            print(
                f"first step {time.time() - t_begin:.2f}s after main: library "
                f"{t_connect - t_begin:.2f}s, distributed init "
                f"{t_init - t_connect:.2f}s, mesh and restore {t_restored - t_init:.2f}s, "
                f"first step {time.time() - t_restored:.2f}s",
                flush=True,
            )
        if multihost_utils.reached_preemption_sync_point(step):
            save(ckpt_dir, step, params)
            print(f"checkpointed step {step} at the preemption sync point", flush=True)
            os._exit(PREEMPTED_EXIT)  # no jax.distributed.shutdown: the peers are leaving too
        if int(anyone):
            save(ckpt_dir, step, params)
            print(f"checkpoint saved at step {step} on request", flush=True)
            if asked and client is not None:
                client.checkpoint_saved(step)
        elif step % args.ckpt_every == 0:
            save(ckpt_dir, step, params)
        asked = client is not None and client.checkpoint_requested  # (seen at the next step)
        if client is not None:
            client.step(step)
        if args.step_seconds:
            time.sleep(args.step_seconds)
    jax.distributed.shutdown()
    print(f"finished {args.steps} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
