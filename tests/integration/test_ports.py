"""The suite's port allocator (tests/ports.py): two test sessions on one machine have the same
xdist worker names, so the same slice of ports; a port one process handed out is never handed
out by another while the first lives."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

HOLD = "import sys, tests.ports as p; print(p.free_port(), flush=True); sys.stdin.read()"
TAKE = "import tests.ports as p; print(p.free_port())"


def test_a_port_another_session_holds_is_skipped_until_it_ends() -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert holder.stdout is not None
        held = int(holder.stdout.readline())
        taken = subprocess.run(
            [sys.executable, "-c", TAKE], capture_output=True, text=True, check=True, cwd=ROOT
        )
        assert int(taken.stdout) != held
    finally:
        holder.communicate("")  # the holder ends: its lock goes with it
    from tests.ports import _claimed_elsewhere

    assert not _claimed_elsewhere(held)  # its lock ended with it
