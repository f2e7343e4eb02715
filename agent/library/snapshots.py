"""Snapshots of the train state into the node-local store, without stalling the training loop.

    client = agent.connect(on_command=agent.jax.exit_on_restart)
    got = client.restore(agree=agent.snapshots.torch_min)     # None: nothing held, start fresh
    for step in range(got.step + 1 if got else 1, n):
        train_step()
        client.snapshot(step, {"model": model.state_dict(), "opt": opt.state_dict()})

``snapshot(step, state)`` copies the state's arrays into a host staging buffer (the step waits
for that copy: the device-to-host transfer of a GPU state, a memcpy of a host one) and returns;
a background thread (``marduk-snapshots``) writes the buffer into the store
(agent/library/local_store.py). Two staging buffers: one being written, one pending; a newer
snapshot replaces a pending one not yet started (``snapshots.superseded``), so the loop never
waits for the store. ``copy=False`` skips the copy for arrays that nothing changes in place
(jax arrays of a step that does not donate its input): the writer reads them directly.

``restore(agree=...)`` finds the newest step the whole job holds: each rank's newest complete
snapshot it may restore (snapshot_format.refusal), the minimum over the ranks (``agree``: the
ranks' own collective, ``torch_min`` or ``jax_min``), then a second round in which every rank
says whether it holds that step. It maps the snapshot's data (copy-on-write: no copy, no
zero-filled pages; local_store.read_data) and returns the arrays as views of it; only when no
local step is held by all does it look at the agent's persistent copies
(``MARDUK_PERSIST_CKPT_DIR``), the same way.

At a notice (a ``restart``, ``fail`` or ``stop`` the agent forwards before stopping the trainer)
the library writes the pending snapshot, the last completed step, within ``flush_s``
(``flush``), unless the command names this trainer's own devices: a state copied from a failed
device is dropped (``snapshots.discarded``) and the one before it stays.

Nothing here raises into the training loop after construction: a snapshot that cannot be taken
or written (a type it does not know, the store full) is counted (``stats``) and recorded
(``errors``), and training goes on.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent.library import snapshot_format as fmt
from agent.library.local_store import LocalStore, StoreFull, check_snapshot, read_data
from agent.library.snapshot_format import Buffer, Identity, Leaf, Manifest, Shard

log = logging.getLogger("agent.snapshots")

FLUSH_S = fmt.FLUSH_S

Agree = Callable[[int], int]


@dataclass(frozen=True, slots=True)
class Restored:
    """What ``restore`` found: the step, the state (arrays viewing one buffer), where from."""

    step: int
    state: Any
    source: str  # "local" or "persistent"
    nbytes: int
    seconds: float


@dataclass(slots=True)
class _Pending:
    step: int
    manifest: Manifest
    chunks: list[memoryview]
    slot: int  # the staging buffer it uses; -1: none (copy=False)


class Snapshots:
    """One rank's snapshots in the store at ``root`` (see the module's docstring)."""

    def __init__(
        self,
        root: str | Path,
        me: Identity,
        *,
        max_bytes: int = 0,
        flush_s: float = FLUSH_S,
        persistent: str | Path | None = None,
    ) -> None:
        self.me = me
        self.store = LocalStore(root, me.rank, max_bytes).open()
        self.persistent = Path(persistent) if persistent else None
        self.flush_s = flush_s
        self.stats: Counter[str] = Counter()
        self.errors: deque[str] = deque(maxlen=50)
        self.last_written: int | None = None
        self._staging: list[np.ndarray | None] = [None, None]
        self._writing: _Pending | None = None
        self._pending: _Pending | None = None
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="marduk-snapshots", daemon=True)
        self._thread.start()

    # --- taking a snapshot (the training thread) -------------------------------------------------

    def snapshot(self, step: int, state: Any, *, copy: bool = True) -> bool:
        """Copy ``state``'s arrays to the host and queue their write; never blocks on the
        store. False (counted, recorded) when the state cannot be snapshotted."""
        t0 = time.perf_counter()
        try:
            tree, arrays, leaves, owned = _flatten(state)
        except TypeError as e:
            self._record("snapshots.unsupported", f"snapshot of step {step} not taken: {e}")
            return False
        sizes = [a.nbytes for a in arrays]
        offsets, total = fmt.layout(sizes)
        buffers = [
            Buffer(offset=o, nbytes=a.nbytes, dtype=a.dtype.name, shape=list(a.shape))
            for o, a in zip(offsets, arrays, strict=True)
        ]
        m = Manifest(
            v=fmt.FORMAT_VERSION,
            job=self.me.job,
            lineage=self.me.lineage,
            epoch=self.me.epoch,
            world_size=self.me.world_size,
            rank=self.me.rank,
            step=int(step),
            nbytes=total,
            crc32=0,
            created_at=time.time(),
            buffers=buffers,
            leaves=leaves,
            tree=tree,
        )
        with self._cv:
            if self._pending is not None:  # not started yet: this newer one replaces it
                self.stats["snapshots.superseded"] += 1
            self._pending = None
            busy = self._writing.slot if self._writing is not None else -1
        slot = 1 if busy == 0 else 0
        # What aliases live memory is copied; a fresh host copy (from a device) is not.
        staged = self._stage(slot, arrays, offsets, total, owned) if copy else list(arrays)
        chunks = _chunks(staged, offsets, total)
        with self._cv:
            self._pending = _Pending(int(step), m, chunks, slot)
            self._cv.notify_all()
        self.stats["snapshots.taken"] += 1
        self.stats["snapshots.copy_us"] += int((time.perf_counter() - t0) * 1e6)
        return True

    def _stage(
        self,
        slot: int,
        arrays: Sequence[np.ndarray],
        offsets: list[int],
        total: int,
        owned: set[int],
    ) -> list[np.ndarray]:
        """Each array, copied into the slot's staging buffer unless ``owned`` (already a copy
        of its own): the buffer is reused, so after the first snapshot the copy runs at memcpy
        speed (no page faults)."""
        buf = self._staging[slot]
        if buf is None or buf.nbytes != total:
            buf = self._staging[slot] = np.empty(total, dtype=np.uint8)
        staged = []
        for i, (a, at) in enumerate(zip(arrays, offsets, strict=True)):
            if i in owned:
                staged.append(a)
                continue
            dst = buf[at : at + a.nbytes].view(a.dtype).reshape(a.shape)
            np.copyto(dst, a, casting="no")
            staged.append(dst)
        return staged

    # --- writing (the background thread) ---------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._closed:
                    self._cv.wait()
                if self._pending is None:
                    return
                job, self._pending = self._pending, None
                self._writing = job
            try:
                self.store.write(job.manifest, job.chunks)
                self.stats["snapshots.written"] += 1
                self.stats["snapshots.bytes"] += job.manifest.nbytes
                self.last_written = job.step
            except StoreFull as e:
                self._record("snapshots.store_full", f"snapshot of step {job.step}: {e.strerror}")
            except Exception as e:  # the writer must outlive any one snapshot
                self._record(
                    "snapshots.errors", f"snapshot of step {job.step}: {type(e).__name__}: {e}"
                )
            finally:
                with self._cv:
                    self._writing = None
                    self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every snapshot taken is written (True), at most ``timeout`` seconds
        (default ``flush_s``)."""
        deadline = time.monotonic() + (self.flush_s if timeout is None else timeout)
        with self._cv:
            while self._pending is not None or self._writing is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stats["snapshots.flush_timeouts"] += 1
                    return False
                self._cv.wait(left)
        return True

    def at_notice(self, devices: Sequence[str], mine: Sequence[str]) -> int | None:
        """A notice that the trainer is about to be stopped: write the last step taken within
        ``flush_s`` (dropped if ``devices``, the failed ones, include this trainer's own);
        return the newest step written."""
        if set(devices) & set(mine):
            with self._cv:
                if self._pending is not None:
                    self._pending = None
                    self.stats["snapshots.discarded"] += 1
        self.flush()
        return self.last_written

    def close(self) -> None:
        """Write what is pending (within ``flush_s``), stop the writer. Safe to call twice."""
        self.flush()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(self.flush_s)

    # --- restoring -------------------------------------------------------------------------------

    def restore(
        self, like: Any = None, *, agree: Agree | None = None, verify: bool = False
    ) -> Restored | None:
        """The newest step every rank holds, read back; None when none is held (start from
        scratch, or from the trainer's own checkpoint). ``agree``: the minimum over the job's
        ranks (required when the world size is above 1); ``like``: a tree of the state's
        structure (its jax arrays' shardings) for a state flattened by jax; ``verify``: check
        the data's checksum too (a pass over it at ~1 GB/s)."""
        if agree is None:
            if self.me.world_size > 1:
                raise ValueError("restore(agree=...) is required for a world size above 1")
            agree = _alone
        self.flush()
        for source, directory in (("local", self.store.dir), ("persistent", self._persist_dir())):
            found = self._agreed(directory, agree)
            if found is None:
                continue
            t0 = time.perf_counter()
            snapshot, m = found
            data = read_data(snapshot, m, verify=verify)
            state = _unflatten(m, data, like)
            took = time.perf_counter() - t0
            self.stats[f"restores.{source}"] += 1
            log.info("restored step %d from the %s store (%.3fs)", m.step, source, took)
            return Restored(m.step, state, source, m.nbytes, took)
        self.stats["restores.none"] += 1
        return None

    def _persist_dir(self) -> Path | None:
        if self.persistent is None:
            return None
        return self.persistent / f"rank-{self.me.rank}"

    def _agreed(self, directory: Path | None, agree: Agree) -> tuple[Path, Manifest] | None:
        """Two rounds of ``agree`` (every rank runs both, whatever it holds)."""
        valid: dict[int, Manifest] = {}
        if directory is not None:
            from agent.library.local_store import complete_steps

            for held_step in complete_steps(directory):
                m, why = check_snapshot(directory / fmt.step_name(held_step), self.me)
                if m is None:
                    self._record("restores.refused", f"snapshot of step {held_step} refused: {why}")
                else:
                    valid[held_step] = m
        step = fmt.agreed_step(max(valid, default=None), agree)
        held = step if step is not None and step in valid else -1
        if step is None or agree(held) != step:
            return None
        assert directory is not None
        return directory / fmt.step_name(step), valid[step]

    def _record(self, counter: str, message: str) -> None:
        self.stats[counter] += 1
        self.errors.append(f"{time.strftime('%H:%M:%S')} {message}")
        log.warning("%s", message)


