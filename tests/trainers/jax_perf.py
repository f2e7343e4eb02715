"""A ``jax.distributed`` trainer that marks its per-rank compute for the straggler detector.

Every step: ``compute`` (the rank's own work, outside any collective: 20 ms here), then the
mesh's jitted step (the collectives: every process waits for the slowest there, so its step
time is everyone's). A rank on the device ``SLOW_DEVICE`` (one of its MARDUK_DEVICES) computes
1.5x longer while the file ``SLOW_FLAG`` exists (a throttling device, mid-run). The model and
the output lines are examples/jax_distributed_trainer.py's (tests/jax_mesh.py reads them)."""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jax_sync_point import load_example  # this folder: the script's own (sys.path[0])

import agent
import agent.jax


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--ckpt-every", type=int, default=0, help="(taken, unused: no checkpoints)")
    p.add_argument("--step-seconds", type=float, default=0.02, help="the compute section")
    args = p.parse_args()
    ex = load_example()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    client = agent.connect(on_command=agent.jax.exit_on_restart)
    where = agent.jax.initialize()
    devices = np.array(jax.devices()).reshape(jax.process_count(), jax.local_device_count())
    mesh = Mesh(devices, ("data", "model"))
    params = [ex.global_array(mesh, s, v) for s, v in zip(ex.SPECS, ex.init_state(32), strict=True)]
    x_np, y_np = ex.batch(64 * jax.process_count())
    x, y = ex.global_array(mesh, P("data"), x_np), ex.global_array(mesh, P("data"), y_np)

    @jax.jit
    def train_step(params, x, y):  # type: ignore[no-untyped-def]
        loss, grads = jax.value_and_grad(ex.loss_fn)(params, x, y)
        return [w - 0.05 * g for w, g in zip(params, grads, strict=True)], loss

    print(
        f"process {where.process_id}/{jax.process_count()}: coordinator "
        f"{where.coordinator_address}, epoch {os.environ.get('MARDUK_EPOCH', '0')}, "
        "resuming at step 0",
        flush=True,
    )
    flag = os.environ.get("SLOW_FLAG", "")
    mine = os.environ.get("SLOW_DEVICE", "-") in os.environ.get("MARDUK_DEVICES", "").split(",")
    for step in range(1, args.steps + 1):
        slow = mine and flag and os.path.exists(flag)
        with client.section("compute"):
            time.sleep(args.step_seconds * (1.5 if slow else 1.0))
        params, loss = train_step(params, x, y)
        print(f"step {step} loss {float(loss):.6f} sum 0", flush=True)  # waits for the mesh
        client.step(step)


if __name__ == "__main__":
    main()
