"""A hot standby's copy of the state bucket (``StateMirror``), kept current by a KV watch, so a
takeover only waits to have seen the last revision. See marduk/store/state.py for the records.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from typing import Any

import msgspec
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.client import JetStreamContext

from marduk.aio import Pulse, TaskSet
from marduk.core.records import DeviceRecord, EpochRecord, WorkerRecord
from marduk.store.state import (
    FENCE_KEYS,
    Loaded,
    StateStore,
    decode_device,
    decode_epoch,
    decode_worker,
)

log = logging.getLogger("marduk.store")


class StateMirror:
    """A hot standby's copy of the state bucket, kept current by a KV watch.

    Records are decoded as they arrive (the standby has time; a new leader does not), so
    ``snapshot()`` only lists them. Not while this controller leads (``leading``): every
    write is then its own, already in its policy, and decoding each one as the watch echoes it
    back was ~3.5% of the leader's time under health events. Those are kept as the bytes
    written and decoded when the mirror is read (``snapshot``) or the controller stops leading
    (``leading = False``: a standby decodes as records come again), so the mirror is as
    current at a takeover, or a re-election from it, as if each had been decoded on arrival.

    ``caught_up()`` says whether it has seen every revision the bucket had when asked (so a new
    leader does not miss the old one's last writes). If the watch breaks, the mirror is marked
    unusable and takeover falls back to ``StateStore.load()``.
    """

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self._workers: dict[str, WorkerRecord] = {}
        self._epochs: dict[str, EpochRecord] = {}
        self._devices: dict[str, DeviceRecord] = {}
        self._unreadable: set[str] = set()
        self._undecoded: dict[str, bytes] = {}  # key -> value, written while leading
        self._leading = False
        self.revision: dict[str, int] = {}  # bucket -> last revision seen
        self.version = 0  # bumped on every change to the records
        self.changed_at = time.monotonic()
        self.changed = Pulse()  # beats on every change to the records
        self.healthy = False
        self._tasks = TaskSet(self._follow_failed, prefix="mirror-")

    async def start(self) -> None:
        self.healthy = True
        # The state bucket only: the events bucket's keys expire by TTL without a delete a
        # watch would see, so a mirror of it would only grow; it is read at takeover instead.
        for kv, bucket in ((self.store.kv, self.store.bucket),):
            watcher = await kv.watchall()
            self._tasks.spawn(self._follow(watcher, bucket), bucket)

    @property
    def leading(self) -> bool:
        return self._leading

    @leading.setter
    def leading(self, leading: bool) -> None:
        """Set by the controller as it starts and stops serving."""
        self._leading = leading
        if not leading:
            self._decode_held()

    def _decode_held(self) -> None:
        held, self._undecoded = self._undecoded, {}
        for key, value in held.items():
            self._decode(key, value)

    def _put(self, key: str, value: bytes) -> None:
        self._drop(key)
        if self._leading:
            self._undecoded[key] = value
        else:
            self._decode(key, value)

    def _decode(self, key: str, value: bytes) -> None:
        try:
            if key.startswith("w."):
                self._workers[key] = decode_worker(value)
            elif key.startswith("e."):
                self._epochs[key] = decode_epoch(value)
            elif key.startswith("d."):
                self._devices[key] = decode_device(value)
        except msgspec.DecodeError as e:
            self._unreadable.add(key)
            log.warning("skipping unreadable state record %s: %s", key, e)

    def _drop(self, key: str) -> None:
        self.version += 1
        self.changed_at = time.monotonic()
        self.changed.notify()
        for records in (self._workers, self._epochs, self._devices):
            records.pop(key, None)
        self._undecoded.pop(key, None)
        self._unreadable.discard(key)

    def _follow_failed(self, task: asyncio.Task[Any], e: BaseException) -> None:
        # _follow catches every Exception itself; anything else ends the mirror the same way.
        self.healthy = False
        log.warning("state mirror task %s ended (%s); takeover will reload", task.get_name(), e)

    async def _follow(self, watcher: Any, bucket: str) -> None:
        try:
            while True:
                try:
                    entry = await watcher.updates(timeout=3600.0)
                except (TimeoutError, NatsTimeoutError):
                    continue
                if entry is None:  # end of the initial values
                    continue
                self.revision[bucket] = max(self.revision.get(bucket, 0), entry.revision or 0)
                if entry.key in FENCE_KEYS:
                    continue  # no record: a policy prepared before a term's claim still holds
                if entry.operation is not None or entry.value is None:
                    self._drop(entry.key)
                else:
                    self._put(entry.key, entry.value)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.healthy = False
            log.warning("state mirror of %s stopped (%s); takeover will reload", bucket, e)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()

    async def caught_up(
        self, js: JetStreamContext, *, stall: float = 1.0, limit: float = 60.0
    ) -> bool:
        """True once the mirror has seen the last revision the bucket had when called.

        It waits as long as the mirror makes progress (a fresh controller's watch is still
        replaying 50k records: reading them again would only take longer), but gives up after
        ``stall`` seconds without progress or ``limit`` in all."""
        if not self.healthy:
            return False
        targets = {}
        for bucket in (self.store.bucket,):
            info = await js.stream_info(f"KV_{bucket}")
            targets[bucket] = info.state.last_seq
        start = last_progress = time.monotonic()
        seen = dict(self.revision)
        while any(self.revision.get(b, 0) < seq for b, seq in targets.items()):
            # Deleted keys' revisions may be purged; a bucket with nothing left has no entry.
            now = time.monotonic()
            if self.revision != seen:
                seen, last_progress = dict(self.revision), now
            if not self.healthy or now - last_progress > stall or now - start > limit:
                return False
            await asyncio.sleep(0.01)
        return True

    def snapshot(self) -> Loaded:
        """Copies of the records: a policy built from them edits its records in place, and the
        mirror must keep showing the bucket, not a leader's decisions (a leader that steps down
        drops the ones it never wrote, and leads again from the mirror). Shallow copies do: the
        policy replaces a record's lists and command, it never edits them."""
        self._decode_held()  # written while leading (no await: the mirror holds still)
        return Loaded(
            [copy.copy(r) for r in self._workers.values()],
            [copy.copy(r) for r in self._epochs.values()],
            [copy.copy(r) for r in self._devices.values()],
            skipped=len(self._unreadable),
        )

    async def stop(self) -> None:
        await self._tasks.stop()
        self.healthy = False
