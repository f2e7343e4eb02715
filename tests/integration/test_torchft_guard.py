"""agent.torchft without a lighthouse: what it refuses, with one clear line each. The
behaviour with real torchft groups is tests/e2e/test_torchft.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agent.errors import AgentError
from agent.torchft import attach, replica_id


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
