"""The commit mechanism of the controller shell, against a real nats-server.

``Controller._commit`` promises two things that nothing else in the suite would miss if they
went away:

* write-ahead: an epoch's ceiling is durable in the state bucket *before* a command carrying that
  epoch is published, so a controller restored from the bucket never issues it again;
* decision order (``marduk.controller.commit.CommitPipeline``): commits from different subscriptions
  (health stream, reports, registrations, forget, the tick) go out in the order they were
  decided, even though many are in flight at once, and the store ends as the last decision
  left it.

Each test below was checked by breaking the mechanism on purpose (see its docstring). The
instruments: ``DurableKV`` wraps the state bucket, records what the server has stored (an epoch
record's ``max(epoch, ceiling)`` is the floor a restored controller issues above) and can hold a
write at a gate; ``watch_commands`` wraps the controller's publish and notes, for every command,
the durable floor of its scope at the moment it goes out.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client as NATS

from marduk.controller import Controller
from marduk.core.drmap import WorkerKey
from marduk.core.records import EpochKey, EpochRecord
from marduk.store.state import epoch_kv_key, handled_kv_key, worker_kv_key
from marduk.wire import protocol as wire
from marduk.wire.protocol import decode, encode
from marduk.wire.subjects import Subjects
from monitor_cli.health import UndecidedError
from tests.conftest import (
    NatsServer,
    controller_settings,
    eventually,
    health_event,
    start_serving,
    store_health,
)

pytestmark = pytest.mark.timeout(60)

S = Subjects()
JOB = "wal"
SCOPE = EpochKey(JOB, "r1")
SCOPE_KEY = epoch_kv_key(SCOPE)


class Killed(ConnectionError):
    """A write attempted after the simulated death of the controller process."""


class DurableKV:
    """The state bucket as seen through the store: records what the server has stored.

    ``floors[key]`` is ``max(epoch, ceiling)`` of the last epoch record stored under ``key``:
    what ``Policy.restore`` would issue above. ``hold(op, key, value)`` names writes to park at
    ``gate`` until the test opens it; ``refuse`` names writes that fail; ``dead`` makes every
    write fail, as if the process had died (nothing it writes any more reaches the server);
    ``slow`` delays each write first.
    """

    def __init__(self, kv: Any) -> None:
        self._kv = kv
        self.floors: dict[str, int] = {}
        self.done: list[tuple[str, str, bytes | None]] = []  # (op, key, value) once stored
        self.entered: list[tuple[str, str, bytes | None]] = []  # (op, key, value) when called
        self.hold: Callable[[str, str, bytes | None], bool] = lambda op, key, value: False
        self.gate = asyncio.Event()
        self.held = asyncio.Event()
        self.refuse: Callable[[str, str, bytes | None], bool] = lambda op, key, value: False
        self.slow = 0.0
        self.dead = False

    async def _before(self, op: str, key: str, value: bytes | None) -> None:
        self.entered.append((op, key, value))
        if self.slow:
            await asyncio.sleep(self.slow)
        if self.hold(op, key, value):
            self.held.set()
            await self.gate.wait()
        if self.dead:
            raise Killed(f"{op} {key}: the controller is dead")
        if self.refuse(op, key, value):
            raise ConnectionError(f"{op} {key}: JetStream unavailable")

    async def put(self, key: str, value: bytes, *args: Any, **kw: Any) -> int:
        await self._before("put", key, value)
        revision: int = await self._kv.put(key, value, *args, **kw)
        self.done.append(("put", key, value))
        if key.startswith("e."):
            rec = msgspec.json.decode(value, type=EpochRecord)
            self.floors[key] = max(rec.epoch, rec.ceiling)
        return revision

    async def delete(self, key: str, *args: Any, **kw: Any) -> Any:
        await self._before("delete", key, None)
        result = await self._kv.delete(key, *args, **kw)
        self.done.append(("delete", key, None))
        self.floors.pop(key, None)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)


@dataclass
class Sent:
    command: wire.Command
    durable_floor: int  # of the command's scope, when the command was published


@dataclass
class Instruments:
    kv: DurableKV
    sent: list[Sent] = field(default_factory=list)

    def epochs(self, scope: EpochKey = SCOPE) -> list[int]:
        return [
            s.command.epoch
            for s in self.sent
            if EpochKey(s.command.job, s.command.replica) == scope
        ]

    def not_durable(self) -> list[str]:
        return [
            f"epoch {s.command.epoch} of {s.command.job}/{s.command.replica or '*'} published "
            f"while the stored floor was {s.durable_floor}"
            for s in self.sent
            if s.durable_floor < s.command.epoch
        ]


def instrument(c: Controller) -> Instruments:
    """Wrap the controller's state bucket and its publish (of commands) with recorders."""
    assert c.store is not None and c.nc is not None
    kv = DurableKV(c.store.kv)
    c.store.kv = kv  # type: ignore[assignment]
    tools = Instruments(kv)
    publish = c.nc.publish

    async def watched(subject: str, payload: bytes = b"", *args: Any, **kw: Any) -> None:
        if ".cmd." in subject:
            if kv.dead:
                return  # a dead process publishes nothing
            command = decode(payload, wire.Command)
            key = epoch_kv_key(EpochKey(command.job, command.replica))
            tools.sent.append(Sent(command, kv.floors.get(key, 0)))
        await publish(subject, payload, *args, **kw)

    c.nc.publish = watched  # type: ignore[method-assign]
    return tools


