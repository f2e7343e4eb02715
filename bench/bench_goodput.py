"""Benchmark: goodput (ETTR) of the JAX example job under failures, Marduk against restart-all.

The job: examples/jax_trainer.py, 2 replicas x 2 workers, each worker data parallel over 2 CPU
devices, a step every ``--step-seconds``, a checkpoint every ``--ckpt-every`` steps and on
SIGTERM. Two contenders run it, one after the other, under the same failure schedule:

* ``marduk``: a controller on its own nats-server and 4 ``marduk agent run`` (the fork server,
  the default; ``--scope replica``): a device event restarts the replica that uses the device;
  a trainer crash restarts its replica (the crashed worker, and its peer on command).
  ``--scope job`` (one mesh over the whole job): every failure restarts all 4, warm.
* ``restart-all``: bench/goodput_supervisor.py, the status quo without Marduk: on any failure
  it stops every worker (SIGTERM, the same grace) and starts them all cold, as a Kubernetes
  Job restarting its pods or torchrun's restart-all would.

The failures (``--seed``: same seed, same schedule, for both): ``--per-minute`` single failures
spread over the window, plus ``--bursts`` bursts of ``--burst-size`` failures ``--burst-gap``
s apart; each one a device event (for Marduk a health event published as ``marduk monitor
inject-failure`` does, through the same client function, so that its time is the publish's, not
a CLI start's; for restart-all, a line to the supervisor, which restarts everything) or a
trainer crash (kill -9 of the target worker's trainer process), on a worker the seed picks.

The window opens when all 4 workers have stepped and lasts ``--duration`` s. Per worker, every
instant of it is put in one category (bench/goodput_account.py): productive steps, lost steps
(done after the last checkpoint and redone), checkpoint, detection, stop, restart, import, init,
restore, compile, from the times the trainer logs (``--events``), the agents log (JSON logs:
trainer started, trainer crashed) and the supervisor logs. ETTR = productive / wall, over the
4 workers.

    .venv/bin/python bench/bench_goodput.py --plot docs/img/goodput.png

Every port is held by the process that uses it (nats-server picks its own, ``-p -1``). Every
process started runs in a session of its own and is killed with it, on Ctrl-C too; the run
ends with a check that nothing started under the run's directory is left. BENCH_KEEP=1 keeps the
run's directory (events, logs).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
from bench_notify import machine, source_version, start_nats_server
from bench_restart import wait_for
from goodput_account import CATEGORIES, Account, account, ettr, incarnations, slices

ROOT = Path(__file__).resolve().parent.parent
TRAINER = str(ROOT / "examples" / "jax_trainer.py")
JOB = "gp"
WORKERS = [(f"r{r}", w) for r in range(2) for w in range(2)]
CONTENDERS = ("marduk", "restart-all")


@dataclass(frozen=True)
class Failure:
    at: float  # seconds after the window opened
    kind: str  # device | crash
    replica: str
    worker: int


def schedule(
    seed: int,
    duration: float,
    per_minute: float,
    bursts: int,
    burst_size: int,
    burst_gap: float,
    kinds: tuple[str, ...] = ("device", "crash"),
) -> list[Failure]:
    """Single failures one per 60/per_minute s (at a seeded point of each period, away from its
    edges), and ``bursts`` bursts, each in a seeded place of its share of the window."""
    rng = random.Random(seed)

    def one(at: float) -> Failure:
        replica, worker = rng.choice(WORKERS)
        return Failure(round(at, 3), rng.choice(kinds), replica, worker)

    out = []
    if per_minute > 0:
        period = 60.0 / per_minute
        k = 0
        while (k + 0.8) * period <= duration:
            out.append(one((k + rng.uniform(0.2, 0.8)) * period))
            k += 1
    for b in range(bursts):
        share = duration / bursts
        start = b * share + rng.uniform(0.2, 0.6) * share
        out.extend(one(start + i * burst_gap) for i in range(burst_size))
    return sorted(out, key=lambda f: f.at)


def read_jsonl(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --- contenders --------------------------------------------------------------------------------


class Contender:
    name = ""

    def __init__(self, run_dir: Path, env: dict[str, str], trainer: list[str]) -> None:
        self.dir, self.env, self.trainer = run_dir, env, trainer
        self.procs: list[subprocess.Popen[bytes]] = []
        self.infra = 0  # how many of procs (the first) are servers the others need

    def popen(self, args: list[str], name: str, **kw: object) -> subprocess.Popen[bytes]:
        """A child in a session of its own (killed with its whole group at the end)."""
        out = open(self.dir / f"{name}.out", "wb")  # noqa: SIM115
        err = open(self.dir / f"{name}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            args, env=self.env, cwd=ROOT, stdout=out, stderr=err, start_new_session=True, **kw
        )  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc  # type: ignore[no-any-return]

    def check(self) -> None:
        for p in self.procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args[:6]!r}... exited with {p.returncode} (see {self.dir})")

    def stop(self) -> None:
        """SIGTERM the processes this contender started, then SIGKILL each one's whole group:
        the supervisors first (agents report their end to a controller still up), then the
        infrastructure (``self.infra``: the first ones started), in reverse order."""
        infra = self.procs[: self.infra]
        for group in (self.procs[self.infra :], infra[::-1]):
            for p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 15
            for p in group:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                p.wait()

    # What the accounting needs, per worker: trainer starts (time, pid) and the times its
    # supervisor saw a trainer die unannounced.
    def spawns(self, replica: str, worker: int) -> list[tuple[float, int]]:
        raise NotImplementedError

    def notices(self, replica: str, worker: int) -> list[float]:
        raise NotImplementedError

    def device_event(self, f: Failure) -> float:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError


class Marduk(Contender):
    name = "marduk"
    scope = "replica"
    STARTED = re.compile(r"trainer started: pid (\d+)")

    def start(self) -> None:
        server, self.url = start_nats_server(self.dir / "nats")
        self.procs.append(server)
        self.env = {
            **self.env,
            "MARDUK_ADDR": self.url,
            "MARDUK_STATE_DIR": str(self.dir / "state"),
            # The schedule fails the same devices again and again: lift the budgets that would
            # (rightly) quarantine them and hand the pod to the scheduler: that is another
            # benchmark's story.
            "MARDUK_DEVICE_MAX_FAILURES": "1000000",
            "MARDUK_FLAP_LIMIT": "1000000",
        }
        self.popen([sys.executable, "-m", "marduk", "controller", "--no-embedded"], "controller")
        wait_for(
            lambda: b"serving prefix" in (self.dir / "controller.log").read_bytes(),
            60,
            "the controller",
        )
        self.infra = 2  # nats-server, controller
        for replica, w in WORKERS:
            self.popen(
                [
                    *(sys.executable, "-m", "marduk", "agent", "run", "--job", JOB),
                    *("--replica", replica, "--worker", str(w), "--scope", self.scope),
                    *("--devices", self.device(replica, w), "--grace", "10"),
                    *("--max-restarts", "1000000", "--json-logs", "--log-level", "info"),
                    *("--", *self.trainer),
                ],
                f"agent-{replica}-{w}",
            )

    @staticmethod
    def device(replica: str, worker: int) -> str:
        return f"{JOB}-{replica}-d{worker}"

    def _log(self, replica: str, worker: int) -> list[dict[str, object]]:
        return read_jsonl(self.dir / f"agent-{replica}-{worker}.log")

    def spawns(self, replica: str, worker: int) -> list[tuple[float, int]]:
        out = []
        for rec in self._log(replica, worker):
            m = self.STARTED.match(str(rec.get("msg", "")))
            if m:
                out.append((float(rec["ts"]), int(m.group(1))))  # type: ignore[arg-type]
        return out

    def notices(self, replica: str, worker: int) -> list[float]:
        return [
            float(rec["ts"])  # type: ignore[arg-type]
            for rec in self._log(replica, worker)
            if str(rec.get("msg", "")).startswith(("trainer crashed", "trainer hung"))
        ]

    def device_event(self, f: Failure) -> float:
        from monitor_cli.health import publish_health

        t = time.time()
        reply = asyncio.run(
            publish_health(
                self.url, "marduk", self.device(f.replica, f.worker), "failed", reason="bench"
            )
        )
        if not reply.known:
            raise RuntimeError(f"the controller does not know {self.device(f.replica, f.worker)}")
        return t


class RestartAll(Contender):
    name = "restart-all"

    def start(self) -> None:
        self.sup = self.popen(
            [
                *(sys.executable, str(ROOT / "bench" / "goodput_supervisor.py"), "--job", JOB),
                *("--grace", "10", "--log", str(self.dir / "supervisor.jsonl")),
                *("--", *self.trainer),
            ],
            "supervisor",
            stdin=subprocess.PIPE,
        )

    def _log(self) -> list[dict[str, object]]:
        return read_jsonl(self.dir / "supervisor.jsonl")

    def spawns(self, replica: str, worker: int) -> list[tuple[float, int]]:
        return [
            (float(e["t"]), int(e["pid"]))  # type: ignore[arg-type, call-overload]
            for e in self._log()
            if e["ev"] == "started" and (e["replica"], e["worker"]) == (replica, worker)
        ]

    def notices(self, replica: str, worker: int) -> list[float]:
        return [
            float(e["t"])  # type: ignore[arg-type]
            for e in self._log()
            if e["ev"] == "exited" and (e["replica"], e["worker"]) == (replica, worker)
        ]

    def device_event(self, f: Failure) -> float:
        assert self.sup.stdin is not None
        t = time.time()
        self.sup.stdin.write(f"device {f.replica} {f.worker}\n".encode())
        self.sup.stdin.flush()
        return t


def crash(c: Contender, f: Failure, timeout: float = 60) -> float:
    """kill -9 the target worker's current trainer (once one runs); return when."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spawns = c.spawns(f.replica, f.worker)
        if spawns and alive(spawns[-1][1]):
            t = time.time()
            try:
                os.kill(spawns[-1][1], signal.SIGKILL)
                return t
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    raise TimeoutError(f"no trainer of {f.replica}/{f.worker} to kill for {timeout}s")


