"""Stable identifiers for this process's accelerators.

Order of precedence:

1. ``MARDUK_DEVICES`` (comma-separated), when set: used as given.
2. NVIDIA GPUs: the NVML UUID (``GPU-8e1a...``; ``MIG-...`` for MIG instances), the id that
   ``nvidia-smi -L``, DCGM and Kubernetes' device plugin use, so a health monitor on the node can
   publish events keyed by the same string. jax's ``local_hardware_id`` is the CUDA ordinal;
   it is mapped through ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs) to an NVML handle. Needs the
   ``nvidia-ml-py`` package and a driver; without them, the fallback below is used.
3. Everything else (TPU, CPU, GPUs without NVML): ``<host>:<platform>:<local_hardware_id>``,
   e.g. ``worker-3:tpu:0``. Stable across restarts of the process on the same host.

NVLink domains (``nvlink_domain``): the GPUs of one NVLink domain (an NVL72 rack) share NVML's
fabric ClusterUUID; ``MARDUK_NVLINK_DOMAIN`` overrides it (any string: synthetic domains in
tests, or a site's own names where NVML has no fabric). ``--segment`` jobs use it.

``marduk agent run`` finds its node's devices without a framework (``node_device_uuids``): the
same ``MARDUK_DEVICES``, then every GPU NVML shows (through ``CUDA_VISIBLE_DEVICES``), and only
then, on a node where jax can only find CPUs (no accelerator device node, or ``JAX_PLATFORMS=cpu``),
the CPUs jax would list, without asking it; else jax's view, asked in a child process so the
agent itself never initialises a backend (no device memory taken, no framework threads in a
process that forks trainers).

Note: CUDA orders devices fastest-first by default, NVML by PCI bus id. On nodes of identical
GPUs (every training node we know of) the two agree; on mixed nodes set
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or pass ``devices=`` / ``MARDUK_DEVICES`` explicitly.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agent.channel.handoff import DEVICES, parse_devices

NVLINK_DOMAIN = "MARDUK_NVLINK_DOMAIN"

log = logging.getLogger("agent.devices")


def devices_from_env() -> list[str] | None:
    given = parse_devices(os.environ.get(DEVICES))
    return None if given is None else list(given)


def local_device_uuids(backend: str | None = None) -> list[str]:
    """UUIDs of the accelerators this process uses (see the module docstring for the format)."""
    env = devices_from_env()
    if env is not None:
        return env
    import jax  # deferred: importing jax costs about a second

    devices = jax.local_devices(backend=backend)
    return device_ids(devices, host=socket.gethostname(), nvml_uuid=nvml_uuid_for_ordinal)


def node_device_uuids(*, timeout: float = 120.0) -> list[str]:
    """The accelerators of this node, for the supervisor: found without importing a framework
    into the calling process. ``MARDUK_DEVICES``; else the GPUs NVML shows (those
    ``CUDA_VISIBLE_DEVICES`` names, when set); else ``local_device_uuids()`` in a child process
    (TPU, CPU; the ids the library would register); else ``<host>:cpu:0`` with a warning."""
    env = devices_from_env()
    if env is not None:
        return env
    gpus = nvml_visible_uuids()
    if gpus:
        return gpus
    cpus = cpu_only_devices(os.environ, _accelerator_nodes())
    if cpus is not None:
        host = socket.gethostname()
        return [f"{host}:cpu:{i}" for i in range(cpus)]
    found = _discover_in_child(timeout)
    if found:
        return found
    host = socket.gethostname()
    log.warning(
        "no accelerator found (no GPU through NVML; jax could not list devices): registering "
        "%s:cpu:0 — pass --devices (or MARDUK_DEVICES) with the ids your monitors publish",
        host,
    )
    return [f"{host}:cpu:0"]


def nvml_visible_uuids() -> list[str]:
    """NVML UUIDs of the GPUs this process may use (``CUDA_VISIBLE_DEVICES`` when set, indices or
    UUIDs; every GPU otherwise); empty without NVML or GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        return [u for i in range(len(entries)) if (u := nvml_uuid_for_ordinal(i)) is not None]
    pynvml = _nvml()
    if pynvml is None:
        return []
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    except Exception as e:
        log.debug("NVML device count failed: %s", e)
        return []
    return [u for i in range(count) if (u := nvml_uuid_for_ordinal(i)) is not None]


# Device nodes through which jax could find an accelerator on Linux: NVIDIA (nvidia*), TPU
# v2-v4 and Gaudi (accel*), TPU v5e and later (vfio), AMD ROCm (kfd).
_ACCELERATOR_NODES = ("nvidia", "accel", "vfio", "kfd")


def _accelerator_nodes(dev: str = "/dev") -> list[str]:
    try:
        names = os.listdir(dev)
    except OSError:
        return ["?"]  # cannot tell: ask jax
    return sorted(n for n in names if n.startswith(_ACCELERATOR_NODES))


