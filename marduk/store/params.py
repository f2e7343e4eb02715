"""Live parameters in their own JetStream key-value bucket (decisions.md #20).

Bucket ``<prefix>_params`` (dots replaced by ``_``), one key per job::

    p.<job>    JobParams   (the desired values, their version, who set them)

Every write is a compare-and-set on the key's revision (``KeyValue.update(last=...)``): two
controllers, or two sets racing in one, can never overwrite each other's version; the loser
reads the key again and applies its change on top (``ParamsDesk``), so no update is lost and the
last writer's values win. The bucket keeps a few revisions per key: what a job ran before.

Apart from the state bucket on purpose: its records are the restart policy's (mirrored by every
standby, rebuilt at takeover); parameters are read whole at each term and are few.
"""

from __future__ import annotations

import msgspec
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyDeletedError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from marduk.errors import MardukError
from marduk.store.kv import open_bucket, read_bucket
from marduk.wire.params import JobParams

HISTORY = 8


class ParamsConflict(MardukError):
    """The key changed since it was read (another set, another controller): read it again."""


def params_bucket_name(prefix: str) -> str:
    return prefix.replace(".", "_") + "_params"


def params_kv_key(job: str) -> str:
    return f"p.{job}"


class ParamsStore:
    def __init__(self, kv: KeyValue, bucket: str) -> None:
        self.kv = kv
        self.bucket = bucket

    @classmethod
    async def open(cls, nc: NATS, prefix: str, *, replicas: int = 1) -> ParamsStore:
        js = nc.jetstream(timeout=5.0)
        kv = await open_bucket(
            js,
            KeyValueConfig(
                bucket=params_bucket_name(prefix),
                history=HISTORY,
                storage=StorageType.FILE,
                replicas=replicas,
                description="Marduk: live parameters, the desired values per job",
            ),
        )
        return cls(kv, params_bucket_name(prefix))

    async def load(self) -> tuple[dict[str, tuple[JobParams, int]], int]:
        """Every job's document with its revision; and how many records did not decode."""
        out: dict[str, tuple[JobParams, int]] = {}
        skipped = 0
        async for key, value in read_bucket(self.kv, self.bucket):
            job = key[2:] if key.startswith("p.") else ""
            try:
                params = msgspec.json.decode(value, type=JobParams)
            except (msgspec.DecodeError, msgspec.ValidationError):
                skipped += 1
                continue
            if params.job != job:
                skipped += 1
                continue
            out[job] = (params, 0)
        # read_bucket gives no revisions: ask each key (few: one per job with parameters).
        for job in list(out):
            got = await self.get(job)
            if got is not None:
                out[job] = got
        return out, skipped

    async def get(self, job: str) -> tuple[JobParams, int] | None:
        try:
            entry = await self.kv.get(params_kv_key(job))
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if entry.value is None or entry.revision is None:
            return None
        try:
            return msgspec.json.decode(entry.value, type=JobParams), entry.revision
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    async def put(self, params: JobParams, revision: int) -> int:
        """Store ``params`` if the key is still at ``revision`` (0: absent); its new revision.
        Raises ParamsConflict if it is not."""
        data = msgspec.json.encode(params)
        key = params_kv_key(params.job)
        try:
            if revision == 0:
                return await self.kv.create(key, data)
            return await self.kv.update(key, data, last=revision)
        except KeyWrongLastSequenceError:
            raise ParamsConflict(f"{key} changed since revision {revision}") from None
        except Exception as e:
            # create() on an existing key raises a plain API error (wrong last sequence 0).
            if "wrong last sequence" in str(e):
                raise ParamsConflict(f"{key} exists already") from None
            raise
