"""Probe: what ends a recv pending in torchft's ProcessGroupGloo (gloo, CPU, two processes).

Rank 0 waits in a recv from rank 1, which never sends; then, 0.5 s in, ``self``: rank 0 aborts
its own process group (what the Guard does on a peer_failed notice); ``peer``: rank 1 aborts
its own; ``kill``: rank 1 is SIGKILLed. Prints when and how rank 0's recv ended (the process
group's timeout is 5 s). docs/benchmarks.md, "torchft", says what it showed.

    .venv/bin/python bench/torchft_abort_probe.py self    # likewise peer, kill
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta


def rank_main(rank: int, port: int, mode: str) -> None:
    import torch
    from torch.distributed import TCPStore
    from torchft import ProcessGroupGloo

    store = TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    pg.configure(f"127.0.0.1:{port}/probe", f"r{rank}", rank, 2)
    if rank == 1:
        time.sleep(0.5)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "peer":
            pg.abort()
        time.sleep(8)
        return
    work = pg.recv([torch.zeros(4)], 1, 0)
    if mode == "self":
        threading.Timer(0.5, pg.abort).start()
    t0 = time.monotonic()
    try:
        work.wait()
        print(f"{mode}: the recv returned after {time.monotonic() - t0:.2f} s")
    except Exception as e:
        print(f"{mode}: the recv failed after {time.monotonic() - t0:.2f} s: {str(e)[:80]}")
    del store


def main() -> None:
    if len(sys.argv) == 4:
        rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
        return
    mode = sys.argv[1] if len(sys.argv) > 1 else "self"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    me = [sys.executable, __file__]
    r0 = subprocess.Popen([*me, "0", str(port), mode])
    time.sleep(0.5)
    r1 = subprocess.Popen([*me, "1", str(port), mode])
    r0.wait(30)
    r1.kill()
    r1.wait()


if __name__ == "__main__":
    main()