def cpu_only_devices(env: Mapping[str, str], accelerator_nodes: Sequence[str]) -> int | None:
    """How many CPU devices jax would list on a node it can only find CPUs on (``JAX_PLATFORMS``
    says ``cpu``, or Linux shows no accelerator device node); None when it may see an
    accelerator (then a child asks jax). Spares a CPU node's agent the 1.4 s of CPU of importing
    jax in a child to learn that it has a CPU. The count is jax's: 1, or what
    ``JAX_NUM_CPU_DEVICES`` or ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` asks."""
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms and platforms != ["cpu"]:
        return None
    if not platforms and (sys.platform != "linux" or accelerator_nodes):
        return None
    count = 1
    for flag in env.get("XLA_FLAGS", "").split():
        name, _, value = flag.partition("=")
        if name == "--xla_force_host_platform_device_count" and value.isdigit():
            count = int(value)
    given = env.get("JAX_NUM_CPU_DEVICES", "").strip()
    if given.isdigit() and int(given) > 0:
        count = int(given)  # jax's own setting wins over the XLA flag
    return max(count, 1)


_CHILD = "import json, agent.library.devices as d; print(json.dumps(d.local_device_uuids()))"


def _discover_in_child(timeout: float) -> list[str]:
    """``local_device_uuids()`` in a fresh interpreter; empty if it fails (no jax, no backend)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD],
            capture_output=True,
            timeout=timeout,
            text=True,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("device discovery through jax failed: %s", e)
        return []
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        log.info("device discovery through jax failed: %s", last)
        return []
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return []
    return [str(d) for d in found] if isinstance(found, list) else []


def device_ids(
    devices: Sequence[Any],
    *,
    host: str,
    nvml_uuid: Callable[[int], str | None],
) -> list[str]:
    """Ids for jax devices; ``nvml_uuid(ordinal)`` gives a GPU's NVML UUID or None."""
    out = []
    for d in devices:
        platform = str(getattr(d, "platform", "unknown")).lower()
        hw = getattr(d, "local_hardware_id", None)
        local = hw if isinstance(hw, int) and hw >= 0 else d.id
        uuid = nvml_uuid(local) if platform in ("gpu", "cuda") else None
        out.append(uuid or f"{host}:{platform}:{local}")
    return out


def nvlink_domain(devices: Sequence[str]) -> str:
    """The NVLink domain of this node's GPUs ``devices``: ``MARDUK_NVLINK_DOMAIN`` if set, else
    their NVML ClusterUUID when every one that has one shares it; "" when none has one (no
    NVML, no fabric), or they disagree (logged: no segment can hold this node)."""
    given = os.environ.get(NVLINK_DOMAIN)
    if given is not None:
        return given.strip()[:256]
    pynvml = _nvml()
    if pynvml is None:
        return ""
    found = {d for u in devices if u.startswith("GPU-") and (d := cluster_uuid(pynvml, u))}
    if len(found) > 1:
        log.warning(
            "this node's GPUs are in %d NVLink domains (%s): registering none",
            len(found),
            ", ".join(sorted(found)),
        )
        return ""
    return found.pop() if found else ""


def cluster_uuid(pynvml: Any, uuid: str) -> str:
    """NVML's fabric ClusterUUID of the GPU ``uuid`` as a UUID string; "" when it has none (no
    fabric, the fabric not yet registered, an all-zero id, an older driver or NVML)."""
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid.encode())
        info = pynvml.c_nvmlGpuFabricInfo_t()
        # pynvml passes the struct on to C as given: a pointer to it, as NVML fills it in.
        pynvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
    except Exception as e:  # NVMLError (not supported), AttributeError (an older pynvml)
        log.debug("NVML fabric info for %s: %s", uuid, e)
        return ""
    return fabric_domain(bytes(info.clusterUuid), info.state, info.status)


FABRIC_COMPLETED = 3  # NVML_GPU_FABRIC_STATE_COMPLETED
NVML_SUCCESS = 0


def fabric_domain(cluster: bytes, state: int, status: int) -> str:
    """A ClusterUUID's 16 bytes as ``8-4-4-4-12`` hex, or "" unless the GPU's fabric
    registration completed with success and the id is not all zeros."""
    if state != FABRIC_COMPLETED or status != NVML_SUCCESS or not any(cluster):
        return ""
    h = cluster.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


_nvml_state: dict[str, Any] = {}


def nvml_uuid_for_ordinal(ordinal: int) -> str | None:
    """NVML UUID of the GPU with this CUDA ordinal, or None when NVML is unavailable."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    entry: str | None = None
    if visible is not None and visible.strip():
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if ordinal >= len(entries):
            return None
        entry = entries[ordinal]
        if entry.startswith(("GPU-", "MIG-")):
            return entry
    pynvml = _nvml()
    if pynvml is None:
        return None
    try:
        index = int(entry) if entry is not None else ordinal
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
    except Exception as e:  # NVMLError, ValueError (a non-numeric entry)
        log.debug("NVML lookup for CUDA ordinal %d failed: %s", ordinal, e)
        return None
    return uuid.decode() if isinstance(uuid, bytes) else str(uuid)


def _nvml() -> Any:
    if "module" in _nvml_state:
        return _nvml_state["module"]
    module = None
    try:
        import pynvml

        pynvml.nvmlInit()
        module = pynvml
    except Exception as e:  # ImportError, NVMLError_LibraryNotFound, driver not loaded
        log.debug("NVML unavailable: %s", e)
    _nvml_state["module"] = module
    return module
