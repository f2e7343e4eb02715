"""examples/torchft_ddp.py with the race of issue 19 made certain, for tests/e2e/test_torchft.py.

The first quorum answer with three groups at step ``MARDUK_TEST_RACE_STEP`` or later: the
group ``MARDUK_TEST_RACE_DIES`` SIGKILLs its trainer right after the lighthouse answered (once:
a file in ``MARDUK_TEST_RACE_DIR`` marks it, so its next incarnation lives), and every other
group holds that answer ``MARDUK_TEST_RACE_DELAY`` seconds before torchft sees it, as a slow
answer would be: the peer_failed notice comes while their quorum call is in flight, and the
answer still holds the dead incarnation. The hook wraps the Manager's quorum client before
``attach`` does, so the Guard sees the call in flight as long as the hold lasts.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from pathlib import Path
from typing import Any

from agent import torchft as marduk_ft

STEP = int(os.environ["MARDUK_TEST_RACE_STEP"])
DIES = os.environ["MARDUK_TEST_RACE_DIES"]
DELAY = float(os.environ.get("MARDUK_TEST_RACE_DELAY", "2"))
DIED = Path(os.environ["MARDUK_TEST_RACE_DIR"]) / "died"


class _Race:
    def __init__(self, inner: Any, replica: str) -> None:
        self._inner = inner
        self._replica = replica
        self._done = False

    def _quorum(self, **kwargs: Any) -> Any:
        result = self._inner._quorum(**kwargs)
        if self._done or int(kwargs.get("step", 0)) < STEP or len(result.replica_ids) < 3:
            return result
        self._done = True
        if self._replica == DIES:
            if not DIED.exists():
                DIED.touch()
                print(f"race: dying after quorum {result.quorum_id}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        else:
            print(
                f"race: holding quorum {result.quorum_id} {DELAY:g}s", file=sys.stderr, flush=True
            )
            time.sleep(DELAY)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


_attach = marduk_ft.attach


def _racing_attach(manager: Any, pg: Any = None, **kwargs: Any) -> marduk_ft.Guard:
    manager._client = _Race(manager._client, marduk_ft.replica_id())
    return _attach(manager, pg, **kwargs)


marduk_ft.attach = _racing_attach  # type: ignore[assignment]
sys.argv = ["examples/torchft_ddp.py", *sys.argv[1:]]
runpy.run_path("examples/torchft_ddp.py", run_name="__main__")
