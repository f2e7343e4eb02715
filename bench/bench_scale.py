"""Benchmark: the control plane at scale (10k replicas x 8 devices, 25k x 4).

Setup (all on loopback): one nats-server with JetStream (it picks its port, read back from its
ports file); a leader ``marduk controller --no-embedded`` and a hot standby, each its own
process; ``--procs`` registrant processes, each one NATS connection sending the replicas'
registrations (the same ``Registration`` an agent sends, ``--in-flight`` at a time per
process). Registrants stand in for agents so the figure is the controller's, not 100k client
connections' on two cores (``bench_notify.py`` measures the library path).

Measured, in order:
* registration of every replica: from the go signal to the last reply, and registrations/s;
* the leader's RSS after registration and its peak (VmHWM) at the end;
* notice latency, scope replica: a device failure published on ``marduk.health`` (as
  ``nats pub`` does) -> the command received by a subscriber of the job's command subjects in
  a registrant process, one event per replica, ``--gap`` apart; p50/p99;
* failover: the leader is stopped (``--stop term``: SIGTERM, it resigns the lease; ``kill``:
  SIGKILL, the standby waits out the lease TTL), then the time until the standby answers a
  query as leader, and what it logged: how long it took from election to serving and where the
  state came from (its mirror, or the buckets);
* cold restart: the new leader is SIGKILLed with no standby left and a fresh controller is
  started: process start -> serving (with the lease TTL it must wait out) and its own
  election -> serving.

    .venv/bin/python bench/bench_scale.py --replicas 10000 --devices-per-replica 8
    .venv/bin/python bench/bench_scale.py --replicas 25000 --devices-per-replica 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nats

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_notify import machine, source_version, start_nats_server, summary

from marduk.wire import protocol as wire

JOB = "bench"


# --- registrant processes ------------------------------------------------------------------------


async def registrant(url: str, first: int, count: int, dpr: int, in_flight: int, rx: bool) -> None:
    nc = await nats.connect(url, pending_size=256 * 1024 * 1024)
    received: dict[str, int] = {}
    acks: set[asyncio.Task[object]] = set()

    async def on_cmd(msg) -> None:  # type: ignore[no-untyped-def]
        t = time.monotonic_ns()
        cmd = wire.decode(msg.data, wire.Command)
        received.setdefault(cmd.event_id, t)
        # Confirm it, as an agent does once restarted (else the leader resends it every second).
        ack = wire.Ack(job=JOB, replica=cmd.replica or "", worker=0, epoch=cmd.epoch)
        task = asyncio.create_task(nc.request(f"marduk.{JOB}.ack", wire.encode(ack), timeout=10))
        acks.add(task)
        task.add_done_callback(acks.discard)

    if rx:
        await nc.subscribe(f"marduk.{JOB}.cmd.>", cb=on_cmd, pending_msgs_limit=1_000_000)
    go = asyncio.Event()
    done = asyncio.Event()

    async def on_go(msg) -> None:  # type: ignore[no-untyped-def]
        go.set()

    async def on_done(msg) -> None:  # type: ignore[no-untyped-def]
        done.set()

    await nc.subscribe("bench.go", cb=on_go)
    await nc.subscribe("bench.done", cb=on_done)
    regs = [
        wire.encode(
            wire.Registration(
                job=JOB,
                replica=f"r{i}",
                worker=0,
                devices=[f"gpu-{i}-{d}" for d in range(dpr)],
                pid=100_000 + i,
                host=f"host-{i}",
                incarnation=0,
            )
        )
        for i in range(first, first + count)
    ]
    await nc.flush()
    print(json.dumps({"ready": True}), flush=True)
    await go.wait()
    t0 = time.monotonic_ns()
    sem = asyncio.Semaphore(in_flight)
    errors: list[str] = []

    async def one(payload: bytes) -> None:
        async with sem:
            for _ in range(20):  # a lost request (no responders while busy) is retried
                try:
                    msg = await nc.request(f"marduk.{JOB}.register", payload, timeout=10)
                except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                    continue
                reply = wire.decode(msg.data, wire.RegisterReply | wire.ErrorReply)  # type: ignore[arg-type]
                if isinstance(reply, wire.ErrorReply):
                    errors.append(reply.code)
                return
            errors.append("timeout")

    await asyncio.gather(*(one(p) for p in regs))
    t1 = time.monotonic_ns()
    print(json.dumps({"registered": count, "start_ns": t0, "end_ns": t1, "errors": errors[:5],
                      "n_errors": len(errors)}), flush=True)  # fmt: skip
    await done.wait()
    print(json.dumps({"received": received}), flush=True)
    await nc.close()


# --- driver --------------------------------------------------------------------------------------


def rss_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_controller(url: str, log: Path, ttl: float, worker_ttl: float) -> subprocess.Popen[bytes]:
    env = {**os.environ, "MARDUK_ADDR": url, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "marduk", "controller", "--no-embedded", "--log-level", "info",
         "--lease-ttl", str(ttl), "--worker-ttl", str(worker_ttl)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"),
    )  # fmt: skip


async def wait_leader(nc: nats.NATS, not_id: str = "", timeout: float = 120.0) -> wire.QueryReply:
    """Poll with ping queries (every 5 ms) until a leader other than ``not_id`` answers."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = await nc.request("marduk.ctl.query", wire.encode(wire.Query(what="ping")), 0.2)
            reply = wire.decode(msg.data, wire.QueryReply)
            if reply.controller.role == "leader" and reply.controller.controller_id != not_id:
                return reply
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            pass
        await asyncio.sleep(0.005)
    raise TimeoutError("no leader answered")


