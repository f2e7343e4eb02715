"""examples/torchft_ddp.py without Marduk: the same trainer, its ``agent.torchft.attach`` a no-op
(no registration, no commands, no peer notices), for torchft-alone runs under a plain restart
loop. The replica id comes from ``MARDUK_REPLICA_ID`` as in the example.

    MARDUK_REPLICA_ID=g1 torchrun --standalone --nproc-per-node 1 --max-restarts 1000 \\
        bench/torchft_alone.py --lighthouse http://127.0.0.1:29510 --step-seconds 0.1
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path
from typing import Any

import agent.torchft as marduk_ft

EXAMPLE = str(Path(__file__).resolve().parent.parent / "examples" / "torchft_ddp.py")


class NoGuard:
    def step(self) -> None:
        pass


def no_attach(manager: Any, pg: Any = None, **_: Any) -> NoGuard:
    return NoGuard()


marduk_ft.attach = no_attach  # type: ignore[assignment]
sys.argv = [EXAMPLE, *sys.argv[1:]]
runpy.run_path(EXAMPLE, run_name="__main__")
