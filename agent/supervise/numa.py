"""NUMA binding per local rank (``marduk agent run --numa-bind auto|N``): each rank's trainer runs
on the CPUs, and allocates from the memory, of the NUMA node its accelerator hangs off.

``N`` is NVIDIA's launcher's ``NVRX_GPUS_PER_NUMA``: GPU ``g`` is on node ``g // N``. ``auto``
reads each GPU's node from sysfs (``/sys/bus/pci/devices/BUS/numa_node``): the GPU's bus as NVML
says it, by the rank's device UUID or its index; without NVML, the NVIDIA display controllers in
PCI bus order (NVML's and nvidia-smi's index order). On a machine with one NUMA node every rank
is on node 0. Local rank ``i`` uses GPU ``i`` (torchrun's convention), or with
``--rank-devices split`` the first of its share.

The binding: where ``numactl`` is installed, a trainer started cold runs under ``numactl
--cpunodebind=NODE --membind=NODE``; else, and for trainers started warm (forked from the fork
server, or prestarted: no exec to wrap), the trainer binds itself with ``os.sched_setaffinity``
to the node's CPUs (``/sys/devices/system/node/nodeN/cpulist``) before the trainer's code runs,
and its memory follows them (the kernel's default policy allocates on the local node).
``MARDUK_NUMA_NODE`` and ``MARDUK_NUMA_CPUS`` tell the trainer where it is.
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

NODE_ENV = "MARDUK_NUMA_NODE"
CPUS_ENV = "MARDUK_NUMA_CPUS"
NODES = "/sys/devices/system/node"
PCI = "/sys/bus/pci/devices"
NVIDIA = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA and 3D controllers


class NumaError(ValueError):
    """``--numa-bind`` asked for and impossible here: one line, for the user."""


@dataclass(frozen=True, slots=True)
class Topology:
    """The machine's NUMA nodes (their CPUs) and the node of each GPU (-1: unknown)."""

    nodes: Mapping[int, tuple[int, ...]]
    gpus: tuple[int, ...] = ()
    by_uuid: Mapping[str, int] = field(default_factory=dict)  # NVML's GPU UUID -> node


@dataclass(frozen=True, slots=True)
class Binding:
    node: int
    cpus: tuple[int, ...]

    def env(self) -> dict[str, str]:
        return {NODE_ENV: str(self.node), CPUS_ENV: format_cpulist(self.cpus)}


def parse_cpulist(text: str) -> tuple[int, ...]:
    """``0-3,8-11`` (sysfs's and ``Cpus_allowed_list``'s form) as CPU numbers."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(set(cpus)))


def format_cpulist(cpus: tuple[int, ...] | list[int]) -> str:
    """The inverse of ``parse_cpulist``: runs as ``a-b``."""
    out: list[str] = []
    ordered = sorted(set(cpus))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(out)


def plan(
    spec: str, nproc: int, gpus_per_rank: int, topo: Topology, devices: Sequence[str] = ()
) -> list[Binding]:
    """Each local rank's binding for ``--numa-bind spec`` (pure). ``devices``: the node's
    (``--devices``); with ``auto``, a rank whose first GPU NVML knows by its UUID is on that
    GPU's node, any other by its GPU's index."""
    if not topo.nodes:
        raise NumaError(f"--numa-bind {spec}: this machine shows no NUMA node ({NODES})")
    per = max(gpus_per_rank, 1)
    if spec == "auto":
        nodes = []
        for i in range(nproc):
            uuid = devices[i * per] if i * per < len(devices) else ""
            known = topo.by_uuid.get(uuid, -1) if len(topo.nodes) > 1 else -1
            nodes.append(known if known >= 0 else _auto_node(i * per, topo))
    else:
        if not spec.isdigit() or int(spec) < 1:
            raise NumaError(
                f"--numa-bind {spec!r}: 'auto' (from the GPUs' NUMA affinity) or the number of "
                "GPUs per NUMA node (NVRX_GPUS_PER_NUMA's meaning)"
            )
        nodes = [i * per // int(spec) for i in range(nproc)]
    bindings = []
    for rank, node in enumerate(nodes):
        cpus = topo.nodes.get(node)
        if not cpus:
            have = format_cpulist(list(topo.nodes)) or "none"
            raise NumaError(
                f"--numa-bind {spec}: local rank {rank} would be on NUMA node {node}, but this "
                f"machine has node(s) {have} (with CPUs)"
            )
        bindings.append(Binding(node, cpus))
    return bindings


def _auto_node(gpu: int, topo: Topology) -> int:
    if len(topo.nodes) == 1:
        return next(iter(topo.nodes))  # one node: nothing to discover
    if gpu >= len(topo.gpus):
        raise NumaError(
            f"--numa-bind auto: local rank's GPU {gpu} not found ({len(topo.gpus)} NVIDIA GPU(s) "
            f"in {PCI}); give the GPUs per NUMA node instead (--numa-bind N)"
        )
    node = topo.gpus[gpu]
    if node < 0:
        raise NumaError(
            f"--numa-bind auto: GPU {gpu}'s NUMA node is unknown (numa_node -1 in {PCI}); give "
            "the GPUs per NUMA node instead (--numa-bind N)"
        )
    return node


def numactl_command(cmd: list[str], numactl: str, binding: Binding) -> list[str]:
    """``cmd`` under numactl, bound to the binding's node (CPUs and memory)."""
    node = str(binding.node)
    return [numactl, f"--cpunodebind={node}", f"--membind={node}", *cmd]


