"""Benchmark: health event publish -> each affected replica's library receiving its command.

Setup (all on loopback): one nats-server with JetStream; ``marduk controller`` as its own
process; ``--replicas`` agent clients (one NATS connection each, the real ``agent`` library)
spread over ``--procs`` processes, each replica registering ``--devices-per-replica`` devices.

Measured:
* notify latency, scope replica: one failed device -> its one replica (a new replica each
  trial, so no coalescing), from the monitor's publish to the library's receipt of the command;
* the same for scope job (``--scope job``): one command fanned out to every replica; the
  latency of the last replica to receive it;
* a one-hop nats-py publish -> subscriber baseline in the same setup, for context, and the same
  through JetStream (a plain publish stored by a stream, delivered by a durable push consumer
  with explicit acks), which is how health events reach the controller;
* registration time for all replicas, and the controller's peak RSS (VmHWM).

The agents acknowledge each restart as a trainer does once it applied it (``client.ack``, not
awaited, as ``marduk agent run`` does): the controller stops resending it. ``--no-ack`` leaves
them unacknowledged, as every run before issue 15's tail work did: each restart is then resent
once a second until ``pending_timeout`` (4,000+ resends a run, in the measured window).

Timestamps are CLOCK_MONOTONIC (time.monotonic_ns), shared by all processes on Linux.

    .venv/bin/python bench/bench_notify.py                      # 1,000 replicas x 8 devices
    .venv/bin/python bench/bench_notify.py --scope job --trials 50
    .venv/bin/python bench/bench_notify.py --no-ack                  # the figures before
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import nats

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from marduk.transport.embedded import find_binary, listening
from marduk.wire import protocol as wire


def start_nats_server(tmp: Path, timeout: float = 10.0) -> tuple[subprocess.Popen[bytes], str]:
    """A nats-server with JetStream on a port it picks itself (``-p -1``), read back from its
    ports file: no window in which another process could take the port."""
    ports_dir = tmp / "ports"
    ports_dir.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen(
        [find_binary(), "-a", "127.0.0.1", "-p", "-1", "-js", "-sd", str(tmp / "js"),
         "--ports_file_dir", str(ports_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"nats-server exited with code {server.returncode}")
        for f in ports_dir.glob(f"*_{server.pid}.ports"):
            try:
                url = json.loads(f.read_text())["nats"][0]
            except (ValueError, KeyError, IndexError):
                continue  # being written
            host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
            if listening(host, int(port), 0.1):
                return server, url
        time.sleep(0.01)
    server.kill()
    raise RuntimeError("nats-server did not write its ports file in time")


def source_version() -> str:
    """The commit the benchmark ran (``+dirty``: with uncommitted changes to the code)."""

    def git(*a: str) -> str:
        return subprocess.run(
            ["git", *a], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout.strip()

    sha = git("rev-parse", "--short", "HEAD")
    if not sha:
        return (
            (ROOT / "SOURCE_COMMIT").read_text().strip()
            if (ROOT / "SOURCE_COMMIT").exists()
            else "?"
        )
    dirty = git("status", "--porcelain", "--", "marduk", "agent", "monitor_cli")
    return sha + ("+dirty" if dirty else "")


def machine() -> dict[str, str | int]:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "?",
    )
    mem_kib = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    return {
        "nproc": os.cpu_count() or 0,
        "cpu": model,
        "ram_gib": round(mem_kib / 2**20, 1),
        "python": platform.python_version(),
        "note": "2-core VM shared with other work",
    }


# --- agent side (runs in child processes) --------------------------------------------------------


async def agents_main(
    url: str, first: int, count: int, dpr: int, scope: str, ack: bool = True
) -> None:
    from agent.library.client import AsyncClient, Options

    received: list[tuple[str, int, int]] = []  # (event_id, epoch, recv_ns)
    pings: list[tuple[int, int]] = []
    js_pings: list[tuple[int, int]] = []
    clients = []
    acks: dict[bool, int] = {True: 0, False: 0}  # confirmed by the controller, or not
    by_index: dict[int, AsyncClient] = {}

    async def applied(c: AsyncClient, cmd) -> None:  # type: ignore[no-untyped-def]
        acks[await c.ack(cmd)] += 1

    def make_cb(idx: int):  # type: ignore[no-untyped-def]
        def cb(cmd):  # type: ignore[no-untyped-def]
            received.append((f"{cmd.command_id}|{idx}", cmd.epoch, time.monotonic_ns()))
            # A trainer acks the restart once it applied it; here at once, and not awaited
            # (the library runs the coroutine returned), as ``marduk agent run`` does.
            return applied(by_index[idx], cmd) if ack and cmd.is_failure else None

        return cb

    t0 = time.monotonic()
    sem = asyncio.Semaphore(50)

    async def one(i: int) -> None:
        opts = Options(
            job="bench",
            replica=f"r{i}",
            worker=0,
            devices=[f"gpu-{i}-{d}" for d in range(dpr)],
            addr=url,
            prefix="marduk",
            scope=scope,
            timeout=60,
            incarnation=0,
            epoch=0,  # type: ignore[arg-type]
            resync_interval=3600,
        )
        async with sem:
            c = AsyncClient(opts, make_cb(i), deliver=lambda _c: None)
            by_index[i] = c
            await c.start()
            clients.append(c)

    await asyncio.gather(*(one(i) for i in range(first, first + count)))
    reg_s = time.monotonic() - t0
    nc = await nats.connect(url)
    done = asyncio.Event()

    async def on_ping(msg) -> None:  # type: ignore[no-untyped-def]
        pings.append((int(msg.data), time.monotonic_ns()))

    async def on_done(msg) -> None:  # type: ignore[no-untyped-def]
        done.set()

    async def on_js_ping(msg) -> None:  # type: ignore[no-untyped-def]
        # Like the controller's health consumer: durable push, explicit ack after handling.
        js_pings.append((int(msg.data), time.monotonic_ns()))
        await msg.ack()

    if first == 0:
        await nc.subscribe("bench.ping", cb=on_ping)
        await nc.jetstream().subscribe(
            "bench.jsping", durable="bench-js", stream="bench_js", cb=on_js_ping, manual_ack=True
        )
    await nc.subscribe("bench.done", cb=on_done)
    await nc.flush()
    print(json.dumps({"ready": True, "registration_s": reg_s}), flush=True)
    await done.wait()
    out = {"received": received, "pings": pings, "js_pings": js_pings, "acks": acks[True]}
    print(json.dumps({**out, "acks_unconfirmed": acks[False]}), flush=True)
    for c in clients:
        await c.close(deregister=False)
    await nc.close()


# --- driver ------------------------------------------------------------------------------------


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    k = max(0, min(len(values) - 1, round(p / 100 * (len(values) - 1))))
    return values[k]


def summary(name: str, values_ms: list[float]) -> dict[str, float | int | str]:
    return {
        "metric": name,
        "n": len(values_ms),
        "p50_ms": round(pct(values_ms, 50), 3),
        "p99_ms": round(pct(values_ms, 99), 3),
        "max_ms": round(max(values_ms), 3),
        "mean_ms": round(statistics.fmean(values_ms), 3),
    }


def vm_hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def driver(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="marduk-bench-"))
    server, url = start_nats_server(tmp)
    env = {**os.environ, "MARDUK_ADDR": url}
    ctl = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "marduk",
            "controller",
            "--no-embedded",
            "--log-level",
            "info",
            # Port 0: the controller binds one and logs it (read back below); ours to hold.
            "--metrics-addr",
            "127.0.0.1:0",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "controller.log", "w"),  # noqa: SIM115
        text=True,
    )
    procs: list[subprocess.Popen[str]] = []
    try:
        nc = await nats.connect(url)
        for _ in range(100):  # wait for the controller
            try:
                await nc.request(
                    "marduk.ctl.query", wire.encode(wire.Query(what="ping")), timeout=0.5
                )
                break
            except Exception:
                await asyncio.sleep(0.1)
        # A stream like the health stream, for the one-hop JetStream baseline.
        await nc.jetstream().add_stream(name="bench_js", subjects=["bench.jsping"])
        per = args.replicas // args.procs
        t0 = time.monotonic()
        for p in range(args.procs):
            count = per if p < args.procs - 1 else args.replicas - per * (args.procs - 1)
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--agents",
                        url,
                        str(p * per),
                        str(count),
                        str(args.devices_per_replica),
                        args.scope,
                        "ack" if args.ack else "no-ack",
                    ],
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for p in procs:
            assert p.stdout is not None
            json.loads(p.stdout.readline())
        reg_all_s = time.monotonic() - t0
        rss_after_reg = vm_hwm_mib(ctl.pid)

        # One-hop baseline: publish -> a plain nats-py subscriber in an agent process.
        for _ in range(args.trials):
            await nc.publish("bench.ping", str(time.monotonic_ns()).encode())
            await nc.flush()
            await asyncio.sleep(args.gap)
        # The same through JetStream: a plain publish the stream stores, a durable push consumer.
        for _ in range(args.trials):
            await nc.publish("bench.jsping", str(time.monotonic_ns()).encode())
            await nc.flush()
            await asyncio.sleep(args.gap)

        # The control plane's own figure: one plain subscriber of the job's command subjects in
        # this process sees each command one hop after the controller published it (however
        # long the agent processes then take to decode their copies).
        tapped: dict[str, int] = {}

        async def on_tap(msg) -> None:  # type: ignore[no-untyped-def]
            t = time.monotonic_ns()
            tapped.setdefault(wire.decode(msg.data, wire.Command).event_id, t)

        await nc.subscribe("marduk.bench.cmd.>", cb=on_tap)
        metrics_url = await metrics_address(tmp / "controller.log")
        before = await asyncio.to_thread(event_to_command, metrics_url)
        stats_before = await controller_stats(nc)
        await nc.flush()
        sent: dict[str, int] = {}
        sent_by_event: dict[str, int] = {}
        trials = args.trials if args.scope == "replica" else min(args.trials, 200)
        for i in range(trials):
            r = i % args.replicas if args.scope == "replica" else 0
            device = f"gpu-{r}-{i % args.devices_per_replica}"
            event = wire.DeviceHealth(device=device, state="failed", event_id=f"bench-{i}")
            key = f"bench/{'r' + str(r) if args.scope == 'replica' else '*'}/"
            t = time.monotonic_ns()
            sent_by_event[event.event_id] = t
            await nc.publish("marduk.health", wire.encode(event))
            await nc.flush()
            sent[f"{key}{i // args.replicas + 1 if args.scope == 'replica' else i + 1}"] = t
            if args.scope == "job":
                await asyncio.sleep(max(args.gap, 0.05))
                # Confirm the epoch for every worker so the next event is not coalesced.
                await nc.request(
                    "marduk.ctl.query", wire.encode(wire.Query(what="ping")), timeout=5
                )
                await ack_all(nc, args.replicas, i + 1)
            else:
                await asyncio.sleep(args.gap)
        await asyncio.sleep(1.0)
        after = await asyncio.to_thread(event_to_command, metrics_url)
        stats_after = await controller_stats(nc)
        rss_peak = vm_hwm_mib(ctl.pid)
        await nc.publish("bench.done", b"")
        await nc.flush()
        received: list[tuple[str, int, int]] = []
        pings: list[tuple[int, int]] = []
        js_pings: list[tuple[int, int]] = []
        acks = acks_unconfirmed = 0
        for p in procs:
            out, _ = p.communicate(timeout=120)
            data = json.loads(out.strip().splitlines()[-1])
            received += [tuple(x) for x in data["received"]]  # type: ignore[misc]
            pings += [tuple(x) for x in data["pings"]]  # type: ignore[misc]
            js_pings += [tuple(x) for x in data["js_pings"]]  # type: ignore[misc]
            acks += data["acks"]
            acks_unconfirmed += data["acks_unconfirmed"]
        await nc.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        ctl.terminate()
        ctl.wait(10)
        server.terminate()
        server.wait(10)

    one_hop = [(recv - sent_ns) / 1e6 for sent_ns, recv in pings]
    by_command: dict[str, list[int]] = {}
    for tag, _epoch, recv in received:
        command_id = tag.split("|")[0]
        by_command.setdefault(command_id, []).append(recv)
    notify, last = [], []
    for command_id, t in sent.items():
        recvs = by_command.get(command_id)
        if not recvs:
            continue
        notify += [(r - t) / 1e6 for r in recvs]
        last.append((max(recvs) - t) / 1e6)
    js_hop = [(recv - sent_ns) / 1e6 for sent_ns, recv in js_pings]
    tap = [(tapped[e] - t) / 1e6 for e, t in sent_by_event.items() if e in tapped]
    results = [
        summary("one-hop nats-py publish->subscriber", one_hop),
        summary("one-hop JetStream publish (stored) -> durable push consumer", js_hop),
    ]
    if args.scope == "replica":
        results.append(summary("event publish -> library receives command (scope replica)", notify))
    else:
        results.append(
            summary("event publish -> command on the wire (one subscriber, scope job)", tap)
        )
        results.append(summary("event publish -> every replica received (scope job), last", last))
        results.append(summary("event publish -> each replica received (scope job)", notify))
    n = after["count"] - before["count"]
    inside = {
        "metric": "controller: event delivered -> its commands published (its own histogram)",
        "n": n,
        "mean_ms": round((after["sum"] - before["sum"]) / n * 1000, 3) if n else None,
        "cumulative_by_le_ms": {
            str(le * 1000): round(after["buckets"][le] - before["buckets"][le])
            for le in sorted(after["buckets"])
            if le <= 0.05
        },
    }
    results.insert(2, inside)  # type: ignore[arg-type]
    report = {
        "machine": machine(),
        "source": source_version(),
        "replicas": args.replicas,
        "devices": args.replicas * args.devices_per_replica,
        "scope": args.scope,
        "commands_sent": len(sent),
        "commands_received": sum(len(v) for v in by_command.values()),
        "agents_ack": args.ack,
        "acks_confirmed": acks,
        "acks_unconfirmed": acks_unconfirmed,
        # In the measured window (the events and the second after them), from the controller.
        "controller_in_window": {
            k: stats_after.get(k, 0) - stats_before.get(k, 0)
            for k in ("commands.restart", "commands.resent", "received.ack")
        },
        "registration_all_s": round(reg_all_s, 2),
        "controller_peak_rss_mib_after_registration": round(rss_after_reg, 1),
        "controller_peak_rss_mib": round(rss_peak, 1),
        "procs": args.procs,
        "load_1min": os.getloadavg()[0],
        "results": results,
    }
    print(json.dumps(report, indent=2))
    print(f"controller log: {tmp / 'controller.log'}", file=sys.stderr)


async def metrics_address(log: Path, timeout: float = 10.0) -> str:
    """The controller's /metrics URL, from the line it logs once it has bound its port."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = await asyncio.to_thread(log.read_text)
        m = re.search(r"metrics and probes on (http://[\d.]+:\d+)", text)
        if m:
            return m[1] + "/metrics"
        await asyncio.sleep(0.05)
    raise RuntimeError("the controller did not log its metrics address")


