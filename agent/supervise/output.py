"""Each local rank's output: passed through line by line (prefixed, teed, redirected to
``--log-dir`` files), its tail kept for the diagnosis, its step lines parsed.

The supervisor (agent/supervise/supervisor.py) starts one pump per stream of each rank; what a
step line says goes to ``on_step`` (the supervision core decides what progress is).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Callable
from typing import IO

from agent.supervise.launch import LogSpec, Std
from agent.supervise.rank_facts import Rank

log = logging.getLogger("agent.supervisor")


CONSOLE_HOLD_BYTES = 256 * 1024
"""The most of one unfinished line a rank's console output holds back to show it whole."""


async def read_output(stream: asyncio.StreamReader) -> bytes:
    """The next line of a trainer's output, its newline kept; b"" at the end.

    A line longer than the reader's limit (a progress bar redrawn with \\r, a big tensor
    printed, a JSON blob) comes back in pieces, without a newline until the last: passed
    through whole, never an error. (``readline()`` raises ValueError there,
    and a pump that stops reading blocks its trainer on a full pipe: a healthy trainer "hangs".)
    """
    try:
        return await stream.readuntil(b"\n")
    except asyncio.IncompleteReadError as e:
        return e.partial  # the last line, without its newline (b"": the end)
    except asyncio.LimitOverrunError as e:
        return await stream.readexactly(max(e.consumed, 1))


def step_of(step_re: re.Pattern[str], text: str) -> int | None:
    """The step a line of output reports (the regex's first group), or None."""
    m = step_re.search(text)
    if m is None:
        return None
    try:
        return int(m.group(1))
    except (ValueError, IndexError):
        return None


def console(which: Std) -> IO[bytes]:
    return sys.stdout.buffer if which == Std.OUT else sys.stderr.buffer


class RankOutput:
    """The ranks' output: this run's log directory, and a pump per stream of each rank."""

    def __init__(
        self,
        logs: LogSpec,
        step_regex: str,
        run_prefix: str,
        on_step: Callable[[int, int], None],
        *,
        consoles: Callable[[Std], IO[bytes]] = console,
    ) -> None:
        self.logs = logs
        self.step_re = re.compile(step_regex)
        self._run_prefix = run_prefix  # <job>_<replica>_<worker>_
        self._on_step = on_step  # (rank, step)
        self._consoles = consoles
        self.run_dir = ""  # --log-dir/<job>_<replica>_<worker>_<unique>, made at the first start

    def open_logs(self, rank: Rank, attempt: int) -> None:
        logs = self.logs
        if logs.wants_files and not self.run_dir:
            base = logs.log_dir or tempfile.mkdtemp(prefix="marduk_logs_")
            # One directory per run, as torchrun makes: the last run's logs stay.
            os.makedirs(base, exist_ok=True)
            self.run_dir = tempfile.mkdtemp(prefix=self._run_prefix, dir=base)
            log.info("rank logs under %s", self.run_dir)
        rank.open_logs(logs, self.run_dir, attempt)

    async def pump(
        self, rank: Rank, stream: asyncio.StreamReader | None, which: Std, prefix: bytes
    ) -> None:
        """Pass a rank's output through line by line (prefixed, teed, redirected); keep the
        tail; parse steps."""
        if stream is None:
            return
        out = self._consoles(which)
        show = self.logs.to_console(rank.index, which)
        file = rank.files[0 if which == Std.OUT else 1] if rank.files else None
        at_start = True  # of a line: a long line's later pieces get no prefix
        held: list[bytes] = []  # the pieces of a long line not yet shown
        held_bytes = 0
        while True:
            line = await read_output(stream)
            if not line:
                if show and held:
                    out.write(b"".join(held))
                    out.flush()
                return
            if show:
                # A long line is shown whole, in one write, so that the other ranks' lines
                # never land inside it on the shared console (up to CONSOLE_HOLD_BYTES; a
                # longer one goes out in pieces).
                held.append(prefix + line if at_start else line)
                held_bytes += len(held[-1])
                if line.endswith(b"\n") or held_bytes >= CONSOLE_HOLD_BYTES:
                    out.write(b"".join(held))
                    out.flush()
                    held.clear()
                    held_bytes = 0
            at_start = line.endswith(b"\n")
            if file is not None and not file.closed:
                file.write(line)
                file.flush()
            text = line.decode(errors="replace").rstrip()
            rank.tail.append(text)
            step = step_of(self.step_re, text)
            if step is not None:
                with contextlib.suppress(ValueError, IndexError):
                    self._on_step(rank.index, step)
