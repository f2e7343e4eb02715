"""The node-local snapshot store on disk: one directory per rank, one per complete snapshot.

``<root>/rank-<R>/step-<N>/{data.bin,manifest.json}`` (agent/library/snapshot_format.py). A
snapshot is written under ``.tmp-<N>-<pid>``: the data, fsync'd, then the manifest, fsync'd,
then the directory renamed to ``step-<N>`` and its parent fsync'd; only then are the older ones
beyond the newest two removed. So a reader (the next incarnation, the agent's persistent copier)
sees each snapshot complete or not at all, and the one before stays until the next is complete.
On tmpfs (the default) fsync costs nothing; on a disk it is what makes the rename mean complete.

The size bound (``max_bytes``, the whole store: every local rank's snapshots) is checked before a
write: a snapshot that would not fit next to what the store holds raises ``StoreFull``, as does
the filesystem running out of space (``ENOSPC``) mid-write; the temporary is removed either way.
The agent (agent/supervise/local_ckpt.py) reads the store with the same class.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import shutil
import zlib
from collections.abc import Sequence
from pathlib import Path

from agent.library import snapshot_format as fmt
from agent.library.snapshot_format import Identity, Manifest

CHUNK = 64 << 20  # bytes written or checksummed at a time


class StoreFull(OSError):
    """The snapshot does not fit in the store (its size bound, or the filesystem is full)."""


def rank_dir(root: Path, rank: int) -> Path:
    return root / f"rank-{rank}"


class LocalStore:
    """One rank's snapshots in the store at ``root``."""

    def __init__(self, root: str | os.PathLike[str], rank: int, max_bytes: int = 0) -> None:
        self.root = Path(root)
        self.rank = rank
        self.max_bytes = max_bytes  # 0: no bound of ours (the filesystem's)
        self.dir = rank_dir(self.root, rank)

    def open(self) -> LocalStore:
        """Create this rank's directory; remove the temporaries a killed writer left."""
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        for p in self.dir.iterdir():
            if p.name.startswith(fmt.TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)
        return self

    def steps(self) -> list[int]:
        """The steps of this rank's complete snapshots, newest first."""
        return complete_steps(self.dir)

    def usage(self) -> int:
        """Bytes the whole store holds (every rank's snapshots and temporaries)."""
        return store_usage(self.root)

    def write(self, m: Manifest, chunks: Sequence[memoryview]) -> Manifest:
        """Write a snapshot of ``m`` (its ``crc32`` is filled in here) from ``chunks``, the
        data in order; return the manifest written. Raises StoreFull (nothing left behind)."""
        if self.max_bytes and self.usage() + m.nbytes > self.max_bytes:
            raise StoreFull(
                errno.ENOSPC,
                f"the local checkpoint store {self.root} is full: {m.nbytes} bytes do not fit "
                f"under its bound of {self.max_bytes} ({self.usage()} held)",
            )
        tmp = self.dir / fmt.tmp_name(m.step, os.getpid())
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(mode=0o700)
            crc = _write_data(tmp / fmt.DATA, chunks)
            import msgspec

            done = msgspec.structs.replace(m, crc32=crc)
            _write_file(tmp / fmt.MANIFEST, fmt.encode_manifest(done))
            _fsync_dir(tmp)
            final = self.dir / fmt.step_name(m.step)
            if final.exists():  # the same step again (a replayed step): the new one stands
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.dir)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                full = f"the local checkpoint store {self.root} is full: {e}"
                raise StoreFull(e.errno, full) from None
            raise
        for step in fmt.to_prune(self.steps()):
            shutil.rmtree(self.dir / fmt.step_name(step), ignore_errors=True)
        return done

    def manifest(self, step: int) -> Manifest:
        return read_manifest(self.dir / fmt.step_name(step))

    def check(self, step: int, me: Identity) -> tuple[Manifest | None, str | None]:
        """The manifest of ``step`` if ``me`` may restore it, else (None, why not)."""
        return check_snapshot(self.dir / fmt.step_name(step), me)


def complete_steps(directory: Path) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted((s for n in names if (s := fmt.step_of(n)) is not None), reverse=True)


def read_manifest(snapshot: Path) -> Manifest:
    return fmt.decode_manifest((snapshot / fmt.MANIFEST).read_bytes())


def check_snapshot(snapshot: Path, me: Identity) -> tuple[Manifest | None, str | None]:
    """The manifest of the snapshot directory ``snapshot`` if ``me`` may restore it."""
    try:
        m = read_manifest(snapshot)
        size = (snapshot / fmt.DATA).stat().st_size
    except (OSError, ValueError) as e:
        return None, f"unreadable: {e}"
    why = fmt.refusal(m, me, size)
    return (None, why) if why else (m, None)


def read_data(snapshot: Path, m: Manifest, verify: bool = False) -> memoryview:
    """The snapshot's data as one private copy-on-write mapping of its file: no copy and no
    zero-filled pages; each page is the store's own (tmpfs: memory) until written, so reading
    the state back (``load_state_dict``, ``device_put``) runs at memcpy speed, and a write goes
    to a private copy of its page, never to the store. The mapping keeps the file's pages
    while the arrays live, even once the store removes the snapshot. With ``verify``, the
    data's CRC-32 is checked first (ValueError if it differs)."""
    with open(snapshot / fmt.DATA, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != m.nbytes:
            raise ValueError(f"{snapshot}: {size} bytes of data, the manifest says {m.nbytes}")
        if not m.nbytes:
            return memoryview(bytearray())
        mapped = mmap.mmap(
            f.fileno(), m.nbytes, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    view = memoryview(mapped)
    if verify:
        crc = 0
        for at in range(0, m.nbytes, CHUNK):
            crc = zlib.crc32(view[at : at + CHUNK], crc)
        if crc != m.crc32:
            raise ValueError(f"{snapshot}: checksum {crc:#x}, the manifest says {m.crc32:#x}")
    return view


def store_usage(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(dirpath, name)).st_size
    return total


def _write_data(path: Path, chunks: Sequence[memoryview]) -> int:
    crc = 0
    with open(path, "wb", buffering=0) as f:
        for chunk in chunks:
            for at in range(0, len(chunk), CHUNK):
                piece = chunk[at : at + CHUNK]
                written = 0
                while written < len(piece):
                    written += f.write(piece[written:]) or 0
                crc = zlib.crc32(piece, crc)
        os.fsync(f.fileno())
    return crc


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
