"""Chaos soak: real controllers and a real nats-server killed at random while devices fail.

One nats-server (JetStream, file store), three ``marduk controller --no-embedded`` processes
(one leads, two stand by), and agents (the real library, in this process) on a fixed map of
devices, some shared between replicas and between jobs, one job of scope ``job``. For
``MARDUK_CHAOS_SECONDS`` (default 60): failure events are published durably at random
intervals (each with a unique id), agents ack what they receive, the leader is SIGKILLed and
replaced, or paused with SIGSTOP past its lease and let go on; now and then the nats-server is
SIGKILLed and started again on the same port and store; the controller is asked who leads five
times a second.

Then, once the last leader has had time to settle:

* every event the stream accepted is handled (its decision is in the events bucket), known,
  and aimed at exactly the restart scopes that use its device; every worker of those scopes
  ended at or above the epoch decided for it;
* no restart scope ever saw two different decisions under one epoch (a later resend may only
  add devices), and no decision went out at or below an epoch already seen for its scope;
* no agent saw its epoch go backwards;
* every worker converged: its epoch is its scope's current epoch and it has applied it;
* no ``ctl.query`` got two answers from controllers that said they lead (never two leaders at
  once), no query got two answers at all (a paused leader, let go on, must not answer what
  queued up while it slept), and no controller process exited by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from agent.library.client import AsyncClient, Command, connect_async
from marduk.store.state import events_bucket_name, handled_kv_key
from marduk.transport import bus
from marduk.wire import protocol as wire
from marduk.wire.protocol import decode, encode
from marduk.wire.subjects import Subjects
from tests.conftest import NatsServer, store_health
from tests.processes import Proc

SECONDS = float(os.environ.get("MARDUK_CHAOS_SECONDS", "60"))
SEED = int(os.environ.get("MARDUK_CHAOS_SEED", str(random.randrange(2**32))))
CONTROLLERS = 3
LEASE_TTL = 2.0
S = Subjects()

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(int(SECONDS) + 300)]

# (job, replica, worker, devices, scope). A1, B1, C0 are shared by two replicas of "chaos";
# A2 by chaos/r1 and the job-scope job "mesh"; r2 has two workers.
TOPOLOGY: list[tuple[str, str, int, list[str], str]] = [
    ("chaos", "r0", 0, ["A0", "A1"], "replica"),
    ("chaos", "r1", 0, ["A1", "A2"], "replica"),
    ("chaos", "r2", 0, ["B0"], "replica"),
    ("chaos", "r2", 1, ["B1"], "replica"),
    ("chaos", "r3", 0, ["B1", "C0"], "replica"),
    ("chaos", "r4", 0, ["C0", "C1"], "replica"),
    ("chaos", "r5", 0, ["D0"], "replica"),
    ("mesh", "m0", 0, ["M0"], "job"),
    ("mesh", "m1", 0, ["M1", "A2"], "job"),
]
# Shared devices fail more often: their events coalesce and merge.
DEVICE_WEIGHTS = {"A1": 3, "A2": 3, "B1": 3, "C0": 3}
Scope = tuple[str, str | None]


def scope_of(job: str, replica: str, kind: str) -> Scope:
    return (job, None if kind == "job" else replica)


def scopes_using(device: str) -> set[Scope]:
    return {scope_of(j, r, k) for j, r, _, devices, k in TOPOLOGY if device in devices}


@dataclass
class Member:
    """One agent and everything it saw, in order."""

    client: AsyncClient
    scope: Scope
    received: list[Command] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)  # samples of client.epoch

    @property
    def name(self) -> str:
        o = self.client.opts
        return f"{o.job}/{o.replica}/{o.worker}"


class Cluster:
    """The nats-server and the controller processes, with what was done to them."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.server = NatsServer(tmp_path / "js")
        self.procs: list[Proc] = []
        self.killed: set[int] = set()
        self.exits: list[str] = []  # controllers that exited by themselves
        self.leader_kills = 0
        self.leader_pauses = 0
        self.server_kills = 0

    @property
    def server_up(self) -> bool:
        return self.server.proc is not None

    def start_controller(self) -> None:
        state = self.tmp / f"controller-{len(self.procs)}"
        args = ["--no-embedded", "--addr", self.server.url, "--state-dir", str(state)]
        args += ["--lease-ttl", str(LEASE_TTL)]
        cmd = [sys.executable, "-m", "marduk", "controller", *args]
        self.procs.append(Proc(cmd, {"PYTHONUNBUFFERED": "1", "MARDUK_LOG_LEVEL": "info"}))

    def alive(self) -> list[Proc]:
        return [p for p in self.procs if p.proc.poll() is None]

    def keep(self) -> None:
        """Note controllers that exited by themselves; run CONTROLLERS of them again."""
        for p in self.procs:
            code = p.proc.poll()
            if code is not None and p.proc.pid not in self.killed:
                self.killed.add(p.proc.pid)  # noted once
                tail = "".join(p.all[-15:])
                self.exits.append(f"pid {p.proc.pid} exited with {code}:\n{tail}")
        if self.server_up:
            while len(self.alive()) < CONTROLLERS:
                self.start_controller()

    def kill(self, pid: int) -> None:
        for p in self.alive():
            if p.proc.pid == pid:
                self.killed.add(pid)
                p.stop(signal.SIGKILL)

    def signal(self, pid: int, sig: int) -> None:
        for p in self.alive():
            if p.proc.pid == pid:
                p.proc.send_signal(sig)

    def kill_server(self) -> None:
        proc, self.server.proc = self.server.proc, None
        assert proc is not None
        proc.kill()
        proc.wait()
        self.server_kills += 1

    def logs(self) -> str:
        return "\n".join(f"--- pid {p.proc.pid}\n" + "".join(p.all[-40:]) for p in self.procs)


