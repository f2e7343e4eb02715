"""The node-local checkpoint store the agent keeps for its trainers, and its persistent copies.

The pod outlives the trainer, so a store the agent creates outlives every incarnation: by
default a directory on tmpfs, ``/dev/shm/marduk-<job>-<replica>-<worker>`` (``--local-ckpt-dir``;
``none``: no store), made when the agent starts (0700), kept across incarnations and across a
restart of the agent itself, removed when the job ends for this member: the trainers finished
(exit 0), ``fail`` or retired (71), ``stop`` (72), or at any exit while it holds no snapshot.
Every other exit (the budget spent, a preemption) keeps it: a container restarted in the same
pod finds its snapshots. The trainers
get its path (``MARDUK_LOCAL_CKPT_DIR``), its size bound (``--local-ckpt-max``), the notice's
bound (``--local-ckpt-flush``) and the lineage (``--ckpt-lineage``), and write their snapshots
into it themselves (agent/library/snapshots.py); nothing of a snapshot passes through the agent.

With ``--persist-dir`` the agent copies each rank's newest complete snapshot there in the
background (``Persister``), at most one copy at a time and a new one at most every
``--persist-interval`` seconds, so a persistent copy lags the newest snapshot by at most the
interval plus one copy's time (``marduk_agent_persist_lag_steps``, ``..._lag_seconds``). The
trainer never waits for it; the copy has the store's layout (a temporary renamed complete), so
``client.restore()`` reads it the same way when no local step is held by every rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from agent.channel.handoff import Handoff
from agent.library import snapshot_format as fmt
from agent.library.local_store import complete_steps, rank_dir, read_manifest

if TYPE_CHECKING:
    from agent.supervise.supervisor_config import SupervisorConfig

log = logging.getLogger("agent.local_ckpt")

AUTO: Final = "auto"
OFF: Final = ("none", "off", "")
SHM: Final = "/dev/shm"
# Exits that end the job for this member: its snapshots can serve no one.
REMOVED_ON: Final = frozenset({0, 71, 72})
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS: Final = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes of ``4GiB``, ``512M``, ``1048576`` (binary units; 0: no bound)."""
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (e.g. 4GiB, 512M, or bytes)")
    number, unit = m.groups()
    return int(float(number) * _UNITS[(unit or "").lower()[:1]])


def store_path(given: str, job: str, replica: str, worker: int) -> Path | None:
    """Where the store lives: ``given``, or on tmpfs for ``auto`` (the temporary directory
    where this machine has no /dev/shm), None for ``none``."""
    if given.strip().lower() in OFF:
        return None
    if given != AUTO:
        return Path(given)
    base = SHM if os.path.isdir(SHM) else tempfile.gettempdir()
    return Path(base) / f"marduk-{job}-{replica}-{worker}"


@dataclass(frozen=True, slots=True)
class LocalCkpt:
    """The store as configured: where, its bound, the notice's, persistent copies."""

    path: Path | None
    max_bytes: int = 0
    flush_s: float = 2.0
    persist_dir: Path | None = None
    persist_interval_s: float = 60.0
    lineage: str | None = None

    @classmethod
    def configured(cls, config: SupervisorConfig, job: str, replica: str, worker: int) -> LocalCkpt:
        """The store ``marduk agent run``'s options describe, for this member."""
        return cls(
            store_path(config.local_ckpt_dir, job, replica, worker),
            max_bytes=config.local_ckpt_max_bytes,
            flush_s=config.local_ckpt_flush_s,
            persist_dir=Path(config.persist_dir) if config.persist_dir else None,
            persist_interval_s=config.persist_interval_s,
            lineage=config.ckpt_lineage,
        )

    @property
    def on(self) -> bool:
        return self.path is not None

    def open(self) -> bool:
        """Create the store (kept if it exists: an earlier agent's snapshots). False (said
        once) when it cannot be made: the trainers then run without one."""
        if self.path is None:
            return False
        try:
            self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
            if self.persist_dir is not None:
                self.persist_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            log.error("no local checkpoint store: cannot create %s: %s", self.path, e)
            return False
        held = sum(len(complete_steps(d)) for d in _rank_dirs(self.path))
        log.info(
            "local checkpoint store %s%s%s",
            self.path,
            f" (bound {self.max_bytes} bytes)" if self.max_bytes else "",
            f", {held} snapshot(s) held from before" if held else "",
        )
        return True

    def handoff(self) -> dict[str, str]:
        """The trainers' ``MARDUK_LOCAL_CKPT_*`` variables (none without a store)."""
        if self.path is None:
            return {}
        given = Handoff(
            local_ckpt_dir=str(self.path),
            local_ckpt_max_bytes=self.max_bytes or None,
            local_ckpt_flush_ms=round(self.flush_s * 1000),
            persist_ckpt_dir=str(self.persist_dir) if self.persist_dir else None,
            ckpt_lineage=self.lineage,
        )
        env = given.to_env()
        for counter in ("MARDUK_EPOCH", "MARDUK_RESTART_COUNT"):  # the trainer env's own
            env.pop(counter, None)
        return env

    def remove_if_done(self, code: int) -> None:
        """The job ended for this member (``REMOVED_ON``): its store goes with it. A store
        that holds no snapshot goes whatever the exit (nothing in it to find again)."""
        if self.path is None:
            return
        empty = not any(files for _dir, _dirs, files in os.walk(self.path))
        if code not in REMOVED_ON and not empty:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        if not empty:
            log.info("local checkpoint store %s removed (exit %d)", self.path, code)


