"""Devices' slowness records in JetStream (decisions.md 19): a device found slow keeps that on its
record after its job ends and across controller restarts and failovers.

The bucket is ``<prefix>_perf`` (dots replaced by ``_``), one key per device::

    s.<base64url(device)>   SlowDevice   (detections, the runs it was slow in, worst score)

Apart from the state bucket on purpose: a record is evidence, not a decision (no command, no
epoch hangs on it), so it is written after the event without the term's fence, read-modify-write
(a lost race between two leaders loses one count, never a device). Writes are rare (one per
straggler detected per device), reads are one key, or the whole bucket for ``ctl.perf_query``.
"""

from __future__ import annotations

import base64
import logging

import msgspec
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue

from marduk.store.kv import open_bucket, read_bucket
from marduk.wire.perf import SlowDevice

log = logging.getLogger("marduk.store")


def perf_bucket_name(prefix: str) -> str:
    return prefix.replace(".", "_") + "_perf"


def slow_kv_key(device: str) -> str:
    return "s." + base64.urlsafe_b64encode(device.encode()).decode().rstrip("=")


class SlownessStore:
    """Read and write devices' slowness records."""

    def __init__(self, kv: KeyValue, bucket: str) -> None:
        self._kv = kv
        self.bucket = bucket

    @classmethod
    async def open(cls, nc: NATS, prefix: str, *, replicas: int = 1) -> SlownessStore:
        bucket = perf_bucket_name(prefix)
        config = KeyValueConfig(
            bucket=bucket, history=1, storage=StorageType.FILE, replicas=replicas
        )
        return cls(await open_bucket(nc.jetstream(), config), bucket)

    async def get(self, device: str) -> SlowDevice | None:
        try:
            entry = await self._kv.get(slow_kv_key(device))
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if not entry.value:
            return None
        try:
            return msgspec.json.decode(entry.value, type=SlowDevice)
        except msgspec.DecodeError:
            log.warning("unreadable slowness record for %s: ignored", device)
            return None

    async def put(self, record: SlowDevice) -> None:
        await self._kv.put(slow_kv_key(record.device), msgspec.json.encode(record))

    async def load(self) -> list[SlowDevice]:
        out = []
        async for _key, value in read_bucket(self._kv, self.bucket):
            try:
                out.append(msgspec.json.decode(value, type=SlowDevice))
            except msgspec.DecodeError:
                continue
        return out