# --- one run -------------------------------------------------------------------------------------


@dataclass
class Result:
    contender: str
    window: tuple[float, float]
    failures: list[tuple[float, str, str, int]]  # (time, kind, replica, worker) as injected
    total: Account
    per_worker: dict[str, Account]
    progress: dict[str, list[tuple[float, int]]]  # worker -> (time, step), for the plot


def run_one(cls: type[Contender], failures: list[Failure], args: argparse.Namespace) -> Result:
    run_dir = Path(tempfile.mkdtemp(prefix=f"marduk-goodput-{cls.name}-"))
    events_dir = run_dir / "events"
    trainer = [
        *(sys.executable, TRAINER, "--steps", "100000000"),
        *("--step-seconds", str(args.step_seconds), "--ckpt-every", str(args.ckpt_every)),
        *("--ckpt-dir", str(run_dir / "ckpt"), "--events", str(events_dir)),
    ]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "OMP_NUM_THREADS": "1",
    }
    c = cls(run_dir, env, trainer)
    injected: list[tuple[float, str, str, int]] = []
    try:
        t_launch = time.time()
        c.start()

        def all_stepping() -> float | None:
            firsts = []
            for replica, w in WORKERS:
                steps = [e for e in read_jsonl(events_dir / f"{JOB}-{replica}-{w}.jsonl")
                         if e["ev"] == "step"]  # fmt: skip
                if not steps:
                    c.check()
                    return None
                firsts.append(float(steps[0]["t"]))  # type: ignore[arg-type]
            return max(firsts)

        t0 = float(wait_for(all_stepping, 600, "every worker's first step"))  # type: ignore[arg-type]
        t0 = max(t0, time.time())
        log(f"{c.name}: all 4 workers stepping {t0 - t_launch:.1f} s after launch; "
            f"window of {args.duration:g} s opens")  # fmt: skip
        for f in failures:
            time.sleep(max(0.0, t0 + f.at - time.time()))
            c.check()
            t = c.device_event(f) if f.kind == "device" else crash(c, f)
            injected.append((t, f.kind, f.replica, f.worker))
            log(f"{c.name}: +{t - t0:6.1f} s {f.kind} {f.replica}/{f.worker}")
        time.sleep(max(0.0, t0 + args.duration - time.time()))
        c.check()
        t1 = t0 + args.duration
    finally:
        c.stop()
        left = leftovers(run_dir)
        if left:
            log(f"{c.name}: {len(left)} process(es) left behind, killed: {left}")
    fail_times = [t for t, *_ in injected]
    total, per_worker, progress = Account(), {}, {}
    for replica, w in WORKERS:
        who = f"{JOB}-{replica}-{w}"
        evs = read_jsonl(events_dir / f"{who}.jsonl")
        incs = incarnations(c.spawns(replica, w), evs)
        acc = account(incs, c.notices(replica, w), fail_times, t0, t1)
        if os.environ.get("BENCH_KEEP"):  # what each span of the worker's life was spent on
            spans = slices(incs, c.notices(replica, w), fail_times, t1)
            (run_dir / f"spans-{who}.txt").write_text(
                "".join(f"{a - t0:9.3f} {b - a:8.3f} {what}\n" for a, b, what in spans)
            )
        per_worker[who], progress[who] = (
            acc,
            [
                (float(e["t"]) - t0, int(e["step"]))  # type: ignore[arg-type, call-overload]
                for e in evs
                if e["ev"] == "step" and float(e["t"]) <= t1  # type: ignore[arg-type]
            ],
        )
        total.add(acc)
    if os.environ.get("BENCH_KEEP"):
        log(f"kept {run_dir}")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    return Result(c.name, (t0, t1), injected, total, per_worker, progress)


