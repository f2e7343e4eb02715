"""Controller state in a JetStream key-value bucket (decisions.md #4).

Keys (the bucket is ``<prefix>_state`` with dots replaced by ``_``)::

    w.<job>.<replica>.<worker>   WorkerRecord   (the registration, applied epoch)
    e.<job>.<replica>            EpochRecord    (epoch, the command that set it)
    e.<job>._job                 EpochRecord    scope ``job`` (no replica token starts with _)
    d.<base64url(device)>        DeviceRecord   (health state, failure history)

Handled health events (the controller's replies) live in a second bucket, ``<prefix>_events``,
whose keys expire after the dedup window: a monitor that retries an event after a restart or a
failover is answered "duplicate" with the original decision.

    h.<base64url(event_id)>      HealthReply

Fencing (decisions.md #13). A leader's first write of its term is the ``term`` key of the
state bucket (``TermRecord``, compare-and-set from the revision it read, refused if a later
term is already there). Every later write of that leader to the state bucket (ceilings,
records, deletes) carries the headers ``Nats-Expected-Last-Subject-Sequence: <revision of its
term key>`` and ``Nats-Expected-Last-Subject-Sequence-Subject: $KV.<bucket>.term``: the server
stores it only while the term key is still the leader's own, so once a successor has claimed
its term, a lapsed leader's delayed or reconnect-buffered write is refused (``Fenced``), not
stored. The events bucket (another stream) cannot be fenced by that key: its writes are made
only after the same batch's fenced state writes were stored (a ``probe`` key is written when a
batch has nothing else for the state bucket), so a dedup record never lands for an event whose
effects a successor could not see.

A controller killed with SIGKILL and started again reads the buckets and has the same map and
epochs. A hot standby keeps a ``StateMirror``: a watch of both buckets, so at takeover it
already holds every record and only waits to have seen the last revision.

Epochs are reserved in blocks: an epoch record's ``ceiling`` is written before any
command above the previous ceiling is published (write-ahead), so a restarted controller issues
above every epoch that may have gone out, and most restarts need no write before their command.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import KeyValueConfig, StorageType
from nats.js.client import JetStreamContext
from nats.js.errors import (
    BucketNotFoundError,
    InvalidKeyError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
)
from nats.js.kv import KeyValue

from marduk.aio import Pulse
from marduk.core.drmap import WorkerKey
from marduk.core.policy import Outcome
from marduk.core.records import DeviceRecord, EpochKey, EpochRecord, WorkerRecord
from marduk.errors import MardukError
from marduk.wire.protocol import HealthReply

log = logging.getLogger("marduk.store")

WRITES_IN_FLIGHT = 2048
"""KV writes awaited together at most (each is one publish and one server acknowledgement)."""


def bucket_name(prefix: str) -> str:
    return prefix.replace(".", "_") + "_state"


def events_bucket_name(prefix: str) -> str:
    return prefix.replace(".", "_") + "_events"


def handled_kv_key(event_id: str) -> str:
    return "h." + base64.urlsafe_b64encode(event_id.encode()).decode().rstrip("=")


def worker_kv_key(key: WorkerKey) -> str:
    return f"w.{key.job}.{key.replica}.{key.worker}"


def epoch_kv_key(key: EpochKey) -> str:
    return f"e.{key.job}.{key.replica or '_job'}"


def device_kv_key(device: str) -> str:
    return "d." + base64.urlsafe_b64encode(device.encode()).decode().rstrip("=")


TERM_KEY = "term"
"""The state bucket's fencing key: the term of the leader allowed to write (``TermRecord``)."""
PROBE_KEY = "probe"
"""Written (fenced) when a batch has dedup records but nothing else for the state bucket."""
_FENCE_KEYS = frozenset({TERM_KEY, PROBE_KEY})
_EXPECTED_SEQ = "Nats-Expected-Last-Subject-Sequence"
_EXPECTED_SEQ_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"
_WRONG_LAST_SEQUENCE = b"10071"  # JetStream's err_code for "wrong last sequence"


