"""``agent.jax``: jax.distributed's arguments from torchrun's variables, the wait for the
coordinator, and the exit on a restart (real sockets and processes)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from agent.jax import RESTART_EXIT_CODE, Distributed, distributed_args, wait_for_coordinator
from tests.conftest import ROOT
from tests.ports import free_port


def test_arguments_come_from_torchruns_variables() -> None:
    env = {"MASTER_ADDR": "h0", "MASTER_PORT": "29603", "RANK": "2", "WORLD_SIZE": "3"}
    assert distributed_args(env) == Distributed("h0:29603", 3, 2)
    assert distributed_args({**env, "MASTER_ADDR": "::1"}).coordinator_address == "[::1]:29603"
    with pytest.raises(ValueError, match="MASTER_PORT, RANK not set"):
        distributed_args({"MASTER_ADDR": "h0", "WORLD_SIZE": "2"})


def test_waits_until_the_coordinator_listens() -> None:
    port = free_port()
    assert not wait_for_coordinator(f"127.0.0.1:{port}", timeout=0.1)
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later() -> None:
        time.sleep(0.3)
        server.bind(("127.0.0.1", port))
        server.listen()

    threading.Thread(target=listen_later).start()
    t0 = time.monotonic()
    try:
        assert wait_for_coordinator(f"127.0.0.1:{port}", timeout=10)
        assert time.monotonic() - t0 >= 0.25
    finally:
        server.close()


TRAINER = """
import time
from agent.library.command import Command
from agent.jax import exit_on_restart
def cmd(kind):
    return Command(kind=kind, epoch=4, reason="device d1 failed", devices=("d1",), job="j",
                   replica=None, scope="job", command_id="c", issued_at=0.0, received_at=0.0)
exit_on_restart(cmd("checkpoint"))
print("still training", flush=True)
exit_on_restart(cmd("{kind}"))
time.sleep(30)
"""


@pytest.mark.parametrize("kind", ["restart", "fail", "stop"])
def test_a_restart_ends_the_trainer_at_once_a_checkpoint_does_not(kind: str) -> None:
    r = subprocess.run(
        [sys.executable, "-c", TRAINER.replace("{kind}", kind)],
        capture_output=True,
        text=True,
        timeout=20,
        cwd=ROOT,
    )
    assert r.returncode == RESTART_EXIT_CODE, r.stderr
    assert r.stdout.splitlines() == [
        "still training",
        f"marduk: {kind} at epoch 4 (device d1 failed): exiting now",
    ]
