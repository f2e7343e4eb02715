"""What a snapshot is on disk, and which one may be restored: pure rules, no I/O.

A snapshot is one directory per step and rank in the node-local store the agent keeps
(agent/library/local_store.py writes it): ``data.bin``, every buffer of the train state's host
copy back to back (each at a 64-byte boundary: raw bytes, no pickle, one mapping restores it), and
``manifest.json`` (``Manifest``): the job, the lineage, the epoch it was written at, the world
size and rank, the step, the data's size and CRC-32, where each buffer lies and the state's
structure (``tree``). The directory appears complete or not at all (written under a temporary
name, renamed), so a reader never sees a torn one; ``refusal`` is what a reader checks before
trusting one: a snapshot of another job, lineage, world size or rank, from an epoch ahead of the
reader's (a later run's, or a forgotten controller's) or whose data is not the size its manifest
says, is refused, never restored. Nothing is resharded: a snapshot restores onto the same world
size and rank only (a job that changes shape restores from persistent checkpoints).

The structure (``encode_tree``): nested dicts (``str`` or ``int`` keys, in order), lists and
tuples of leaves; a leaf is an array (numpy, torch, jax: a ``Leaf`` of one or more buffers) or
a plain value (None, bool, int, float, str) kept in the manifest. Other containers (a JAX
pytree of NamedTuples, an optax state) are flattened by jax (``{"jax": n}``) and restored into
the structure of a ``like`` tree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, Literal

import msgspec

FORMAT_VERSION: Final = 1
ALIGN: Final = 64
DATA: Final = "data.bin"
MANIFEST: Final = "manifest.json"
STEP_PREFIX: Final = "step-"
TMP_PREFIX: Final = ".tmp-"
# Snapshots kept per rank: the newest and the one before it, so that when one rank of the job
# died writing step N, the others still hold N - 1, the step the whole job can restore.
KEEP: Final = 2
# Seconds a notice (a forwarded restart, fail or stop) gives the pending snapshot to be written
# before the agent stops the trainer (``marduk agent run --local-ckpt-flush``).
FLUSH_S: Final = 2.0

Scalar = None | bool | int | float | str


class Buffer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One contiguous array in ``data.bin``."""

    offset: int
    nbytes: int
    dtype: str  # numpy's name ("float32", "bfloat16")
    shape: list[int]


class Shard(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One addressable shard of a jax array: its slice of the global array, and its buffer."""

    index: list[list[int]]  # [[start, stop], ...] per dimension
    buffer: int


class Leaf(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An array of the state: ``numpy``, ``torch`` (its dtype if numpy has none), ``jax``
    (this process's distinct shards, ``shape`` the global shape)."""

    kind: Literal["numpy", "torch", "jax"]
    shape: list[int]
    buffers: list[int] = []
    shards: list[Shard] = []
    torch_dtype: str | None = None


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    v: int
    job: str
    lineage: str
    epoch: int
    world_size: int
    rank: int
    step: int
    nbytes: int
    crc32: int
    created_at: float
    buffers: list[Buffer]
    leaves: list[Leaf]
    tree: Any  # encode_tree's form


class Identity(msgspec.Struct, frozen=True):
    """Who is restoring: a snapshot must have been written by the same job, lineage, world
    size and rank, at an epoch not ahead of this one."""

    job: str
    lineage: str
    epoch: int
    world_size: int
    rank: int


def encode_manifest(m: Manifest) -> bytes:
    return msgspec.json.encode(m)


def decode_manifest(raw: bytes) -> Manifest:
    """Strict: a manifest that is not one (cut off, another version) raises ValueError."""
    try:
        m = msgspec.json.decode(raw, type=Manifest)
    except msgspec.DecodeError as e:
        raise ValueError(f"not a snapshot manifest: {e}") from None
    if m.v != FORMAT_VERSION:
        raise ValueError(f"snapshot format {m.v}, this library reads {FORMAT_VERSION}")
    return m


def refusal(m: Manifest, me: Identity, data_size: int) -> str | None:
    """Why the snapshot ``m`` (its data file ``data_size`` bytes) must not be restored by
    ``me``, or None when it may."""
    if m.job != me.job:
        return f"of job {m.job!r}, not {me.job!r}"
    if m.lineage != me.lineage:
        return f"of lineage {m.lineage!r}, not {me.lineage!r}"
    if m.world_size != me.world_size:
        return f"of world size {m.world_size}, not {me.world_size} (not resharded)"
    if m.rank != me.rank:
        return f"of rank {m.rank}, not {me.rank}"
    if m.epoch > me.epoch:
        return f"written at epoch {m.epoch}, ahead of this one ({me.epoch}): another run's"
    if data_size != m.nbytes:
        return f"torn: {data_size} bytes of data, the manifest says {m.nbytes}"
    end = max((b.offset + b.nbytes for b in m.buffers), default=0)
    if end > m.nbytes:
        return f"corrupt: a buffer ends at {end}, past the data's {m.nbytes} bytes"
    return None


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:012d}"