def bind_self(environ: Mapping[str, str] = os.environ) -> None:
    """In a trainer: bind this process to the CPUs its agent chose (``MARDUK_NUMA_CPUS``), if
    any. Failing to is said, never fatal (the trainer runs unbound)."""
    cpus = environ.get(CPUS_ENV)
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, parse_cpulist(cpus))
    except (OSError, ValueError) as e:
        print(f"marduk: cannot bind to CPUs {cpus}: {e}", file=sys.stderr, flush=True)


# --- reading the machine ------------------------------------------------------------------------


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def pci_path(bus_id: str, pci_dir: str = PCI) -> str:
    """NVML's bus id (``00000000:41:00.0``) as its sysfs directory (``0000:41:00.0``)."""
    domain, _, rest = bus_id.strip().lower().partition(":")
    return os.path.join(pci_dir, f"{domain[-4:]:0>4}:{rest}")


def _nvml_gpus(pci_dir: str) -> list[tuple[str, int]] | None:
    """(UUID, NUMA node) of each GPU in NVML's index order; None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # ImportError, no driver: sysfs alone
        return None
    out = []
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid, bus = pynvml.nvmlDeviceGetUUID(handle), pynvml.nvmlDeviceGetPciInfo(handle).busId
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            bus = bus.decode() if isinstance(bus, bytes) else str(bus)
            node = _read(os.path.join(pci_path(bus, pci_dir), "numa_node"))
            out.append((uuid, int(node) if node.lstrip("-").isdigit() else -1))
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return out


def read_topology(nodes_dir: str = NODES, pci_dir: str = PCI, nvml: bool = True) -> Topology:
    """The NUMA nodes with CPUs, and the NVIDIA GPUs' nodes: in NVML's order, by UUID too,
    where NVML answers; else the NVIDIA display controllers in PCI bus order (NVML's order)."""
    nodes: dict[int, tuple[int, ...]] = {}
    for path in glob.glob(os.path.join(nodes_dir, "node[0-9]*")):
        cpus = parse_cpulist(_read(os.path.join(path, "cpulist")))
        if cpus:
            nodes[int(os.path.basename(path)[4:])] = cpus
    gpus = []
    for dev in sorted(glob.glob(os.path.join(pci_dir, "*"))):
        cls = _read(os.path.join(dev, "class"))
        if _read(os.path.join(dev, "vendor")) == NVIDIA and cls.startswith(GPU_CLASSES):
            node = _read(os.path.join(dev, "numa_node"))
            gpus.append(int(node) if node.lstrip("-").isdigit() else -1)
    found = _nvml_gpus(pci_dir) if nvml else None
    if found:
        return Topology(dict(sorted(nodes.items())), tuple(n for _, n in found), dict(found))
    return Topology(dict(sorted(nodes.items())), tuple(gpus))
