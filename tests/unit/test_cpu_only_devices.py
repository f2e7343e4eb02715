"""Which nodes an agent lists the CPUs of without asking jax (agent/library/devices.py)."""

from __future__ import annotations

import sys

import pytest

from agent.library.devices import cpu_only_devices

linux = pytest.mark.skipif(sys.platform != "linux", reason="device nodes are Linux's")


@linux
def test_a_node_without_accelerator_nodes_has_jaxs_cpu_count() -> None:
    assert cpu_only_devices({}, []) == 1
    assert cpu_only_devices({"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}, []) == 4
    flags = "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=2"
    assert cpu_only_devices({"XLA_FLAGS": flags}, []) == 2
    # jax's own setting wins over the XLA flag, as in jax
    assert cpu_only_devices({"XLA_FLAGS": flags, "JAX_NUM_CPU_DEVICES": "3"}, []) == 3
    assert cpu_only_devices({"XLA_FLAGS": "--xla_force_host_platform_device_count=x"}, []) == 1


@pytest.mark.parametrize("node", ["nvidia0", "nvidiactl", "accel0", "vfio", "kfd"])
def test_a_node_that_may_hold_an_accelerator_asks_jax(node: str) -> None:
    assert cpu_only_devices({}, [node]) is None


def test_jax_platforms_decides_when_set() -> None:
    assert cpu_only_devices({"JAX_PLATFORMS": "cpu"}, ["nvidia0"]) == 1
    assert cpu_only_devices({"JAX_PLATFORMS": " cpu "}, ["accel0"]) == 1
    assert cpu_only_devices({"JAX_PLATFORMS": "tpu"}, []) is None
    assert cpu_only_devices({"JAX_PLATFORMS": "cuda,cpu"}, []) is None