@contextlib.asynccontextmanager
async def running(server: NatsServer, tmp_path: Path, **settings: Any) -> AsyncIterator[Controller]:
    """A controller whose epochs are reserved one at a time and never coalesce.

    ``epoch_block=1``: every epoch after the first needs a write-ahead of its ceiling.
    ``pending_timeout_s=0``: every failure issues a new epoch (no coalescing, no resends), so
    every command published is a new decision.
    """
    s = controller_settings(server, tmp_path, epoch_block=1, pending_timeout_s=0.0)
    for name, value in settings.items():
        setattr(s, name, value)
    c = await start_serving(Controller(s))
    try:
        yield c
    finally:
        await c.stop()


async def register(
    nc: NATS, replica: str, devices: list[str], *, job: str = JOB, timeout: float = 5.0
) -> wire.RegisterReply:
    """Register a worker by hand: unlike the agent library, it never re-registers by itself."""
    reg = wire.Registration(
        job=job, replica=replica, devices=devices, pid=4242, host="test", incarnation=0
    )
    msg = await nc.request(S.register(job), encode(reg), timeout=timeout)
    return decode(msg.data, wire.RegisterReply)


async def report_crash(nc: NATS, replica: str, epoch: int, timeout: float = 5.0) -> Any:
    report = wire.Report(job=JOB, replica=replica, status="crashed", epoch=epoch)
    msg = await nc.request(S.report(JOB), encode(report), timeout=timeout)
    return decode(msg.data, wire.ReportReply | wire.ErrorReply)  # type: ignore[arg-type]


