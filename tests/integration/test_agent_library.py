"""The agent library as a trainer uses it: sync client, failure modes, reconnects, devices."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import nats
import pytest

import agent
from agent.library.devices import device_ids
from marduk.controller import Controller
from tests.conftest import (
    NatsServer,
    controller_settings,
    eventually,
    free_port,
    health_event,
    start_serving,
)


async def inject(url: str, device: str) -> None:
    nc = await nats.connect(url)
    await health_event(nc, device)
    await nc.close()


async def test_sync_client_wait_failed_ack_close(
    controller: Controller, nats_server: NatsServer
) -> None:
    seen: list[tuple[str, str]] = []

    def on_command(c: agent.Command) -> None:
        seen.append((c.kind, threading.current_thread().name))

    client = await asyncio.to_thread(
        agent.connect, "r1", ["d1", "d2"], "train", nats_server.url, None, on_command
    )
    try:
        assert client.state == "registered"
        assert await asyncio.to_thread(client.wait, 0.05) is None
        await inject(nats_server.url, "d2")
        cmd = await asyncio.to_thread(client.wait, 5)
        assert cmd is not None and (cmd.kind, cmd.epoch, cmd.devices) == ("restart", 1, ("d2",))
        assert client.failed and client.last_failure == cmd
        # The command is queued for wait() before on_command runs, on the client's thread
        # (never the caller's): the callback may come a moment after wait() returned.
        await eventually(lambda: bool(seen), timeout=5)
        assert seen == [("restart", "marduk-agent")]
        assert await asyncio.to_thread(client.ack) is True
        assert not client.failed and not client.errors
        assert controller.policy.workers[("train", "r1", 0)].applied_epoch == 1  # type: ignore[index]
    finally:
        await asyncio.to_thread(client.close)
        await asyncio.to_thread(client.close)
    assert not controller.policy.drmap.has_device("d1")


async def test_connect_without_server_raises_clearly_after_timeout() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    with pytest.raises(agent.AgentError, match=f"cannot connect to NATS at {url}"):
        await asyncio.to_thread(agent.connect, "r1", ["d1"], None, url, None, None, timeout=1.0)


async def test_connect_without_controller_raises_clearly(nats_server: NatsServer) -> None:
    with pytest.raises(agent.AgentError, match="no Marduk controller answered"):
        await agent.connect_async("r1", ["d1"], addr=nats_server.url, timeout=1.0)


async def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(agent.AgentError, match="invalid replica id"):
        await agent.connect_async("r 1", ["d1"], addr="nats://127.0.0.1:1", timeout=0.5)
    with pytest.raises(agent.AgentError, match="scope must be"):
        await agent.connect_async("r1", ["d1"], scope="pod", timeout=0.5)


async def test_connect_waits_for_a_controller_that_starts_late(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    task = asyncio.create_task(agent.connect_async("r1", ["d1"], addr=nats_server.url, timeout=10))
    await asyncio.sleep(0.5)  # the scenario: no controller yet for a while
    assert not task.done()  # still trying, not failed
    c = Controller(controller_settings(nats_server, tmp_path))
    await c.start()
    client = await task
    assert client.state == "registered"
    await client.close()
    await c.stop()


async def test_survives_nats_restart_and_reregisters(tmp_path: Path) -> None:
    """The server goes away and comes back (same port, same store): state shows it; no raise."""
    server = NatsServer(tmp_path / "js").start()
    c = await start_serving(Controller(controller_settings(server, tmp_path)))
    client = await agent.connect_async("r1", ["d1"], addr=server.url, timeout=5)
    try:
        server.stop()
        await eventually(lambda: client.state == "disconnected")
        await asyncio.sleep(0.5)
        server.start()
        await eventually(
            lambda: client.state == "registered" and client.stats["registrations"] >= 2
        )
        await inject(server.url, "d1")
        cmd = await client.wait(5)
        assert cmd is not None and cmd.kind == "restart"
    finally:
        await client.close()
        await c.stop()
        server.stop()


def test_device_ids_format_and_nvml_preference() -> None:
    devs = [SimpleNamespace(platform="tpu", local_hardware_id=i, id=10 + i) for i in range(2)]
    assert device_ids(devs, host="h", nvml_uuid=lambda i: None) == ["h:tpu:0", "h:tpu:1"]
    gpus = [SimpleNamespace(platform="gpu", local_hardware_id=1, id=5)]
    assert device_ids(gpus, host="h", nvml_uuid=lambda i: f"GPU-{i}") == ["GPU-1"]
    assert device_ids(gpus, host="h", nvml_uuid=lambda i: None) == ["h:gpu:1"]


def test_cuda_visible_devices_uuid_passthrough(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent.library.devices import nvml_uuid_for_ordinal

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-aaa,GPU-bbb")
    assert nvml_uuid_for_ordinal(1) == "GPU-bbb"
    assert nvml_uuid_for_ordinal(2) is None


def uuids_in_subprocess(env: dict[str, str]) -> list[str]:
    code = "import agent, json; print(json.dumps(agent.local_device_uuids()))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return json.loads(out)  # type: ignore[no-any-return]


def test_local_device_uuids_through_jax_and_env_override() -> None:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=3",
        "JAX_PLATFORMS": "cpu",
    }
    env.pop("MARDUK_DEVICES", None)
    host = socket.gethostname()
    assert uuids_in_subprocess(env) == [f"{host}:cpu:{i}" for i in range(3)]
    env["MARDUK_DEVICES"] = "GPU-x, GPU-y"
    assert uuids_in_subprocess(env) == ["GPU-x", "GPU-y"]


def test_library_imports_without_jax_controller_or_cli() -> None:
    code = (
        "import sys, agent; "
        "bad = [m for m in ('jax', 'typer', 'rich', 'marduk.controller', 'marduk.cli', "
        "'marduk.store.state', 'uvloop') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()
    assert out == "[]"


def node_uuids_in_subprocess(env: dict[str, str]) -> tuple[list[str], list[str]]:
    """``node_device_uuids()`` in a fresh process: (the ids, which frameworks it imported)."""
    code = (
        "import sys, json, agent.library.devices as d; ids = d.node_device_uuids(); "
        "print(json.dumps([ids, [m for m in ('jax', 'torch') if m in sys.modules]]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    ids, imported = json.loads(out.stdout.strip().splitlines()[-1])
    return ids, imported


def test_the_supervisor_finds_devices_without_importing_a_framework(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
    }
    env.pop("MARDUK_DEVICES", None)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    host = socket.gethostname()
    # A node where jax can only find CPUs: their ids, and no framework imported anywhere.
    assert node_uuids_in_subprocess(env) == ([f"{host}:cpu:0", f"{host}:cpu:1"], [])
    # GPUs named by UUID in CUDA_VISIBLE_DEVICES are taken as they are, no child asked.
    env["CUDA_VISIBLE_DEVICES"] = "GPU-aaa,GPU-bbb"
    assert node_uuids_in_subprocess(env) == (["GPU-aaa", "GPU-bbb"], [])
    del env["CUDA_VISIBLE_DEVICES"]
    # Without jax at all, on a node that may have an accelerator (jax is asked): one warning
    # and the host's CPU, never a traceback.
    env["JAX_PLATFORMS"] = "tpu"
    shadow = tmp_path / "nojax"
    (shadow / "jax").mkdir(parents=True)
    (shadow / "jax" / "__init__.py").write_text("raise ImportError('no jax here')\n")
    env["PYTHONPATH"] = os.pathsep.join([str(shadow), env.get("PYTHONPATH", "")])
    assert node_uuids_in_subprocess(env) == ([f"{host}:cpu:0"], [])


def test_the_cpus_counted_without_jax_are_the_ones_jax_lists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node where jax can find only CPUs is not asked (``cpu_only_devices``): the ids must be
    the ones jax itself gives, asked the way an accelerator node is asked (a child process)."""
    from agent.library.devices import _discover_in_child, cpu_only_devices

    host = socket.gethostname()
    for extra in (
        {},
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
        {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_NUM_CPU_DEVICES": "3"},
    ):
        for name in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "MARDUK_DEVICES"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("JAX_PLATFORMS", "cpu")
        for name, value in extra.items():
            monkeypatch.setenv(name, value)
        count = cpu_only_devices(os.environ, [])
        assert count is not None
        assert _discover_in_child(120) == [f"{host}:cpu:{i}" for i in range(count)], extra
