"""Storage checks before a start (``marduk agent run --storage-check PATH[:rw]``,
``--check-mounts``), in a child process under a deadline: a hung NFS or Lustre mount blocks the
process that touches it (``stat`` never returns), so the supervisor never touches them itself.

Each path must exist and be readable (a directory listable, a file read), writable too with
``:rw`` (a file created and removed in it, or the file opened for appending), and the mount it
is on (``/proc/self/mountinfo``) must answer; on a network file system (NFS, Lustre, ...) its
mount point is listed. ``--check-mounts`` checks every NFS and Lustre mount of this node the
same way. Where Lustre's health file is present (``/sys/fs/lustre/health_check``) it must say
``healthy``. Exit 0: all well; 1: the ``STORAGE FAIL <why>`` lines on stdout say what is not.

    python -m agent.supervise.storage_probe [--mounts] /data /ckpt:rw
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass

MOUNTINFO = "/proc/self/mountinfo"
LUSTRE_HEALTH = "/sys/fs/lustre/health_check"
# File systems whose mount may hang or vanish under us: their mount point is listed too.
NETWORK_FS = frozenset({"nfs", "nfs4", "lustre", "cifs", "smb3", "ceph", "glusterfs", "beegfs"})
CHECKED_MOUNTS = frozenset({"nfs", "nfs4", "lustre"})  # what --check-mounts looks at (NVRx's)
FAIL = "STORAGE FAIL "
SCRIPT = os.path.abspath(__file__)  # what the supervisor runs (``run_probe``)


class StorageSpecError(ValueError):
    """A ``--storage-check`` value that names no path: one line, for the user."""


@dataclass(frozen=True, slots=True)
class StoragePath:
    path: str
    write: bool = False

    def __str__(self) -> str:
        return f"{self.path}:rw" if self.write else self.path


def parse_storage(text: str) -> StoragePath:
    """``PATH``, ``PATH:ro`` or ``PATH:rw`` (absolute)."""
    path, colon, mode = text.rpartition(":")
    if not colon or mode not in ("ro", "rw"):
        path, mode = text, "ro"
    if not path.startswith("/"):
        raise StorageSpecError(
            f"--storage-check {text!r}: an absolute path, optionally :rw (writable) or :ro"
        )
    return StoragePath(os.path.normpath(path), write=mode == "rw")


@dataclass(frozen=True, slots=True)
class Mount:
    point: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    r"""mountinfo's octal escapes (``\040`` is a space)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of ``/proc/self/mountinfo`` (proc(5)): point, type and source (pure)."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if dash < 5 or len(fields) < dash + 3:
            continue
        mounts.append(Mount(_unescape(fields[4]), fields[dash + 1], _unescape(fields[dash + 2])))
    return mounts


def mount_of(path: str, mounts: Iterable[Mount]) -> Mount | None:
    """The mount ``path`` (absolute, resolved) is on: the longest mount point above it, the
    last one mounted there (pure)."""
    best: Mount | None = None
    for m in mounts:
        point = m.point.rstrip("/") or "/"
        inside = path == point or path.startswith(point + "/") or point == "/"
        if inside and (best is None or len(point) >= len(best.point.rstrip("/") or "/")):
            best = m
    return best


# --- in the child ----------------------------------------------------------------------------


def _readable(path: str) -> str:
    if os.path.isdir(path):
        with os.scandir(path) as it:
            next(it, None)
    else:
        with open(path, "rb") as f:
            f.read(4096)
    return ""


def _writable(path: str) -> str:
    if os.path.isdir(path):
        fd, name = tempfile.mkstemp(prefix=".marduk-storage-check-", dir=path)
        try:
            os.write(fd, b"ok")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(name)
    else:
        with open(path, "ab"):
            pass
    return ""


def _answers(m: Mount) -> str:
    """A network mount answers: its point is statted and listed."""
    os.statvfs(m.point)
    with os.scandir(m.point) as it:
        next(it, None)
    return ""


def check_path(spec: StoragePath, mounts: list[Mount]) -> list[str]:
    """What is wrong with ``spec`` (empty: nothing)."""
    if not os.path.exists(spec.path):
        return [f"{spec}: missing"]
    failures = []
    for what, probe in (("unreadable", _readable), ("not writable", _writable)):
        if what == "not writable" and not spec.write:
            continue
        try:
            probe(spec.path)
        except OSError as e:
            failures.append(f"{spec}: {what} ({e.strerror or e})")
    m = mount_of(os.path.realpath(spec.path), mounts)
    if m is None:
        failures.append(f"{spec}: on no mount listed in {MOUNTINFO}")
    elif m.fstype in NETWORK_FS:
        failures += [f"{spec}: {f}" for f in check_mount(m)]
    return failures


def check_mount(m: Mount) -> list[str]:
    try:
        _answers(m)
    except OSError as e:
        return [f"{m.fstype} mount {m.point} ({m.source}) does not answer: {e.strerror or e}"]
    return []


def lustre_health(path: str = LUSTRE_HEALTH) -> list[str]:
    """Lustre's own verdict, where the file is there (absent: no Lustre client here)."""
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            status = f.read().strip()
    except OSError as e:
        return [f"{path}: unreadable ({e.strerror or e})"]
    return [] if status == "healthy" else [f"{path} says {status!r}"]


def check(specs: list[StoragePath], all_mounts: bool) -> list[str]:
    try:
        with open(MOUNTINFO) as f:
            mounts = parse_mountinfo(f.read())
    except OSError as e:
        return [f"{MOUNTINFO}: unreadable ({e.strerror or e})"]
    failures = lustre_health()
    for spec in specs:
        failures += check_path(spec, mounts)
    if all_mounts:
        for m in mounts:
            if m.fstype in CHECKED_MOUNTS:
                failures += check_mount(m)
    return failures


def main(argv: list[str]) -> int:
    all_mounts = "--mounts" in argv
    specs = [parse_storage(a) for a in argv if a != "--mounts"]
    failures = check(specs, all_mounts)
    for line in failures:
        print(f"{FAIL}{line}", flush=True)
    return 1 if failures else 0


# --- in the supervisor -------------------------------------------------------------------------


async def run_probe(specs: list[StoragePath], all_mounts: bool, timeout_s: float) -> list[str]:
    """Run the probe in a child under ``timeout_s``; what failed, one line each (empty: all
    well). A child stuck past it (a hung mount) is killed and not waited for long: one in
    uninterruptible sleep dies only when the file system lets it go."""
    from marduk.transport.children import run_with_deadline

    # This file run as a script: the child imports the standard library only, not the agent
    # package (whose library client costs seconds to import on a loaded host).
    cmd = [sys.executable, SCRIPT, *map(str, specs)]
    if all_mounts:
        cmd.append("--mounts")
    code, lines = await run_with_deadline(cmd, timeout_s)
    if code is None:
        what = ", ".join(map(str, specs)) or "the mounts"
        return [f"{what}: no answer within {timeout_s:g}s (a hung mount?)"]
    failed = [x[len(FAIL) :] for x in lines if x.startswith(FAIL)]
    if code == 0:
        return []
    return failed or [f"storage check exited {code}: {' | '.join(lines[-3:])}"]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
