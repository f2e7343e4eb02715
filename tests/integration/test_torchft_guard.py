"""agent.torchft without a lighthouse: what it refuses, with one clear line each, and its
heartbeats while the Manager waits for a quorum. The behaviour with real torchft groups is
tests/e2e/test_torchft.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from agent.errors import AgentError
from agent.torchft import (
    LIGHTHOUSE_FLAGS,
    Guard,
    _watch_quorums,
    attach,
    lighthouse_command,
    replica_id,
)


def test_the_replica_id_is_marduks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MARDUK_REPLICA_ID", "g7")
    assert replica_id() == "g7"
    assert replica_id(default="other") == "g7"  # the agent's --replica wins
    monkeypatch.delenv("MARDUK_REPLICA_ID")
    assert replica_id(default="g1") == "g1"
    with pytest.raises(AgentError, match="no replica id: set MARDUK_REPLICA_ID"):
        replica_id()


def test_attach_wants_a_manager() -> None:
    with pytest.raises(AgentError, match="wants a torchft Manager, not dict"):
        attach({})  # type: ignore[arg-type]


def test_importing_it_imports_neither_torch_nor_torchft() -> None:
    code = "import sys, agent.torchft; print([m for m in ('torch', 'torchft') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_lighthouse_flags_are_torchft_lighthouses() -> None:
    """The timers Marduk recommends are options of the torchft_lighthouse installed (a torchft
    that renames one fails here, not in a user's job)."""
    pytest.importorskip("torchft", reason="torchft is not installed: pip install -e '.[dev]'")
    binary = str(Path(sys.executable).parent / "torchft_lighthouse")
    cmd = lighthouse_command(2, "127.0.0.1:0", binary=binary)
    assert cmd[:5] == [binary, "--min_replicas", "2", "--bind", "127.0.0.1:0"]
    assert cmd[5:] == list(LIGHTHOUSE_FLAGS)
    usage = subprocess.run([binary, "--help"], capture_output=True, text=True, check=True).stdout
    for flag in LIGHTHOUSE_FLAGS[::2]:
        assert flag + " " in usage, (flag, usage)


class _Client:
    def __init__(self) -> None:
        self.beats = 0

    def heartbeat(self) -> None:
        self.beats += 1

    def step(self, step: int) -> None:
        pass


class _Inner:
    """A Manager's quorum client whose ``_quorum`` waits until released (the lighthouse waits
    for a dead or hung group to time out)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def _quorum(self, *args: object, **kwargs: object) -> object:
        self.release.wait(10)
        return types.SimpleNamespace(replica_ids=["g1:a", "g3:b"])


class _Manager:
    def __init__(self) -> None:
        self._client = _Inner()

    def report_error(self, e: Exception) -> None:
        pass

    def current_step(self) -> int:
        return 7


def test_waiting_for_a_quorum_is_not_a_hang() -> None:
    """While the Manager's quorum call is in flight the Guard heartbeats (after the first step
    only: before it, the agent's startup timeout applies); a group stuck anywhere else does not
    (that is a hang for ``--hang-timeout``)."""
    manager = _Manager()
    inner = manager._client
    guard = Guard(manager, beat_every=0.01)
    _watch_quorums(manager, guard)
    client = _Client()
    guard.client = client  # type: ignore[assignment]
    guard.start_beats()

    def quorum() -> threading.Thread:
        t = threading.Thread(target=manager._client._quorum, args=(0, 7))
        t.start()
        return t

    waiting = quorum()  # the first quorum: startup, no heartbeat
    time.sleep(0.1)
    assert client.beats == 0
    inner.release.set()
    waiting.join()
    guard.step()
    inner.release.clear()
    time.sleep(0.1)
    assert client.beats == 0  # stepping, not waiting: steps are the progress
    waiting = quorum()
    deadline = time.monotonic() + 5
    while client.beats < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.beats >= 3
    inner.release.set()
    waiting.join()
    assert guard.quorum == frozenset({"g1", "g3"})
    beats = client.beats
    time.sleep(0.1)
    assert client.beats - beats <= 1  # at most one that was under way
