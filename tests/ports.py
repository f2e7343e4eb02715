"""Loopback ports for tests that run side by side (pytest-xdist).

A port taken by binding to port 0 and closing the socket is the kernel's next *ephemeral* port:
the same range every outgoing connection draws its local port from, so with several test
processes at once another test's client socket (or another worker's bind-0 probe) can take it
between the probe and the server's own bind, and the server fails to start or, worse, a test
talks to another test's server. Here each pytest-xdist worker hands out ports from a slice of
its own below the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), one after
another, each checked by binding, so two workers never pick the same port, a worker never picks
a port it handed out a moment ago (a server still in TIME_WAIT), and no client socket lands on
one."""

from __future__ import annotations

import itertools
import os
import socket
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
            if all(_bindable(p) for p in range(base, base + span)):
                # The cycle skips the ports of the span too, so the next caller starts past it.
                for _ in range(span - 1):
                    next(_next)
                return base
    raise RuntimeError(f"no {span} free consecutive ports in {_ports.start}-{_ports.stop - 1}")
