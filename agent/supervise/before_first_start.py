"""Before the first incarnation of ``marduk agent run``: the warnings about its setup, its
registration with the controller (before the trainers start, or in the background when
standalone or when none answers), and the end of a node that failed its checks where nobody can
take its place (agent/supervise/start_checks.py)."""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable

from agent.library.client import AsyncClient
from agent.supervise.controller_link import ControllerLink
from agent.supervise.proctree import become_subreaper
from agent.supervise.signals import Signals
from agent.supervise.start_checks import FAILURE_CLASS
from agent.supervise.supervision import ExitCode, Supervision
from agent.supervise.supervisor_config import SupervisorConfig
from marduk.errors import MardukError
from marduk.transport.credentials import redact
from marduk.wire import protocol as wire

log = logging.getLogger("agent.supervisor")

Report = Callable[..., Awaitable[wire.ReportReply | None]]


def warn_about_setup(config: SupervisorConfig, nproc: int) -> None:
    logs = config.logs
    if logs.log_dir and not logs.wants_files:
        log.warning(
            "--log-dir %s: nothing is written there without --tee or --redirects "
            "(e.g. --tee 3 for both streams of every rank)",
            logs.log_dir,
        )
    if config.launch is not None and config.launch.thread_env(os.environ):
        log.warning(
            "OMP_NUM_THREADS set to 1 for each of the %d local ranks (as torchrun does); "
            "set it yourself to tune it",
            nproc,
        )
    # Orphans of our trainers (setsid'd helpers) become ours, not init's: ended with them.
    if not become_subreaper():
        log.warning(
            "cannot become a child subreaper: processes that leave a trainer's "
            "session may outlive it"
        )


async def join_controller(
    config: SupervisorConfig,
    link: ControllerLink,
    core: Supervision,
    signals: Signals,
    report: Report,
    on_joined: Callable[[AsyncClient], Awaitable[None]],
) -> int | None:
    """Register before the trainers start (or, standalone, in the background); an exit code
    when the agent must not start them."""
    opts = config.opts
    if config.standalone:
        log.info(
            "standalone: restarts are local; joining the controller at %s when it answers",
            redact(opts.addr),
        )
        link.join_in_background(on_joined)
        return None
    # Nothing starts until the controller answers: say so at once, not after the wait.
    log.info(
        "registering with the controller at %s: the trainers start once it answers "
        "(up to %g s; --standalone starts them now and joins it later)",
        redact(opts.addr),
        opts.timeout,
    )
    then = "exiting (--require-controller)" if config.require_controller else "running standalone"

    def unreachable(why: str) -> None:
        log.warning(
            "cannot reach NATS at %s (%s); retrying for up to %g s, then %s",
            redact(opts.addr),
            why,
            opts.timeout,
            then,
        )

    try:
        client = await signals.or_signal(link.connect(unreachable))
    except MardukError as e:
        if config.require_controller:
            log.error("cannot register with the controller: %s", e)
            return ExitCode.SETUP
        log.warning(
            "cannot register with the controller (%s): running standalone (local "
            "restarts only) and joining it when it answers",
            e,
        )
        link.join_in_background(on_joined)
        return None
    if client is None:
        log.warning("%s before the trainers started: exiting", signals.name)
        await link.close(deregister=False)
        return ExitCode.PREEMPTED
    gave_up = core.joined(client.epoch, list(client.unusable_devices))
    if gave_up is not None:
        # Quarantined or drained by the controller: running here cannot help; the pod goes
        # back to the scheduler (a node the device is not on).
        log.error("%s; not starting the trainer", gave_up.why)
        await report("gave_up", summary="devices out of service")
        await link.close(deregister=True, reason="devices out of service")
        return gave_up.code
    return None


async def give_up_unhealthy(link: ControllerLink, report: Report, reason: str) -> int:
    """This node failed its checks before the first start, and its ranks are its own (static,
    or one node): reported (``gave_up``, class ``node_check``), then exit 71 so the pod goes
    back to the scheduler, onto another node."""
    log.error("not starting the trainers on this node: %s", reason)
    await report(
        "gave_up",
        failure_class=FAILURE_CLASS,
        action="check_node",
        summary="node checks failed before the first start",
        lines=[reason],
    )
    # Still registered (as after a failed device check): status shows why, until it expires.
    await link.close(deregister=False)
    return ExitCode.DEVICE_FAILED