async def health_reply_task(nc: NATS, device: str, event_id: str) -> asyncio.Task[bytes]:
    """Publish a failure event durably; the task ends with the controller's answer."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox, max_msgs=1)
    event = wire.DeviceHealth(device=device, state="failed", event_id=event_id)
    await store_health(nc, encode(event), inbox)

    async def answer() -> bytes:
        data: bytes = (await sub.next_msg(timeout=20)).data
        return data

    return asyncio.create_task(answer())


async def observe_commands(nc: NATS, job: str = JOB) -> list[wire.Command]:
    """Every command published for ``job``, in the order this (raw, never re-registering)
    subscriber received them: an agent cut off from the controller sees exactly this."""
    seen: list[wire.Command] = []

    async def on_msg(msg: Any) -> None:
        seen.append(decode(msg.data, wire.Command))

    await nc.subscribe(f"{S.prefix}.{job}.cmd.>", cb=on_msg)
    await nc.flush()
    return seen


def reused_epochs(seen: list[wire.Command]) -> list[str]:
    """Epochs an agent saw for two different decisions. A resend of one decision keeps its
    kind, cause and issue time, and may only add devices (a merged failure)."""
    first: dict[tuple[str, str | None, int], wire.Command] = {}
    bad = []
    for c in seen:
        prev = first.setdefault((c.job, c.replica, c.epoch), c)
        same = (c.kind, c.event_id, c.issued_at) == (prev.kind, prev.event_id, prev.issued_at)
        if not same or not set(prev.devices) <= set(c.devices):
            bad.append(f"epoch {c.epoch}: {prev.devices} ({prev.reason}) then {c.devices}")
    return bad


# --- write-ahead of epoch ceilings ---------------------------------------------------------------


async def test_ceiling_is_durable_before_its_command_is_published(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """Every command goes out only once its epoch is covered by a stored ceiling.

    Catches: ``_commit`` persisting ``write_ahead`` after the commands are published; ``Policy``
    never putting records into ``write_ahead`` (they then go out with the other records, after
    the publish); the write-ahead not awaited (started as a task). Seen when broken: "epoch 2 of
    wal/r1 published while the stored floor was 1" (and the same for every later epoch).
    """
    async with running(nats_server, tmp_path) as c:
        tools = instrument(c)
        tools.kv.slow = 0.02  # a write that is not awaited would land after its command
        nc = await nats.connect(nats_server.url)
        try:
            await register(nc, "r1", ["d1", "d2"])
            await register(nc, "r2", ["d2"])
            for i in range(4):  # a failure from the health stream, then one from a report
                reply = await health_event(nc, f"d{1 + i % 2}", event_id=f"wal-{i}")
                assert reply.actions, reply
                epoch = c.policy.epoch_of(SCOPE)
                assert isinstance(await report_crash(nc, "r1", epoch), wire.ReportReply)
            assert tools.epochs() == list(range(1, 9))
            assert tools.epochs(EpochKey(JOB, "r2")) == [1, 2]
            assert not tools.not_durable()
        finally:
            await nc.close()


async def test_restored_controller_never_reissues_an_epoch_that_went_out(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """A controller that dies right after publishing a command, before writing anything else,
    is replaced by one restored from the bucket: its next command is above the one that went
    out, so an agent that has not re-registered yet (and so could not tell the new controller
    what it saw) never gets a different restart under an epoch it already applied.

    Catches: the write-ahead persisted after the publish, or never (records only in
    ``put_epochs``). Seen when broken: "epoch 2: ['d2'] (device d2 failed) then ['d3']".
    """
    nc = await nats.connect(nats_server.url)
    try:
        seen = await observe_commands(nc)
        async with running(nats_server, tmp_path) as c1:
            tools = instrument(c1)
            await register(nc, "r1", ["d1", "d2", "d3"])
            await health_event(nc, "d1", event_id="before")
            publish = c1.nc.publish  # type: ignore[union-attr]

            async def die_after_command(
                subject: str, payload: bytes = b"", *a: Any, **kw: Any
            ) -> None:
                await publish(subject, payload, *a, **kw)
                if ".cmd." in subject:
                    tools.kv.dead = True  # SIGKILL now: nothing more is written

            c1.nc.publish = die_after_command  # type: ignore[method-assign,union-attr]
            # Dead: its records are not written, so it answers nobody (nor acks the event).
            with pytest.raises(UndecidedError):
                await health_event(nc, "d2", event_id="last-words", timeout=2.0)
            assert tools.kv.dead and [c.epoch for c in seen] == [1, 2]

        async with running(nats_server, tmp_path) as c2:
            reply = await health_event(nc, "d3", event_id="after")
            [action] = reply.actions
            await eventually(lambda: len(seen) == 3)
            assert not reused_epochs(seen), reused_epochs(seen)
            assert action.epoch > 2 and seen[-1].epoch == action.epoch
            assert c2.policy.epoch_of(SCOPE) == action.epoch
    finally:
        await nc.close()


# --- one commit at a time -----------------------------------------------------------------------


async def test_commits_from_different_subscriptions_publish_in_decision_order(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """A failure from the health stream decides epoch 2 and is slow to write its ceiling; a
    crash report (another subscription) decides epoch 3 meanwhile. Epoch 2 must still go out
    before epoch 3: agents drop a command below the last epoch they received, so 3-then-2 loses
    the restart for the failed device.

    Catches: the pipeline committing each outcome on its own (a task per ``submit``) instead
    of queueing it behind the ones decided before. Seen when broken: published epochs
    [1, 3, 2] instead of [1, 2, 3]. (The write-ahead bugs above trip its durability check too.)
    """
    async with running(nats_server, tmp_path, tick_interval_s=3600.0) as c:
        pipeline = c.pipeline  # the only other commit now: the report's (no ticks)
        tools = instrument(c)
        nc = await nats.connect(nats_server.url)
        try:
            await register(nc, "r1", ["d1"])
            await health_event(nc, "d1", event_id="first")  # epoch 1, within the first block
            # Epoch 2 needs a new ceiling: park that write until epoch 3 has been decided.
            tools.kv.hold = lambda op, key, value: (
                key == SCOPE_KEY and b'"epoch":2,' in (value or b"")
            )
            slow = await health_reply_task(nc, "d1", "second")
            await asyncio.wait_for(tools.kv.held.wait(), 10)
            fast = asyncio.create_task(report_crash(nc, "r1", epoch=2, timeout=20))
            await eventually(lambda: c.policy.epoch_of(SCOPE) == 3)
            # Open the gate once the report's commit is either waiting behind the first (as it
            # must) or has published without waiting (the bug).
            await eventually(lambda: pipeline.contended.is_set() or 3 in tools.epochs())
            tools.kv.gate.set()
            assert decode(await slow, wire.HealthReply).actions[0].epoch == 2
            assert isinstance(await fast, wire.ReportReply)
            assert tools.epochs() == [1, 2, 3]
            assert not tools.not_durable()
        finally:
            await nc.close()


async def test_the_store_ends_as_the_last_decision_left_it(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """A registration is slow to write; an operator's forget of that worker (another
    subscription) is decided meanwhile. The bucket must end without the worker, as memory
    does: a write of the earlier decision landing after the later one would bring the worker
    back at the next restart.

    Catches: a batch's records written without waiting for the previous batch's (in
    ``CommitPipeline._write``). Seen when broken: the bucket still holds ``w.wal.r9.0`` after
    the forget; a restored controller has the worker.
    """
    async with running(nats_server, tmp_path, tick_interval_s=3600.0) as c:
        pipeline = c.pipeline
        tools = instrument(c)
        wkey = worker_kv_key(WorkerKey(JOB, "r9", 0))
        nc = await nats.connect(nats_server.url)
        try:
            await register(nc, "r1", ["d1"])  # keeps the job alive in the map
            tools.kv.hold = lambda op, key, value: op == "put" and key == wkey
            reg = asyncio.create_task(register(nc, "r9", ["d9"], timeout=20))
            await asyncio.wait_for(tools.kv.held.wait(), 10)
            forget = wire.Forget(job=JOB, replica="r9")
            sent = asyncio.create_task(nc.request(S.forget, encode(forget), timeout=20))
            await eventually(lambda: WorkerKey(JOB, "r9", 0) not in c.policy.workers)
            await eventually(
                lambda: pipeline.contended.is_set() or ("delete", wkey, None) in tools.kv.done
            )
            tools.kv.gate.set()
            assert (await reg).outcome == "new"
            assert decode((await sent).data, wire.ForgetReply).removed == ["wal/r9/0"]
            assert c.store is not None
            stored = {
                (w.registration.replica, w.registration.worker)
                for w in (await c.store.load()).workers
            }
            in_memory = {(k.replica, k.worker) for k in c.policy.workers}
            assert stored == in_memory == {("r1", 0)}
        finally:
            await nc.close()


async def test_a_ceiling_is_not_overwritten_by_an_earlier_decisions_record(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """A failure decides epoch 1 (inside the reserved block, so its epoch record is written only
    after the command, and that write is slow); a crash report then decides epoch 2, whose
    ceiling must be written ahead. The ceiling may not land before the earlier record: that
    record (ceiling 1) would then overwrite it, and a controller restored from the bucket would
    issue epoch 2 a second time.

    Catches: the write-ahead not waiting for an earlier batch still writing the same key (in
    ``CommitPipeline._go_out``). Seen when broken: the stored floor ends at 1 after epoch 2 went
    out.
    """
    async with running(nats_server, tmp_path, tick_interval_s=3600.0) as c:
        pipeline = c.pipeline
        tools = instrument(c)
        nc = await nats.connect(nats_server.url)
        try:
            await register(nc, "r1", ["d1"])
            tools.kv.hold = lambda op, key, value: (
                key == SCOPE_KEY and b'"epoch":1,' in (value or b"")
            )
            first = await health_reply_task(nc, "d1", "first")
            await asyncio.wait_for(tools.kv.held.wait(), 10)
            pipeline.contended.clear()
            second = asyncio.create_task(report_crash(nc, "r1", epoch=1, timeout=20))
            await eventually(lambda: c.policy.epoch_of(SCOPE) == 2)
            await eventually(lambda: pipeline.contended.is_set() or 2 in tools.epochs())
            tools.kv.gate.set()
            assert decode(await first, wire.HealthReply).actions[0].epoch == 1
            assert isinstance(await second, wire.ReportReply)
            await eventually(lambda: not pipeline.busy())
            assert tools.epochs() == [1, 2]
            assert not tools.not_durable()
            assert tools.kv.floors[SCOPE_KEY] == 2, tools.kv.floors
        finally:
            await nc.close()


# --- fencing and durability at the edges (each was a bug, found by these tests) ---------------


class StalledLease:
    """The lease bucket as a leader whose lease loop has stalled sees it (a paused process, a
    starved event loop): a renewal neither arrives nor gives up until ``heal``."""

    def __init__(self, kv: Any) -> None:
        self._kv = kv
        self.healed = asyncio.Event()

    async def update(self, *args: Any, **kw: Any) -> int:
        while not self.healed.is_set():
            try:
                await self.healed.wait()
            except asyncio.CancelledError:
                continue  # stalled: not even its timeout gets it going
        raise ConnectionError("the renewal never arrived")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kv, name)


async def test_a_leader_whose_lease_lapsed_during_its_write_ahead_publishes_nothing(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """The leader's write-ahead of epoch 2 is slow and its lease loop stalls (a paused process);
    a standby takes over and issues its own epoch 2. When the old write lands, the old leader,
    whose lease has lapsed, must not publish its epoch 2."""
    nc = await nats.connect(nats_server.url)
    try:
        seen = await observe_commands(nc)
        async with running(nats_server, tmp_path, lease_ttl=1.0) as c1:
            tools = instrument(c1)
            await register(nc, "r1", ["d1", "d2"])
            await health_event(nc, "d1", event_id="one")
            tools.kv.hold = lambda op, key, value: (
                key == SCOPE_KEY and b'"epoch":2,' in (value or b"")
            )
            await health_reply_task(nc, "d2", "two-old-leader")
            await asyncio.wait_for(tools.kv.held.wait(), 10)
            assert c1.leadership is not None
            lease = StalledLease(c1.leadership.kv)
            c1.leadership.kv = lease  # type: ignore[assignment]
            try:
                async with running(nats_server, tmp_path, lease_ttl=1.0) as c2:
                    # The new leader's own epoch 2: a crash report (both controllers hear it;
                    # only a leader answers).
                    assert isinstance(await report_crash(nc, "r1", epoch=1), wire.ReportReply)
                    assert c2.policy.epoch_of(SCOPE) == 2 and not c1.leading()
                    tools.kv.gate.set()
                    await eventually(lambda: ("put", SCOPE_KEY) in [d[:2] for d in tools.kv.done])
                    await eventually(lambda: not c1.pipeline.busy())
                    late = [f"{s.command.epoch} {s.command.devices}" for s in tools.sent[1:]]
                    assert not late, f"the deposed leader published epoch {late}"
                    await nc.flush()
                    assert not reused_epochs(seen), reused_epochs(seen)
            finally:
                lease.healed.set()
    finally:
        await nc.close()


async def test_a_command_whose_ceiling_could_not_be_written_is_not_reissued(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """The state bucket refuses writes of this scope's epoch record (JetStream unavailable for
    it) while a failure is handled; the leader is then replaced. No epoch may carry two
    restarts."""
    nc = await nats.connect(nats_server.url)
    try:
        seen = await observe_commands(nc)
        async with running(nats_server, tmp_path) as c1:
            tools = instrument(c1)
            await register(nc, "r1", ["d1", "d2", "d3"])
            await health_event(nc, "d1", event_id="one")
            tools.kv.refuse = lambda op, key, value: key == SCOPE_KEY
            event = wire.DeviceHealth(device="d2", state="failed", event_id="two")
            await store_health(nc, encode(event))
            # Handled once every attempt to write the ceiling has failed (answered or not).
            await eventually(lambda: c1.stats["store.errors"] >= 3)
            await eventually(lambda: not c1.pipeline.busy())
        async with running(nats_server, tmp_path):
            await health_event(nc, "d3", event_id="three")
            await eventually(lambda: any(c.event_id == "three" for c in seen))
            assert not reused_epochs(seen), reused_epochs(seen)
    finally:
        await nc.close()


async def test_a_leader_whose_lease_lapsed_does_not_answer_requests(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """A leader's lease loop stalls (a paused process) and a standby takes over: a query must
    get one answer, the new leader's."""
    nc = await nats.connect(nats_server.url)
    async with running(nats_server, tmp_path, lease_ttl=1.0) as c1:
        assert c1.leadership is not None and c1.nc is not None
        lease = StalledLease(c1.leadership.kv)
        c1.leadership.kv = lease  # type: ignore[assignment]
        try:
            async with running(nats_server, tmp_path, lease_ttl=1.0) as c2:
                assert not c1.leading()
                inbox = nc.new_inbox()
                sub = await nc.subscribe(inbox)
                before = c1.stats["received.query"]
                await nc.publish(S.query, encode(wire.Query(what="ping")), reply=inbox)
                await eventually(lambda: c1.stats["received.query"] > before)
                await c1.nc.flush()  # whatever c1 answered has reached the server
                await nc.flush()  # ... and has been delivered to us
                answers = []
                with contextlib.suppress(nats.errors.TimeoutError):
                    while True:
                        msg = await sub.next_msg(timeout=0.5)
                        answers.append(decode(msg.data, wire.QueryReply).controller)
                ids = [(a.controller_id, a.role) for a in answers]
                assert ids == [(c2.controller_id, "leader")], ids
        finally:
            lease.healed.set()
            await nc.close()


