"""Every process a trainer left behind ends with it.

A trainer's process group is not its tree: a data-loader worker or a helper that calls
``setsid`` leaves the group, and once its parent dies the kernel hands it to init, out of the
agent's sight, still holding GPU memory, a port, or the agent's stdout pipe. So the agent is a
child subreaper (``PR_SET_CHILD_SUBREAPER``): orphans of its trainers are re-parented to it, not to
init, and stay its descendants, which the kernel's per-process child lists give (psutil where
the kernel has none). After the trainers of an incarnation have ended (SIGTERM, grace,
SIGKILL), ``end_leftovers`` gives every remaining descendant but the agent's own helpers (the
fork server, trainers waiting to start) SIGTERM, the same grace, then SIGKILL, and reaps the
ones re-parented to the agent.
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


# The kernel keeps per-thread child lists (CONFIG_PROC_CHILDREN): a subtree walk is cheap.
_CHILD_LISTS = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


async def find_leftovers(spare: set[int]) -> list[psutil.Process]:
    """``leftovers``, on a thread only where it must read every process (no child lists)."""
    if _CHILD_LISTS:
        return leftovers(spare)
    return await find_leftovers(spare)


def leftovers(spare: set[int]) -> list[psutil.Process]:
    """This process's descendants, but ``spare`` and theirs."""
    me = os.getpid()
    found = descendants(me)
    if found is None:  # no /proc/PID/task/TID/children here: psutil reads every process
        return _leftovers_by_psutil(spare)
    spared = set(spare)
    for pid in spare:
        spared.update(descendants(pid) or ())
    out = []
    for pid in found:
        if pid not in spared:
            with contextlib.suppress(psutil.Error):
                out.append(psutil.Process(pid))
    return out


def descendants(root: int) -> list[int] | None:
    """Every descendant of ``root``, walking down its subtree through the kernel's
    ``/proc/PID/task/TID/children`` lists: the cost is the subtree's size, where psutil's
    ``children(recursive=True)`` reads the status of every process on the machine (three
    times per stop of a trainer; 8 agents doing it at once during a job-wide restart took
    most of the restart's time on a loaded 2-core machine). None where the kernel has no such
    list (built without CONFIG_PROC_CHILDREN, or not Linux). A list read while a child is
    being created or reaped may miss it (the kernel's caveat): the callers look again."""
    first = _children(root)
    if first is None:
        return None
    out: list[int] = []
    todo = list(first)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(_children(pid) or ())
    return out


def _children(pid: int) -> list[int] | None:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return [] if os.path.isdir("/proc/self/task") else None  # gone, or no /proc at all
    kids: list[int] = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids.extend(int(k) for k in f.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/self/task/{os.getpid()}/children"):
                return None  # the kernel does not have the lists
        except OSError:
            continue  # the thread ended meanwhile
    return kids


def _leftovers_by_psutil(spare: set[int]) -> list[psutil.Process]:
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
        members = in_groups(await find_leftovers(spare), pgids)
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
    procs = await find_leftovers(spare)
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
