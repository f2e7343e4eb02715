"""The unit tier starts no process and opens no network socket: a test that does belongs in
tests/integration (a nats-server, sockets) or tests/e2e (processes). Enforced, not hoped for."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest


def _refuse(what: str) -> Callable[..., Any]:
    def refuse(*args: object, **kwargs: object) -> Any:
        raise AssertionError(
            f"a unit test {what}: move it to tests/integration or tests/e2e (tests/conftest.py)"
        )

    return refuse


@pytest.fixture(autouse=True)
def _no_processes_no_sockets(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("started a process"))
    monkeypatch.setattr(os, "fork", _refuse("forked"))
    monkeypatch.setattr(socket.socket, "connect", _refuse("opened a network connection"))
    monkeypatch.setattr(socket.socket, "bind", _refuse("bound a socket"))
    yield
