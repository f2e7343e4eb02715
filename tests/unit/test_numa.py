"""NUMA binding per local rank (``--numa-bind``), pure: the CPU lists, which node each rank gets,
the command line a rank started cold runs, and the machine read from a sysfs tree of our own."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.supervise import numa
from agent.supervise.numa import Binding, NumaError, Topology
from agent.supervise.run_config import ConfigError, Lookups, RunArgs, build_config
from agent.supervise.starter import cold_command

TWO = Topology({0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}, gpus=(0, 0, 1, 1))


def test_cpulists_round_trip() -> None:
    assert numa.parse_cpulist("0-3,8-11,13\n") == (0, 1, 2, 3, 8, 9, 10, 11, 13)
    assert numa.format_cpulist([13, 0, 1, 2, 3, 9, 8]) == "0-3,8-9,13"
    assert numa.parse_cpulist("") == ()


def test_n_gpus_per_node_puts_gpu_g_on_node_g_over_n() -> None:
    assert [b.node for b in numa.plan("2", 4, 1, TWO)] == [0, 0, 1, 1]
    # Two GPUs a rank (--rank-devices split): rank 1's first GPU is GPU 2, on node 1.
    assert [b.node for b in numa.plan("2", 2, 2, TWO)] == [0, 1]
    assert numa.plan("2", 4, 1, TWO)[3] == Binding(1, (4, 5, 6, 7))


def test_auto_reads_each_gpus_node_and_one_node_needs_no_discovery() -> None:
    assert [b.node for b in numa.plan("auto", 4, 1, Topology(TWO.nodes, (1, 1, 0, 0)))] == [
        1,
        1,
        0,
        0,
    ]
    one = Topology({0: (0, 1)})  # no GPU at all: one node, every rank on it
    assert numa.plan("auto", 3, 1, one) == [Binding(0, (0, 1))] * 3


def test_auto_takes_a_ranks_gpu_by_its_uuid_where_nvml_knew_it() -> None:
    topo = Topology(TWO.nodes, gpus=(0, 0, 1, 1), by_uuid={"GPU-b": 1, "GPU-a": 0})
    # --devices in another order than NVML's: each rank by its own first device's node.
    assert [b.node for b in numa.plan("auto", 2, 1, topo, ["GPU-b", "GPU-a"])] == [1, 0]
    # A device NVML does not know (or none given): by the rank's GPU index.
    assert [b.node for b in numa.plan("auto", 4, 1, topo, ["GPU-x"])] == [0, 0, 1, 1]


def test_nvml_bus_ids_name_their_sysfs_directory() -> None:
    assert numa.pci_path("00000000:41:00.0", "/s") == "/s/0000:41:00.0"
    assert numa.pci_path("0001:C1:00.0\n", "/s") == "/s/0001:c1:00.0"


@pytest.mark.parametrize(
    ("spec", "topo", "says"),
    [
        ("1", Topology({0: (0, 1)}), "local rank 1 would be on NUMA node 1"),
        ("auto", Topology(TWO.nodes, (0,)), "GPU 1 not found"),
        ("auto", Topology(TWO.nodes, (0, -1)), "GPU 1's NUMA node is unknown"),
        ("two", TWO, "'auto'"),
        ("0", TWO, "'auto'"),
        ("2", Topology({}), "no NUMA node"),
    ],
)
def test_impossible_bindings_say_why(spec: str, topo: Topology, says: str) -> None:
    with pytest.raises(NumaError, match=says):
        numa.plan(spec, 2, 1, topo)


def test_a_cold_start_runs_under_numactl_when_installed_else_as_given() -> None:
    env = {**Binding(1, (4, 5, 6, 7)).env(), "X": "1"}
    assert env[numa.CPUS_ENV] == "4-7" and env[numa.NODE_ENV] == "1"
    cmd = ["python", "train.py", "--lr", "1"]
    assert cold_command(cmd, env, "/usr/bin/numactl") == [
        "/usr/bin/numactl",
        "--cpunodebind=1",
        "--membind=1",
        *cmd,
    ]
    assert cold_command(cmd, env, None) == cmd  # bound by its own affinity call instead
    assert cold_command(cmd, {"X": "1"}, "/usr/bin/numactl") == cmd  # no binding asked


def test_bind_self_sets_the_affinity_the_agent_chose_and_never_fails() -> None:
    mine = os.sched_getaffinity(0)
    try:
        cpu = min(mine)
        numa.bind_self({numa.CPUS_ENV: str(cpu)})
        assert os.sched_getaffinity(0) == {cpu}
        numa.bind_self({numa.CPUS_ENV: "100000"})  # no such CPU: said, not raised
        numa.bind_self({})
        assert os.sched_getaffinity(0) == {cpu}
    finally:
        os.sched_setaffinity(0, mine)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_machine_is_read_from_sysfs(tmp_path: Path) -> None:
    nodes, pci = tmp_path / "node", tmp_path / "pci"
    _write(nodes / "node0" / "cpulist", "0-3\n")
    _write(nodes / "node1" / "cpulist", "4-7\n")
    _write(nodes / "node2" / "cpulist", "\n")  # memory only: not a node to bind to
    for bus, vendor, cls, node in (
        ("0000:41:00.0", "0x10de", "0x030200", "1"),
        ("0000:01:00.0", "0x10de", "0x030000", "0"),
        ("0000:02:00.0", "0x8086", "0x020000", "0"),  # a NIC: not a GPU
        ("0000:81:00.0", "0x10de", "0x030200", "-1"),
    ):
        _write(pci / bus / "vendor", vendor + "\n")
        _write(pci / bus / "class", cls + "\n")
        _write(pci / bus / "numa_node", node + "\n")
    topo = numa.read_topology(str(nodes), str(pci), nvml=False)
    assert topo == Topology({0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}, gpus=(0, 1, -1))


def test_agent_run_numa_bind_is_a_usage_error_when_impossible() -> None:
    def lookups(topo: Topology) -> Lookups:
        return Lookups(
            node_name=lambda: "h",
            check_master=lambda _l: None,
            default_preload=lambda _c: [],
            environ={},
            topology=lambda: topo,
            numactl=lambda: "/usr/bin/numactl",
        )

    args = RunArgs(cmd=["python", "t.py"], nproc_per_node="2", numa_bind="1", devices="a,b")
    with pytest.raises(ConfigError, match="local rank 1 would be on NUMA node 1"):
        build_config(args, lookups(Topology({0: (0, 1)})))
    config = build_config(args, lookups(TWO))
    assert config.numa == [Binding(0, (0, 1, 2, 3)), Binding(1, (4, 5, 6, 7))]
    assert config.numactl == "/usr/bin/numactl"
    plain = build_config(RunArgs(cmd=["python", "t.py"], replica="r", devices="a"), lookups(TWO))
    assert plain.numa is None and plain.numactl is None
