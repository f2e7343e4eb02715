"""Probe: the benchmark's 3 s crash stall replayed without torchft's Manager or Marduk.

Three ranks of torchft's ProcessGroupGloo (timeout 3 s) run steps of four allreduces, as
examples/torchft_ddp.py does; a rank is SIGKILLed at a random moment (rotating), and 5 ms later
the other two abort their process groups (what the Guard does on a ``peer_failed`` notice). A
survivor that saw an error keeps the step's Works (``held``, as a loop variable would) or drops
them (``dropped``) and then waits 4 s, as a group waiting for the next quorum. A trial stalls
when a survivor's Work ran to the timeout (``Timed out`` or ``Application timeout caused pair
closure``). docs/benchmarks.md, "torchft", says what it showed.

    .venv/bin/python bench/torchft_ring_probe.py held 24     # likewise dropped
"""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

SIZES = (1024, 64, 64, 1)  # the example's parameters


def rank_main(rank: int, port: int, mode: str) -> None:
    import torch
    from torch.distributed import AllreduceOptions, ReduceOp, TCPStore
    from torchft import ProcessGroupGloo

    store = TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=3))
    pg.configure(f"127.0.0.1:{port}/ring", f"r{rank}", rank, 3)
    aborted: list[float] = []

    def abort_on_request() -> None:
        for line in sys.stdin:
            if line.strip() == "abort":
                aborted.append(time.monotonic())
                pg.abort()

    threading.Thread(target=abort_on_request, daemon=True).start()
    print("ready", flush=True)
    tensors = [torch.randn(n) for n in SIZES]
    step = 0
    while True:
        works = []
        for t in tensors:
            opts = AllreduceOptions()
            opts.reduceOp = ReduceOp.SUM
            works.append(pg.allreduce([t], opts))
        errors = []
        for i, work in enumerate(works):
            try:
                work.wait()
            except Exception as e:
                since = time.monotonic() - aborted[0] if aborted else -1.0
                errors.append(f"r{rank} step {step} work {i}: {since:.2f} s after the abort: {e}")
        if errors:
            print("\n".join(e[:160] for e in errors), flush=True)
            if mode == "dropped":
                del works, work
            time.sleep(4)
            del store
            return
        step += 1


def trial(victim: int, mode: str) -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(3):
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, str(rank), str(port), mode],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
        )
        if rank == 0:
            time.sleep(0.3)  # rank 0 holds the store
    try:
        for p in procs:
            assert p.stdout is not None
            while "ready" not in p.stdout.readline():
                pass
        time.sleep(0.5 + random.random() * 0.5)
        procs[victim].kill()
        time.sleep(0.005)
        for rank, p in enumerate(procs):
            if rank != victim and p.stdin is not None:
                p.stdin.write("abort\n")
                p.stdin.flush()
        return "".join(p.communicate(timeout=20)[0] for r, p in enumerate(procs) if r != victim)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main() -> None:
    if len(sys.argv) == 4:
        rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
        return
    mode = sys.argv[1] if len(sys.argv) > 1 else "held"
    trials = int(sys.argv[2]) if len(sys.argv) > 2 else 24
    stalls = 0
    for n in range(trials):
        said = trial(n % 3, mode)
        stalled = "Timed out" in said or "pair closure" in said
        stalls += stalled
        print(f"trial {n} r{n % 3} killed: {'STALL' if stalled else 'ok'}", flush=True)
        if stalled:
            print(said, flush=True)
    print(f"{mode}: {stalls} of {trials} trials stalled", flush=True)


if __name__ == "__main__":
    main()
