"""``marduk agent run`` with no option builds the default settings: its options take their
defaults from ``SupervisorConfig`` (agent/supervise/supervisor_config.py), ``LaunchSpec`` and the library
(agent/library/options.py), so what can still drift is the CLI's own wiring (an option that maps a
sentinel, renames a value, or forgets to pass one on). The command runs as users run it, up to
the point where it would start the supervisor."""

from __future__ import annotations

import dataclasses

import pytest
from typer.testing import CliRunner

import agent.supervise.supervisor
from agent.library import options
from agent.supervise.launch import LaunchSpec, Std
from agent.supervise.supervisor_config import CONNECT_TIMEOUT_S, SupervisorConfig, default_preload
from marduk.cli import app

pytestmark = pytest.mark.framework_preload  # the defaults checked here include --preload's


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[SupervisorConfig]:
    """The configs ``marduk agent run`` hands the supervisor (which does not run)."""
    for name in [
        "MARDUK_JOB",
        "MARDUK_SCOPE",
        "MARDUK_PREFIX",
        "MARDUK_WORKER",
        "MARDUK_REPLICA_ID",
        "MARDUK_EPOCH",
        "MARDUK_RESTART_COUNT",
        "MARDUK_DEVICES",
        "MARDUK_AGENT_SOCKET",
        "MARDUK_CONTROLLER_KEY",
    ]:
        monkeypatch.delenv(name, raising=False)
    configs: list[SupervisorConfig] = []

    class Captured:
        def __init__(self, config: SupervisorConfig) -> None:
            configs.append(config)

        async def run(self) -> int:
            return 0

    monkeypatch.setattr(agent.supervise.supervisor, "Supervisor", Captured)
    return configs


def invoke(*args: str) -> None:
    result = CliRunner().invoke(app, ["agent", "run", "--replica", "r0", "--devices", "d0", *args])
    assert result.exit_code == 0, result.output


def test_no_option_gives_the_default_supervisor_config(built: list[SupervisorConfig]) -> None:
    invoke("--", "true")
    (config,) = built
    expected = SupervisorConfig(cmd=["true"], opts=config.opts, preload=default_preload())
    for field in dataclasses.fields(SupervisorConfig):
        if field.name == "logs":
            continue  # compared by what it does, below ({0: Std.NONE} is "no redirect" too)
        got, want = getattr(config, field.name), getattr(expected, field.name)
        assert got == want, f"{field.name}: the CLI gives {got!r}, the default is {want!r}"
    logs, default = config.logs, expected.logs
    for stream in (Std.OUT, Std.ERR):
        assert logs.to_console(0, stream) == default.to_console(0, stream)
        assert logs.to_file(0, stream) == default.to_file(0, stream)
    assert (logs.log_dir, logs.prefix_template) == (default.log_dir, default.prefix_template)
    o = config.opts
    assert (o.job, o.scope, o.prefix, o.worker) == (
        options.DEFAULT_JOB,
        options.DEFAULT_SCOPE,
        "marduk",
        0,
    )
    assert o.timeout == CONNECT_TIMEOUT_S


def test_torchrun_options_default_as_the_launch_contract(built: list[SupervisorConfig]) -> None:
    invoke("--nproc-per-node", "2", "--", "true")
    (config,) = built
    assert config.launch == LaunchSpec(nproc_per_node=2, max_restarts=config.max_restarts)
    assert config.logs.prefix_template is not None  # [rankN]: prefixes with several ranks


def test_the_preload_default_follows_the_framework_the_script_imports() -> None:
    pytest.importorskip("torch", reason="torch (CPU) is not installed: pip install torch")
    pytest.importorskip("jax", reason="jax is not installed")
    assert default_preload("import os\nimport torch.distributed as dist\n") == ["torch"]
    assert default_preload("from torch import nn\nimport jax\n") == ["jax"]  # both: jax
    assert default_preload("import numpy\n") == ["jax"]  # as before
    assert default_preload("# import torch in a comment? no: not at a line's start\n") == ["jax"]


def test_a_torchrun_drop_in_preloads_torch(built: list[SupervisorConfig]) -> None:
    pytest.importorskip("torch", reason="torch (CPU) is not installed: pip install torch")
    invoke("--nproc-per-node", "2", "tests/trainers/gloo.py")
    assert built[0].preload == ["torch"]
