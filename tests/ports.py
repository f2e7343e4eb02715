"""Loopback ports for tests that run side by side (pytest-xdist).

A port taken by binding to port 0 and closing the socket is the kernel's next *ephemeral* port:
the same range every outgoing connection draws its local port from, so with several test
processes at once another test's client socket (or another worker's bind-0 probe) can take it
between the probe and the server's own bind, and the server fails to start or, worse, a test
talks to another test's server. Here each pytest-xdist worker hands out ports from a slice of
its own below the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), one after
another, each checked by binding, so two workers never pick the same port, a worker never picks
a port it handed out a moment ago (a server still in TIME_WAIT), and no client socket lands on
one.

Two test sessions on one machine (two checkouts, or a developer's run beside CI's) have the same
worker names, so the same slices: each port handed out is also locked, for the life of the
process, in a file every session shares (a POSIX byte-range lock on byte ``port``: released by
the kernel when the process ends, however it ends), and a port another process holds is
skipped."""

from __future__ import annotations

import fcntl
import itertools
import os
import socket
import tempfile
import threading
from pathlib import Path

# Below the kernel's ephemeral range (32768-60999 by default): nothing picks these by itself.
LOW, HIGH = 20000, 32000
SLICES = 16  # up to 16 workers; a worker past that shares a slice (still checked by binding)


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _worker_index() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw3" -> 3; no xdist: slice 0
    digits = worker.lstrip("gw")
    return int(digits) % SLICES if digits.isdigit() else 0


def _slice() -> range:
    high = min(HIGH, _ephemeral_floor())
    width = (high - LOW) // SLICES
    start = LOW + _worker_index() * width
    return range(start, start + width)


_ports = _slice()
_next = itertools.cycle(_ports)
_lock = threading.Lock()
_claims: int | None = None  # the shared lock file's descriptor, opened on first use


def _claimed_elsewhere(port: int) -> bool:
    """Lock byte ``port`` of the shared file for this process; True if another process holds
    it (a lock this process holds already is taken again: its own ports cycle round)."""
    global _claims
    if _claims is None:
        path = Path(tempfile.gettempdir()) / "marduk-test-ports.lock"
        _claims = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.lockf(_claims, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
    except OSError:
        return True
    return False


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A loopback port free now, from this worker's slice, not handed out again soon."""
    return free_port_base(1)


def free_port_base(span: int = 1) -> int:
    """A base port with ``span`` consecutive free ports from it, in this worker's slice."""
    with _lock:
        for _ in range(len(_ports)):
            base = next(_next)
            if base + span > _ports.stop:
                continue
            span_ports = range(base, base + span)
            if not any(_claimed_elsewhere(p) for p in span_ports) and all(
                _bindable(p) for p in span_ports
            ):
                # The cycle skips the ports of the span too, so the next caller starts past it.
                for _ in range(span - 1):
                    next(_next)
                return base
    raise RuntimeError(f"no {span} free consecutive ports in {_ports.start}-{_ports.stop - 1}")
