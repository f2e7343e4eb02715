"""A ``jax.distributed`` trainer with no Marduk code in it, stopping as JAX trainers do.

What MaxText, AXLearn and Orbax's checkpoint manager do with SIGTERM once ``jax.distributed``
runs: JAX's preemption service catches the signal, every step asks
``multihost_utils.reached_preemption_sync_point(step)``, and when it says so the trainer saves
and exits. It reads torchrun's variables and calls ``jax.distributed.initialize`` itself (no
``agent`` import, no wait for the coordinator); a failed collective (a peer died) propagates,
so Python's exit runs JAX's ``shutdown`` barrier with the dead peer while the preemption
service swallows SIGTERM: only SIGKILL ends it then. The model, checkpoints and per-process
executable cache are examples/jax_distributed_trainer.py's (loaded by path; that module imports
Marduk's library only in its own ``main``), and so are its output lines, which tests/jax_mesh.py
reads. ``--save-seconds``: the save at the sync point takes that much longer (a large state).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "jax_distributed_trainer.py"
PREEMPTED_EXIT = 143


def load_example():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("jax_distributed_trainer", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--step-seconds", type=float, default=0.0)
    p.add_argument("--save-seconds", type=float, default=0.0)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    args = p.parse_args()
    ex = load_example()
    ckpt_dir = Path(os.environ.get("MARDUK_CKPT_DIR", ".ckpt"))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")

    env = os.environ
    coordinator = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    jax.distributed.initialize(coordinator, int(env["WORLD_SIZE"]), int(env["RANK"]))
    devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
    mesh = Mesh(devices, ("data", "model"))
    start = ex.agree_on_start(ckpt_dir)
    state = ex.restore(ckpt_dir, start, args.hidden)
    params = [ex.global_array(mesh, s, v) for s, v in zip(ex.SPECS, state, strict=True)]
    x_np, y_np = ex.batch(64 * jax.process_count())
    x, y = ex.global_array(mesh, P("data"), x_np), ex.global_array(mesh, P("data"), y_np)
    out = NamedSharding(mesh, P())

    @jax.jit
    def train_step(params, x, y):  # type: ignore[no-untyped-def]
        loss, grads = jax.value_and_grad(ex.loss_fn)(params, x, y)
        params = [w - args.lr * g for w, g in zip(params, grads, strict=True)]
        return params, loss, jax.lax.with_sharding_constraint(sum(jnp.sum(w) for w in params), out)

    # The epoch only labels the output (tests/jax_mesh.py groups lines by it): nothing else of
    # Marduk's hand-off is read.
    print(
        f"process {jax.process_index()}/{jax.process_count()}: coordinator {coordinator}, "
        f"epoch {env.get('MARDUK_EPOCH', '0')}, resuming at step {start}",
        flush=True,
    )
    step_fn = ex.executable(train_step, (params, x, y), ckpt_dir / "executables")
    for step in range(start + 1, args.steps + 1):
        params, loss, total = step_fn(params, x, y)
        print(f"step {step} loss {float(loss):.6f} sum {float(total):.6f}", flush=True)
        if multihost_utils.reached_preemption_sync_point(step):
            ex.save(ckpt_dir, step, params)
            time.sleep(args.save_seconds)
            print(f"checkpointed step {step} at the preemption sync point", flush=True)
            os._exit(PREEMPTED_EXIT)  # no jax.distributed.shutdown: every peer is leaving too
        if step % args.ckpt_every == 0:
            ex.save(ckpt_dir, step, params)
        time.sleep(args.step_seconds)


if __name__ == "__main__":
    main()