def leftovers(run_dir: Path) -> list[int]:
    """Processes whose command line names the run's directory (all of ours do): killed."""
    left = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any(str(run_dir) in a for a in p.info["cmdline"] or ()):
            left.append(p.info["pid"])
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    return left


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- report --------------------------------------------------------------------------------------


def step_times(r: Result) -> dict[str, float]:
    """Step to next step within one trainer, in ms (a slower step is productive time too)."""
    dts = sorted(
        b[0] - a[0]
        for pts in r.progress.values()
        for a, b in itertools.pairwise(pts)
        if b[1] == a[1] + 1 and a[0] >= 0
    )
    if not dts:
        return {}
    return {
        "median": round(1000 * statistics.median(dts), 1),
        "mean": round(1000 * statistics.fmean(dts), 1),
        "p99": round(1000 * dts[min(len(dts) - 1, int(0.99 * len(dts)))], 1),
    }


def summary(r: Result) -> dict[str, object]:
    wall = sum(r.total.seconds.values())
    return {
        "contender": r.contender,
        "ettr": round(ettr(r.total), 4),
        "worker_seconds": round(wall, 1),
        "breakdown_s": {k: round(r.total.seconds[k], 2) for k in CATEGORIES},
        "breakdown_pct": {k: round(100 * r.total.seconds[k] / wall, 2) for k in CATEGORIES},
        # Per trainer start in the window: what one restart of one worker cost, on average.
        "per_start_ms": {
            k: round(1000 * r.total.seconds[k] / max(1, r.total.restarts), 1)
            for k in CATEGORIES[3:]
        },
        "steps_kept": r.total.steps_kept,
        "step_ms": step_times(r),
        "steps_lost": r.total.steps_lost,
        "trainer_starts": r.total.restarts,
        "failures": len(r.failures),
    }