class TermRecord(msgspec.Struct, kw_only=True):
    """The value of the ``term`` key: who leads the state bucket, from which lease term."""

    term: int
    holder: str
    claimed_at: float = 0.0


class Loaded(msgspec.Struct):
    workers: list[WorkerRecord]
    epochs: list[EpochRecord]
    devices: list[DeviceRecord]
    handled: list[HealthReply] = []
    skipped: int = 0

    def add(self, key: str, value: bytes) -> None:
        """Decode one record by its key's kind; an unreadable one is skipped and counted."""
        try:
            if key.startswith("w."):
                self.workers.append(msgspec.json.decode(value, type=WorkerRecord))
            elif key.startswith("e."):
                self.epochs.append(msgspec.json.decode(value, type=EpochRecord))
            elif key.startswith("d."):
                self.devices.append(msgspec.json.decode(value, type=DeviceRecord))
            elif key.startswith("h."):
                self.handled.append(msgspec.json.decode(value, type=HealthReply))
        except msgspec.DecodeError as e:
            self.skipped += 1
            log.warning("skipping unreadable state record %s: %s", key, e)


class StateStore:
    """Reads and writes the controller's records."""

    def __init__(self, kv: KeyValue, bucket: str, events: KeyValue, events_bucket: str) -> None:
        self.kv = kv
        self.bucket = bucket
        self.events = events
        self.events_bucket = events_bucket
        self._enc = msgspec.json.Encoder()
        self._writer = BatchWriter(kv._js._nc)  # the connection the buckets were bound on
        self.term = 0
        """The term whose key this store's writes are fenced by (0: not claimed, unfenced)."""
        self._fence: dict[str, str] = {}

    async def claim_term(self, term: int, holder: str) -> int:
        """Make ``term`` the state bucket's term: compare-and-set on the ``term`` key, from
        then on every write carries its revision. Raises ``Fenced`` if the key already holds
        this term or a later one (another leader has claimed it: we are not the leader).
        Returns the revision. Until it succeeds, writes keep the fence of our earlier term (if
        any), which the server refuses once this claim is stored."""
        value = msgspec.json.encode(TermRecord(term=term, holder=holder, claimed_at=time.time()))
        while True:
            try:
                entry = await self.kv.get(TERM_KEY)
            except (KeyNotFoundError, KeyDeletedError):
                entry = None
            current = _decode_term(entry.value if entry is not None else None)
            if current is not None and current.term >= term:
                raise Fenced(f"term {current.term} was claimed by {current.holder}", current.term)
            try:
                if entry is None:
                    revision = await self.kv.create(TERM_KEY, value)
                else:
                    revision = await self.kv.update(TERM_KEY, value, last=entry.revision)
            except KeyWrongLastSequenceError:
                continue  # someone wrote it meanwhile: read it again
            self.term = term
            self._fence = {
                _EXPECTED_SEQ: str(revision),
                _EXPECTED_SEQ_SUBJECT: self.kv._pre + TERM_KEY,
            }
            return revision

    @classmethod
    async def open(
        cls, nc: NATS, prefix: str, *, replicas: int = 1, dedup_window_s: float = 3600.0
    ) -> StateStore:
        """Bind the buckets, creating them (file storage, one revision per key) if needed."""
        js = nc.jetstream(timeout=5.0)
        kv = await _bucket(
            js,
            KeyValueConfig(
                bucket=bucket_name(prefix),
                history=1,
                storage=StorageType.FILE,
                replicas=replicas,
                description="Marduk controller state: registrations, epochs, devices",
            ),
        )
        events = await _bucket(
            js,
            KeyValueConfig(
                bucket=events_bucket_name(prefix),
                history=1,
                ttl=dedup_window_s,
                storage=StorageType.FILE,
                replicas=replicas,
                description="Marduk: health events handled (dedup across restarts)",
            ),
        )
        return cls(kv, bucket_name(prefix), events, events_bucket_name(prefix))

    async def load_handled(self) -> list[HealthReply]:
        """The handled events still inside the dedup window (the events bucket)."""
        out = Loaded([], [], [])
        async for key, value in read_bucket(self.events, self.events_bucket):
            out.add(key, value)
        return out.handled

    async def load(self) -> Loaded:
        """Every record in both buckets. Records that no longer decode are skipped and counted."""
        out = Loaded([], [], [])
        for kv, bucket in ((self.kv, self.bucket), (self.events, self.events_bucket)):
            async for key, value in read_bucket(kv, bucket):
                out.add(key, value)
        return out

    async def write_ahead(self, ceilings: list[EpochRecord]) -> None:
        """Persist the epoch ceilings that must be durable before commands go out (all at
        once: one batch of writes in flight)."""
        enc = self._enc.encode
        await self._write(
            self.kv,
            {epoch_kv_key(EpochKey(e.job, e.replica)): enc(e) for e in ceilings},
            self._fence,
        )

    async def apply(self, outcomes: list[Outcome]) -> None:
        """Persist the other records some outcomes changed, in decision order: where two
        outcomes write one key, only the later write is made."""
        state: dict[str, bytes | None] = {}  # None: delete
        handled: dict[str, bytes | None] = {}
        enc = self._enc.encode
        for o in outcomes:
            for rec in o.put_workers:
                reg = rec.registration
                state[worker_kv_key(WorkerKey(reg.job, reg.replica, reg.worker))] = enc(rec)
            for key in o.deleted_workers:
                state[worker_kv_key(key)] = None
            for epoch in o.put_epochs:
                state[epoch_kv_key(EpochKey(epoch.job, epoch.replica))] = enc(epoch)
            for ekey in o.deleted_epochs:
                state[epoch_kv_key(ekey)] = None
            for device in o.put_devices:
                state[device_kv_key(device.device)] = enc(device)
            for name in o.deleted_devices:
                state[device_kv_key(name)] = None
            for reply in o.handled:
                handled[handled_kv_key(reply.event_id)] = enc(reply)
        if handled and not state and self._fence:
            state[PROBE_KEY] = str(self.term).encode()
        # The state first, fenced; the dedup records only once it is stored (see the top).
        await self._write(self.kv, state, self._fence)
        await self._write(self.events, handled)

    async def _write(
        self, kv: KeyValue, writes: dict[str, bytes | None], headers: dict[str, str] | None = None
    ) -> None:
        """Make ``writes`` (key -> value, None to delete) with many writes in flight at once
        (each key once, so their order does not matter); raise the first error once all have
        been tried."""
        if not writes:
            return
        if type(kv) is KeyValue:
            await self._writer.write(kv, writes, headers=headers)
            return
        # Anything else that looks like a bucket (a test's recorder around one): key by key.
        items = list(writes.items())
        errors: list[BaseException] = []
        for i in range(0, len(items), WRITES_IN_FLIGHT):
            results = await asyncio.gather(
                *(
                    kv.put(key, value) if value is not None else self._delete(kv, key)
                    for key, value in items[i : i + WRITES_IN_FLIGHT]
                ),
                return_exceptions=True,
            )
            errors += [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]

    @staticmethod
    async def _delete(kv: KeyValue, key: str) -> None:
        try:
            await kv.delete(key)
        except KeyNotFoundError:
            pass


