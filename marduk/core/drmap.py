"""DRMap: the many-to-many map between physical devices and training replicas.

Pure data structure, no I/O. A replica spans one or more workers (one per host, say); each worker
registers the devices it uses. The map answers both ways:

* ``replicas_for_device(d)``: the replicas to tell when device ``d`` fails;
* ``devices_for_replica(r)``: every device any worker of replica ``r`` uses.

Invariant, checked by ``check_invariants`` and by property tests: if device ``d`` maps
to replica ``r`` then ``r`` maps back to ``d``, and the reverse; no empty entries are kept.
Workers are the unit of registration so that re-registering one worker of a replica replaces that
worker's devices without touching the others'.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple


class ReplicaKey(NamedTuple):
    job: str
    replica: str

    def __str__(self) -> str:
        return f"{self.job}/{self.replica}"


class WorkerKey(NamedTuple):
    job: str
    replica: str
    worker: int

    @property
    def replica_key(self) -> ReplicaKey:
        return ReplicaKey(self.job, self.replica)

    def __str__(self) -> str:
        return f"{self.job}/{self.replica}/{self.worker}"


class DRMap:
    """Device <-> replica map, built from worker registrations."""

    __slots__ = ("_device_to_workers", "_replica_to_workers", "_worker_devices")

    def __init__(self) -> None:
        self._worker_devices: dict[WorkerKey, frozenset[str]] = {}
        self._device_to_workers: dict[str, set[WorkerKey]] = {}
        self._replica_to_workers: dict[ReplicaKey, set[WorkerKey]] = {}

    # --- updates -------------------------------------------------------------------------------

    def set_worker(self, key: WorkerKey, devices: Iterable[str]) -> frozenset[str]:
        """Add a worker or replace its devices. Returns the devices it no longer uses."""
        new = frozenset(devices)
        old = self._worker_devices.get(key, frozenset())
        for device in old - new:
            self._unlink(device, key)
        for device in new - old:
            self._device_to_workers.setdefault(device, set()).add(key)
        self._worker_devices[key] = new
        self._replica_to_workers.setdefault(key.replica_key, set()).add(key)
        return old - new

    def remove_worker(self, key: WorkerKey) -> frozenset[str]:
        """Forget a worker. Returns the devices it used (empty if it was unknown)."""
        devices = self._worker_devices.pop(key, None)
        if devices is None:
            return frozenset()
        for device in devices:
            self._unlink(device, key)
        workers = self._replica_to_workers[key.replica_key]
        workers.discard(key)
        if not workers:
            del self._replica_to_workers[key.replica_key]
        return devices

    def remove_replica(self, replica: ReplicaKey) -> frozenset[WorkerKey]:
        """Forget every worker of a replica. Returns the workers removed."""
        workers = frozenset(self._replica_to_workers.get(replica, ()))
        for key in workers:
            self.remove_worker(key)
        return workers

    def remove_device(self, device: str) -> frozenset[WorkerKey]:
        """Take a device out of every worker that uses it (e.g. quarantine).

        Workers stay registered, possibly with no devices. Returns the workers that used it.
        """
        workers = frozenset(self._device_to_workers.pop(device, ()))
        for key in workers:
            self._worker_devices[key] = self._worker_devices[key] - {device}
        return workers

    def _unlink(self, device: str, key: WorkerKey) -> None:
        workers = self._device_to_workers[device]
        workers.discard(key)
        if not workers:
            del self._device_to_workers[device]

    # --- lookups -------------------------------------------------------------------------------

    def workers_for_device(self, device: str) -> frozenset[WorkerKey]:
        return frozenset(self._device_to_workers.get(device, ()))

    def replicas_for_device(self, device: str) -> frozenset[ReplicaKey]:
        return frozenset(w.replica_key for w in self._device_to_workers.get(device, ()))

    def devices_for_worker(self, key: WorkerKey) -> frozenset[str]:
        return self._worker_devices.get(key, frozenset())

    def devices_for_replica(self, replica: ReplicaKey) -> frozenset[str]:
        out: set[str] = set()
        for key in self._replica_to_workers.get(replica, ()):
            out |= self._worker_devices[key]
        return frozenset(out)

    def workers_of_replica(self, replica: ReplicaKey) -> frozenset[WorkerKey]:
        return frozenset(self._replica_to_workers.get(replica, ()))

    def workers_of_job(self, job: str) -> frozenset[WorkerKey]:
        return frozenset(k for k in self._worker_devices if k.job == job)

    def replicas_of_job(self, job: str) -> frozenset[ReplicaKey]:
        return frozenset(r for r in self._replica_to_workers if r.job == job)

    def has_device(self, device: str) -> bool:
        return device in self._device_to_workers

    def has_worker(self, key: WorkerKey) -> bool:
        return key in self._worker_devices

    def workers(self) -> Iterator[WorkerKey]:
        return iter(self._worker_devices)

    def replicas(self) -> Iterator[ReplicaKey]:
        return iter(self._replica_to_workers)

    def devices(self) -> Iterator[str]:
        return iter(self._device_to_workers)

    def __len__(self) -> int:
        return len(self._worker_devices)

    # Both maps (device -> replicas, replica -> devices), for display, snapshots and tests.
    @property
    def device_to_replicas(self) -> dict[str, frozenset[ReplicaKey]]:
        return {d: self.replicas_for_device(d) for d in self._device_to_workers}

    @property
    def replica_to_devices(self) -> dict[ReplicaKey, frozenset[str]]:
        return {r: self.devices_for_replica(r) for r in self._replica_to_workers}

    # --- snapshot / restore --------------------------------------------------------------------

    def snapshot(self) -> list[dict[str, Any]]:
        """A JSON-able snapshot: one entry per worker, sorted for stable output."""
        return [
            {"job": k.job, "replica": k.replica, "worker": k.worker, "devices": sorted(v)}
            for k, v in sorted(self._worker_devices.items())
        ]

    @classmethod
    def restore(cls, snapshot: Iterable[dict[str, Any]]) -> DRMap:
        drmap = cls()
        for entry in snapshot:
            key = WorkerKey(str(entry["job"]), str(entry["replica"]), int(entry["worker"]))
            drmap.set_worker(key, (str(d) for d in entry["devices"]))
        return drmap

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DRMap) and self._worker_devices == other._worker_devices

    __hash__ = None  # type: ignore[assignment]

    # --- invariants ----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the indexes disagree (the invariant above)."""
        for device, workers in self._device_to_workers.items():
            assert workers, f"empty worker set kept for device {device}"
            for key in workers:
                assert device in self._worker_devices.get(key, ()), (
                    f"{device} -> {key} but the worker does not list it"
                )
        for key, devices in self._worker_devices.items():
            for device in devices:
                assert key in self._device_to_workers.get(device, ()), (
                    f"{key} lists {device} but the device index does not"
                )
            assert key in self._replica_to_workers.get(key.replica_key, ()), (
                f"{key} missing from its replica's workers"
            )
        for replica, workers in self._replica_to_workers.items():
            assert workers, f"empty worker set kept for replica {replica}"
            for key in workers:
                assert key in self._worker_devices and key.replica_key == replica
        # The map is many-to-many: device -> replicas and replica -> devices agree both ways.
        d2r, r2d = self.device_to_replicas, self.replica_to_devices
        for device, replicas in d2r.items():
            for replica in replicas:
                assert device in r2d[replica], f"{device} -> {replica} but not back"
        for replica, devices in r2d.items():
            for device in devices:
                assert replica in d2r[device], f"{replica} -> {device} but not back"