def _rank_dirs(root: Path) -> Iterator[Path]:
    try:
        yield from (p for p in root.iterdir() if p.is_dir() and p.name.startswith("rank-"))
    except FileNotFoundError:
        return


class Persister:
    """Copies each rank's newest complete snapshot from the store to ``persist_dir``."""

    def __init__(self, ckpt: LocalCkpt, stats: Counter[str]) -> None:
        assert ckpt.path is not None and ckpt.persist_dir is not None
        self.root, self.target = ckpt.path, ckpt.persist_dir
        self.interval_s = ckpt.persist_interval_s
        self.stats = stats

    async def run(self) -> None:
        while True:
            t0 = time.monotonic()
            try:
                await asyncio.to_thread(self.once)
            except OSError as e:
                self.stats["persist.errors"] += 1
                log.warning("persistent checkpoint copy failed: %s", e)
            await asyncio.sleep(max(0.05, self.interval_s - (time.monotonic() - t0)))

    def once(self) -> None:
        """One pass: every rank's newest snapshot not yet copied, copied."""
        for src in _rank_dirs(self.root):
            steps = complete_steps(src)
            if not steps:
                continue
            dst = self.target / src.name
            done = complete_steps(dst)
            if not done or done[0] < steps[0]:
                self._copy(src / fmt.step_name(steps[0]), dst, steps[0])

    def lag(self, now: float) -> tuple[float, float]:
        """How far the persistent copies are behind the newest local snapshots (the worst
        rank): in steps, and in seconds (the age of the newest copy while a newer snapshot
        exists; 0 when caught up). Read at each scrape (a directory listing per rank)."""
        lag_steps, lag_s = 0, 0.0
        for src in _rank_dirs(self.root):
            steps = complete_steps(src)
            if not steps:
                continue
            done = complete_steps(self.target / src.name)
            after = done[0] if done else 0
            if after >= steps[0]:
                continue
            lag_steps = max(lag_steps, steps[0] - after)
            oldest = src / fmt.step_name(steps[-1])
            with contextlib.suppress(OSError, ValueError):
                if done:
                    taken = read_manifest(self.target / src.name / fmt.step_name(after))
                else:  # nothing copied yet: behind since the oldest snapshot held
                    taken = read_manifest(oldest)
                lag_s = max(lag_s, now - taken.created_at)
        return float(lag_steps), lag_s

    def _copy(self, snapshot: Path, dst: Path, step: int) -> None:
        """Copy one snapshot: both files opened first, so a snapshot the trainer prunes
        meanwhile is still read whole (an unlinked file stays readable while open)."""
        try:
            manifest = (snapshot / fmt.MANIFEST).read_bytes()
            data = open(snapshot / fmt.DATA, "rb")  # noqa: SIM115  # closed below
        except FileNotFoundError:  # pruned before we opened it: a newer one, next pass
            self.stats["persist.overtaken"] += 1
            return
        dst.mkdir(parents=True, exist_ok=True)
        tmp = dst / fmt.tmp_name(step, os.getpid())
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with data:
                tmp.mkdir()
                with open(tmp / fmt.DATA, "wb") as out:
                    shutil.copyfileobj(data, out, 16 << 20)
                    out.flush()
                    os.fsync(out.fileno())
            with open(tmp / fmt.MANIFEST, "wb") as out:
                out.write(manifest)
                out.flush()
                os.fsync(out.fileno())
            final = dst / fmt.step_name(step)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
            fd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)  # the rename made durable
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in fmt.to_prune(complete_steps(dst)):
            shutil.rmtree(dst / fmt.step_name(old), ignore_errors=True)
        self.stats["persist.copies"] += 1
        self.stats["persist.bytes"] += (final / fmt.DATA).stat().st_size


__all__ = ["LocalCkpt", "Persister", "parse_size", "rank_dir", "store_path"]