class WriteError(MardukError):
    """The server refused (or did not acknowledge) some writes of a batch."""


class Fenced(WriteError):
    """The server refused a write because another leader's term began (the term key moved),
    or the term is already claimed: this controller is not the leader any more."""

    def __init__(self, message: str, term: int = 0) -> None:
        super().__init__(message)
        self.term = term  # the term claimed in the store, where known


_VALID_KEY = re.compile(r"[-/_=a-zA-Z0-9]+(\.[-/_=a-zA-Z0-9]+)*")


class BatchWriter:
    """Writes many keys of a bucket at once, with one subscription for every acknowledgement.

    ``KeyValue.put`` is one request per key: a reply future, a timer, a random token (an
    ``os.urandom`` call) and a parsed acknowledgement each, about a quarter of the leader's
    CPU at 2,000 registrations a second. Here a batch's puts and deletes are published with
    replies to ``<inbox>.<batch>.<n>``, on one subscription made once per connection (not a
    subscription per batch: on a cluster every SUB and UNSUB is interest that travels the
    routes), and the acknowledgements are counted.
    """

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self._inbox = ""
        self._sub: Any = None
        self._subscribing = asyncio.Lock()
        self._batches: dict[str, _Batch] = {}
        self._next = 0

    async def write(
        self,
        kv: KeyValue,
        writes: dict[str, bytes | None],
        *,
        timeout: float = 5.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Put (or, for None, delete) the keys, each with ``headers`` (the term's fence).
        Raises ``Fenced`` if the fence refused any, ``WriteError`` if any other was refused or
        not acknowledged within ``timeout``; every write is idempotent, so the caller may
        retry the batch (not a fenced one: it will never be stored)."""
        for key in writes:
            if not _VALID_KEY.fullmatch(key):
                raise InvalidKeyError(key)
        if not writes:
            return
        await self._subscribe()
        self._next += 1
        batch_id = str(self._next)
        batch = self._batches[batch_id] = _Batch(len(writes))
        reply_prefix = f"{self._inbox}.{batch_id}."
        try:
            for i, (key, value) in enumerate(writes.items()):
                # kv._pre: the bucket's subject prefix ("$KV.<bucket>.", or with a JetStream
                # API prefix), as KeyValue.put itself builds the subject.
                subject, reply = kv._pre + key, reply_prefix + str(i)
                if value is None:
                    hdrs = {**headers, _KV_OP: _KV_DEL} if headers else {_KV_OP: _KV_DEL}
                    await self.nc.publish(subject, b"", reply=reply, headers=hdrs)
                else:
                    await self.nc.publish(subject, value, reply=reply, headers=headers or None)
            try:
                await asyncio.wait_for(asyncio.shield(batch.done), timeout)
            except TimeoutError:
                raise WriteError(
                    f"{batch.remaining} of {len(writes)} writes not acknowledged"
                ) from None
        finally:
            del self._batches[batch_id]  # a late acknowledgement is dropped
        if batch.fenced:
            raise Fenced(f"{batch.fenced} of {len(writes)} writes refused: another term began")
        if batch.refused:
            raise WriteError(
                f"{len(batch.refused)} of {len(writes)} writes refused: {batch.refused[0]}"
            )

    async def _subscribe(self) -> None:
        async with self._subscribing:
            if self._sub is None:
                self._inbox = self.nc.new_inbox()
                self._sub = await self.nc.subscribe(
                    self._inbox + ".>",
                    cb=self._on_ack,
                    pending_msgs_limit=1_000_000,
                    pending_bytes_limit=256 * 1024 * 1024,
                )

    async def _on_ack(self, msg: Msg) -> None:
        batch = self._batches.get(msg.subject[len(self._inbox) + 1 :].split(".", 1)[0])
        if batch is not None:
            batch.acknowledged(msg)


class _Batch:
    def __init__(self, count: int) -> None:
        self.remaining = count
        self.refused: list[str] = []
        self.fenced = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def acknowledged(self, msg: Msg) -> None:
        # {"stream":..,"seq":..} or {"error":{..}}; a bare status (503: no stream) is an error.
        if b'"error"' in msg.data or not msg.data:
            self.refused.append(msg.data.decode(errors="replace")[:200] or str(msg.headers))
            if _WRONG_LAST_SEQUENCE in msg.data:
                self.fenced += 1
        self.remaining -= 1
        if self.remaining == 0 and not self.done.done():
            self.done.set_result(None)


_KV_OP, _KV_DEL = "KV-Operation", "DEL"


async def _bucket(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    try:
        return await js.key_value(config.bucket)
    except BucketNotFoundError:
        return await js.create_key_value(config)


async def read_bucket(
    kv: KeyValue, bucket: str, *, timeout: float = 10.0
) -> AsyncIterator[tuple[str, bytes]]:
    """Every key of a bucket with its value (deleted keys left out), read with one watch.

    Not ``KeyValue.watchall``'s end marker: nats-py sends it when the consumer's info says
    nothing is pending and its callback has not run yet, which is also the case when the server
    has already pushed every record and the callback is waiting for that very answer: a load
    then read an empty bucket (a restarted controller with no workers, 6 loads in 150 of a
    bucket of 303 records). The end here is the server's own count on each record: the one
    delivered with nothing pending after it. An empty bucket is known from the stream's message
    count before watching; a quiet second with nothing pending on the server (the last record
    expired while we read) ends it too. Raises ``TimeoutError`` after ``timeout`` seconds
    without a record while the server says more are pending."""
    info = await kv._js.stream_info(f"KV_{bucket}")
    if not info.state.messages:
        return
    watcher = await kv.watchall()
    quiet = 0.0
    try:
        while True:
            try:
                entry = await watcher.updates(timeout=1.0)  # type: ignore[no-untyped-call]
            except (TimeoutError, NatsTimeoutError):
                sub: Any = watcher._sub  # the watch's ordered consumer
                pending = (await sub.consumer_info()).num_pending
                quiet += 1.0
                if not pending:
                    return
                if quiet >= timeout:
                    raise TimeoutError(
                        f"{bucket}: {pending} records pending, none delivered"
                    ) from None
                continue
            quiet = 0.0
            if entry is None:  # nats-py's end marker (see above): not trusted
                continue
            if entry.value is not None and entry.operation is None:
                yield entry.key, entry.value
            if not entry.delta:
                return
    finally:
        await watcher.stop()  # type: ignore[no-untyped-call]


class StateMirror:
    """A hot standby's copy of the state bucket, kept current by a KV watch.

    Records are decoded as they arrive (the standby has time; a new leader does not), so
    ``snapshot()`` only lists them. ``caught_up()`` says whether it has seen every revision the
    bucket had when asked (so a new leader does not miss the old one's last writes). If the
    watch breaks, the mirror is marked unusable and takeover falls back to
    ``StateStore.load()``.
    """

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self._workers: dict[str, WorkerRecord] = {}
        self._epochs: dict[str, EpochRecord] = {}
        self._devices: dict[str, DeviceRecord] = {}
        self._unreadable: set[str] = set()
        self.revision: dict[str, int] = {}  # bucket -> last revision seen
        self.version = 0  # bumped on every change to the records
        self.changed_at = time.monotonic()
        self.changed = Pulse()  # beats on every change to the records
        self.healthy = False
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self.healthy = True
        # The state bucket only: the events bucket's keys expire by TTL without a delete a
        # watch would see, so a mirror of it would only grow; it is read at takeover instead.
        for kv, bucket in ((self.store.kv, self.store.bucket),):
            watcher = await kv.watchall()
            self._tasks.append(
                asyncio.create_task(self._follow(watcher, bucket), name=f"mirror-{bucket}")
            )

    def _put(self, key: str, value: bytes) -> None:
        self._drop(key)
        try:
            if key.startswith("w."):
                self._workers[key] = _decode_worker(value)
            elif key.startswith("e."):
                self._epochs[key] = _decode_epoch(value)
            elif key.startswith("d."):
                self._devices[key] = _decode_device(value)
        except msgspec.DecodeError as e:
            self._unreadable.add(key)
            log.warning("skipping unreadable state record %s: %s", key, e)

    def _drop(self, key: str) -> None:
        self.version += 1
        self.changed_at = time.monotonic()
        self.changed.notify()
        for records in (self._workers, self._epochs, self._devices):
            records.pop(key, None)
        self._unreadable.discard(key)

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
                if entry.key in _FENCE_KEYS:
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
        return Loaded(
            [copy.copy(r) for r in self._workers.values()],
            [copy.copy(r) for r in self._epochs.values()],
            [copy.copy(r) for r in self._devices.values()],
            skipped=len(self._unreadable),
        )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self.healthy = False


def _decode_term(value: bytes | None) -> TermRecord | None:
    if not value:
        return None
    try:
        return msgspec.json.decode(value, type=TermRecord)
    except msgspec.DecodeError:
        return None


_decode_worker = msgspec.json.Decoder(WorkerRecord).decode
_decode_epoch = msgspec.json.Decoder(EpochRecord).decode
_decode_device = msgspec.json.Decoder(DeviceRecord).decode
