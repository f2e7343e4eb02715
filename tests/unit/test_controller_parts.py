"""Each part of the controller built alone, with real small objects (``tests/parts.py``): a
real policy, a real commit pipeline over steps that record, no ``Controller`` and no server."""

from __future__ import annotations

import pytest
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry

from marduk.controller.commit import CommitPipeline, Steps
from marduk.controller.handlers import Handlers
from marduk.controller.outbox import Outbox
from marduk.controller.standbys import Standbys
from marduk.core.decisions import Outcome
from marduk.core.policy import Policy
from marduk.core.records import EpochRecord
from marduk.errors import ProtocolError
from marduk.wire.protocol import (
    ControllerEvent,
    ControllerInfo,
    DeviceHealth,
    RegisterReply,
    Registration,
    Standby,
    encode,
)
from marduk.wire.subjects import Subjects
from tests.parts import Shell

S = Subjects()


def reg(replica: str) -> Registration:
    return Registration(job="j", replica=replica, devices=[f"{replica}-d0"])


def info(controller_id: str = "test-controller") -> ControllerInfo:
    return ControllerInfo(
        controller_id=controller_id, version="0", pid=1, started_at=0.0, prefix="marduk"
    )


class Recorded:
    """The pipeline's steps, recording what went out and what was written."""

    def __init__(self) -> None:
        self.published: list[Outcome] = []
        self.persisted: list[Outcome] = []
        self.announced: list[ControllerEvent] = []

    def steps(self) -> Steps:
        async def write_ahead(ceilings: list[EpochRecord]) -> bool:
            return True

        async def publish(outcome: Outcome) -> None:
            self.published.append(outcome)

        async def persist(outcomes: list[Outcome]) -> None:
            self.persisted.extend(outcomes)

        async def announce(outcome: Outcome) -> None:
            self.announced.extend(outcome.events)

        return Steps(
            leading=lambda: True,
            write_ahead=write_ahead,
            publish=publish,
            persist=persist,
            announce=announce,
            stop=lambda counter, why: None,
        )

    async def announce_one(self, event: ControllerEvent) -> None:
        self.announced.append(event)


def handlers_of(policy: Policy, recorded: Recorded) -> tuple[Handlers, CollectorRegistry]:
    registry = CollectorRegistry()
    pipeline = CommitPipeline(recorded.steps())
    handlers = Handlers(
        Shell().context(),
        policy=lambda: policy,
        submit=pipeline.submit,
        announce=recorded.announce_one,
        standbys=lambda: [],
        info=info,
        registry=registry,
    )
    return handlers, registry


async def test_the_handlers_answer_a_registration_once_its_commit_is_written() -> None:
    policy, recorded = Policy(), Recorded()
    handlers, _ = handlers_of(policy, recorded)
    reply = await handlers.register(reg("a"), S.register("j"))
    assert isinstance(reply, RegisterReply) and reply.outcome == "new"
    assert [w.registration.replica for o in recorded.persisted for w in o.put_workers] == ["a"]
    with pytest.raises(ProtocolError) as e:  # a job's message on another job's subject
        await handlers.register(reg("b"), S.register("other"))
    assert e.value.reason == "subject_mismatch"


async def test_a_health_decision_is_committed_and_its_notice_timed() -> None:
    policy, recorded = Policy(), Recorded()
    handlers, registry = handlers_of(policy, recorded)
    await handlers.register(reg("a"), S.register("j"))
    decided = handlers.decide_health(DeviceHealth(device="a-d0", state="failed", event_id="e1"))
    assert decided.reply.known and [a.replica for a in decided.reply.actions] == ["a"]
    await decided.committed()
    assert [c.kind for o in recorded.published for c in o.commands] == ["restart"]
    assert registry.get_sample_value("marduk_event_to_command_seconds_count") == 1.0


async def test_the_outbox_steps_down_through_what_it_is_handed() -> None:
    shell = Shell()
    outbox = Outbox(shell.context(), store=lambda: None, signing_seed=lambda: None)
    outbox.stop_committing("store.persist_failed", "records could not be written")
    assert shell.stepped_down == ["records could not be written"]
    assert shell.stats["store.persist_failed"] == 1
    # Not connected: an event is logged and counted, never raised.
    event = ControllerEvent(kind="command_oversized", ts=0.0, job="j")
    await outbox.announce(event)
    assert shell.stats["errors.command_oversized"] == 1
    assert await outbox.write_ahead([]) is True  # no store yet: nothing to write


async def test_the_standbys_heard_from_are_listed_but_not_ourselves_or_junk() -> None:
    shell = Shell()
    standbys = Standbys(shell.context(), info=info)

    def announcement(data: bytes) -> Msg:
        return Msg(_client=None, subject=S.standby, data=data)  # type: ignore[arg-type]

    await standbys.on_announcement(announcement(encode(Standby(controller=info("other")))))
    await standbys.on_announcement(announcement(encode(Standby(controller=info()))))
    await standbys.on_announcement(announcement(b"{not json"))
    assert [i.controller_id for i in standbys.live()] == ["other"]
    assert shell.stats["rejected"] == 1
