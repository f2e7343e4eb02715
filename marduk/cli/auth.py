"""``marduk auth``: issue, rotate and revoke the NATS identities of a deployment."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from marduk.shell import options

app = typer.Typer(
    help="Identities and permissions on NATS: one nkey per role, a server config that enforces "
    "them, and the controller's public key agents verify commands with.",
    no_args_is_help=True,
)

Dir = Annotated[Path, typer.Argument(help="The auth directory (private: 0700, seeds 0600).")]


_APPLY = (
    "a `marduk controller --auth` running its embedded server applies it within a second; "
    "reload other servers: nats-server --signal reload"
)


def _fail(e: Exception) -> None:
    typer.echo(f"error: {e}", err=True)
    raise typer.Exit(1) from None


@app.command()
def init(
    directory: Dir,
    prefix: options.Prefix = options.DEFAULTS["prefix"],
    force: Annotated[
        bool, typer.Option("--force", help="Replace existing identities (every key changes).")
    ] = False,
) -> None:
    """Create controller, agent, monitor and admin identities and nats-server.conf."""
    from marduk.transport import auth

    try:
        created = auth.init(directory, prefix, force=force)
    except (auth.AuthError, OSError) as e:
        _fail(e)
        return
    for i in created:
        typer.echo(f"{i.role:10} {directory / (i.name + '.nk')}  {i.public_key}")
    typer.echo(
        f"server config: {directory / auth.CONFIG_FILE} "
        f"(marduk controller --auth {directory}, or include it in your nats-server config)"
    )


@app.command("add-agent")
def add_agent(
    directory: Dir,
    job: Annotated[str, typer.Option("--job", help="The only job this credential may serve.")],
) -> None:
    """An agent credential valid for one job's subjects only (agent-JOB.nk)."""
    from marduk.transport import auth

    try:
        i = auth.add_agent(directory, job)
    except (auth.AuthError, ValueError, OSError) as e:
        _fail(e)
        return
    typer.echo(f"agent for job {job}: {directory / (i.name + '.nk')}  {i.public_key}")
    typer.echo(_APPLY)


@app.command()
def rotate(
    directory: Dir,
    name: Annotated[str, typer.Argument(help="Identity, e.g. agent or admin.")],
    finish: Annotated[
        bool,
        typer.Option("--finish", help="End the rotation: the previous key is refused from now on."),
    ] = False,
) -> None:
    """Give an identity a new key; the old one stays valid until `rotate --finish`.

    Holders keep the seed they connected with: restart each with the new seed file, then
    finish. A controller rotation also lists both keys in controller.pub meanwhile."""
    from marduk.transport import auth

    try:
        i = auth.finish_rotation(directory, name) if finish else auth.rotate(directory, name)
    except (auth.AuthError, OSError) as e:
        _fail(e)
        return
    if finish:
        typer.echo(f"{name}: previous key {i.previous} refused from now on")
        typer.echo(_APPLY)
        return
    typer.echo(f"{name}: new key {i.public_key} in {directory / (name + '.nk')}")
    typer.echo(
        f"the previous key {i.previous} stays valid until `marduk auth rotate {directory} "
        f"{name} --finish`: restart every holder of {name}.nk first"
    )
    typer.echo(_APPLY)
    if i.role == "controller":
        typer.echo(
            "controller.pub lists both keys meanwhile: restart agents with it before the "
            "controller, and finish after"
        )


@app.command()
def revoke(
    directory: Dir, name: Annotated[str, typer.Argument(help="Identity to remove.")]
) -> None:
    """Remove an identity: its key is refused once the server reloads."""
    from marduk.transport import auth

    try:
        i = auth.revoke(directory, name)
    except (auth.AuthError, OSError) as e:
        _fail(e)
        return
    typer.echo(f"revoked {name} ({i.public_key})")
    typer.echo(_APPLY)


@app.command("update-config")
def update_config(directory: Dir) -> None:
    """Write nats-server.conf again from DIR's identities (same keys), e.g. after an upgrade."""
    from marduk.transport import auth

    try:
        auth.update_config(directory)
    except (auth.AuthError, OSError) as e:
        _fail(e)
        return
    typer.echo(f"wrote {directory / auth.CONFIG_FILE}")
    typer.echo(_APPLY)


@app.command("list")
def list_(directory: Dir) -> None:
    """Show the identities in DIR: name, role, job and public key (never a seed)."""
    from marduk.transport import auth

    try:
        prefix, found = auth.identities(directory)
    except (auth.AuthError, OSError) as e:
        _fail(e)
        return
    typer.echo(f"prefix {prefix}")
    for i in found:
        typer.echo(f"{i.name:20} {i.role:10} {i.job or '*':12} {i.public_key}")
        if i.previous:
            typer.echo(f"{'':44} {i.previous} (previous: valid until rotate --finish)")
