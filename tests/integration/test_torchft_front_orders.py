"""The front's shell takes Marduk's orders as the controller publishes them (real ``Command``
bytes, no server): ``restart`` and ``fail`` of its job drop the group's incarnations, anything
else drops nothing, and what cannot be read is counted (agent/torchft_front/front.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("grpc", reason="grpcio is not installed: pip install -e '.[dev]'")

from agent.torchft_front.config import FrontConfig
from agent.torchft_front.front import Front
from agent.torchft_front.wire import heartbeat_request
from marduk.wire import codec
from marduk.wire.protocol import Command, PeerFailure


def command(kind: str, replica: str | None, epoch: int, job: str = "ft", **more: object) -> bytes:
    scope = "replica" if replica else "job"
    cid = f"{job}/{replica or '*'}/{epoch}"
    return codec.encode(
        Command(
            command_id=cid, job=job, replica=replica, scope=scope, kind=kind, epoch=epoch, **more
        )  # type: ignore[arg-type]
    )


async def test_restart_and_fail_of_the_job_drop_and_nothing_else_does() -> None:
    front = Front(FrontConfig(job="ft", lighthouse="127.0.0.1:1"))
    for i in ("g1:a", "g2:b", "g3:c"):
        assert front.table.beat(i, 0.0)
        front.requests[i] = heartbeat_request(i)
    front.order(command("checkpoint", "g1", 1), "marduk.ft.cmd.replica.g1")
    front.order(command("restart", "g1", 1, job="other"), "marduk.other.cmd.replica.g1")
    peers = [PeerFailure(replica="g1", epoch=1, kind="restart")]
    front.order(command("peer_failed", "g2", 0, peers=peers), "marduk.ft.cmd.replica.g2")
    assert sorted(front.table.ids()) == ["g1:a", "g2:b", "g3:c"]
    front.order(command("restart", "g1", 1), "marduk.ft.cmd.replica.g1")
    front.order(command("fail", "g2", 4), "marduk.ft.cmd.replica.g2")
    assert front.table.ids() == ["g3:c"]
    assert sorted(front.requests) == ["g3:c"]  # nothing left to forward for the dropped
    front.order(command("restart", None, 1), "marduk.ft.cmd.job")
    assert front.table.ids() == []
    await front.channel.close()


async def test_an_unreadable_command_is_counted_and_drops_nothing() -> None:
    front = Front(FrontConfig(job="ft", lighthouse="127.0.0.1:1"))
    assert front.table.beat("g1:a", 0.0)
    for junk in (b"", b"{", b'{"type": "command", "v": 1}', b"\xff" * 10):
        front.order(junk, "marduk.ft.cmd.replica.g1")
    assert front.errors["command_undecodable"] == 4
    assert front.table.ids() == ["g1:a"]
    await front.channel.close()