async def connect(url: str, name: str) -> NATS:
    return await bus.connect(url, name=name, timeout=10, reconnect=True)


async def ask_leader(nc: NATS, timeout: float = 1.0) -> wire.ControllerInfo | None:
    try:
        msg = await nc.request(S.query, encode(wire.Query(what="ping")), timeout=timeout)
        return decode(msg.data, wire.QueryReply).controller
    except Exception:
        await asyncio.sleep(0.2)  # no responders comes back at once
        return None


async def await_leader(nc: NATS, cluster: Cluster, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while await ask_leader(nc) is None:
        assert time.monotonic() < deadline, f"no leader answers\n{cluster.logs()}"


class Watch:
    """Asks who leads, five times a second; counts the answers to each question."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        # An _INBOX. subject: the controller answers no other reply subject (confused deputy).
        self.inbox = f"_INBOX.CHAOS{os.getpid()}x{random.randrange(2**32)}"
        self.answers: dict[int, list[tuple[str, int, str]]] = defaultdict(list)
        self.asked = 0

    async def run(self, stop: asyncio.Event) -> None:
        async def on_answer(msg: Any) -> None:
            info = decode(msg.data, wire.QueryReply).controller
            n = int(msg.subject.rsplit(".", 1)[1])
            self.answers[n].append((info.controller_id, info.term, info.role))

        await self.nc.subscribe(f"{self.inbox}.*", cb=on_answer)
        while not stop.is_set():
            self.asked += 1
            with contextlib.suppress(Exception):
                ping = encode(wire.Query(what="ping"))
                await self.nc.publish(S.query, ping, reply=f"{self.inbox}.{self.asked}")
            await asyncio.sleep(0.2)


async def follow(member: Member, stop: asyncio.Event, rng: random.Random) -> None:
    """The trainer's loop: take each command, 'restart', acknowledge."""
    while not stop.is_set():
        command = await member.client.wait(0.25)
        member.epochs.append(member.client.epoch)
        if command is None:
            continue
        member.received.append(command)
        await asyncio.sleep(rng.uniform(0.0, 0.3))
        await member.client.ack(command)


async def observe(nc: NATS, seen: list[wire.Command]) -> None:
    """Every command on the bus, as a cut-off agent (no library fencing) would get it."""

    async def on_command(msg: Any) -> None:
        seen.append(decode(msg.data, wire.Command))

    await nc.subscribe(f"{S.prefix}.*.cmd.>", cb=on_command)


async def publish_events(
    nc: NATS,
    stop: asyncio.Event,
    rng: random.Random,
    accepted: dict[str, str],
    plain: dict[str, str],
) -> int:
    """Failure events at random intervals: most through JetStream (``accepted`` once the stream
    confirmed), a quarter as plain publishes (``plain``: stored unless the server was down).
    Returns how many the stream did not confirm."""
    devices = sorted({d for *_, ds, _ in TOPOLOGY for d in ds})
    weights = [DEVICE_WEIGHTS.get(d, 1) for d in devices]
    unconfirmed = 0
    n = 0
    while not stop.is_set():
        await asyncio.sleep(rng.uniform(0.05, 0.6))
        n += 1
        device = rng.choices(devices, weights)[0]
        event_id = f"chaos-{SEED}-{n}"
        event = wire.DeviceHealth(device=device, state="failed", event_id=event_id, source="chaos")
        if rng.random() < 0.25:
            with contextlib.suppress(Exception):
                await nc.publish(S.health, encode(event))
                plain[event_id] = device
            continue
        try:
            await store_health(nc, encode(event))
            accepted[event_id] = device
        except Exception:  # the server is down: a monitor would retry; we only count it
            unconfirmed += 1
    return unconfirmed


async def wreak_havoc(cluster: Cluster, nc: NATS, stop: asyncio.Event, rng: random.Random) -> None:
    """Every few seconds: kill the leader (and start another controller), pause it (SIGSTOP,
    as a VM pause or a starved host would) past its lease, or kill the nats-server."""
    while not stop.is_set():
        await asyncio.sleep(rng.uniform(3.0, 8.0))
        if stop.is_set():
            return
        dice = rng.random()
        if dice < 0.85:
            leader = await ask_leader(nc)
            if leader is None:
                pass
            elif dice < 0.6:
                cluster.kill(leader.pid)
                cluster.leader_kills += 1
            else:
                cluster.signal(leader.pid, signal.SIGSTOP)
                await asyncio.sleep(rng.uniform(LEASE_TTL * 1.2, LEASE_TTL * 3))
                cluster.signal(leader.pid, signal.SIGCONT)
                cluster.leader_pauses += 1
        else:
            cluster.kill_server()
            await asyncio.sleep(rng.uniform(0.3, 3.0))
            await asyncio.to_thread(cluster.server.start)
        cluster.keep()


async def tend(cluster: Cluster, stop: asyncio.Event) -> None:
    while not stop.is_set():
        cluster.keep()
        await asyncio.sleep(1.0)


def decision_problems(seen: list[wire.Command]) -> list[str]:
    """Two different decisions under one epoch, or a new decision not above what went out."""
    problems = []
    first: dict[tuple[Scope, int], wire.Command] = {}
    top: dict[Scope, int] = {}
    for c in seen:
        scope: Scope = (c.job, c.replica)
        prev = first.get((scope, c.epoch))
        if prev is None:
            if c.epoch <= top.get(scope, 0):
                problems.append(f"{scope} new decision {c.epoch} after {top[scope]}: {c}")
            first[(scope, c.epoch)] = c
        elif (prev.kind, prev.event_id, prev.issued_at) != (
            c.kind,
            c.event_id,
            c.issued_at,
        ) or not (set(prev.devices) <= set(c.devices) or set(c.devices) <= set(prev.devices)):
            problems.append(f"{scope} epoch {c.epoch} reused: {prev} then {c}")
        top[scope] = max(top.get(scope, 0), c.epoch)
    return problems


def member_problems(m: Member) -> list[str]:
    problems = []
    if any(b < a for a, b in zip(m.epochs, m.epochs[1:], strict=False)):
        problems.append(f"{m.name}: client.epoch went backwards: {m.epochs}")
    for a, b in zip(m.received, m.received[1:], strict=False):
        if b.epoch < a.epoch or (b.epoch == a.epoch and not set(a.devices) < set(b.devices)):
            problems.append(
                f"{m.name}: {a.kind}@{a.epoch}{a.devices} then {b.kind}@{b.epoch}{b.devices}"
            )
    return problems


async def test_chaos_soak(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    print(f"chaos seed {SEED} (MARDUK_CHAOS_SEED reproduces the choices), {SECONDS:g}s")
    cluster = Cluster(tmp_path)
    cluster.server.start()
    stop, done = asyncio.Event(), asyncio.Event()
    members: list[Member] = []
    tasks: list[asyncio.Task[Any]] = []
    ncs: list[NATS] = []
    try:
        cluster.keep()
        ctl = await connect(cluster.server.url, "chaos-driver")
        ncs.append(ctl)
        await await_leader(ctl, cluster)
        for job, replica, worker, devices, kind in TOPOLOGY:
            client = await connect_async(
                replica, devices, job=job, worker=worker, scope=kind,
                addr=cluster.server.url, timeout=30,
            )  # fmt: skip
            members.append(Member(client, scope_of(job, replica, kind)))
        seen: list[wire.Command] = []
        raw = await connect(cluster.server.url, "chaos-observer")
        ncs.append(raw)
        await observe(raw, seen)
        watch = Watch(await connect(cluster.server.url, "chaos-watch"))
        ncs.append(watch.nc)
        events_nc = await connect(cluster.server.url, "chaos-monitor")
        ncs.append(events_nc)
        accepted: dict[str, str] = {}
        plain: dict[str, str] = {}

        tasks = [asyncio.create_task(follow(m, done, rng)) for m in members]
        tasks.append(asyncio.create_task(watch.run(done)))
        havoc = [
            asyncio.create_task(publish_events(events_nc, stop, rng, accepted, plain)),
            asyncio.create_task(wreak_havoc(cluster, ctl, stop, rng)),
            asyncio.create_task(tend(cluster, stop)),
        ]
        await asyncio.sleep(SECONDS)
        stop.set()
        unconfirmed, *_ = await asyncio.gather(*havoc)
        if not cluster.server_up:
            await asyncio.to_thread(cluster.server.start)
        cluster.keep()

        # Settle: a leader, every accepted event decided, every worker at its scope's epoch.
        await await_leader(ctl, cluster)
        kv = await ctl.jetstream(timeout=5).key_value(events_bucket_name(S.prefix))
        decisions: dict[str, wire.HealthReply] = {}

        async def all_decided() -> bool:
            for event_id in accepted:
                if event_id not in decisions:
                    try:
                        entry = await kv.get(handled_kv_key(event_id))
                    except Exception:
                        return False
                    assert entry.value is not None
                    decisions[event_id] = decode(entry.value, wire.HealthReply)
            return True

        deadline = time.monotonic() + 90
        while not await all_decided():
            missing = sorted(set(accepted) - set(decisions))
            assert time.monotonic() < deadline, f"undecided: {missing}\n{cluster.logs()}"
            await asyncio.sleep(0.5)
        for event_id in plain:  # not required (maybe never stored); checked where decided
            with contextlib.suppress(Exception):
                entry = await kv.get(handled_kv_key(event_id))
                assert entry.value is not None
                decisions[event_id] = decode(entry.value, wire.HealthReply)

        workers: list[wire.WorkerInfo] = []

        async def converged() -> bool:
            nonlocal workers
            try:
                msg = await ctl.request(S.query, encode(wire.Query(what="map")), timeout=2)
            except Exception:
                return False
            workers = decode(msg.data, wire.QueryReply).workers
            mine = {(w.job, w.replica, w.worker): w for w in workers}
            return all(
                (w := mine.get((m.client.opts.job, m.client.opts.replica, m.client.opts.worker)))
                is not None
                and w.state == "live"
                and m.client.epoch == w.epoch == w.applied_epoch
                and not m.client.failed
                for m in members
            )

        deadline = time.monotonic() + 60
        while not await converged():
            if time.monotonic() > deadline:
                detail = [(m.name, m.client.epoch, m.client.failed) for m in members]
                raise AssertionError(f"not converged: {detail}\n{workers}\n{cluster.logs()}")
            await asyncio.sleep(0.5)
        done.set()
        await asyncio.gather(*tasks)

        # --- invariants ---
        problems: list[str] = []
        final = {m.name: m.client.epoch for m in members}
        for event_id, device in [*accepted.items(), *plain.items()]:
            if (d := decisions.get(event_id)) is None:
                continue
            acted = {(a.job, a.replica) for a in d.actions}
            if not d.known or acted != scopes_using(device):
                problems.append(f"{event_id} on {device}: known={d.known} actions {d.actions}")
            for a in d.actions:
                for m in members:
                    if m.scope == (a.job, a.replica) and final[m.name] < a.epoch:
                        problems.append(
                            f"{m.name} ended at {final[m.name]} < {a.epoch} ({event_id})"
                        )
        problems += decision_problems(seen)
        for m in members:
            problems += member_problems(m)
        two_leaders = {
            n: a for n, a in watch.answers.items() if [r for *_, r in a].count("leader") > 1
        }
        if two_leaders:
            problems.append(f"queries answered by two leaders: {two_leaders}")
        # Every question gets one answer: a paused leader, let go on, drops what queued up
        # while it slept (it no longer leads) instead of answering beside the new leader.
        late = sum(1 for a in watch.answers.values() if len(a) > 1)
        if late:
            twice = {n: a for n, a in watch.answers.items() if len(a) > 1}
            problems.append(f"{late} queries answered twice: {dict(list(twice.items())[:5])}")
        if cluster.exits:
            problems.append("controllers exited by themselves:\n" + "\n".join(cluster.exits))
        terms = sorted({t for a in watch.answers.values() for _, t, _ in a})
        print(
            f"events accepted {len(accepted)}, unconfirmed {unconfirmed}, plain {len(plain)} "
            f"({sum(e in decisions for e in plain)} decided); commands seen "
            f"{len(seen)}; leader kills {cluster.leader_kills}, pauses {cluster.leader_pauses}, "
            f"server kills "
            f"{cluster.server_kills}; controllers started {len(cluster.procs)}; leader terms "
            f"seen {terms}; queries {watch.asked}, answered {len(watch.answers)} (also by a "
            f"lapsed leader: {late}); final epochs "
            f"{final}"
        )
        assert not problems, "\n".join(problems[:30])
        assert len(accepted) > SECONDS  # the run did what it says
        assert cluster.leader_kills + cluster.leader_pauses + cluster.server_kills >= SECONDS / 15
        assert len(watch.answers) > watch.asked / 3
    finally:
        stop.set()
        done.set()
        for task in tasks:
            task.cancel()
        for m in members:
            await m.client.close(deregister=False)
        for nc in ncs:
            await bus.close(nc, drain=False)
        for p in cluster.procs:
            p.stop(signal.SIGKILL)
        cluster.server.stop()
