"""A prestarted trainer: the next trainer, its own process started ahead of time, waiting on
its stdin: ``python -m agent.supervise.prestarted --preload jax -- train.py``.

Most of a restarted trainer's time-to-first-step is the interpreter importing the framework. With
``--no-fork-server`` (or where the fork server, ``agent/supervise/zygote.py``, cannot be used) the
supervisor keeps one prestarted trainer per local rank that has already imported the modules
named by ``--preload`` and waits. On a restart the supervisor writes one JSON line to its stdin,
``{"env": {...}}`` (the trainer's environment: the new epoch, restart count, torchrun's
variables, ``MARDUK_WARM_START=standby``: a value kept for the trainers that read it); the
process applies it to ``os.environ`` and runs the trainer as ``python`` would (``runpy``, with
``__name__ == "__main__"`` and ``sys.argv`` set). EOF on stdin (the supervisor discarded it)
exits quietly.

Only what is imported is preloaded: no device is touched before the trainer runs, so the old
trainer still owns the accelerators while its successor waits. ("Standby" is a controller's
role, never this process.)
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys

from agent.supervise import numa

USAGE = "usage: python -m agent.supervise.{} [--preload a,b] -- SCRIPT|-m MODULE [ARGS...]"


def parse(argv: list[str], name: str = "prestarted") -> tuple[dict[str, str], list[str]]:
    """(options, target) of ``[--opt value]... -- SCRIPT|-m MODULE [ARGS...]``."""
    if "--" not in argv:
        sys.exit(USAGE.format(name))
    split = argv.index("--")
    opts, target = argv[:split], argv[split + 1 :]
    if len(opts) % 2 or not all(o.startswith("--") for o in opts[::2]):
        sys.exit(USAGE.format(name))
    if not target or (target[0] == "-m" and len(target) < 2):
        sys.exit(f"agent.supervise.{name}: nothing to run")
    return dict(zip(opts[::2], opts[1::2], strict=True)), target


def preload(modules: str, who: str = "prestarted") -> None:
    """Import ``modules`` (comma-separated); a failure is reported, not fatal."""
    for name in (m for m in modules.split(",") if m):
        try:
            importlib.import_module(name)
        except Exception as e:  # the trainer will import it and fail for real if it must
            print(
                f"agent.supervise.{who}: could not preload {name}: {e}", file=sys.stderr, flush=True
            )


def run_target(target: list[str]) -> None:
    """Run ``SCRIPT ARGS`` or ``-m MODULE ARGS`` as ``python`` would, in this process."""
    if target[0] == "-m":
        sys.argv = [target[1], *target[2:]]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(target)
        # As `python SCRIPT` does: the script's directory first on the path.
        sys.path[0] = os.path.dirname(os.path.abspath(target[0]))
        runpy.run_path(target[0], run_name="__main__")


def main(argv: list[str]) -> None:
    opts, target = parse(argv)
    preload(opts.get("--preload", ""))
    line = sys.stdin.readline()
    if not line:
        return  # discarded
    order = json.loads(line)
    os.environ.update({str(k): str(v) for k, v in order.get("env", {}).items()})
    numa.bind_self()  # --numa-bind: this rank's CPUs (agent/supervise/numa.py)
    sys.stdin.close()
    sys.stdin = open(os.devnull)  # noqa: SIM115 - the trainer's stdin, as the supervisor gives
    run_target(target)


if __name__ == "__main__":
    main(sys.argv[1:])
