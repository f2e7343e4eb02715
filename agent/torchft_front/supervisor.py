"""``marduk torchft-lighthouse``'s process: it starts torchft's real lighthouse on loopback
(a port of its own, the short ``--heartbeat_timeout_ms``), then the front (a child process,
``agent.torchft_front.front``) on the Managers' address, and keeps a spare front waiting, its
imports done, that takes the address as soon as the front dies: the Managers reconnect to the
same address, and the new front's table is rebuilt from their next heartbeats
(``FrontConfig.rebuild_s``). The lighthouse dying ends the command (exit 1), as torchft's own
lighthouse dying ends a job's quorums: its state is the job's quorum, which only it has. Every
child dies with this process (``PR_SET_PDEATHSIG``). No grpcio here: the fronts import it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import fields
from typing import Final

from agent.torchft_front.config import FrontConfig
from marduk.transport import bus

log = logging.getLogger("marduk.torchft_front")
PR_SET_PDEATHSIG: Final = 1
RESTART_PAUSE_S: Final = (0.0, 0.5, 2.0)  # after 1, 2, 3+ deaths within a minute


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def loopback_port() -> str:
    """A free loopback address for torchft's lighthouse (it cannot hand back a port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def lighthouse_args(
    binary: list[str], cfg: FrontConfig, min_replicas: int, extra: list[str]
) -> list[str]:
    """torchft's lighthouse behind the front: at ``cfg.lighthouse`` (loopback), the short
    timeout (``inner_timeout_s``), a quorum tick below it; ``extra`` (its flags) after ours."""
    return [
        *binary,
        *("--min_replicas", str(min_replicas), "--bind", cfg.lighthouse),
        *("--heartbeat_timeout_ms", str(round(cfg.inner_timeout_s * 1000))),
        *("--quorum_tick_ms", str(max(1, round(cfg.inner_timeout_s * 1000 / 5)))),
        *extra,
    ]


def _credentials_env() -> dict[str, str]:
    """This process's NATS credentials as the front's MARDUK_* variables."""
    creds = bus.default_credentials()
    out = {}
    for f in fields(creds):
        value = getattr(creds, f.name)
        if value is not None:
            out[f"MARDUK_{f.name.upper()}"] = str(value)
    return out


class Supervisor:
    def __init__(self, cfg: FrontConfig, lighthouse: list[str]) -> None:
        self.cfg = cfg
        self.lighthouse_cmd = lighthouse
        self.stopping = threading.Event()
        self.lh: subprocess.Popen[bytes] | None = None
        self.front: subprocess.Popen[bytes] | None = None
        self.spare: subprocess.Popen[bytes] | None = None
        self.deaths: list[float] = []

    def start_lighthouse(self, timeout: float = 120.0) -> None:
        """Start it (its output goes to ours, its log level is RUST_LOG's) and wait until its
        port takes connections."""
        lh = self.lh = subprocess.Popen(self.lighthouse_cmd, preexec_fn=_die_with_parent)
        host, port = self.cfg.lighthouse.rsplit(":", 1)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if lh.poll() is not None:
                raise RuntimeError(f"torchft's lighthouse exited ({lh.returncode})")
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(
            f"torchft's lighthouse did not listen on {self.cfg.lighthouse} within {timeout:g}s"
        )

    def _spawn_front(self) -> subprocess.Popen[bytes]:
        """A front's process, its imports done, waiting for a line on its stdin to serve."""
        return subprocess.Popen(
            [sys.executable, "-m", "agent.torchft_front.front", self.cfg.to_json(), "--spare"],
            env={**os.environ, **_credentials_env()},
            stdin=subprocess.PIPE,
            preexec_fn=_die_with_parent,
        )

    def start_front(self) -> None:
        """Make the spare (or, if it is gone, a new process) the front, and start the next
        spare: a front that dies is replaced by one that has its imports behind it."""
        spare, self.spare = self.spare, None
        if spare is None or spare.poll() is not None:
            spare = self._spawn_front()
        assert spare.stdin is not None
        try:
            spare.stdin.write(b"serve\n")
            spare.stdin.flush()
        except OSError:  # it died between the check and the write: the loop sees it exit
            pass
        self.front = spare
        log.info("front started (pid %d)", spare.pid)
        self.spare = self._spawn_front()

    def run(self) -> int:
        try:
            self.start_lighthouse()
        except (OSError, RuntimeError) as e:
            log.error("%s", e)
            self.stop()
            return 1
        log.info(
            "torchft's lighthouse at %s (its dashboard: http://%s)",
            self.cfg.lighthouse,
            self.cfg.lighthouse,
        )
        self.start_front()
        while not self.stopping.is_set():
            self.stopping.wait(0.05)
            assert self.lh is not None and self.front is not None
            if self.lh.poll() is not None:
                if self.stopping.is_set():
                    break
                log.error("torchft's lighthouse exited (%s): stopping", self.lh.returncode)
                self.stop()
                return 1
            if self.front.poll() is not None and not self.stopping.is_set():
                self._front_died()
        self.stop()
        return 0

    def _front_died(self) -> None:
        assert self.front is not None
        now = time.monotonic()
        self.deaths = [t for t in self.deaths if now - t < 60] + [now]
        pause = RESTART_PAUSE_S[min(len(self.deaths), len(RESTART_PAUSE_S)) - 1]
        log.warning("the front exited (%s): starting it again in %gs", self.front.returncode, pause)
        if pause:
            self.stopping.wait(pause)
        if not self.stopping.is_set():
            self.start_front()

    def stop(self) -> None:
        self.stopping.set()
        procs = (self.spare, self.front, self.lh)
        for p in procs:
            if p is not None and p.poll() is None:
                p.terminate()
        for p in procs:
            if p is not None:
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
