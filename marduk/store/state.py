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
import logging

import msgspec
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import (
    KeyNotFoundError,
)
from nats.js.kv import KeyValue

from marduk.core.drmap import WorkerKey
from marduk.core.policy import Outcome
from marduk.core.records import DeviceRecord, EpochKey, EpochRecord, WorkerRecord
from marduk.store.kv import (
    TERM_KEY,
    BatchWriter,
    claim_term,
    open_bucket,
    read_bucket,
)
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


PROBE_KEY = "probe"
"""Written (fenced) when a batch has dedup records but nothing else for the state bucket."""
FENCE_KEYS = frozenset({TERM_KEY, PROBE_KEY})


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
        revision, self._fence = await claim_term(self.kv, term, holder)
        self.term = term
        return revision

    @classmethod
    async def open(
        cls, nc: NATS, prefix: str, *, replicas: int = 1, dedup_window_s: float = 3600.0
    ) -> StateStore:
        """Bind the buckets, creating them (file storage, one revision per key) if needed."""
        js = nc.jetstream(timeout=5.0)
        kv = await open_bucket(
            js,
            KeyValueConfig(
                bucket=bucket_name(prefix),
                history=1,
                storage=StorageType.FILE,
                replicas=replicas,
                description="Marduk controller state: registrations, epochs, devices",
            ),
        )
        events = await open_bucket(
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


decode_worker = msgspec.json.Decoder(WorkerRecord).decode
decode_epoch = msgspec.json.Decoder(EpochRecord).decode
decode_device = msgspec.json.Decoder(DeviceRecord).decode
