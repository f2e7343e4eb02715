"""The environment ``marduk agent run`` hands each trainer it starts: its own, torchrun's
thread setting, unbuffered output, the ``MARDUK_*`` hand-off (agent/channel/handoff.py) and,
per local rank, its socket and torchrun's variables (agent/supervise/launch.py). Pure."""

from __future__ import annotations

from collections.abc import Mapping

from agent.channel import handoff
from agent.channel.handoff import Handoff
from agent.library.client import Options
from agent.supervise.launch import LaunchSpec


def trainer_env(
    opts: Options,
    *,
    epoch: int,
    incarnation: int,
    launch: LaunchSpec | None,
    environ: Mapping[str, str],
    supervisor_pid: int,
    local_ckpt: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """What every rank's trainer gets (and the fork server imports with); ``local_ckpt``: the
    store's variables (agent/supervise/local_ckpt.py), which replace any of the agent's own."""
    given = Handoff(
        job=opts.job,
        replica=opts.replica,
        worker=opts.worker,
        epoch=epoch,
        restart_count=max(incarnation, 0),
        devices=tuple(opts.devices),
        scope=opts.scope,
        addr=opts.addr,
        supervisor_pid=supervisor_pid,
    )
    threads = launch.thread_env(environ) if launch is not None else {}
    own = {k: v for k, v in environ.items() if k not in LOCAL_CKPT_VARS}
    return {**own, **threads, "PYTHONUNBUFFERED": "1", **given.to_env(), **(local_ckpt or {})}


LOCAL_CKPT_VARS = frozenset(
    {
        handoff.LOCAL_CKPT_DIR,
        handoff.LOCAL_CKPT_MAX_BYTES,
        handoff.LOCAL_CKPT_FLUSH_MS,
        handoff.PERSIST_CKPT_DIR,
        handoff.CKPT_LINEAGE,
    }
)


def rank_env(
    base: Mapping[str, str],
    *,
    rank: int,
    socket_path: str,
    placed: LaunchSpec | None,
    devices: list[str],
    incarnation: int,
    master_port: int,
) -> dict[str, str]:
    """One local rank's: ``base`` (``trainer_env``), its socket, its torchrun variables."""
    env = {**base, handoff.AGENT_SOCKET: socket_path}
    if placed is not None:
        env.update(placed.env(rank, devices, incarnation, master_port))
    return env
