"""Controller state in a JetStream key-value bucket (DESIGN.md decision 4).

Keys (the bucket is ``<prefix>_state`` with dots replaced by ``_``)::

    w.<job>.<replica>.<worker>   WorkerRecord   (the registration, applied epoch)
    e.<job>.<replica>            EpochRecord    (epoch, the command that set it)
    e.<job>._job                 EpochRecord    scope ``job`` (no replica token starts with _)
    d.<base64url(device)>        DeviceRecord   (health state, failure history)

A controller killed with SIGKILL and started again reads the bucket and has the same map and
epochs. Epochs are reserved in blocks: an epoch record's ``ceiling`` is written before any
command above the previous ceiling is published (write-ahead), so a restarted controller issues
above every epoch that may have gone out, and most restarts need no write before their command.
"""

from __future__ import annotations

import base64
import logging

import msgspec
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError
from nats.js.kv import KeyValue

from marduk.drmap import WorkerKey
from marduk.policy import DeviceRecord, EpochKey, EpochRecord, Outcome, WorkerRecord

log = logging.getLogger("marduk.store")


def bucket_name(prefix: str) -> str:
    return prefix.replace(".", "_") + "_state"


def worker_kv_key(key: WorkerKey) -> str:
    return f"w.{key.job}.{key.replica}.{key.worker}"


def epoch_kv_key(key: EpochKey) -> str:
    return f"e.{key.job}.{key.replica or '_job'}"


def device_kv_key(device: str) -> str:
    return "d." + base64.urlsafe_b64encode(device.encode()).decode().rstrip("=")


class Loaded(msgspec.Struct):
    workers: list[WorkerRecord]
    epochs: list[EpochRecord]
    devices: list[DeviceRecord]
    skipped: int = 0


class StateStore:
    """Reads and writes the controller's records."""

    def __init__(self, kv: KeyValue, bucket: str) -> None:
        self.kv = kv
        self.bucket = bucket
        self._enc = msgspec.json.Encoder()

    @classmethod
    async def open(cls, nc: NATS, prefix: str, *, replicas: int = 1) -> StateStore:
        """Bind the bucket, creating it (file storage, one revision per key) if needed."""
        js = nc.jetstream(timeout=5.0)
        name = bucket_name(prefix)
        try:
            kv = await js.key_value(name)
        except BucketNotFoundError:
            kv = await js.create_key_value(
                KeyValueConfig(
                    bucket=name,
                    history=1,
                    storage=StorageType.FILE,
                    replicas=replicas,
                    description="Marduk controller state: registrations, epochs, devices",
                )
            )
        return cls(kv, name)

    async def load(self) -> Loaded:
        """Every record in the bucket. Records that no longer decode are skipped and counted."""
        out = Loaded([], [], [])
        watcher = await self.kv.watchall(ignore_deletes=True)
        try:
            while True:
                entry = await watcher.updates(timeout=10.0)  # type: ignore[no-untyped-call]
                if entry is None:
                    break
                if entry.value is None or entry.operation is not None:
                    continue
                try:
                    if entry.key.startswith("w."):
                        out.workers.append(msgspec.json.decode(entry.value, type=WorkerRecord))
                    elif entry.key.startswith("e."):
                        out.epochs.append(msgspec.json.decode(entry.value, type=EpochRecord))
                    elif entry.key.startswith("d."):
                        out.devices.append(msgspec.json.decode(entry.value, type=DeviceRecord))
                except msgspec.DecodeError as e:
                    out.skipped += 1
                    log.warning("skipping unreadable state record %s: %s", entry.key, e)
        finally:
            await watcher.stop()  # type: ignore[no-untyped-call]
        return out

    async def write_ahead(self, outcome: Outcome) -> None:
        """Persist the epoch ceilings that must be durable before commands go out."""
        for epoch in outcome.write_ahead:
            await self.kv.put(
                epoch_kv_key(EpochKey(epoch.job, epoch.replica)), self._enc.encode(epoch)
            )

    async def apply(self, outcome: Outcome) -> None:
        """Persist the other records an outcome changed."""
        for rec in outcome.put_workers:
            reg = rec.registration
            await self.kv.put(
                worker_kv_key(WorkerKey(reg.job, reg.replica, reg.worker)), self._enc.encode(rec)
            )
        for key in outcome.deleted_workers:
            await self._delete(worker_kv_key(key))
        for epoch in outcome.put_epochs:
            await self.kv.put(
                epoch_kv_key(EpochKey(epoch.job, epoch.replica)), self._enc.encode(epoch)
            )
        for ekey in outcome.deleted_epochs:
            await self._delete(epoch_kv_key(ekey))
        for device in outcome.put_devices:
            await self.kv.put(device_kv_key(device.device), self._enc.encode(device))

    async def _delete(self, key: str) -> None:
        try:
            await self.kv.delete(key)
        except KeyNotFoundError:
            pass