# --- the collectives ``agree`` is ---------------------------------------------------------------


def _alone(step: int) -> int:
    return step


def torch_min(step: int) -> int:
    """The minimum of ``step`` over the ranks of torch.distributed's default group."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([step], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def jax_min(step: int) -> int:
    """The minimum of ``step`` over the processes of a ``jax.distributed`` job."""
    from jax.experimental import multihost_utils

    return int(np.min(multihost_utils.process_allgather(np.int64(step))))


# --- states in and out --------------------------------------------------------------------------


def _is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_jax(x: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array)


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray | np.generic) or _is_torch(x) or _is_jax(x)


def _flatten(state: Any) -> tuple[Any, list[np.ndarray], list[Leaf], set[int]]:
    """The tree, the host arrays (device-to-host copied here), each leaf's description and
    which arrays are host copies of their own (``owned``: from a device), not views of live
    memory."""
    enc = fmt.encode_tree(state, _is_array)
    if enc is None or any(_is_jax(x) for x in enc.leaves):
        jax = sys.modules.get("jax")
        if jax is None:
            raise TypeError(f"a state of {type(state).__name__} holds a type this does not know")
        flat = jax.tree_util.tree_leaves(state)
        nodes: list[dict[str, Any]] = []
        objs: list[Any] = []
        for x in flat:
            if _is_array(x):
                objs.append(x)
                nodes.append({"a": len(objs) - 1})
            elif x is None or isinstance(x, bool | int | float | str):
                nodes.append({"v": x})
            else:
                raise TypeError(f"a leaf of type {type(x).__name__}")
        tree: Any = {"jax": nodes}
    else:
        tree, objs = enc.tree, enc.leaves
    arrays: list[np.ndarray] = []
    leaves: list[Leaf] = []
    owned: set[int] = set()
    for x in objs:
        if _is_jax(x):
            leaves.append(_jax_leaf(x, arrays, owned))
        elif _is_torch(x):
            _torch_tables()
            t = x.detach()
            if t.device.type != "cpu":
                t = t.cpu()  # the device-to-host copy the step waits for
                owned.add(len(arrays))
            torch_dtype = None
            if t.dtype.is_floating_point and t.dtype not in _NUMPY_FLOATS:
                torch_dtype = str(t.dtype)
                t = t.view(_SAME_SIZE_INT[t.element_size()])
            arrays.append(t.numpy())
            leaves.append(Leaf("torch", list(x.shape), [len(arrays) - 1], torch_dtype=torch_dtype))
        else:
            arrays.append(np.asarray(x))
            leaves.append(Leaf("numpy", list(np.shape(x)), [len(arrays) - 1]))
    return tree, arrays, leaves, owned


def _jax_leaf(x: Any, arrays: list[np.ndarray], owned: set[int]) -> Leaf:
    """This process's distinct shards of a jax array (a replicated one: one copy); a shard on
    an accelerator comes back as a host copy of its own (``owned``), one on the CPU as a view."""
    shape = list(x.shape)
    seen: dict[tuple[tuple[int, int], ...], int] = {}
    shards = []
    for s in x.addressable_shards:
        index = tuple(_bounds(sl, n) for sl, n in zip(s.index, shape, strict=True))
        if index in seen:
            continue
        if s.device.platform != "cpu":
            owned.add(len(arrays))
        arrays.append(np.asarray(s.data))
        seen[index] = len(arrays) - 1
        shards.append(Shard([list(b) for b in index], len(arrays) - 1))
    return Leaf("jax", shape, shards=shards)


def _bounds(sl: slice, n: int) -> tuple[int, int]:
    start, stop, _ = sl.indices(n)
    return start, stop


def _chunks(arrays: Sequence[np.ndarray], offsets: list[int], total: int) -> list[memoryview]:
    """The data as the arrays themselves and the padding between them (``copy=False``)."""
    out: list[memoryview] = []
    at = 0
    for a, o in zip(arrays, offsets, strict=True):
        if o > at:
            out.append(memoryview(bytes(o - at)))
        out.append(memoryview(np.ascontiguousarray(a)).cast("B"))  # type: ignore[arg-type]
        at = o + a.nbytes
    if total > at:
        out.append(memoryview(bytes(total - at)))
    return out


def _unflatten(m: Manifest, data: memoryview, like: Any) -> Any:
    whole = np.frombuffer(data, dtype=np.uint8)

    def buffer(i: int) -> np.ndarray:
        b = m.buffers[i]
        return whole[b.offset : b.offset + b.nbytes].view(_dtype(b.dtype)).reshape(b.shape)

    tree = m.tree
    if isinstance(tree, dict) and "jax" in tree:
        jax = sys.modules.get("jax")
        if jax is None or like is None:
            raise ValueError("this snapshot was flattened by jax: restore(like=...) its structure")
        targets = jax.tree_util.tree_leaves(like)
        nodes = tree["jax"]
        if len(targets) != len(nodes):
            raise ValueError(f"like has {len(targets)} leaves, the snapshot {len(nodes)}")
        values = [
            _leaf(m.leaves[n["a"]], buffer, t) if "a" in n else n["v"]
            for n, t in zip(nodes, targets, strict=True)
        ]
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(like), values)
    return fmt.decode_tree(tree, lambda i: _leaf(m.leaves[i], buffer, None))


def _leaf(leaf: Leaf, buffer: Callable[[int], np.ndarray], like: Any) -> Any:
    if leaf.kind == "torch":
        import torch

        t = torch.from_numpy(buffer(leaf.buffers[0]))
        if leaf.torch_dtype is not None:
            t = t.view(getattr(torch, leaf.torch_dtype.removeprefix("torch.")))
        return t
    if leaf.kind == "numpy":
        return buffer(leaf.buffers[0])
    # jax: onto like's shardings, else the whole array if this process holds it whole
    if like is not None and hasattr(like, "sharding"):
        import jax

        by_index = {tuple(map(tuple, s.index)): s.buffer for s in leaf.shards}
        shape = tuple(leaf.shape)
        puts = []
        for device, index in like.sharding.addressable_devices_indices_map(shape).items():
            key = tuple(_bounds(sl, n) for sl, n in zip(index, shape, strict=True))
            if key not in by_index:
                raise ValueError(f"no shard {key} of an array of shape {shape} in the snapshot")
            puts.append(jax.device_put(buffer(by_index[key]), device))
        return jax.make_array_from_single_device_arrays(shape, like.sharding, puts)
    whole = [
        s for s in leaf.shards if all(b == [0, n] for b, n in zip(s.index, leaf.shape, strict=True))
    ]
    if not whole:
        raise ValueError("a sharded jax array: restore(like=...) with its sharding")
    return buffer(whole[0].buffer)


def _dtype(name: str) -> np.dtype[Any]:
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes  # bfloat16 and friends, as jax names them

        found: np.dtype[Any] = np.dtype(getattr(ml_dtypes, name))
        return found


_NUMPY_FLOATS: set[Any] = set()
_SAME_SIZE_INT: dict[int, Any] = {}


def _torch_tables() -> None:
    torch = sys.modules.get("torch")
    if torch is None or _NUMPY_FLOATS:
        return
    _NUMPY_FLOATS.update({torch.float16, torch.float32, torch.float64})
    _SAME_SIZE_INT.update({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64})


def from_env(job: str, epoch: int, env: Any = None) -> Snapshots | None:
    """The snapshots of the store the agent handed this trainer (``MARDUK_LOCAL_CKPT_DIR``,
    this rank from torchrun's ``RANK`` and ``WORLD_SIZE``), or None when it handed none."""
    import os

    from agent.channel.handoff import Handoff

    env = os.environ if env is None else env
    given = Handoff.from_env(env)
    if not given.local_ckpt_dir:
        return None
    me = Identity(
        job=job,
        lineage=given.ckpt_lineage or job,
        epoch=epoch,
        world_size=int(env.get("WORLD_SIZE") or 1),
        rank=int(env.get("RANK") or 0),
    )
    flush_ms = given.local_ckpt_flush_ms
    return Snapshots(
        given.local_ckpt_dir,
        me,
        max_bytes=given.local_ckpt_max_bytes or 0,
        flush_s=FLUSH_S if flush_ms is None else flush_ms / 1000,
        persistent=given.persist_ckpt_dir,
    )
