"""Benchmark: the pure core's cost of a registration in one large ``--nnodes`` job.

A job whose ranks the controller assigns (``--nnodes N:N``) of ``--nodes`` workers registers
(each first registration is checked against a few workers that stand for the others), its
membership forms, then every worker renews its unchanged registration, ``--rounds`` times, as
agents do every renewal interval. No server, no I/O: the time is the policy's alone, on one
core, and a renewal blocks the controller's event loop for that long.

    .venv/bin/python bench/bench_renewal.py                  # 1,024 nodes (the wire's maximum)
    .venv/bin/python bench/bench_renewal.py --nodes 256 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from marduk.core.policy import Policy, PolicyConfig
from marduk.wire.protocol import Registration, Rendezvous


def registration(i: int, nodes: int) -> Registration:
    name = f"node-{i:04d}"
    return Registration(
        job="big",
        replica=name,
        host=name,
        devices=[f"{name}-gpu{d}" for d in range(8)],
        scope="job",
        pid=1000 + i,
        rendezvous=Rendezvous(
            nproc=8, min_nodes=nodes, max_nodes=nodes, addr=f"10.0.{i // 256}.{i % 256}",
            ports=[40000, 40001],
        ),
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    policy = Policy(PolicyConfig())
    regs = [registration(i, args.nodes) for i in range(args.nodes)]
    t0 = time.perf_counter()
    for i, reg in enumerate(regs):
        policy.register(reg, now=1.0 + i * 1e-3)
    first_s = time.perf_counter() - t0
    assert policy.epochs, "the membership did not form"
    per_renewal_ms: list[float] = []
    for r in range(args.rounds):
        for reg in regs:
            t = time.perf_counter()
            policy.register(reg, now=100.0 + r)
            per_renewal_ms.append((time.perf_counter() - t) * 1e3)
    per_renewal_ms.sort()
    result = {
        "nodes": args.nodes,
        "first_registrations_s": round(first_s, 3),
        "renewal_ms_p50": round(statistics.median(per_renewal_ms), 4),
        "renewal_ms_p99": round(per_renewal_ms[int(len(per_renewal_ms) * 0.99) - 1], 4),
        "renewal_round_s": round(sum(per_renewal_ms) / 1e3 / args.rounds, 4),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
