"""A standalone trainer that reads its live parameters: prints them at start and whenever
``on_params`` says they changed (applied at the next step boundary), refusing ``lr`` above 1."""

from __future__ import annotations

import argparse
import threading
import time

import agent

p = argparse.ArgumentParser()
p.add_argument("--replica", required=True)
p.add_argument("--job", default="params")
p.add_argument("--lr", type=float, default=0.1)  # the command line's value
args = p.parse_args()

changed = threading.Event()
client = agent.connect(
    args.replica, [f"{args.replica}-gpu0"], job=args.job, on_params=lambda _: changed.set()
)
lr = float(client.params.get("lr", args.lr))  # type: ignore[arg-type]
print(f"START version={client.params.version} lr={lr}", flush=True)
if client.params.version:
    client.params_applied(client.params.version)
step = 0
while True:
    step += 1
    client.step(step)
    if changed.is_set():  # a step boundary
        changed.clear()
        params = client.params
        new = float(params.get("lr", args.lr))  # type: ignore[arg-type]
        if new > 1.0:
            client.params_applied(params.version, rejected={"lr": f"{new} is above 1.0"})
            print(f"REJECTED version={params.version} lr={new}", flush=True)
        else:
            lr = new
            client.params_applied(params.version)
            print(f"PARAMS version={params.version} lr={lr}", flush=True)
    time.sleep(0.02)
