"""The JAX example under ``marduk agent run``: a device failure restarts exactly the right
trainer, which resumes from its checkpoint (the step continues, the loss stays sane)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.test_e2e_acceptance import Proc, controller, inject

pytestmark = pytest.mark.e2e


def jax_agent(env: dict[str, str], replica: str, devices: str) -> Proc:
    return Proc(
        [
            sys.executable,
            "-m",
            "marduk",
            "agent",
            "run",
            "--replica",
            replica,
            "--devices",
            devices,
            "--grace",
            "10",
            "--startup-timeout",
            "120",
            "--",
            sys.executable,
            "examples/jax_trainer.py",
            "--steps",
            "100000",
            "--ckpt-every",
            "5",
            "--step-seconds",
            "0.05",
        ],
        env,
    )


def last_step(p: Proc) -> int:
    steps = [int(m.group(1)) for line in p.all if (m := re.match(r"step (\d+) loss", line))]
    return steps[-1] if steps else 0


def test_device_failure_restarts_one_jax_trainer_which_resumes(tmp_path: Path) -> None:
    env = {
        "MARDUK_ADDR": f"nats://127.0.0.1:{free_port()}",
        "MARDUK_STATE_DIR": str(tmp_path / "state"),
        "MARDUK_CKPT_DIR": str(tmp_path / "ckpt"),
        "JAX_PLATFORMS": "cpu",
        "PYTHONUNBUFFERED": "1",
    }
    ctl = controller(env)
    r1 = jax_agent(env, "r1", "d1,d2")
    r2 = jax_agent(env, "r2", "d3")
    try:
        r1.expect("step 12 loss", timeout=90)
        r2.expect("step 12 loss", timeout=90)
        first_loss = float(next(ln for ln in r1.all if ln.startswith("step 1 loss")).split()[-1])
        inject(env, "d2")
        line = r1.expect("checkpointed step", timeout=30)
        saved = int(line.split()[2])
        resumed = r1.expect("resuming at step", timeout=90)
        assert "epoch 1" in resumed
        assert int(resumed.split()[-1]) == saved >= 12
        r1.expect(f"step {saved + 3} loss", timeout=90)
        losses = [float(ln.split()[-1]) for ln in r1.all if ln.startswith(f"step {saved + 1} loss")]
        assert losses and losses[0] < first_loss  # continued training, not from scratch
        time.sleep(1)
        assert sum("resuming at step" in ln for ln in r2.all) == 1  # r2 never restarted
        assert last_step(r2) > 12
    finally:
        r1.stop()
        r2.stop()
        ctl.stop()
