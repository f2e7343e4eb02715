"""A supervised trainer that asks its agent things (``client.request``): steps every
``--step-seconds``; where ``ASK`` is set (a comma-separated list of kinds), asks each at step 3
(once per agent: the file ``ASKED`` names is made then) and prints each answer; ``--exit N``:
exits N right after asking."""

from __future__ import annotations

import argparse
import os
import sys
import time

import agent

p = argparse.ArgumentParser()
p.add_argument("--step-seconds", type=float, default=0.1)
p.add_argument("--exit", type=int, default=-1)
args = p.parse_args()

client = agent.connect()
e = os.environ
print(
    f"STARTED epoch={e.get('MARDUK_EPOCH')} world={e.get('WORLD_SIZE')} "
    f"group={e.get('GROUP_RANK')}",
    flush=True,
)
asks = [k for k in e.get("ASK", "").split(",") if k]
marker = e.get("ASKED", "")
step = 0
while True:
    step += 1
    client.step(step)
    if step == 3 and asks and not (marker and os.path.exists(marker)):
        if marker:
            open(marker, "w").close()
        for kind in asks:
            answer = client.request(kind, reason="test asks")
            print(f"ANSWER {kind} accepted={answer.accepted} code={answer.code}", flush=True)
            print(f"DETAIL {answer.detail}", flush=True)
        if args.exit >= 0:
            sys.exit(args.exit)
    time.sleep(args.step_seconds)
