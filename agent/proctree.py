"""Every process a trainer left behind ends with it.

A trainer's process group is not its tree: a data-loader worker or a helper that calls
``setsid`` leaves the group, and once its parent dies the kernel hands it to init, out of the
agent's sight, still holding GPU memory, a port, or the agent's stdout pipe. So the agent is a
child subreaper (``PR_SET_CHILD_SUBREAPER``): orphans of its trainers are re-parented to it, not to
init, and stay its descendants, which psutil lists. After the trainers of an incarnation have
ended (SIGTERM, grace, SIGKILL), ``end_leftovers`` gives every remaining descendant but the
agent's own helpers (the fork server, trainers waiting to start) SIGTERM, the same grace, then
SIGKILL, and reaps the ones re-parented to the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import time

import psutil

log = logging.getLogger("agent.supervisor")

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the reaper of its descendants' orphans (Linux >= 3.4)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return int(ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def leftovers(spare: set[int]) -> list[psutil.Process]:
    """This process's descendants, but ``spare`` and theirs."""
    me = psutil.Process()
    try:
        everyone = me.children(recursive=True)
    except psutil.Error:
        return []
    spared = set(spare)
    for pid in spare:
        with contextlib.suppress(psutil.Error):
            spared.update(p.pid for p in psutil.Process(pid).children(recursive=True))
    return [p for p in everyone if p.pid not in spared]


def in_groups(procs: list[psutil.Process], pgids: set[int]) -> list[psutil.Process]:
    """Those of ``procs`` still running in one of the process groups ``pgids``."""
    found = []
    for p in procs:
        with contextlib.suppress(OSError):
            if os.getpgid(p.pid) in pgids and _running(p):
                found.append(p)
    return found


async def wait_groups_gone(pgids: set[int], spare: set[int], deadline: float) -> None:
    """Until no descendant of ours is left in the process groups ``pgids`` (children the
    trainers forked there), or ``deadline`` (monotonic). Signals nothing.

    Only our descendants are looked at, never the bare group id: once a group's leader is
    reaped and its last member gone, the kernel may give that number to an unrelated process
    (and its group); ``killpg`` would reach it. The agent is the subreaper of what is left
    of its trainers, so every member that matters is a descendant."""
    while pgids and time.monotonic() < deadline:
        members = in_groups(await asyncio.to_thread(leftovers, spare), pgids)
        if not members:
            return
        _reap(members)
        await asyncio.sleep(0.02)


async def end_leftovers(
    spare: set[int], grace_s: float, termed: frozenset[int] | set[int] = frozenset()
) -> int:
    """SIGTERM every leftover descendant (but those in ``termed``: they had theirs), wait up
    to ``grace_s``, SIGKILL the rest; reap the ones that are our children. Returns how many
    there were."""
    procs = await asyncio.to_thread(leftovers, spare)
    _reap(procs)  # exited already (zombies re-parented to us): not left behind
    procs = [p for p in procs if _running(p)]
    if not procs:
        return 0
    log.warning(
        "%d process(es) the trainers left behind (e.g. after setsid): %s; ending them",
        len(procs),
        ", ".join(f"{p.pid}" for p in procs[:10]),
    )
    for p in procs:
        if p.pid not in termed:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    alive = procs
    while alive and time.monotonic() < deadline:
        _reap(alive)
        alive = [p for p in alive if _running(p)]
        if alive:
            await asyncio.sleep(0.02)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    end = time.monotonic() + 5.0
    while alive and time.monotonic() < end:
        _reap(alive)
        alive = [p for p in alive if _running(p)]
        if alive:
            await asyncio.sleep(0.01)
    _reap(procs)  # zombies re-parented to us meanwhile
    return len(procs)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _reap(procs: list[psutil.Process]) -> None:
    """Collect the exit status of those re-parented to us (else they stay zombies)."""
    me = os.getpid()
    for p in procs:
        with contextlib.suppress(psutil.Error, ChildProcessError, OSError):
            if p.ppid() == me:
                os.waitpid(p.pid, os.WNOHANG)
