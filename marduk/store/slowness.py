"""Devices' slowness records in JetStream (decisions.md 19): a device found slow keeps that on its
record after its job ends and across controller restarts and failovers.

The bucket is ``<prefix>_perf`` (dots replaced by ``_``), one key per device::

    s.<base64url(device)>   SlowDevice   (detections, the runs it was slow in, worst score)

Apart from the state bucket on purpose: a record is evidence, not a decision (no command, no
epoch hangs on it), and the state bucket is mirrored by every standby. Fenced like the state
bucket's writes all the same (decisions.md #13), by a ``term`` key of its own: a leader claims
its term here (``claim_term``, compare-and-set, refused if a later term is there) before its
first read-modify-write of a record, and every write carries that key's revision, so once a
successor has claimed its term the server refuses a lapsed leader's delayed write (``Fenced``):
no count is lost to a race between two leaders. Writes are rare (one per straggler detected
per device), reads are one key, or the whole bucket for ``ctl.perf_query``.
"""

from __future__ import annotations

import base64
import logging

import msgspec
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyDeletedError, KeyNotFoundError
from nats.js.kv import KeyValue

from marduk.store.kv import TERM_KEY, BatchWriter, claim_term, open_bucket, read_bucket
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
        self._writer = BatchWriter(kv._js._nc)  # the connection the bucket was bound on
        self.term = 0
        """The term this store's writes are fenced by (0: none claimed: writes refused)."""
        self._fence: dict[str, str] = {}

    async def claim_term(self, term: int, holder: str) -> None:
        """Make ``term`` the bucket's term (``marduk.store.kv.claim_term``); raises ``Fenced``
        if this term or a later one is claimed already."""
        _, self._fence = await claim_term(self._kv, term, holder)
        self.term = term

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
        """Write the record, fenced by the claimed term (``Fenced`` once another began)."""
        if not self._fence:
            raise RuntimeError("no term claimed: slowness records are written fenced")
        data = msgspec.json.encode(record)
        await self._writer.write(self._kv, {slow_kv_key(record.device): data}, headers=self._fence)

    async def load(self) -> list[SlowDevice]:
        out = []
        async for key, value in read_bucket(self._kv, self.bucket):
            if key == TERM_KEY:
                continue
            try:
                out.append(msgspec.json.decode(value, type=SlowDevice))
            except msgspec.DecodeError:
                continue
        return out