_SERVING = re.compile(
    r"serving prefix .*state from ([\w, ]+): (\d+) worker.* in (\d+) ms"
    r"(?:: state (\d+) ms, subscribing (\d+) ms)?"
)


async def serving_line(log: Path, timeout: float = 10.0) -> dict[str, object]:
    """What the controller logged when it started serving (it logs just after it serves)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in (await asyncio.to_thread(log.read_text)).splitlines():
            m = _SERVING.search(line)
            if m and int(m[2]) > 0:
                return {
                    "state_from": m[1],
                    "workers": int(m[2]),
                    "elected_to_serving_ms": int(m[3]),
                    "state_ms": int(m[4]) if m[4] else None,
                    "subscribing_ms": int(m[5]) if m[5] else None,
                }
        await asyncio.sleep(0.05)
    return {}


async def driver(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="marduk-scale-"))
    server, url = start_nats_server(tmp)
    report: dict[str, object] = {
        "machine": machine(),
        "source": source_version(),
        "replicas": args.replicas,
        "devices": args.replicas * args.devices_per_replica,
        "load_1min_start": os.getloadavg()[0],
    }
    ctls: list[subprocess.Popen[bytes]] = []
    procs: list[subprocess.Popen[str]] = []
    try:
        nc = await nats.connect(url)
        leader = start_controller(url, tmp / "leader.log", args.lease_ttl, args.worker_ttl)
        ctls.append(leader)
        first = await wait_leader(nc)
        standby = start_controller(url, tmp / "standby.log", args.lease_ttl, args.worker_ttl)
        ctls.append(standby)
        await asyncio.sleep(1.0)  # the standby's mirror is watching
        per = args.replicas // args.procs
        for p in range(args.procs):
            count = per if p < args.procs - 1 else args.replicas - per * (args.procs - 1)
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--registrant",
                        url,
                        str(p * per),
                        str(count),
                        str(args.devices_per_replica),
                        str(args.in_flight),
                        str(int(p == 0)),
                    ],
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for p in procs:
            assert p.stdout is not None
            json.loads(p.stdout.readline())
        spy = None
        if args.py_spy:
            spy = subprocess.Popen(
                [args.py_spy, "record", "-p", str(leader.pid), "-f", "raw", "-r", "200",
                 "-o", str(tmp / "leader-registration.txt")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            await asyncio.sleep(1.0)
        roles = {"leader": [leader.pid], "standby": [standby.pid], "nats-server": [server.pid],
                 "registrants": [p.pid for p in procs]}  # fmt: skip
        cpu0 = {role: sum(cpu_s(pid) for pid in pids) for role, pids in roles.items()}
        go = time.monotonic_ns()
        await nc.publish("bench.go", b"")
        await nc.flush()
        ends, n_errors = [], 0
        for p in procs:
            assert p.stdout is not None
            r = json.loads(p.stdout.readline())
            ends.append(r["end_ns"])
            n_errors += r["n_errors"]
        reg_s = (max(ends) - go) / 1e9
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
        report["registration_s"] = round(reg_s, 2)
        report["registration_cpu_s"] = {
            role: round(sum(cpu_s(pid) for pid in pids) - cpu0[role], 2)
            for role, pids in roles.items()
        }
        report["registrations_per_s"] = round(args.replicas / reg_s)
        report["registration_errors"] = n_errors
        report["load_1min_after_registration"] = os.getloadavg()[0]
        report["leader_rss_mib_after_registration"] = round(rss_mib(leader.pid, "VmRSS"), 1)

        if args.py_spy:
            spy = subprocess.Popen(
                [args.py_spy, "record", "-p", str(leader.pid), "-f", "raw", "-r", "200",
                 "-o", str(tmp / "leader-notice.txt")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            await asyncio.sleep(1.0)
        sent: dict[str, int] = {}
        for i in range(args.trials):
            r = (i * 7919) % args.replicas  # spread over the replicas, each at most once
            event_id = f"scale-{i}"
            event = wire.DeviceHealth(
                device=f"gpu-{r}-{i % args.devices_per_replica}", state="failed", event_id=event_id
            )
            sent[event_id] = time.monotonic_ns()
            await nc.publish("marduk.health", wire.encode(event))
            await nc.flush()
            await asyncio.sleep(args.gap)
        await asyncio.sleep(1.0)
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
        await nc.publish("bench.done", b"")
        await nc.flush()
        received: dict[str, int] = {}
        for p in procs:
            out, _ = p.communicate(timeout=120)
            received.update(json.loads(out.strip().splitlines()[-1])["received"])
        notice = [(received[e] - t) / 1e6 for e, t in sent.items() if e in received]
        report["notice"] = summary("event publish -> command received (scope replica)", notice)
        report["notice"]["missing"] = len(sent) - len(notice)  # type: ignore[index]
        report["leader_rss_mib"] = round(rss_mib(leader.pid, "VmRSS"), 1)
        report["leader_peak_rss_mib"] = round(rss_mib(leader.pid, "VmHWM"), 1)
        report["standby_peak_rss_mib"] = round(rss_mib(standby.pid, "VmHWM"), 1)
        report["load_1min_after_notice"] = os.getloadavg()[0]

        # Failover to the hot standby.
        await asyncio.sleep(2.0)  # the standby's mirror has seen the last writes
        t0 = time.monotonic()
        leader.send_signal(signal.SIGTERM if args.stop == "term" else signal.SIGKILL)
        new = await wait_leader(nc, not_id=first.controller.controller_id)
        report["failover"] = {
            "stop": args.stop,
            "stop_to_serving_ms": round((time.monotonic() - t0) * 1000),
            **await serving_line(tmp / "standby.log"),
        }
        leader.wait(30)

        # Cold restart: no standby; the fresh process must also wait out the lease TTL.
        await asyncio.sleep(1.0)
        standby.send_signal(signal.SIGKILL)
        standby.wait(30)
        t0 = time.monotonic()
        cold = start_controller(url, tmp / "cold.log", args.lease_ttl, args.worker_ttl)
        ctls.append(cold)
        await wait_leader(nc, not_id=new.controller.controller_id)
        report["cold_restart"] = {
            "process_start_to_serving_ms": round((time.monotonic() - t0) * 1000),
            "lease_ttl_s": args.lease_ttl,
            **await serving_line(tmp / "cold.log"),
            "peak_rss_mib": round(rss_mib(cold.pid, "VmHWM"), 1),
        }
        report["load_1min_end"] = os.getloadavg()[0]
        await nc.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for c in ctls:
            if c.poll() is None:
                c.terminate()
                try:
                    c.wait(15)
                except subprocess.TimeoutExpired:
                    c.kill()
        server.terminate()
        server.wait(10)
    print(json.dumps(report, indent=2))
    print(f"logs: {tmp}", file=sys.stderr)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--registrant":
        url, first, count, dpr, in_flight, rx = sys.argv[2:8]
        asyncio.run(registrant(url, int(first), int(count), int(dpr), int(in_flight), rx == "1"))
        return
    p = argparse.ArgumentParser(description="Marduk control plane at scale")
    p.add_argument("--replicas", type=int, default=10_000)
    p.add_argument("--devices-per-replica", type=int, default=8)
    p.add_argument("--procs", type=int, default=4, help="registrant processes")
    p.add_argument("--in-flight", type=int, default=500, help="registrations in flight per process")
    p.add_argument("--trials", type=int, default=1000, help="health events for notice latency")
    p.add_argument("--gap", type=float, default=0.005, help="seconds between events")
    p.add_argument("--stop", choices=["term", "kill"], default="kill", help="how the leader stops")
    p.add_argument("--lease-ttl", type=float, default=2.0)
    p.add_argument(
        "--worker-ttl",
        type=float,
        default=600.0,
        help="the controller's --worker-ttl: registrants do not renew, so none goes stale",
    )
    p.add_argument(
        "--py-spy", default="", help="py-spy binary: profile the leader's registration and notices"
    )
    asyncio.run(driver(p.parse_args()))


if __name__ == "__main__":
    main()