async def test_a_re_elected_leader_leads_from_the_store_not_from_its_dropped_decisions(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """A leader whose write-ahead fails steps down and drops its undurable decisions; taking the
    lease back, it must lead from what the bucket holds. Broken on purpose by letting
    ``StateMirror.snapshot`` hand out its own records (the policy then edits the mirror in place,
    and the re-elected leader counts event e3 twice and issues above a ceiling never written)."""

    def settings() -> Any:
        s = controller_settings(nats_server, tmp_path, epoch_block=3, pending_timeout_s=0.0)
        s.lease_ttl = 1.0
        return s

    c0 = await start_serving(Controller(settings()))
    nc = await nats.connect(nats_server.url)
    await register(nc, "r9", ["d4"])
    await health_event(nc, "d4", event_id="pre")  # a d4 record in the bucket
    await register(nc, "r1", ["d1", "d2", "d3", "d4", "d5"])
    for i in range(3):
        await health_event(nc, f"d{i + 1}", event_id=f"e{i}")  # epochs 1..3, ceiling 3
    await eventually(lambda: not c0.pipeline.busy())
    await c0.stop()
    c = await start_serving(Controller(settings()))  # leads from its state mirror
    try:
        before = await c.store.load()
        d4_failures = next(len(d.failures) for d in before.devices if d.device == "d4")
        tools = instrument(c)
        tools.kv.floors[SCOPE_KEY] = 3
        tools.kv.refuse = lambda op, key, value: key == SCOPE_KEY
        await store_health(
            nc, encode(wire.DeviceHealth(device="d4", state="failed", event_id="e3"))
        )
        await eventually(lambda: c.stats["store.write_ahead_failed"] >= 1, timeout=10)
        await eventually(lambda: not c.serving.is_set(), timeout=10)
        tools.kv.refuse = lambda op, key, value: False
        await asyncio.wait_for(c.serving.wait(), 15)  # re-elected
        await eventually(lambda: len(tools.sent) >= 1, timeout=10)  # e3 redelivered, decided once
        await eventually(lambda: not c.pipeline.busy())
        stored = await c.store.load()
        store_d4 = next(d for d in stored.devices if d.device == "d4")
        assert len(store_d4.failures) == d4_failures + 1
        assert len(c.policy.devices["d4"].failures) == d4_failures + 1
        # The refused write-ahead's ceiling (6) never reached the bucket: the new epoch is the
        # first above the durable floor 3, not above 6.
        assert [s.command.epoch for s in tools.sent][:1] == [4]
    finally:
        await nc.close()
        await c.stop()


def _command(replica: str) -> wire.Command:
    return wire.Command(
        command_id=replica, job="j", replica=replica, scope="replica", kind="restart", epoch=1
    )


async def test_a_failed_publish_fails_only_its_own_commit(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """Two commits in one batch; the second's publish raises (say, a payload too large). The
    first is published and durable, both records are written, the error is counted and the
    controller still leads. Broken on purpose by letting the publish error fail the whole batch
    (the code before the fix): the first commit failed too and nothing was written."""
    from marduk.core.decisions import Outcome
    from marduk.core.records import WorkerRecord

    c = await start_serving(Controller(controller_settings(nats_server, tmp_path)))
    try:
        real = c.outbox.publish_command

        async def flaky(command: wire.Command) -> None:
            if command.replica == "bad":
                raise RuntimeError("nats: maximum payload exceeded")
            await real(command)

        c.outbox.publish_command = flaky  # type: ignore[method-assign]

        def worker(replica: str) -> WorkerRecord:
            reg = wire.Registration(
                job="j", replica=replica, devices=[f"d-{replica}"], pid=1, host="h", incarnation=0
            )
            return WorkerRecord(registration=reg, registered_at=1.0, updated_at=1.0)

        good = c.pipeline.submit(Outcome(commands=[_command("good")], put_workers=[worker("good")]))
        bad = c.pipeline.submit(Outcome(commands=[_command("bad")], put_workers=[worker("bad")]))
        results = await asyncio.gather(good.durable, bad.durable, return_exceptions=True)
        assert results[0] is None
        assert isinstance(results[1], RuntimeError)
        await c.pipeline.drain()
        assert c.store is not None
        stored = sorted(w.registration.replica or "" for w in (await c.store.load()).workers)
        assert stored == ["bad", "good"]
        assert c.stats["errors.publish"] == 1
        assert c.leading() and not c.pipeline._closed
        await c.pipeline.submit(Outcome()).durable  # later commits go through
    finally:
        await c.stop()


async def test_an_error_in_a_spawned_task_is_counted(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """Per-request and per-event tasks are not awaited: an error escaping one must be counted
    (``errors.internal``), not lost. Broken on purpose by removing the done-callback."""
    c = await start_serving(Controller(controller_settings(nats_server, tmp_path)))
    try:
        before = c.stats["errors.internal"]

        async def boom() -> None:
            raise RuntimeError("a bug")

        task = c.spawn_background(boom(), "probe")
        await asyncio.wait([task])
        await eventually(lambda: c.stats["errors.internal"] == before + 1)
    finally:
        await c.stop()


async def test_a_lease_that_lapses_while_a_batch_is_publishing_stops_the_rest(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """A publish can yield; if the lease lapses meanwhile, the rest of the batch must not go
    out. Broken on purpose by checking the fence once per batch (the code before the fix)."""
    from marduk.controller.commit import NotServing
    from marduk.core.decisions import Outcome

    c = await start_serving(Controller(controller_settings(nats_server, tmp_path)))
    try:
        real, published, lapsed = c.outbox.publish_command, [], []

        async def lapsing(command: wire.Command) -> None:
            await real(command)
            published.append(command.replica)
            lapsed.append(True)  # the lease lapses while this publish yields

        c.outbox.publish_command = lapsing  # type: ignore[method-assign]
        c.pipeline.steps.leading = lambda: not lapsed

        first = c.pipeline.submit(Outcome(commands=[_command("first")]))
        second = c.pipeline.submit(Outcome(commands=[_command("second")]))
        results = await asyncio.gather(first.durable, second.durable, return_exceptions=True)
        assert published == ["first"]
        assert isinstance(results[1], NotServing)
        assert first.published.done() and first.published.exception() is None
    finally:
        await c.stop()


async def test_a_write_ahead_that_is_never_acknowledged_is_given_up(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """A server that takes a ceiling's write and never answers must not hold every later commit
    (the write-ahead used to wait for as long as the write did): the leader gives up within its
    write-ahead budget, sends nothing of that decision, and steps down. Broken on purpose by
    awaiting the write without a deadline (``_retry``)."""
    s = controller_settings(nats_server, tmp_path, epoch_block=1, pending_timeout_s=0.0)
    c = await start_serving(Controller(s))
    nc = await nats.connect(nats_server.url)
    try:
        await register(nc, "r1", ["d1"])
        tools = instrument(c)
        # The first restart is within the ceiling reserved at registration; the next needs a
        # write-ahead of its ceiling.
        await health_event(nc, "d1", event_id="x0")
        await eventually(lambda: len(tools.sent) == 1 and not c.pipeline.busy())
        tools.kv.hold = lambda op, key, value: key == SCOPE_KEY  # parked, never answered
        await store_health(
            nc, encode(wire.DeviceHealth(device="d1", state="failed", event_id="x1"))
        )
        await eventually(lambda: tools.kv.held.is_set(), timeout=10)
        await eventually(lambda: c.stats["store.write_ahead_failed"] >= 1, timeout=10)
        assert len(tools.sent) == 1  # no command above a ceiling that is not durable
        await eventually(lambda: c.stats["store.given_up"] >= 1, timeout=10)
    finally:
        tools.kv.gate.set()
        await nc.close()
        await c.stop()


async def test_a_health_event_is_acknowledged_only_once_its_dedup_record_is_durable(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """The stream message of a health event is acknowledged after its handled-event record is
    written: acknowledged before, a failover in between would handle it a second time. Broken
    on purpose by acknowledging once the command is published (not awaiting ``durable``)."""
    from marduk.store.health_stream import CONSUMER, stream_name

    s = controller_settings(nats_server, tmp_path, pending_timeout_s=0.0)
    c = await start_serving(Controller(s))
    nc = await nats.connect(nats_server.url)
    try:
        await register(nc, "r1", ["d1"])
        assert c.store is not None
        events = DurableKV(c.store.events)
        c.store.events = events  # type: ignore[assignment]
        tools = instrument(c)
        events.hold = lambda op, key, value: True  # every handled-event record parked
        js = nc.jetstream()
        await store_health(
            nc, encode(wire.DeviceHealth(device="d1", state="failed", event_id="h1"))
        )
        await eventually(lambda: events.held.is_set() and len(tools.sent) == 1)
        await asyncio.sleep(0.3)  # time for an early acknowledgement to reach the server
        info = await js.consumer_info(stream_name(s.prefix), CONSUMER)
        assert info.num_ack_pending == 1  # the command went out; the event is not acked yet
        events.gate.set()
        await eventually(
            lambda: ("put", handled_kv_key("h1")) in [(o, k) for o, k, _ in events.done]
        )

        async def acked() -> bool:
            return (await js.consumer_info(stream_name(s.prefix), CONSUMER)).num_ack_pending == 0

        for _ in range(250):
            if await acked():
                break
            await asyncio.sleep(0.02)
        assert await acked()
    finally:
        await nc.close()
        await c.stop()


async def test_a_registration_is_answered_only_once_its_worker_record_is_durable(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """The registration reply waits for the worker's record: answered before, a failover in
    between would lose a worker the agent believes registered (and the epoch it was told).
    Broken on purpose by replying once the decision's commands are published."""
    c = await start_serving(Controller(controller_settings(nats_server, tmp_path)))
    nc = await nats.connect(nats_server.url)
    try:
        tools = instrument(c)
        worker = worker_kv_key(WorkerKey(JOB, "r1", 0))
        tools.kv.hold = lambda op, key, value: key == worker
        answer = asyncio.create_task(register(nc, "r1", ["d1"], timeout=20))
        await eventually(lambda: tools.kv.held.is_set())
        await asyncio.sleep(0.3)  # time for an early reply to arrive
        assert not answer.done()
        tools.kv.gate.set()
        reply = await asyncio.wait_for(answer, 20)
        assert isinstance(reply, wire.RegisterReply)
        assert ("put", worker) in [(op, key) for op, key, _ in tools.kv.done]
    finally:
        tools.kv.gate.set()
        await nc.close()
        await c.stop()


async def test_a_health_event_is_decided_in_the_consumers_callback(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    """A health event is decided, and its commit queued, before the consumer's callback
    returns, in delivery order: no task (a turn of the event loop, and whatever else is ready
    then) stands between its delivery and its command. Only the wait for its records, the
    answer and the ack go on in a task. Broken on purpose by handing the whole event to a task
    again (``on_health_msg`` spawning ``decide_health_msg`` and its continuation)."""
    from nats.aio.msg import Msg

    c = await start_serving(Controller(controller_settings(nats_server, tmp_path)))
    nc = await nats.connect(nats_server.url)
    try:
        for replica in ("r1", "r2"):
            await register(nc, replica, [f"{replica}-d"])
        tools = instrument(c)
        acks = await nc.subscribe("$JS.ACK.not_the_stream.>")
        for i, replica in enumerate(("r2", "r1"), 1):
            event = wire.DeviceHealth(device=f"{replica}-d", state="failed", event_id=f"cb{i}")
            reply = f"$JS.ACK.not_the_stream.marduk-controller.1.{i}.{i}.0.0"
            await c.edge.on_health_msg(
                Msg(_client=c.nc, subject=S.health, reply=reply, data=encode(event))  # type: ignore[arg-type]
            )
        # Nothing else has run yet: both decided, both commits queued, nothing published.
        assert [c.policy.epoch_of_worker(WorkerKey(JOB, r, 0)) for r in ("r1", "r2")] == [1, 1]
        assert c.pipeline.busy() and not tools.sent
        await eventually(lambda: len(tools.sent) == 2)
        assert [s.command.replica for s in tools.sent] == ["r2", "r1"]  # in delivery order
        for i in (1, 2):  # each acknowledged once durable
            assert (await acks.next_msg(timeout=5)).subject.endswith(f".{i}.{i}.0.0")
    finally:
        await nc.close()
        await c.stop()
