"""A trainer process started ahead of time: ``python -m agent.standby --preload jax -- train.py``.

Most of a restarted trainer's time-to-first-step is the interpreter importing the framework.
The supervisor therefore keeps one standby process per worker that has already imported the
modules named by ``--preload`` and waits. On a restart the supervisor writes one JSON line to
its stdin, ``{"env": {...}}`` (the new MARDUK_EPOCH, MARDUK_RESTART_COUNT, ...); the standby
applies it to ``os.environ`` and runs the trainer as ``python`` would (``runpy``, with
``__name__ == "__main__"`` and ``sys.argv`` set). EOF on stdin (the supervisor discarded it)
exits quietly.

Only what is imported is preloaded: no device is touched before the trainer runs, so the old
trainer still owns the accelerators while its successor waits.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys


def main(argv: list[str]) -> None:
    preload: list[str] = []
    if "--" not in argv:
        sys.exit("usage: python -m agent.standby [--preload a,b] -- SCRIPT|-m MODULE [ARGS...]")
    split = argv.index("--")
    opts, target = argv[:split], argv[split + 1 :]
    if len(opts) >= 2 and opts[0] == "--preload":
        preload = [m for m in opts[1].split(",") if m]
    if not target:
        sys.exit("agent.standby: nothing to run")
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as e:  # the trainer will import it and fail for real if it must
            print(f"agent.standby: could not preload {name}: {e}", file=sys.stderr, flush=True)

    line = sys.stdin.readline()
    if not line:
        return  # discarded
    order = json.loads(line)
    os.environ.update({str(k): str(v) for k, v in order.get("env", {}).items()})
    sys.stdin.close()
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the trainer's stdin, as the supervisor gives
    if target[0] == "-m":
        sys.argv = [target[1], *target[2:]]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(target)
        # As `python SCRIPT` does: the script's directory first on the path.
        sys.path[0] = os.path.dirname(os.path.abspath(target[0]))
        runpy.run_path(target[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