def event_to_command(url: str) -> dict[str, Any]:
    """The controller's ``marduk_event_to_command_seconds`` histogram: count, sum, buckets."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out: dict[str, Any] = {"count": 0.0, "sum": 0.0, "buckets": {}}
    for line in text.splitlines():
        if not line.startswith("marduk_event_to_command_seconds"):
            continue
        name, value = line.rsplit(" ", 1)
        if name.endswith("_count"):
            out["count"] = float(value)
        elif name.endswith("_sum"):
            out["sum"] = float(value)
        elif "_bucket" in name and 'le="+Inf"' not in name:
            out["buckets"][float(name.split('le="')[1].split('"')[0])] = float(value)
    return out


async def controller_stats(nc) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """The controller's counters (``Controller.stats``), as a query answers them."""
    msg = await nc.request("marduk.ctl.query", wire.encode(wire.Query(what="ping")), timeout=5)
    return dict(wire.decode(msg.data, wire.QueryReply).stats)


async def ack_all(nc, replicas: int, epoch: int) -> None:  # type: ignore[no-untyped-def]
    async def one(i: int) -> None:
        ack = wire.Ack(job="bench", replica=f"r{i}", worker=0, epoch=epoch)
        await nc.request("marduk.bench.ack", wire.encode(ack), timeout=10)

    await asyncio.gather(*(one(i) for i in range(replicas)))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--agents":
        url, first, count, dpr, scope, ack = sys.argv[2:8]
        asyncio.run(agents_main(url, int(first), int(count), int(dpr), scope, ack == "ack"))
        return
    p = argparse.ArgumentParser(description="Marduk notify-latency benchmark")
    p.add_argument("--replicas", type=int, default=1000)
    p.add_argument("--devices-per-replica", type=int, default=8)
    p.add_argument("--procs", type=int, default=4, help="processes hosting the agent clients")
    p.add_argument("--trials", type=int, default=1000)
    p.add_argument("--gap", type=float, default=0.005, help="seconds between events")
    p.add_argument("--scope", choices=["replica", "job"], default="replica")
    p.add_argument(
        "--no-ack",
        dest="ack",
        action="store_false",
        help="agents never acknowledge a restart, so the controller resends each once a second "
        "(how this benchmark ran before issue 15's tail work)",
    )
    asyncio.run(driver(p.parse_args()))


if __name__ == "__main__":
    main()
