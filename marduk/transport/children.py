"""Child processes tied to this process's life (Linux)."""

from __future__ import annotations

import ctypes
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child, between fork and exec (``preexec_fn``): have the kernel send ``sig`` when the
    parent dies, SIGKILL included. A no-op where prctl is unavailable."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass
