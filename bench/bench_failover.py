"""Benchmark: controller failover. A leader is SIGKILLed; how long until Marduk serves again, and
is any health event lost or acted on twice?

Setup (all on loopback): one nats-server with JetStream on a port it picks itself; two
``marduk controller --no-embedded`` processes (one leads by lease, one hot standby); replicas are
real ``agent`` clients (one NATS connection each) in this process. After each kill a fresh
controller is started once the trial's measurements are done, so two always run at a kill.

``--mode takeover`` (default 12 kills): find the leader (status query), SIGKILL it, and at once
(or ``--publish-delay`` later) publish failure events, each for a different replica's device:
one plain core publish (like ``nats pub``), one ``publish_durably`` (like ``marduk monitor``),
and one published again every ``--repeat-every`` until its command comes. Measured from the kill:
* the first status query answered by a different controller (serving again),
* each replica's library receiving its restart command (a targeted notice works again),
* the monitor receiving the controller's decision (``publish_durably``'s reply),
* every replica having re-registered (they do on the new leader's hello);
from the new leader's JSON log: kill -> lease taken, lease -> serving (state, subscriptions);
and how many deliveries the new leader counted against the events the stream stored.

``--mode storm`` (default 3 rounds): ``--replicas`` replicas, one failure event per replica's
device published as plain core NATS publishes (like ``nats pub``), ``--storm-gap`` apart; the
leader is SIGKILLed after ``--kill-after`` of them. Counted: events the stream accepted,
commands received, lost (replicas that never got theirs), duplicated restarts (one event, two
epochs), time from the kill until the last command arrived.

    .venv/bin/python bench/bench_failover.py --mode takeover        # 12 kills, --lease-ttl 2
    .venv/bin/python bench/bench_failover.py --mode storm           # 200 replicas, 3 rounds
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import nats

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_notify import machine, pct, source_version, start_nats_server

from marduk.errors import MardukError
from marduk.store.health_stream import CONSUMER
from marduk.transport import bus
from marduk.transport.embedded import find_binary
from marduk.wire import protocol as wire
from marduk.wire.subjects import Subjects
from monitor_cli.health import publish_durably, store, watch_stored

PREFIX = "marduk"
JOB = "bench"
SUBJECTS = Subjects(PREFIX)


def stats_ms(values_s: list[float]) -> dict[str, float | int]:
    ms = [v * 1000 for v in values_s]
    if not ms:
        return {"n": 0}
    return {
        "n": len(ms),
        "p50_ms": round(pct(ms, 50), 1),
        "p99_ms": round(pct(ms, 99), 1),
        "min_ms": round(min(ms), 1),
        "max_ms": round(max(ms), 1),
        "mean_ms": round(statistics.fmean(ms), 1),
    }


# --- controllers -------------------------------------------------------------------------------


@dataclass
class Ctl:
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_lines(self) -> list[dict[str, object]]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out


@dataclass
class Controllers:
    url: str
    tmp: Path
    lease_ttl: float
    running: dict[int, Ctl] = field(default_factory=dict)
    started: int = 0

    def spawn(self) -> Ctl:
        self.started += 1
        log = self.tmp / f"controller-{self.started}.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "marduk", "controller", "--no-embedded",
             "--addr", self.url, "--lease-ttl", str(self.lease_ttl),
             "--json-logs", "--log-level", "info"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=open(log, "w"),  # noqa: SIM115
            start_new_session=True,
        )  # fmt: skip
        ctl = Ctl(proc, log)
        self.running[proc.pid] = ctl
        return ctl

    def kill(self, pid: int) -> Ctl:
        ctl = self.running.pop(pid)
        os.kill(pid, signal.SIGKILL)
        return ctl

    def reap(self, ctl: Ctl) -> None:
        ctl.proc.wait(10)

    def kill_all(self) -> None:
        for pid in list(self.running):
            ctl = self.kill(pid)
            ctl.proc.wait(10)


async def status(nc: nats.NATS, timeout: float = 0.5) -> wire.QueryReply | None:
    try:
        return await bus.request(
            nc, SUBJECTS.query, wire.Query(what="ping"), wire.QueryReply, timeout=timeout
        )
    except MardukError:
        return None


async def two_up(nc: nats.NATS, ctls: Controllers, timeout: float = 60.0) -> wire.QueryReply:
    """Wait until a leader answers and every other controller we run is its known standby."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ctl in ctls.running.values():
            if ctl.proc.poll() is not None:
                raise RuntimeError(f"controller {ctl.pid} exited: see {ctl.log}")
        reply = await status(nc)
        if reply is not None:
            others = set(ctls.running) - {reply.controller.pid}
            if reply.controller.pid in ctls.running and others <= {s.pid for s in reply.standbys}:
                return reply
        await asyncio.sleep(0.1)
    raise RuntimeError(f"controllers not up within {timeout:g}s (logs in {ctls.tmp})")


