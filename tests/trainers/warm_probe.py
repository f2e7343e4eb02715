"""A trainer that reports how it was started and what it inherited (one ``FACTS {json}`` line),
then steps: it crashes 0.3 s in (the first ``--crashes`` incarnations), or when the test creates
``--crash-dir``/crash-<incarnation>, and exits 0 after ``--steps`` (0: never)."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time

facts = {
    "inc": int(os.environ.get("MARDUK_RESTART_COUNT", "-1")),
    "by": os.environ.get("MARDUK_WARM_START", "cold"),
    "threads": threading.active_count(),
    "native_threads": len(os.listdir("/proc/self/task")),
    "pid": os.getpid(),
    "ppid": os.getppid(),
    "pgid": os.getpgid(0),
    "sid": os.getsid(0),
    "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
    "sigmask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "stdin": os.readlink("/proc/self/fd/0"),
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
    "random": random.random(),
    "numpy": float(sys.modules["numpy"].random.random()) if "numpy" in sys.modules else None,
}
print("FACTS " + json.dumps(facts), flush=True)

p = argparse.ArgumentParser()
p.add_argument("--crashes", type=int, default=0, help="crash 0.3 s in, in the first N")
p.add_argument("--steps", type=int, default=0, help="then exit 0 after this many (0: never)")
p.add_argument("--crash-dir", default="", help="crash when DIR/crash-<incarnation> appears")
args = p.parse_args()
crash_file = os.path.join(args.crash_dir, f"crash-{facts['inc']}") if args.crash_dir else ""
deadline = time.monotonic() + 0.3
step = 0
while True:
    step += 1
    print(f"step {step}", flush=True)
    if facts["inc"] < args.crashes and time.monotonic() > deadline:
        sys.exit(3)
    if crash_file and os.path.exists(crash_file):
        sys.exit(4)
    if args.steps and step >= args.steps and facts["inc"] >= args.crashes:
        print("DONE", flush=True)
        sys.exit(0)
    time.sleep(0.02)
