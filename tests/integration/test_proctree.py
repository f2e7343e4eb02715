"""The agent's view of its descendants: the kernel's child lists, as psutil sees them."""

from __future__ import annotations

import os
import subprocess
import time

import psutil

from agent.supervise.proctree import _leftovers_by_psutil, descendants, leftovers


def test_the_subtree_walk_finds_what_psutil_finds_and_spares_the_spare() -> None:
    # Each: a shell with a child that leaves the group (setsid) and one that does not.
    trees = [subprocess.Popen(["sh", "-c", "setsid sleep 30 & sleep 30 & wait"]) for _ in range(3)]
    try:
        deadline = time.monotonic() + 10
        while len(psutil.Process().children(recursive=True)) < 9:
            assert time.monotonic() < deadline, "the trees did not start"
            time.sleep(0.02)
        walked = descendants(os.getpid())
        assert walked is not None
        assert sorted(walked) == sorted(p.pid for p in _leftovers_by_psutil(set()))
        spare = trees[0].pid
        left = {p.pid for p in leftovers({spare})}
        spared = {spare, *(c.pid for c in psutil.Process(spare).children(recursive=True))}
        assert left == set(walked) - spared and len(left) == 6
        assert descendants(2**22 + 1) == []  # no such process: nothing below it
    finally:
        for t in trees:
            for c in psutil.Process(t.pid).children(recursive=True):
                c.kill()
            t.kill()
            t.wait()
