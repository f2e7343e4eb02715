"""Child processes tied to this process's life (Linux), and checks run in one under a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Mapping

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


async def run_with_deadline(
    cmd: list[str], timeout_s: float, env: Mapping[str, str] | None = None
) -> tuple[int | None, list[str]]:
    """Run ``cmd`` in a session of its own, its output (both streams) collected: (its exit
    code, its lines), or (None, []) when it took longer than ``timeout_s`` and was SIGKILLed
    with its process group. A killed child is waited for a second at most: one in an
    uninterruptible sleep (a hung NFS mount) dies only when the kernel lets it go."""
    proc = await asyncio.create_subprocess_exec(
        *cmd,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=dict(env) if env is not None else None,
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), 1.0)
        return None, []
    return proc.returncode, out.decode(errors="replace").splitlines()
