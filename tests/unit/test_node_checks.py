"""The node's checks before a start, pure parts: the node check service's endpoint and answer,
the storage specs, mountinfo, and the storage probe's verdicts on paths of our own."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agent.supervise import storage_probe as probe
from agent.supervise.node_check import (
    Endpoint,
    EndpointError,
    parse_endpoint,
    read_answer,
    request_line,
)
from agent.supervise.storage_probe import Mount, StoragePath, StorageSpecError, parse_storage


def test_endpoints_are_unix_sockets_or_host_and_port() -> None:
    assert parse_endpoint("/run/nhc.sock") == Endpoint(path="/run/nhc.sock")
    assert parse_endpoint("unix:///run/nhc.sock") == Endpoint(path="/run/nhc.sock")
    assert parse_endpoint("./nhc.sock") == Endpoint(path="./nhc.sock")
    assert parse_endpoint("localhost:9000") == Endpoint(host="localhost", port=9000)
    assert parse_endpoint("[::1]:9000") == Endpoint(host="::1", port=9000)
    for bad in ("nhc.sock", "host:", "host:99999", "unix://", ":80"):
        with pytest.raises(EndpointError, match="--node-check-endpoint"):
            parse_endpoint(bad)


def test_the_request_is_one_json_line_naming_the_worker() -> None:
    line = request_line("lin", "n3", 0, "n3.example")
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert json.loads(line) == {
        "v": 1,
        "kind": "node_check",
        "job": "lin",
        "replica": "n3",
        "worker": 0,
        "host": "n3.example",
    }


def test_only_an_explicit_false_is_unhealthy() -> None:
    assert read_answer(b'{"healthy": true}\n').verdict == "healthy"
    sick = read_answer(b'{"healthy": false, "reason": "gpu 3: xid 79"}\n')
    assert (sick.verdict, sick.reason) == ("unhealthy", "gpu 3: xid 79")
    assert read_answer(b'{"healthy": false}').reason  # a reason all the same
    listed = read_answer(b'{"healthy": false, "reason": ["ib0 down", "gpu 1"]}')
    assert listed.verdict == "unhealthy" and "ib0 down" in listed.reason
    for nonsense in (b"ok\n", b'{"healthy": "no"}', b"[]", b'{"fail_count": 1}'):
        assert read_answer(nonsense).verdict == "malformed"


def test_storage_specs() -> None:
    assert parse_storage("/data") == StoragePath("/data")
    assert parse_storage("/ckpt/:rw") == StoragePath("/ckpt", write=True)
    assert parse_storage("/a:b:ro") == StoragePath("/a:b")
    assert parse_storage("/a:b") == StoragePath("/a:b")  # not a mode: part of the path
    assert str(StoragePath("/ckpt", write=True)) == "/ckpt:rw"
    with pytest.raises(StorageSpecError, match="absolute"):
        parse_storage("data:rw")


MOUNTINFO = """\
22 1 0:21 / / rw,relatime shared:1 - overlay overlay rw
30 22 0:40 / /mnt/lus rw - lustre 10.0.0.1@tcp:/fs rw,flock
31 22 0:41 / /mnt/my\\040data rw,relatime - nfs4 srv:/export rw
32 30 0:42 / /mnt/lus/scratch rw - tmpfs tmpfs rw
"""


def test_mountinfo_and_the_mount_a_path_is_on() -> None:
    mounts = probe.parse_mountinfo(MOUNTINFO + "garbage line\n")
    assert mounts[2] == Mount("/mnt/my data", "nfs4", "srv:/export")
    assert probe.mount_of("/mnt/lus/ckpt/x", mounts) == mounts[1]
    assert probe.mount_of("/mnt/lus/scratch/y", mounts) == mounts[3]
    assert probe.mount_of("/mnt/lust", mounts) == mounts[0]
    assert probe.mount_of("/mnt/my data", mounts) == mounts[2]
    assert probe.mount_of("/x", []) is None


def test_lustres_health_file_where_present(tmp_path: Path) -> None:
    health = tmp_path / "health_check"
    assert probe.lustre_health(str(health)) == []  # no Lustre client here
    health.write_text("healthy\n")
    assert probe.lustre_health(str(health)) == []
    health.write_text("NOT HEALTHY\n")
    assert probe.lustre_health(str(health)) == [f"{health} says 'NOT HEALTHY'"]


def test_paths_missing_unreadable_or_not_writable_say_so(tmp_path: Path) -> None:
    with open("/proc/self/mountinfo") as f:
        mounts = probe.parse_mountinfo(f.read())
    (tmp_path / "file").write_text("x")
    assert probe.check_path(StoragePath(str(tmp_path), write=True), mounts) == []
    assert probe.check_path(StoragePath(str(tmp_path / "file"), write=True), mounts) == []
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".marduk")]  # cleaned up
    assert probe.check_path(StoragePath(str(tmp_path / "gone")), mounts) == [
        f"{tmp_path / 'gone'}: missing"
    ]
    # procfs takes no write (root included): readable, not writable.
    assert probe.check_path(StoragePath("/proc/version"), mounts) == []
    [failure] = probe.check_path(StoragePath("/proc/version", write=True), mounts)
    assert failure.startswith("/proc/version:rw: not writable (")
