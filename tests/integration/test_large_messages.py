"""The largest registration the contract allows crosses the real bus: 4,096 devices on one worker.

A worker of a big host registers every device it sees in one message; with NVML-style UUIDs that
is ~180 KB, which must fit MAX_MESSAGE_BYTES (256 KiB) at the controller.
"""

from __future__ import annotations

import uuid

import pytest

from agent.library.client import AsyncClient, connect_async
from marduk.controller import Controller
from marduk.wire import protocol as wire
from monitor_cli.client import publish_health, query
from tests.conftest import NatsServer

JOB, REPLICA = "big", "r0"


def nvml_uuids(n: int) -> list[str]:
    # nvidia-smi -L prints GPU-<uuid4>; MIG instances look alike, so a host can have thousands.
    return [f"GPU-{uuid.uuid4()}" for _ in range(n)]


async def register_all(server: NatsServer, devices: list[str]) -> AsyncClient:
    size = len(wire.encode(wire.Registration(job=JOB, replica=REPLICA, devices=devices)))
    assert size > 100_000  # a real test of the limit: 25 KiB, say, would refuse it
    return await connect_async(REPLICA, devices, job=JOB, addr=server.url, timeout=10)


@pytest.fixture(autouse=True)
def _no_supervisor(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under `marduk agent run` the library talks to the supervisor; here, to the controller.
    monkeypatch.delenv("MARDUK_AGENT_SOCKET", raising=False)


@pytest.mark.timeout(60)
async def test_a_worker_with_4096_devices_registers_and_hears_a_failure(
    controller: Controller, nats_server: NatsServer
) -> None:
    devices = nvml_uuids(wire.MAX_DEVICES_PER_WORKER)
    client = await register_all(nats_server, devices)
    try:
        failed = devices[2_718]
        reply = await publish_health(nats_server.url, "marduk", failed, "failed")
        assert reply.known  # the controller mapped this device, registered among 4,095 others
        command = await client.wait(5)
        assert command is not None, "the failure of one of 4,096 devices never reached the worker"
        assert (command.kind, command.job, command.replica) == ("restart", JOB, REPLICA)
        assert failed in command.devices
    finally:
        await client.close()


@pytest.mark.timeout(60)
async def test_the_map_holds_all_4096_devices(
    controller: Controller, nats_server: NatsServer
) -> None:
    devices = nvml_uuids(wire.MAX_DEVICES_PER_WORKER)
    client = await register_all(nats_server, devices)
    try:
        reply = await query(nats_server.url, "marduk", "map")
        (worker,) = [w for w in reply.workers if (w.job, w.replica) == (JOB, REPLICA)]
        assert sorted(worker.devices) == sorted(devices)
    finally:
        await client.close()
