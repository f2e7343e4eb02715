"""NUMA binding per local rank (``marduk agent run --numa-bind``), with real processes: each
rank's ``Cpus_allowed_list`` (``/proc/<pid>/status``) is its NUMA node's CPUs, whether it
started cold (bound between fork and exec, or under numactl where installed) or was forked
from the fork server (it binds itself). The agent runs pinned to one CPU, so a rank that was
not bound would show that one CPU (affinity is inherited), not its node's list."""

from __future__ import annotations

import re
import sys

import pytest

from agent.supervise import numa
from tests.conftest import eventually_sync
from tests.processes import Proc

pytestmark = pytest.mark.e2e

PIDS = re.compile(r"trainers started: pids ([\d, ]+)")
TOPOLOGY = numa.read_topology()
NODES = sorted(TOPOLOGY.nodes)


def allowed(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(x.split(":", 1)[1].strip() for x in f if x.startswith("Cpus_allowed_list"))


def ranks_bound(env: dict[str, str], nproc: int, spec: str, *options: str) -> list[str]:
    """Each local rank's Cpus_allowed_list under an agent pinned to one CPU of node 0."""
    pinned = min(TOPOLOGY.nodes[NODES[0]])
    run = [sys.executable, "-m", "marduk", "agent", "run", "--standalone", "--replica", "r"]
    run += ["--nproc-per-node", str(nproc), "--numa-bind", spec, "--devices", "d0", *options]
    run += ["tests/trainers/ranks.py", "--step-seconds", "0.2"]
    launcher = f"import os, sys; os.sched_setaffinity(0, {{{pinned}}}); os.execv(sys.argv[1], sys.argv[1:])"
    p = Proc([sys.executable, "-c", launcher, *run], env)
    try:
        line = p.expect("trainers started: pids", timeout=60)
        m = PIDS.search(line)
        assert m is not None, line
        pids = [int(x) for x in m.group(1).replace(",", " ").split()]
        # Each rank's trainer code runs (it prints its variables): a forked one has bound
        # itself by then (a fork waits, with the fork server's affinity, until activated).
        eventually_sync(lambda: sum(x.count("ENV {") for x in p.all) >= nproc, timeout=30)
        return [allowed(pid) for pid in pids]
    finally:
        p.stop()


@pytest.mark.parametrize("start", [("--no-prespawn",), ("--prespawn", "--preload", "none")])
def test_every_rank_runs_on_its_nodes_cpus(env: dict[str, str], start: tuple[str, ...]) -> None:
    node0 = TOPOLOGY.nodes[NODES[0]]
    if len(node0) < 2:
        pytest.skip("NUMA node 0 has one CPU: a bound rank would look like an unbound one")
    # Two GPUs per node (NVRX_GPUS_PER_NUMA=2): both local ranks on node 0, even here.
    got = ranks_bound(env, 2, "2", *start)
    assert got == [numa.format_cpulist(node0)] * 2


@pytest.mark.skipif(len(NODES) < 2, reason="this machine has one NUMA node")
def test_ranks_on_different_nodes_get_each_nodes_cpus(env: dict[str, str]) -> None:
    got = ranks_bound(env, 2, "1", "--no-prespawn")
    assert got == [numa.format_cpulist(TOPOLOGY.nodes[n]) for n in (0, 1)]