def log_times(ctl: Ctl, term: int) -> tuple[float | None, float | None, float | None]:
    """(elected ts, serving ts, state load ms) of ``term`` from a controller's JSON log."""
    elected = serving = state_ms = None
    for rec in ctl.log_lines():
        msg = str(rec.get("msg", ""))
        if msg.startswith(f"elected leader (term {term},"):
            elected = float(rec["ts"])  # type: ignore[arg-type]
        elif "serving prefix" in msg and f"(leader, term {term};" in msg:
            serving = float(rec["ts"])  # type: ignore[arg-type]
            with contextlib.suppress(ValueError, IndexError):
                state_ms = float(msg.rsplit(" in ", 1)[1].split(" ms")[0])
    return elected, serving, state_ms


# --- replicas ----------------------------------------------------------------------------------


@dataclass
class Replica:
    name: str
    client: object  # agent.AsyncClient
    received: list[tuple[float, int, str, tuple[str, ...]]] = field(default_factory=list)
    # (monotonic, epoch, kind, devices) of each command the library accepted (epoch-fenced)


async def start_replicas(url: str, specs: list[tuple[str, list[str]]]) -> list[Replica]:
    import agent

    replicas: list[Replica] = []
    sem = asyncio.Semaphore(25)

    async def one(name: str, devices: list[str]) -> None:
        rep = Replica(name, None)

        def on_command(cmd: agent.Command) -> None:
            rep.received.append((time.monotonic(), cmd.epoch, cmd.kind, tuple(cmd.devices)))

        async with sem:
            rep.client = await agent.connect_async(
                name, devices, job=JOB, addr=url, on_command=on_command, timeout=60
            )
        replicas.append(rep)

    await asyncio.gather(*(one(n, d) for n, d in specs))
    replicas.sort(key=lambda r: r.name)
    return replicas


async def close_replicas(replicas: list[Replica]) -> None:
    await asyncio.gather(*(r.client.close(deregister=False) for r in replicas))  # type: ignore[attr-defined]


def first_command(r: Replica, marks: dict[str, int], device: str) -> tuple[float, int, str] | None:
    """(time, epoch, kind) of the first command about ``device`` since ``marks``."""
    return next(((t, e, k) for t, e, k, d in r.received[marks[r.name] :] if device in d), None)


def drain(rep: Replica) -> None:
    q = rep.client._queue  # type: ignore[attr-defined]
    while not q.empty():
        q.get_nowait()


async def publish_timed(
    nc: nats.NATS,
    event: wire.DeviceHealth,
    timeout: float,
    decided: dict[str, float],
    delay: float = 0.0,
) -> wire.HealthReply:
    """Publish through the health stream; note when the controller's decision comes back."""
    await asyncio.sleep(delay)
    reply = await publish_durably(nc, SUBJECTS, event, timeout=timeout)
    decided["t"] = time.monotonic()
    return reply


async def publish_plain(nc: nats.NATS, event: wire.DeviceHealth, delay: float) -> None:
    """One core NATS publish, as ``nats pub`` does: stored by the stream, nothing waited for."""
    await asyncio.sleep(delay)
    await nc.publish(SUBJECTS.health, wire.encode(event))
    await nc.flush()


async def ack_all(replicas: list[Replica]) -> None:
    """Confirm every pending restart, so the next round's events are not coalesced into them."""
    sem = asyncio.Semaphore(50)

    async def ack(rep: Replica) -> None:
        async with sem:
            await rep.client.ack()  # type: ignore[attr-defined]

    await asyncio.gather(*(ack(rep) for rep in replicas))


# --- takeover ----------------------------------------------------------------------------------


