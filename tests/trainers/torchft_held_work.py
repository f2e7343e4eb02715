"""Two ranks of torchft's ProcessGroupGloo, for tests/integration/test_torchft_guard.py: what a
peer's abort ends, depending on whether that peer still holds a Work of the aborted group.

Both ranks average a model's gradients with ``examples/torchft_ddp.py``'s
``average_gradients`` (a stand-in Manager whose ``allreduce`` is the process group's). Then
rank 0 waits in a recv from rank 1, as a group that moved on to the next collective of a step
its peer gave up; rank 1 aborts its process group (what the Guard does on a ``peer_failed``
notice) with nothing held (``released``) or holding one Work of that step (``held``, as a loop
variable would). Rank 0 prints ``recv ended after S s: ERROR``. The process group's timeout
is 3 s.

    python tests/trainers/torchft_held_work.py released|held
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _average_gradients() -> Any:
    spec = importlib.util.spec_from_file_location("torchft_ddp", ROOT / "examples/torchft_ddp.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.average_gradients


class _Manager:
    def __init__(self, pg: Any) -> None:
        self.pg = pg
        self.last: Any = None

    def allreduce(self, tensor: Any) -> Any:
        from torch.distributed import AllreduceOptions, ReduceOp

        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        self.last = self.pg.allreduce([tensor], opts)  # read only in ``held``
        return self.last


def rank_main(rank: int, port: int, mode: str) -> None:
    import torch
    from torch import nn
    from torch.distributed import TCPStore
    from torchft import ProcessGroupGloo

    sys.path.insert(0, str(ROOT))
    average_gradients = _average_gradients()
    store = TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=3))
    pg.configure(f"127.0.0.1:{port}/held", f"r{rank}", rank, 2)
    model = nn.Linear(4, 1)
    model(torch.ones(2, 4)).sum().backward()
    manager = _Manager(pg)
    average_gradients(manager, model)
    if rank == 1:
        held = manager.last if mode == "held" else None
        manager.last = None
        time.sleep(0.5)
        pg.abort()
        time.sleep(6)
        del held
        return
    work = pg.recv([torch.zeros(4)], 1, 0)
    t0 = time.monotonic()
    try:
        work.wait()
        print(f"recv ended after {time.monotonic() - t0:.2f} s: none", flush=True)
    except Exception as e:
        print(f"recv ended after {time.monotonic() - t0:.2f} s: {str(e)[:120]}", flush=True)
    del store


def main() -> None:
    if len(sys.argv) == 4:
        rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    me = [sys.executable, __file__]
    r0 = subprocess.Popen([*me, "0", str(port), sys.argv[1]])
    # No wait for rank 0's store: a TCPStore client retries its connection until it listens.
    r1 = subprocess.Popen([*me, "1", str(port), sys.argv[1]])
    try:
        r0.wait(60)
    finally:
        r1.kill()
        r1.wait()
        r0.kill()
        r0.wait()


if __name__ == "__main__":
    main()
