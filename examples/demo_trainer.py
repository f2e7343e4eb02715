"""A tiny stand-in trainer for the README demo: registers its devices, prints every command.

    python examples/demo_trainer.py --replica r1 --devices d1,d2

It "trains" (sleeps) and checks ``client.failed`` between steps, the way a real loop would
check at a safe point; on a command it prints it, acknowledges it and carries on.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

import agent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replica", required=True)
    p.add_argument("--devices", required=True, help="comma-separated device UUIDs")
    p.add_argument("--job", default=None)
    p.add_argument("--scope", default=None, choices=["replica", "job"])
    p.add_argument("--step-seconds", type=float, default=0.5)
    args = p.parse_args()

    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        client = agent.connect(
            replica_id=args.replica,
            devices=args.devices.split(","),
            job=args.job,
            scope=args.scope,
        )
    except agent.AgentError as e:
        print(f"[{args.replica}] cannot register: {e}", file=sys.stderr)
        return 1
    o = client.opts
    print(
        f"[{o.replica}] registered job={o.job} devices={','.join(o.devices)} epoch={client.epoch}",
        flush=True,
    )
    step = 0
    while not stop:
        time.sleep(args.step_seconds)  # one training step
        step += 1
        cmd = client.poll()
        if cmd is not None:
            lag_ms = (cmd.received_at - cmd.issued_at) * 1000
            print(
                f"[{o.replica}] COMMAND {cmd.kind} epoch={cmd.epoch} "
                f"devices={','.join(cmd.devices)} reason={cmd.reason!r} "
                f"(controller->trainer {lag_ms:.2f} ms)",
                flush=True,
            )
            client.ack(cmd)
        if client.state != "registered":
            print(f"[{o.replica}] state: {client.state}", flush=True)
    client.close()
    print(f"[{o.replica}] stopped after {step} steps", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
