"""``marduk monitor``: the command group. Each command lives with its kind: health events
(``health_cli``), the operators' changes (``admin_cli``), views of the map and its events
(``view_cli``), the host daemon (``run_cli``) and the Alertmanager receiver
(``alertmanager_cli``); what they share is in ``console``.
"""

from __future__ import annotations

import logging

import typer

from monitor_cli import admin_cli, health_cli, params_cli, run_cli, view_cli
from monitor_cli.alertmanager_cli import app as alertmanager_app

app = typer.Typer(
    help="Publish device health events, inspect the device<->replica map, watch the controller.",
    no_args_is_help=True,
)
# Warnings the bus logs (e.g. a permission violation) reach the user as the command's error
# line; without this, Python's last-resort handler would print them a second time.
logging.getLogger("marduk").addHandler(logging.NullHandler())

# In the order ``--help`` lists them.
for name, command in (
    ("inject-failure", health_cli.inject_failure),
    ("mark-healthy", health_cli.mark_healthy),
    ("forget", admin_cli.forget),
    ("drain", admin_cli.drain),
    ("undrain", admin_cli.undrain),
    ("set", params_cli.set_),
    ("params", params_cli.params),
    ("status", view_cli.status),
    ("top", view_cli.top),
    ("watch", view_cli.watch),
):
    app.command(name)(command)
app.command("run", help=run_cli.HELP)(run_cli.run)
app.add_typer(alertmanager_app)
