"""Each default of ``marduk agent run`` is the settings object's: the CLI must not drift from
``SupervisorConfig`` (agent/supervisor.py) or the library's ``agent/options.py``."""

from __future__ import annotations

import dataclasses
import inspect

from agent import options
from agent.cli import run
from agent.supervisor import SupervisorConfig

CLI = {name: p.default for name, p in inspect.signature(run).parameters.items()}


def test_every_supervisor_option_defaults_to_its_setting() -> None:
    fields = {f.name: f for f in dataclasses.fields(SupervisorConfig)}
    checked = []
    for name, default in CLI.items():
        for field_name in (name, f"{name}_s", f"{name}_mib"):
            field = fields.get(field_name)
            if field is not None and field.default is not dataclasses.MISSING:
                assert default == field.default, f"--{name}: {default!r} != {field.default!r}"
                checked.append(name)
    assert {"max_restarts", "grace", "hang_timeout", "step_regex", "preflight"} <= set(checked)


def test_the_library_options_default_as_the_library_does() -> None:
    assert CLI["job"] == options.DEFAULT_JOB
    assert CLI["scope"] == options.DEFAULT_SCOPE
    assert CLI["prefix"] == options.DEFAULT_PREFIX