def plot(results: list[Result], path: str) -> None:
    """Top: the job's progress (mean step of its workers) over the window, both contenders.
    Bottom: how far each is behind its own failure-free pace (seconds of steps)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.4), sharex=True)
    span = results[0].window[1] - results[0].window[0]
    grid = np.arange(0.0, span, 0.05)
    for r, color in zip(results, ("tab:blue", "tab:gray"), strict=False):
        mean = np.zeros_like(grid)
        paces = []
        for pts in r.progress.values():
            t = np.array([p[0] for p in pts])
            step = np.array([p[1] for p in pts], dtype=float)
            at = np.searchsorted(t, grid, side="right") - 1  # the last step done by then
            mean += np.where(at >= 0, step[np.maximum(at, 0)], step[0])
            steady = np.diff(t)[np.diff(step) == 1]
            paces.append(float(np.median(steady)))
        mean /= len(r.progress)
        label = f"{r.contender}: ETTR {100 * ettr(r.total):.1f} %"
        top.plot(grid, mean, color=color, lw=1.2, label=label)
        pace = float(np.median(paces))  # seconds per step when nothing fails
        behind = grid - (mean - mean[0]) * pace
        bottom.plot(grid, behind, color=color, lw=1.2, label=r.contender)
    for t, kind, replica, w in results[0].failures:
        at = t - results[0].window[0]
        color = "tab:red" if kind == "crash" else "tab:orange"
        for ax in (top, bottom):
            ax.axvline(at, color=color, lw=0.7, ls="--")
        bottom.annotate(
            f"{kind} {replica}/{w}", (at, 0), rotation=90, fontsize=7, color=color,
            xytext=(2, 4), textcoords="offset points", va="bottom",
        )  # fmt: skip
    top.set_ylabel("step (mean of 4 workers)")
    top.legend(fontsize=8, loc="upper left")
    top.set_title(
        "JAX example job, 2 replicas x 2 workers, under the same failures "
        "(dashed: red crash, orange device event)",
        fontsize=9,
    )
    bottom.set_ylabel("seconds behind the\nfailure-free pace")
    bottom.set_xlabel("seconds since every worker stepped")
    bottom.set_xlim(0, span)
    bottom.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def interrupted(*_: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--duration", type=float, default=240.0, help="seconds of the window")
    p.add_argument("--per-minute", type=float, default=1.0, help="single failures a minute")
    p.add_argument("--bursts", type=int, default=1)
    p.add_argument("--burst-size", type=int, default=3)
    p.add_argument("--burst-gap", type=float, default=2.0)
    p.add_argument("--kinds", default="device,crash", help="failure kinds drawn from")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--step-seconds", type=float, default=0.1)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument(
        "--scope",
        choices=("replica", "job"),
        default="replica",
        help="Marduk's restart scope (job: every failure restarts all 4 workers, warm)",
    )
    p.add_argument("--plot", help="write the steps-over-time plot here (PNG; needs matplotlib)")
    p.add_argument("--out", help="also write the JSON report here")
    args = p.parse_args()
    kinds = tuple(args.kinds.split(","))
    if not set(kinds) <= {"device", "crash"} or not kinds:
        p.error("--kinds: device, crash or both")
    classes = {"marduk": Marduk, "restart-all": RestartAll}
    Marduk.scope = args.scope
    if args.scope == "job":
        Marduk.name = "marduk-job"
    names = args.contenders.split(",")
    for n in names:
        if n not in classes:
            p.error(f"unknown contender {n!r} (known: {', '.join(CONTENDERS)})")
    failures = schedule(
        args.seed, args.duration, args.per_minute, args.bursts, args.burst_size,
        args.burst_gap, kinds,
    )  # fmt: skip
    for f in failures:
        log(f"scheduled: +{f.at:6.1f} s {f.kind} {f.replica}/{f.worker}")
    # Ctrl-C and SIGTERM unwind through run_one's cleanup.
    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    results = []
    try:
        for n in names:
            results.append(run_one(classes[n], failures, args))
            log(json.dumps(summary(results[-1])))
    except KeyboardInterrupt:
        log("interrupted: every process the benchmark started is stopped")
        sys.exit(130)
    report = json.dumps(
        {
            "source": source_version(),
            "machine": machine(),
            "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
            "settings": {k: v for k, v in vars(args).items() if k not in ("plot", "out")},
            "schedule": [asdict(f) for f in failures],
            "results": [summary(r) for r in results],
        },
        indent=2,
    )
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")
    if args.plot:
        plot(results, args.plot)
        log(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