def step_of(name: str) -> int | None:
    """The step of a snapshot directory's name; None for anything else (a temporary)."""
    if not name.startswith(STEP_PREFIX):
        return None
    digits = name[len(STEP_PREFIX) :]
    return int(digits) if digits.isdigit() else None


def tmp_name(step: int, pid: int) -> str:
    return f"{TMP_PREFIX}{step}-{pid}"


def to_prune(steps: Iterable[int], keep: int = KEEP) -> list[int]:
    """The complete snapshots to remove once a new one is complete: all but the newest
    ``keep``."""
    ordered = sorted(set(steps), reverse=True)
    return ordered[keep:]


def layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of buffers of ``sizes`` bytes laid out back to back at ``ALIGN``, and the total."""
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += -(-n // ALIGN) * ALIGN
    return offsets, at


def agreed_step(newest: int | None, agree: Callable[[int], int]) -> int | None:
    """The newest step every rank holds: each rank's newest complete step (-1: none), the
    minimum over the job (``agree``: the ranks' own collective), None when some rank has none."""
    step = agree(-1 if newest is None else newest)
    return None if step < 0 else step


class Encoded(msgspec.Struct, frozen=True):
    tree: Any
    leaves: list[Any]  # the arrays, in the order the tree's {"a": i} name them


def encode_tree(state: Any, is_array: Callable[[Any], bool]) -> Encoded | None:
    """The structure of ``state`` and its arrays, or None when it holds a container this form
    does not know (the caller then flattens it with jax)."""
    leaves: list[Any] = []

    def walk(x: Any) -> Any:
        if is_array(x):
            leaves.append(x)
            return {"a": len(leaves) - 1}
        if x is None or isinstance(x, bool | int | float | str):
            return {"v": x}
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                if not isinstance(k, str | int) or isinstance(k, bool):
                    raise _Unknown
                items.append([k, walk(v)])
            return {"d": items}
        if type(x) is list:
            return {"l": [walk(v) for v in x]}
        if type(x) is tuple:
            return {"t": [walk(v) for v in x]}
        raise _Unknown

    try:
        return Encoded(walk(state), leaves)
    except _Unknown:
        return None


def decode_tree(tree: Any, leaf: Callable[[int], Any]) -> Any:
    """The state ``encode_tree`` described, its arrays from ``leaf(i)``."""
    if not isinstance(tree, dict) or len(tree) != 1:
        raise ValueError(f"not a snapshot tree node: {tree!r}")
    ((tag, value),) = tree.items()
    if tag == "a":
        return leaf(value)
    if tag == "v":
        return value
    if tag == "d":
        return {k: decode_tree(v, leaf) for k, v in value}
    if tag == "l":
        return [decode_tree(v, leaf) for v in value]
    if tag == "t":
        return tuple(decode_tree(v, leaf) for v in value)
    raise ValueError(f"unknown snapshot tree node {tag!r}")


class _Unknown(Exception):
    """A container encode_tree does not know."""
