"""Benchmark: ``marduk monitor set`` -> every trainer's ``on_params`` callback.

Setup (all on loopback): one nats-server with JetStream; ``marduk controller`` as its own
process; ``--replicas`` library clients (one NATS connection each, the real ``agent`` library)
spread over ``--procs`` processes, each replica registering ``--devices-per-replica`` devices.
Each trial sends a ``ParamsSet`` (a new ``lr``) the way the CLI does and times, on
CLOCK_MONOTONIC (shared by all processes on Linux), from the request to the *last* replica's
``on_params`` callback: the set is durable (compare-and-set in the KV bucket) before the fan-out
starts, so the figure includes the store's write. Each callback acknowledges the version
(``params_applied``, not awaited), as a trainer does at its next step boundary.

``--shared``: the replicas of a process share its one NATS connection (the library's own
registration, renewals, params fence, callback and acknowledgement, each replica with its own
subscription of the job's ``cmd.params`` subject, so NATS still delivers one copy per replica
and the controller sees exactly what 1,000 trainers make it see: 1,000 registrations renewing,
one publish, 1,000 acknowledgements per set). What it saves is 1,000 sockets and 1,000 renewal
timers in 4 processes on a 2-core machine, which starved under load before any set was timed.

    .venv/bin/python bench/bench_params.py                          # 1,000 replicas x 8 devices
    .venv/bin/python bench/bench_params.py --shared --trials 100    # the same on few sockets
    .venv/bin/python bench/bench_params.py --replicas 200 --trials 50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nats

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_notify import machine, pct, source_version, start_nats_server
from marduk.errors import MardukError
from marduk.wire import protocol as wire
from marduk.wire.params import ParamsQuery, ParamsQueryReply, ParamsSet, ParamsSetReply


async def agents_main(url: str, first: int, count: int, dpr: int, shared: bool = False) -> None:
    from agent.library.client import AsyncClient, Options
    from agent.library.params import ParamsView

    last: dict[int, int] = {}  # version -> the last callback's time (ns) in this process
    seen: dict[int, int] = {}  # version -> callbacks in this process
    nc = await nats.connect(url)

    def make_cb(c: list[AsyncClient]):  # type: ignore[no-untyped-def]
        def cb(view: ParamsView) -> None:
            now = time.monotonic_ns()
            v = view.version
            last[v] = max(last.get(v, 0), now)
            seen[v] = seen.get(v, 0) + 1
            c[0]._spawn(c[0].params_applied(v), "applied")  # not awaited, as a trainer's
            if seen[v] == count:
                asyncio.get_running_loop().create_task(
                    nc.publish("bench.params.done", json.dumps([first, v, last[v]]).encode())
                )

        return cb

    clients: list[AsyncClient] = []
    sem = asyncio.Semaphore(50)

    async def one(i: int) -> None:
        opts = Options(
            job="bench",
            replica=f"r{i}",
            worker=0,
            devices=[f"gpu-{i}-{d}" for d in range(dpr)],
            addr=url,
            prefix="marduk",
            scope="replica",
            timeout=60,
            incarnation=0,
            epoch=0,  # type: ignore[arg-type]
            resync_interval=3600,
        )
        holder: list[AsyncClient] = []
        c = AsyncClient(opts, None, deliver=lambda _c: None)
        holder.append(c)
        c.live.on_params = make_cb(holder)
        async with sem:
            if shared:
                # The library's own registration, params fence and acknowledgement on this
                # process's one connection: its subscription per replica, so NATS still
                # delivers one copy per replica (see the module's docstring).
                c._nc = nc
                await nc.subscribe(c.subjects.params_commands(opts.job), cb=c._on_params_msg)
                await c._register(timeout=120, retry=True)
            else:
                await c.start()
        clients.append(c)

    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(first, first + count)))
    done = asyncio.Event()

    async def on_stop(msg) -> None:  # type: ignore[no-untyped-def]
        done.set()

    await nc.subscribe("bench.params.stop", cb=on_stop)
    await nc.flush()
    print(json.dumps({"ready": True, "registration_s": time.monotonic() - t0}), flush=True)
    renewing = None
    if shared:

        async def renew() -> None:
            # The clients' renewals, spread over their interval as their jitter spreads them,
            # from one loop instead of one timer each.
            while True:
                interval = clients[0].renew_interval if clients else 5.0
                for c in list(clients):
                    c._spawn(c.reregister(), "renew")
                    await asyncio.sleep(interval / max(1, len(clients)))

        renewing = asyncio.get_running_loop().create_task(renew())
    await done.wait()
    if renewing is not None:
        renewing.cancel()
    for c in clients:
        if shared:
            c._nc = None
        await c.close(deregister=False)
    await nc.close()


async def driver(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="marduk-bench-params-"))
    server, url = start_nats_server(tmp)
    env = {**os.environ, "MARDUK_ADDR": url}
    ctl = subprocess.Popen(
        [sys.executable, "-m", "marduk", "controller", "--no-embedded"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp / "controller.log", "w"),  # noqa: SIM115
    )
    procs: list[subprocess.Popen[str]] = []
    try:
        nc = await nats.connect(url)
        for _ in range(100):
            try:
                ping = wire.encode(wire.Query(what="ping"))
                await nc.request("marduk.ctl.query", ping, timeout=0.5)
                break
            except Exception:
                await asyncio.sleep(0.1)
        per = args.replicas // args.procs
        t0 = time.monotonic()
        for p in range(args.procs):
            count = per if p < args.procs - 1 else args.replicas - per * (args.procs - 1)
            cmd = [sys.executable, __file__, "--agents", url, str(p * per), str(count)]
            procs.append(
                subprocess.Popen(
                    [*cmd, str(args.devices_per_replica), "shared" if args.shared else "own"],
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        for proc in procs:
            assert proc.stdout is not None
            json.loads(proc.stdout.readline())
        registration_s = time.monotonic() - t0

        reports: asyncio.Queue[tuple[int, int, int]] = asyncio.Queue()

        async def on_done(msg) -> None:  # type: ignore[no-untyped-def]
            first, version, at = json.loads(msg.data)
            await reports.put((first, version, at))

        await nc.subscribe("bench.params.done", cb=on_done)
        await nc.flush()
        load_start = os.getloadavg()[0]
        latencies: list[float] = []
        replied: list[float] = []  # set -> its reply (stored, published, announced)
        failed: list[str] = []  # sets not answered, or not seen by every replica in time
        for trial in range(1, args.trials + 1):
            t_set = time.monotonic_ns()
            req = ParamsSet(job="bench", values={"lr": 1.0 / (trial + 1)}, by="bench")
            got: dict[int, int] = {}
            try:
                msg = await nc.request("marduk.ctl.params.set", wire.encode(req), timeout=10)
                reply = wire.decode(msg.data, ParamsSetReply)
                version = reply.params.version
                t_stored = time.monotonic_ns()
                while len(got) < args.procs:
                    first, v, at = await asyncio.wait_for(reports.get(), 30)
                    if v == version:
                        got[first] = at
            except (nats.errors.Error, TimeoutError, MardukError) as e:
                # A controller starved out of its lease on an overloaded machine: said, counted,
                # not timed; the next trial waits for a leader again.
                failed.append(f"trial {trial}: {type(e).__name__} {e}"[:200])
                await asyncio.sleep(2.0)
                continue
            latencies.append((max(got.values()) - t_set) / 1e6)
            replied.append((t_stored - t_set) / 1e6)
            if trial == 1:
                print(f"first set: stored in {(t_stored - t_set) / 1e6:.2f} ms", flush=True)
            await asyncio.sleep(args.gap)
        if not latencies:
            raise SystemExit(f"no set reached every replica: {failed[:3]}")
        state = await nc.request(
            "marduk.ctl.params.get", wire.encode(ParamsQuery(job="bench")), timeout=30
        )
        rows = wire.decode(state.data, ParamsQueryReply).workers
        applied = sum(1 for w in rows if w.state == "applied")
        result = {
            "bench": "params",
            "replicas": args.replicas,
            "devices_per_replica": args.devices_per_replica,
            "procs": args.procs,
            "connections": "one per process" if args.shared else "one per replica",
            "gap_s": args.gap,
            "lease_ttl_s": float(os.environ.get("MARDUK_LEASE_TTL", "2")),
            "trials": args.trials,
            "sets_failed": len(failed),
            "failures": failed[:10],
            "registration_s": round(registration_s, 2),
            "set_to_every_callback_ms": {
                "p50": round(pct(latencies, 50), 2),
                "p90": round(pct(latencies, 90), 2),
                "p99": round(pct(latencies, 99), 2),
                "max": round(max(latencies), 2),
            },
            "set_to_reply_ms": {
                "p50": round(pct(replied, 50), 2),
                "p99": round(pct(replied, 99), 2),
            },
            "applied_at_end": f"{applied}/{len(rows)}",
            "load_1min": {"start": load_start, "end": os.getloadavg()[0]},
            "source": source_version(),
            "machine": machine(),
        }
        print(json.dumps(result, indent=2), flush=True)
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=2) + "\n")
        await nc.publish("bench.params.stop", b"")
        await nc.flush()
        await nc.close()
    finally:
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        ctl.terminate()
        ctl.wait(10)
        server.terminate()
        server.wait(10)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--agents":
        url, first, count, dpr = sys.argv[2], *map(int, sys.argv[3:6])
        asyncio.run(agents_main(url, first, count, dpr, shared=sys.argv[6] == "shared"))
        return
    p = argparse.ArgumentParser(description="Marduk live-parameters benchmark")
    p.add_argument("--replicas", type=int, default=1000)
    p.add_argument("--devices-per-replica", type=int, default=8)
    p.add_argument("--procs", type=int, default=4, help="processes hosting the clients")
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--gap", type=float, default=0.02, help="seconds between sets")
    p.add_argument("--out", type=Path, default=None, help="also write the result here (JSON)")
    p.add_argument(
        "--shared",
        action="store_true",
        help="one NATS connection per process for its replicas (see the docstring)",
    )
    asyncio.run(driver(p.parse_args()))


if __name__ == "__main__":
    main()
