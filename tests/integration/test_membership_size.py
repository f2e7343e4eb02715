"""A worker that would make its job's membership too large to command, against a real
nats-server: the controller refuses its registration (``membership_too_large``) with the size,
the budget and what to shorten, announces who was refused, and ``marduk agent run`` exits 1 with
that reason on one line, as for every other final refusal; the workers already there stay."""

from __future__ import annotations

import asyncio

import nats

from marduk.controller import Controller
from marduk.core.issuer import COMMAND_BUDGET
from marduk.wire import protocol as wire
from marduk.wire.protocol import MAX_MEMBERS, decode, encode
from marduk.wire.subjects import Subjects
from tests.conftest import NatsServer, marduk_cli
from tests.unit.test_membership_admission import PAD, reg

S = Subjects()


def registration(i: int) -> bytes:
    """Worker ``i`` of a 1,024-node job with long names: 1,023 of them leave no room for
    another like them (tests/unit/test_membership_admission.py)."""
    return encode(reg(i))


async def test_the_agent_whose_entry_would_overflow_the_membership_exits_with_the_reason(
    controller: Controller, nats_server: NatsServer
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        events: list[wire.ControllerEvent] = []

        async def on(msg) -> None:  # type: ignore[no-untyped-def]
            events.append(decode(msg.data, wire.ControllerEvent))

        await nc.subscribe(S.events("llama"), cb=on)
        for start in range(0, MAX_MEMBERS - 1, 128):
            replies = await asyncio.gather(
                *(
                    nc.request(S.register("llama"), registration(i), timeout=30)
                    for i in range(start, min(start + 128, MAX_MEMBERS - 1))
                )
            )
            assert all(b'"register_reply"' in r.data for r in replies), replies[0].data

        replica = "llama-405b-pretrain-1023"
        argv = [
            "agent", "run", "--addr", nats_server.url, "--job", "llama", "--replica", replica,
            "--devices", "h1023-gpu0", "--nnodes", f"{MAX_MEMBERS}:{MAX_MEMBERS}",
            "--nproc-per-node", "8", "--scope", "job", "--local-addr", f"{replica}.{PAD}",
            "--connect-timeout", "10", "--", "true",
        ]  # fmt: skip
        r = await asyncio.to_thread(marduk_cli, *argv, timeout=60)
        assert r.returncode == 1, (r.stdout, r.stderr)
        [line] = [ln for ln in r.stderr.splitlines() if "membership_too_large" in ln]
        assert "Traceback" not in r.stderr
        assert f"{MAX_MEMBERS} node(s)" in line and f"{COMMAND_BUDGET}-byte budget" in line
        assert "shorten the replica names" in line and "--local-addr" in line

        assert len(controller.policy.workers) == MAX_MEMBERS - 1  # the others stay
        assert controller.stats["rejected.membership_too_large"] >= 1
        refused = [e for e in events if e.kind == "membership_too_large"]
        assert refused and refused[0].replica == replica
    finally:
        await nc.close()
