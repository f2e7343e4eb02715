"""Real processes for end-to-end tests: output collection, the controller, the CLI."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from tests.conftest import ROOT, marduk_cli


class Proc:
    """A child process whose output lines are collected by a thread.

    Every Proc is stopped when its test ends, however it ended (``reap_all``, from conftest).
    """

    live: set[Proc] = set()

    def __init__(self, args: list[str], env: dict[str, str]) -> None:

        self.proc = subprocess.Popen(
            args,
            cwd=ROOT,
            env={**os.environ, **env},
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        Proc.live.add(self)
        self.lines: queue.Queue[str] = queue.Queue()
        self.all: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.all.append(line)
            self.lines.put(line)

    def expect(self, text: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                continue
            if text in line:
                return line
        raise AssertionError(f"{text!r} not seen; output so far:\n{''.join(self.all)}")

    @classmethod
    def reap_all(cls) -> None:
        for p in list(cls.live):
            p.stop()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        Proc.live.discard(self)
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def controller(env: dict[str, str]) -> Proc:
    p = Proc([sys.executable, "-m", "marduk", "controller"], env)
    p.expect("serving prefix")
    return p


def external_controller(env: dict[str, str], state_dir: str) -> Proc:
    """``marduk controller`` against the NATS at MARDUK_ADDR (no embedded server), so that
    several run side by side (one leads, the others stand by) and one can die alone."""
    return Proc(
        [sys.executable, "-m", "marduk", "controller", "--no-embedded", "--state-dir", state_dir],
        env,
    )


def trainer(env: dict[str, str], replica: str, devices: str) -> Proc:
    p = Proc(
        [
            sys.executable,
            "examples/demo_trainer.py",
            "--replica",
            replica,
            "--devices",
            devices,
            "--step-seconds",
            "0.05",
        ],
        env,
    )
    p.expect(f"[{replica}] registered")
    return p


def status(env: dict[str, str]) -> dict:  # type: ignore[type-arg]
    r = marduk_cli("monitor", "status", "--json", env=env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def inject(env: dict[str, str], device: str) -> str:
    r = marduk_cli("monitor", "inject-failure", device, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


def agent_run(env: dict[str, str], *options: str, cmd: list[str]) -> Proc:
    """``marduk agent run OPTIONS -- CMD`` as a collected child process."""
    return Proc([sys.executable, "-m", "marduk", "agent", "run", *options, "--", *cmd], env)


def commands_seen(p: Proc) -> list[str]:
    """The demo trainer's COMMAND lines so far, as "epoch=N devices=..."."""
    return [
        " ".join(line.split("COMMAND restart ")[1].split()[:2])
        for line in p.all
        if "COMMAND restart " in line
    ]