async def takeover(args: argparse.Namespace, url: str, ctls: Controllers) -> dict[str, object]:
    r_count, kills = args.takeover_replicas, args.kills
    per = -(-3 * kills // r_count)  # a fresh device per event: no device failure budget in play
    specs = [(f"t{i}", [f"fo-{i}-{k}" for k in range(per)]) for i in range(r_count)]
    replicas = await start_replicas(url, specs)
    nc = await bus.connect(url, name="bench-failover", timeout=10)
    js = nc.jetstream(timeout=5)
    stream = PREFIX + "_health"
    trials: list[dict[str, object]] = []
    try:
        for i in range(kills):
            await two_up(nc, ctls)
            await asyncio.sleep(random.uniform(0.5, 1.0))  # any phase of the lease renewal
            before = await status(nc, 2.0)
            assert before is not None
            # Three replicas per kill, each hears of one failure: published once as a plain
            # core publish (like `nats pub`); published with publish_durably (what `marduk
            # monitor` does: stored, then waits for the decision, asking again if none comes);
            # published again every --repeat-every until its command comes.
            js_ = [(3 * i + k) % r_count for k in range(3)]
            plain, once, rep = (replicas[j] for j in js_)
            dev_plain, dev_once, dev_rep = (
                f"fo-{j}-{(3 * i + k) // r_count}" for k, j in enumerate(js_)
            )
            marks = {r.name: len(r.received) for r in (plain, once, rep)}
            for r in (plain, once, rep):
                drain(r)
            regs_before = [r.client.stats["registrations"] for r in replicas]  # type: ignore[attr-defined]
            stored_before = (await js.stream_info(stream)).state.messages

            t_kill, wall_kill = time.monotonic(), time.time()
            old = ctls.kill(before.controller.pid)
            decided: dict[str, float] = {}
            event_once = wire.DeviceHealth(
                device=dev_once, state="failed", source="bench", event_id=f"once-{uuid.uuid4()}"
            )
            pub = asyncio.create_task(
                publish_timed(nc, event_once, args.wait, decided, args.publish_delay)
            )
            event_plain = wire.DeviceHealth(
                device=dev_plain, state="failed", source="bench", event_id=f"plain-{uuid.uuid4()}"
            )
            pub_plain = asyncio.create_task(publish_plain(nc, event_plain, args.publish_delay))
            repeats = 0
            t_next = t_kill
            t_serving = t_regs = None
            new_ctl: wire.ControllerInfo | None = None
            deadline = t_kill + args.wait
            while time.monotonic() < deadline:
                if first_command(rep, marks, dev_rep) is None and time.monotonic() >= t_next:
                    event = wire.DeviceHealth(
                        device=dev_rep,
                        state="failed",
                        source="bench",
                        event_id=f"rep-{uuid.uuid4()}",
                    )
                    # Stored once the stream republishes it (it sends no acknowledgements).
                    watch = await watch_stored(nc, SUBJECTS)
                    try:
                        await store(
                            nc, SUBJECTS, wire.encode(event), nc.new_inbox(), watch, timeout=5
                        )
                    finally:
                        await watch.unsubscribe()
                    repeats += 1
                    t_next += args.repeat_every
                if t_serving is None:
                    reply = await status(nc, 0.05)
                    if reply is not None and reply.controller.controller_id != (
                        before.controller.controller_id
                    ):
                        t_serving, new_ctl = time.monotonic(), reply.controller
                if t_regs is None and all(
                    r.client.stats["registrations"] > b  # type: ignore[attr-defined]
                    for r, b in zip(replicas, regs_before, strict=True)
                ):
                    t_regs = time.monotonic()
                if (
                    t_serving
                    and t_regs
                    and first_command(rep, marks, dev_rep)
                    and first_command(once, marks, dev_once)
                    and first_command(plain, marks, dev_plain)
                ):
                    break
                await asyncio.sleep(0.005)
            got_plain, got_once, got_rep = (
                first_command(plain, marks, dev_plain),
                first_command(once, marks, dev_once),
                first_command(rep, marks, dev_rep),
            )
            await pub_plain
            if got_plain is None or got_once is None or got_rep is None or new_ctl is None:
                raise RuntimeError(
                    f"trial {i}: a command or the new leader missing after {args.wait}s"
                )
            health_reply = await pub
            ctls.reap(old)
            # Every stored event handled (the repeats are coalesced) before the restarts are
            # confirmed, so none of them counts as a new failure after the confirmation.
            t_drained = None
            while time.monotonic() < deadline + args.wait:
                ci = await js.consumer_info(stream, CONSUMER)
                if ci.num_pending == 0 and ci.num_ack_pending == 0:
                    t_drained = time.monotonic()
                    break
                await asyncio.sleep(0.02)
            await asyncio.gather(*(r.client.ack() for r in (plain, once, rep)))  # type: ignore[attr-defined]
            stored = (await js.stream_info(stream)).state.messages - stored_before
            after = await status(nc, 2.0)
            elected, serving, state_ms = log_times(ctls.running[new_ctl.pid], new_ctl.term)
            trial = {
                "kill_to_status_s": round(t_serving - t_kill, 4) if t_serving else None,
                "kill_to_command_s": round(got_rep[0] - t_kill, 4),
                "kill_to_command_plain_event_s": round(got_plain[0] - t_kill, 4),
                "kill_to_command_durable_event_s": round(got_once[0] - t_kill, 4),
                "kill_to_decision_reply_durable_event_s": round(decided["t"] - t_kill, 4),
                "kill_to_all_reregistered_s": round(t_regs - t_kill, 4) if t_regs else None,
                "kill_to_lease_s": round(elected - wall_kill, 4) if elected else None,
                "lease_to_serving_s": round(serving - elected, 4) if serving and elected else None,
                "state_load_ms": state_ms,
                "term": new_ctl.term,
                "repeated_events": repeats,
                "commands": {
                    "plain": got_plain[1:],
                    "durable": got_once[1:],
                    "repeated": got_rep[1:],
                },
                "decision_actions": len(health_reply.actions),
                # Every event of the trial acknowledged (none pending, none awaiting an ack).
                "kill_to_stream_drained_s": round(t_drained - t_kill, 4) if t_drained else None,
                # Events the stream stored during the trial (publish_durably's repeats included);
                # more deliveries than that: some were delivered, not acked, and redelivered.
                "events_stored": stored,
                "new_leader_health_deliveries": after.stats.get("received.devicehealth")
                if after
                else None,
            }
            trials.append(trial)
            print(json.dumps({"trial": i, **trial}), file=sys.stderr, flush=True)
            ctls.spawn()  # two controllers again before the next kill
    finally:
        await close_replicas(replicas)
        await bus.close(nc)

    def col(key: str) -> list[float]:
        return [float(t[key]) for t in trials if t[key] is not None]  # type: ignore[arg-type]

    cmd_s = col("kill_to_command_s")
    return {
        "mode": "takeover",
        "lease_ttl_s": args.lease_ttl,
        "replicas": r_count,
        "kills": kills,
        "repeat_every_s": args.repeat_every,
        "publish_delay_s": args.publish_delay,
        "summary": {
            key: stats_ms(col(key))
            for key in (
                "kill_to_status_s",
                "kill_to_command_s",
                "kill_to_command_plain_event_s",
                "kill_to_command_durable_event_s",
                "kill_to_decision_reply_durable_event_s",
                "kill_to_all_reregistered_s",
                "kill_to_lease_s",
                "lease_to_serving_s",
                "kill_to_stream_drained_s",
            )
        },
        "state_load_ms": stats_ms([v / 1000 for v in col("state_load_ms")]),
        "target_s": 3.0,
        "kills_notice_within_target": sum(1 for v in cmd_s if v <= 3.0),
        "kills_plain_event_within_target": sum(
            1 for v in col("kill_to_command_plain_event_s") if v <= 3.0
        ),
        "kills_durable_event_within_target": sum(
            1 for v in col("kill_to_command_durable_event_s") if v <= 3.0
        ),
        "trials": trials,
    }


# --- storm -------------------------------------------------------------------------------------


async def storm(args: argparse.Namespace, url: str, ctls: Controllers) -> dict[str, object]:
    n, rounds = args.replicas, args.rounds
    specs = [(f"s{i}", [f"st-{i}-{r}" for r in range(rounds)]) for i in range(n)]
    t0 = time.monotonic()
    replicas = await start_replicas(url, specs)
    reg_s = time.monotonic() - t0
    nc = await bus.connect(url, name="bench-storm", timeout=10)
    js = nc.jetstream(timeout=5)
    stream = PREFIX + "_health"
    # Every command message on the wire (resends included), before the library's epoch fence.
    on_the_wire: list[tuple[str, int, tuple[str, ...]]] = []  # (replica, epoch, devices)

    async def on_wire(msg) -> None:  # type: ignore[no-untyped-def]
        with contextlib.suppress(ValueError):
            c = wire.decode(msg.data, wire.Command)
            on_the_wire.append((c.replica or "*", c.epoch, tuple(c.devices)))

    await nc.subscribe(f"{PREFIX}.{JOB}.cmd.replica.*", cb=on_wire)
    results: list[dict[str, object]] = []
    try:
        for r in range(rounds):
            await two_up(nc, ctls)
            await asyncio.sleep(1.0)
            before = await status(nc, 2.0)
            assert before is not None
            stored_before = (await js.stream_info(stream)).state.messages
            wire_mark = len(on_the_wire)
            marks = [len(rep.received) for rep in replicas]
            ids = {rep.name: f"storm-{r}-{rep.name}-{uuid.uuid4().hex[:8]}" for rep in replicas}
            dev = {rep.name: f"st-{rep.name[1:]}-{r}" for rep in replicas}
            order = list(replicas)
            random.shuffle(order)
            t_kill = t_first = wall_kill = 0.0
            old: Ctl | None = None
            published = 0
            t_first = time.monotonic()
            for k, rep in enumerate(order):
                if k == args.kill_after:
                    if args.kill_delay > 0:  # let the leader get busy with what it has
                        await nc.flush()
                        await asyncio.sleep(args.kill_delay)
                    t_kill, wall_kill = time.monotonic(), time.time()
                    old = ctls.kill(before.controller.pid)
                event = wire.DeviceHealth(
                    device=dev[rep.name], state="failed", source="bench", event_id=ids[rep.name]
                )
                await nc.publish(SUBJECTS.health, wire.encode(event))  # like `nats pub`
                published += 1
                if args.storm_gap > 0:
                    await nc.flush()
                    await asyncio.sleep(args.storm_gap)
            await nc.flush()
            t_burst_end = time.monotonic()

            def got(rep: Replica, mark: int, device: str) -> list[tuple[float, int, str]]:
                # Each event names a device no other event of the run names.
                return [(t, e, k) for t, e, k, d in rep.received[mark:] if device in d]

            deadline = time.monotonic() + args.wait
            while time.monotonic() < deadline:
                if all(got(rep, m, dev[rep.name]) for rep, m in zip(replicas, marks, strict=True)):
                    break
                await asyncio.sleep(0.01)
            # A late duplicate (an unacked event redelivered after ack_wait) would show by now.
            await asyncio.sleep(max(0.0, t_kill + args.linger - time.monotonic()))
            assert old is not None
            ctls.reap(old)
            stored = (await js.stream_info(stream)).state.messages - stored_before
            now = await status(nc, 2.0)
            elected = serving = None
            if now is not None and now.controller.pid in ctls.running:
                elected, serving, _ = log_times(
                    ctls.running[now.controller.pid], now.controller.term
                )
            per_rep = [got(rep, m, dev[rep.name]) for rep, m in zip(replicas, marks, strict=True)]
            lost = [rep.name for rep, g in zip(replicas, per_rep, strict=True) if not g]
            dup = [
                rep.name
                for rep, g in zip(replicas, per_rep, strict=True)
                if len({e for _, e, _ in g}) > 1
            ]
            other = sum(
                1
                for rep, m in zip(replicas, marks, strict=True)
                for _, _, _, d in rep.received[m:]
                if dev[rep.name] not in d
            )
            wire_round = on_the_wire[wire_mark:]
            wire_epochs: dict[str, set[int]] = {}
            for name, epoch, devices in wire_round:
                if name in dev and dev[name] in devices:
                    wire_epochs.setdefault(name, set()).add(epoch)
            wire_dup = sorted(name for name, e in wire_epochs.items() if len(e) > 1)
            firsts = [min(t for t, _, _ in g) for g in per_rep if g]
            before_kill = sum(1 for t in firsts if t < t_kill)
            after_kill = [t - t_kill for t in firsts if t >= t_kill]
            res = {
                "round": r,
                "published": published,
                "accepted_by_stream": stored,
                "commands_received": sum(1 for g in per_rep if g),
                "lost": len(lost),
                "lost_replicas": lost[:20],
                "duplicated_restarts": len(dup),
                "duplicated_replicas": dup[:20],
                "other_commands": other,
                # Includes resends to workers that have not confirmed yet (same epoch, dropped by
                # the library's epoch fence); replicas confirm only after the round.
                "command_messages_on_wire": len(wire_round),
                "replicas_sent_two_epochs_on_wire": len(wire_dup),
                "commands_before_kill": before_kill,
                "burst_s": round(t_burst_end - t_first, 4),
                "kill_at_s": round(t_kill - t_first, 4),
                "kill_to_lease_s": round(elected - wall_kill, 4) if elected else None,
                "lease_to_serving_s": round(serving - elected, 4) if serving and elected else None,
                "kill_to_first_command_after_kill_s": round(min(after_kill), 4)
                if after_kill
                else None,
                "kill_to_last_command_s": round(max(firsts) - t_kill, 4) if firsts else None,
                "commands_after_kill_by_time_s": histogram(after_kill),
            }
            results.append(res)
            print(json.dumps(res), file=sys.stderr, flush=True)
            ctls.spawn()
            await ack_all(replicas)
            for rep in replicas:
                drain(rep)
    finally:
        await close_replicas(replicas)
        await bus.close(nc)
    return {
        "mode": "storm",
        "lease_ttl_s": args.lease_ttl,
        "replicas": n,
        "kill_after": args.kill_after,
        "storm_gap_s": args.storm_gap,
        "kill_delay_s": args.kill_delay,
        "registration_s": round(reg_s, 2),
        "rounds": results,
        "total_lost": sum(int(x["lost"]) for x in results),  # type: ignore[call-overload]
        "total_duplicated": sum(int(x["duplicated_restarts"]) for x in results),  # type: ignore[call-overload]
    }


def histogram(values: list[float]) -> dict[str, int]:
    """Commands that arrived after the kill, by whole seconds since it."""
    out: dict[str, int] = {}
    for v in sorted(values):
        key = f"{int(v)}-{int(v) + 1}s"
        out[key] = out.get(key, 0) + 1
    return out


# --- driver ------------------------------------------------------------------------------------


async def driver(args: argparse.Namespace) -> str:
    tmp = Path(tempfile.mkdtemp(prefix="marduk-failover-"))
    server, url = start_nats_server(tmp)
    ctls = Controllers(url, tmp, args.lease_ttl)
    t0 = time.monotonic()
    try:
        ctls.spawn()
        nc = await nats.connect(url)
        await two_up(nc, ctls)  # the first one leads before the second starts
        await nc.close()
        ctls.spawn()
        if args.mode == "takeover":
            report = await takeover(args, url, ctls)
        else:
            report = await storm(args, url, ctls)
    finally:
        ctls.kill_all()
        server.terminate()
        server.wait(10)
    report = {
        "machine": machine(),
        "nats_server": subprocess.run(
            [find_binary(), "--version"],
            capture_output=True,
            text=True,
        ).stdout.strip(),
        "source": source_version(),
        "wall_s": round(time.monotonic() - t0, 1),
        **report,
    }
    print(f"controller logs: {tmp}", file=sys.stderr)
    return json.dumps(report, indent=2)


def main() -> None:
    p = argparse.ArgumentParser(description="Marduk controller failover benchmark")
    p.add_argument("--mode", choices=["takeover", "storm"], default="takeover")
    p.add_argument("--lease-ttl", type=float, default=2.0, help="the controllers' --lease-ttl")
    p.add_argument("--kills", type=int, default=12, help="takeover: leader kills")
    p.add_argument("--takeover-replicas", type=int, default=6, help="takeover: replicas")
    p.add_argument(
        "--publish-delay", type=float, default=0.0, help="takeover: s from kill to the event"
    )
    p.add_argument(
        "--repeat-every", type=float, default=0.1, help="takeover: s between repeated events"
    )
    p.add_argument("--replicas", type=int, default=200, help="storm: replicas, one event each")
    p.add_argument("--rounds", type=int, default=3, help="storm: rounds")
    p.add_argument("--kill-after", type=int, default=50, help="storm: kill after N publishes")
    p.add_argument(
        "--kill-delay", type=float, default=0.0, help="storm: s from publish N to the kill"
    )
    p.add_argument("--storm-gap", type=float, default=0.001, help="storm: s between publishes")
    p.add_argument("--wait", type=float, default=30.0, help="bound on each wait, seconds")
    p.add_argument(
        "--linger", type=float, default=10.0, help="storm: watch for duplicates until kill + this"
    )
    p.add_argument("--out", default="", help="also write the JSON report here")
    args = p.parse_args()
    text = asyncio.run(driver(args))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
