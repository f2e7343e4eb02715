"""torchft integration: a replica group registers with Marduk, and a command for it makes its
Manager abandon the step in flight and the process exit, so that ``marduk agent run`` starts it
again warm; the new incarnation rejoins the quorum and heals from a peer (torchft's own healing).

    from torchft import Manager, ProcessGroupGloo
    from agent import torchft as marduk_ft

    manager = Manager(pg=pg, ..., replica_id=marduk_ft.replica_id())
    guard = marduk_ft.attach(manager, pg)   # registers, or talks to `marduk agent run`
    while manager.current_step() < steps:
        ...                                   # zero_grad, forward, backward, optimizer.step()
        guard.step()                          # progress; exits here after a restart/fail

The replica id is Marduk's (``MARDUK_REPLICA_ID``, which ``marduk agent run --replica`` sets);
torchft appends a fresh uuid to it per incarnation. Devices are found as ``agent.connect`` finds
them (``MARDUK_DEVICES``, NVML, jax). A ``restart`` or ``fail`` command, delivered on the agent
library's thread, calls ``manager.report_error`` (the step in flight does not commit), aborts
the process group (the peers' collectives pending with this group fail, at the latest when it
exits, rather than at their timeout) and asks the loop to exit at its next ``guard.step()``; a
loop that does not get there within ``exit_after`` seconds (stuck in a collective or a quorum)
is ended from the agent's thread. The exit is ``os._exit``: nothing deregisters (the next
incarnation re-registers), and there is nothing to save (the group heals from a peer). Exit
codes: ``RESTART_EXIT`` (75) for ``restart``, 71 for ``fail`` (as ``marduk agent run``: the
device is bad, replace the pod).

The group also asks for ``peer_failed`` notices: when the controller restarts or fails another
group of the job, this one is told at once. If that group was in this group's last quorum, the
Guard reports the error to the Manager (the step in flight does not commit) and aborts the
process group, and does not exit (with torchft's ProcessGroupGloo the abort ends the peers'
collectives pending with this group, not this group's own: that one ends when its peer aborts
or dies, or at torchft's timeout; bench/torchft_abort_probe.py). The peers' end only once this
trainer holds no Work of the step: torchft 0.2.0's abort closes gloo's connections when the
process group's last reference goes, and a Work, done or failed, holds one; wait on a step's
Works in a function that drops them, as examples/torchft_ddp.py's ``average_gradients``. The
next step's quorum forms without the failed group (torchft reconfigures the process group when
the membership changes, which it does: the failed group's trainer is ended by its agent). A
notice about a group not in the last quorum (already gone), or one that comes while the next
quorum is forming (no collective of the step has started), abandons nothing. Which groups were
in the quorum is read from the Manager's quorum answers (``Manager._client``, wrapped at
``attach``); where that is not possible the Guard only reports the error, and aborts nothing.

The lighthouse can issue a quorum with a group just before that group dies. So the Guard
remembers the incarnation each notice names (torchft's full ``name:uuid``, as last seen in a
quorum answer: a restarted group's new uuid is never named), and the next answer that still
includes it is refused: the error is reported and the Manager's process group (``Manager._pg``,
wrapped at ``attach``) refuses to be configured for that quorum, which torchft handles as a
failed configure (no heal, the step does not commit, the failed commit bumps the next quorum's
id), instead of waiting the process group's timeout for the dead group's store key. A notice
that comes after the answer, before torchft configures, refuses it the same way; one that comes
once the configure waits is too late (nothing reaches that wait), and the step only does not
commit. Each rank of a group decides alone, and safely: a refusal asks nothing again and raises
nothing to the loop, each rank configures its own process group, and torchft's
``should_commit`` (all ranks of the group) commits the step only if none refused. The mark is
forgotten at the next answer, so a notice that comes late costs at most one quorum.

Hangs: ``guard.step()`` is the progress ``marduk agent run --hang-timeout`` watches, so a trainer
that stops stepping without dying (a frozen process, a deadlock) is ended and started again
after that many seconds, and the other groups get a ``peer_failed`` notice as for a crash. A
group waiting for the lighthouse's quorum is waiting for the others, not hung: while the
Manager's quorum call is in flight (after this incarnation's first step) the Guard sends a
heartbeat every ``beat_every`` s, so that the healthy groups, which wait there for the
lighthouse to give up on a hung or dead group (its ``--heartbeat_timeout_ms`` or
``--join_timeout_ms``), are not taken for hung themselves. A collective pending with a hung
group is not covered (torchft bounds it: the Manager's ``timeout``): set ``--hang-timeout``
above that timeout, or a hang in the middle of a collective may restart the healthy groups too.

The lighthouse: ``lighthouse_command()`` (``LIGHTHOUSE_FLAGS``) is how to run torchft's own
under Marduk. torchft 0.2.0's lighthouse has no call to drop a replica: a failed group's dead
incarnation (each has a fresh uuid) holds the healthy groups' next quorum until its heartbeat
times out (``--heartbeat_timeout_ms``) or the join timeout (``--join_timeout_ms``, counted from
the first group to ask) passes, checked every ``--quorum_tick_ms``; Marduk's notice can shorten
neither. The defaults (5000, 60000, 100) cost the healthy groups about 5 s per failure;
``--heartbeat_timeout_ms 1000`` about 1 s (500: 0.5 s, no false failure in a 5-minute quiet run
on a loaded 2-core machine either). A join timeout of 100 ms (tick 20) brings the stall to one
step + 0.1 s, but it is not in ``LIGHTHOUSE_FLAGS``: it must exceed how late a group that just
healed or reconfigured asks for the next quorum (a heal copies the whole state from a peer), or
the quorums rotate, a different pair each step with the third healing (seen here for ~5 s in 2
of 15 returns at 100 ms; docs/benchmarks.md, "torchft").

``front_command()`` instead runs ``marduk torchft-lighthouse`` (agent/torchft_front): torchft's
lighthouse behind a gRPC front that the Managers use as their lighthouse. It passes their quorum
calls through untouched and keeps heartbeating each live group toward the real lighthouse, which
runs on loopback with a 100 ms heartbeat timeout; at the controller's ``restart`` or ``fail`` for
a group it stops at once, so the dead incarnation leaves the healthy set ~0.1 s after Marduk
knows, not after the heartbeat timeout (the front's own, 1 s, still bounds a group that only
goes silent). The trainers need ``TORCHFT_QUORUM_RETRIES`` (``FRONT_ENV``): should the front's
process die, its supervisor starts it again on the same address, and torchft retries the quorum
calls it cut instead of failing them (docs/operations.md, *torchft lighthouse front*).

Importing this module needs neither torch nor torchft: the Manager is used by its methods only.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, Final, Protocol

import agent
from agent.channel.handoff import Handoff
from agent.errors import AgentError
from agent.library.command import Command

log = logging.getLogger("agent.torchft")

RESTART_EXIT: Final = 75  # EX_TEMPFAIL: start me again
FAIL_EXIT: Final = 71  # as `marduk agent run` after `fail`: a device of this pod is bad
EXIT_AFTER_S: Final = 1.0
BEAT_EVERY_S: Final = 0.5  # heartbeats while waiting for a quorum; below any sane hang timeout
# torchft_lighthouse's timers under Marduk (the module's docstring says why).
LIGHTHOUSE_FLAGS: Final = ("--heartbeat_timeout_ms", "1000")


class MardukCommandError(RuntimeError):
    """What the Manager is told (``report_error``) when Marduk restarts or fails this group."""


class PeerFailedError(RuntimeError):
    """What the Manager is told (``report_error``) when another group of its quorum fails."""


class _Manager(Protocol):
    def report_error(self, e: Exception) -> None: ...

    def current_step(self) -> int: ...


def _name(ft_replica_id: str) -> str:
    """Marduk's replica id from torchft's (``name:uuid``)."""
    return ft_replica_id.split(":", 1)[0]


def replica_id(default: str | None = None) -> str:
    """This group's replica id for ``Manager(replica_id=...)``: ``MARDUK_REPLICA_ID`` (set by
    ``marduk agent run --replica``), else ``default``; AgentError when neither is set."""
    try:
        given = Handoff.from_env().replica
    except ValueError as e:
        raise AgentError(str(e)) from None
    found = given or default
    if not found:
        raise AgentError("no replica id: set MARDUK_REPLICA_ID (or run under marduk agent run)")
    return found


class Guard:
    """Ties one torchft Manager to Marduk. Made by ``attach``."""

    def __init__(
        self,
        manager: _Manager,
        pg: Any = None,
        *,
        exit_after: float = EXIT_AFTER_S,
        beat_every: float = BEAT_EVERY_S,
    ):
        self.manager = manager
        self.pg = pg
        self.exit_after = exit_after
        self.beat_every = beat_every
        self.command: Command | None = None
        self.client: agent.Client | None = None
        self._lock = threading.Lock()
        self.abandoned = 0  # steps abandoned for another group's failure
        self.refused = 0  # quorums answered with a group told failed: not configured
        # The last quorum the Manager was answered (None while unknown: no quorum yet, or the
        # Manager's client could not be wrapped): torchft's replica ids ("name:uuid", a fresh
        # uuid per incarnation), Marduk's ("name"), and its quorum id.
        self.members: frozenset[str] | None = None
        self.quorum: frozenset[str] | None = None
        self.quorum_id: int | None = None
        # torchft ids told failed (peer_failed) since the last answer: the next answer is
        # refused if it includes one. Full ids, so a restarted group's new one never is.
        self._dead: set[str] = set()
        self._seen: dict[str, str] = {}  # Marduk's replica id -> torchft's last seen in a quorum
        self._refuse: int | None = None  # the quorum id whose process group is not configured
        self._answered_in: Any = None  # the Manager's quorum future the last answer came in
        self._waiting = 0  # the Manager's quorum calls in flight
        self._stepped = False  # guard.step() was called: the trainer's startup is over
        self._beats: threading.Thread | None = None

    @property
    def restart_requested(self) -> bool:
        """A restart or fail command came for this group: the loop should stop."""
        return self.command is not None

    def on_command(self, cmd: Command) -> None:
        """The library's callback (its own thread): abandon the step, and exit soon."""
        if cmd.is_notice:
            self.on_peer_failed(cmd)
            return
        if not cmd.is_failure:
            return  # checkpoint requests: a torchft group heals from a peer instead
        with self._lock:
            if self.command is not None:
                return  # an update of the same restart: already on the way out
            self.command = cmd
        devices = ",".join(cmd.devices) or "-"
        print(
            f"marduk: {cmd.kind} at epoch {cmd.epoch} (devices {devices}): abandoning step "
            f"{self._step_or_none()}",
            file=sys.stderr,
            flush=True,
        )
        try:
            self.manager.report_error(MardukCommandError(f"{cmd.kind}: {cmd.reason}"))
        except Exception as e:  # never let the callback die before the exit is scheduled
            log.warning("report_error: %s", e)
        if self.pg is not None:
            try:
                self.pg.abort()
            except Exception as e:
                log.warning("aborting the process group: %s", e)
        timer = threading.Timer(self.exit_after, self._exit, kwargs={"late": True})
        timer.daemon = True
        timer.start()

    def on_peer_failed(self, cmd: Command) -> None:
        """Other groups restart or fail: if one was in our last quorum, abandon the step in
        flight (``report_error``) and end a collective pending with it (abort), without
        exiting; and refuse the next quorum answer if it still includes that incarnation."""
        step = self._step_or_none()
        failed = ", ".join(f"{p.replica} {p.kind} at epoch {p.epoch}" for p in cmd.peers)
        where, dead = self._place_notice({p.replica for p in cmd.peers})
        error = PeerFailedError(f"peer_failed: {failed}")
        # The next answer is checked when it comes: the lighthouse may have issued it with
        # the failed group just before that died (``_answered``).
        refused = f"; refused if the next quorum includes {', '.join(dead)}" if dead else ""
        if where == "elsewhere":
            said = f"not in our last quorum, nothing to abandon{refused} (step {step})"
        elif where == "forming":
            # No collective of this step has started, and an error reported now would only
            # make the healthy groups skip the first step of the new quorum.
            said = f"the next quorum is forming, nothing to abandon{refused} (step {step})"
        elif where == "configuring":
            # The quorum came back with the failed group and torchft configures (or heals)
            # with it: not configured if torchft has not started to (``refuses``); a
            # configure already waiting for the failed group's store key ends at its timeout.
            # No abort: it would race the configure on torchft's thread, and no collective
            # of this step runs once the error is reported.
            said = f"in the quorum being configured, abandoning step {step}"
            self._abandon(error, abort=False)
        else:
            # Abort safe only because the failed group was in the quorum: its trainer is
            # ended, so the next quorum differs (or, still holding the failed incarnation, is
            # refused, and the lighthouse bumps the next one's id for the failed commit) and
            # torchft configures a new process group. Aborting when the quorum stays the
            # same would leave none.
            said = f"abandoning step {step}"
            self._abandon(error, abort=self.members is not None)
        print(f"marduk: peer_failed: {failed}: {said}", file=sys.stderr, flush=True)

    def _place_notice(self, names: set[str]) -> tuple[str, list[str]]:
        """Where a notice about the groups ``names`` finds this one: ``elsewhere`` (none was
        in our last quorum), ``forming`` (the next quorum is being asked for), ``configuring``
        (its answer, with a failed group, is being configured or healed from) or
        ``stepping``; and the torchft ids the failed groups had in the last quorum we saw
        them in (ours or an earlier one), which the next answer is checked against
        (``_answered``)."""
        with self._lock:  # atomic with an answer coming in on torchft's quorum thread
            members = self.members
            # The failed groups' incarnations last seen in a quorum, in our last one or an
            # earlier one (a group left out of a quorum, healing or late, is back in the next).
            dead = sorted(self._seen[n] for n in names if n in self._seen)
            self._dead.update(dead)
            # Unknown quorum (no answer read): the failed group may be in it.
            if not (members & set(dead) if members is not None else names):
                return "elsewhere", dead
            if self._waiting == 0 and not self._quorum_forming():
                return "stepping", dead
            if (
                self._waiting == 0
                and members is not None
                and getattr(self.manager, "_quorum_future", None) is self._answered_in
            ):
                self._refuse = self.quorum_id
                return "configuring", dead
            return "forming", dead

    def _abandon(self, error: Exception, abort: bool) -> None:
        self.abandoned += 1
        try:
            self.manager.report_error(error)
        except Exception as e:
            log.warning("report_error: %s", e)
        if abort and self.pg is not None:
            try:
                self.pg.abort()
            except Exception as e:
                log.warning("aborting the process group: %s", e)

    def _quorum_forming(self) -> bool:
        """The Manager is waiting for this step's quorum, or configuring or healing with it
        (torchft 0.2.0's ``_quorum_future``; False where that cannot be read)."""
        future = getattr(self.manager, "_quorum_future", None)
        done = getattr(future, "done", None)
        return callable(done) and not done()

    def _answered(self, result: Any) -> None:
        """A quorum answer (torchft's ``QuorumResult``), before torchft configures its
        process group with it. One that includes an incarnation told failed since the last
        answer is refused: the error is reported (the step does not commit) and
        ``refuses(quorum_id)`` is true, so the process group is not configured with a member
        that will never write its store key (the configure would wait for it until its
        timeout, which no abort reaches)."""
        try:
            members: frozenset[str] | None = frozenset(str(r) for r in result.replica_ids)
        except (AttributeError, TypeError):  # not a list of ids (another torchft): unknown
            members = None
        quorum_id = getattr(result, "quorum_id", None)
        with self._lock:
            self._answered_in = getattr(self.manager, "_quorum_future", None)
            self.members = members
            self._seen.update((_name(m), m) for m in members or ())
            self.quorum = None if members is None else frozenset(_name(m) for m in members)
            self.quorum_id = quorum_id if isinstance(quorum_id, int) else None
            dead = sorted(self._dead & members) if members is not None else []
            # An incarnation told failed asks the lighthouse no more: at most this answer can
            # still include it. Forgetting it here also bounds what a late notice (one about
            # an incarnation already replaced in our quorum) can cost: one refused quorum.
            self._dead.clear()
            self._refuse = self.quorum_id if dead else None
        if not dead:
            return
        self.refused += 1
        step = self._step_or_none()
        print(
            f"marduk: quorum {quorum_id} includes {', '.join(dead)}, told failed: not "
            f"configured, abandoning step {step}",
            file=sys.stderr,
            flush=True,
        )
        self._abandon(PeerFailedError(f"quorum {quorum_id} includes {', '.join(dead)}"), False)

    def refuses(self, quorum_id: object) -> bool:
        """Whether the process group must not be configured for this quorum id."""
        return quorum_id is not None and quorum_id == self._refuse

    def waiting_for_quorum(self, waiting: bool) -> None:
        """The Manager's quorum call starts (True) or returns (False)."""
        with self._lock:
            self._waiting += 1 if waiting else -1

    def start_beats(self) -> None:
        """Start the thread that sends heartbeats while the Manager waits for a quorum."""
        if self._beats is None:
            self._beats = threading.Thread(target=self._beat, name="marduk-ft-beats", daemon=True)
            self._beats.start()

    def _beat(self) -> None:
        while True:
            time.sleep(self.beat_every)
            # Before the first step the agent's startup timeout applies (a heartbeat would
            # count as the first sign of life); after a command, nothing is reported.
            if self._waiting > 0 and self._stepped and self.command is None:
                client = self.client
                if client is not None:
                    client.heartbeat()

    def step(self) -> None:
        """Call once per step, after ``optimizer.step()``: reports progress (hang detection
        under ``marduk agent run``) and exits when a restart or fail command came."""
        self._stepped = True
        if self.command is not None:
            self._exit()
        if self.client is not None:
            self.client.step(self._step_or_none() or 0)

    def _step_or_none(self) -> int | None:
        try:
            return int(self.manager.current_step())
        except Exception:
            return None

    def _exit(self, late: bool = False) -> None:
        cmd = self.command
        assert cmd is not None
        if late:
            print(
                f"marduk: the loop did not reach guard.step() within {self.exit_after:g}s; "
                "exiting from the agent thread",
                file=sys.stderr,
                flush=True,
            )
        if self.client is not None:
            # Standalone: confirms the epoch to the controller; supervised: a no-op (the
            # agent confirms it). Bounded; a failure is recorded, never raised.
            self.client.ack(cmd)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(FAIL_EXIT if cmd.kind == "fail" else RESTART_EXIT)


def lighthouse_command(
    min_replicas: int, bind: str = "[::]:29510", binary: str = "torchft_lighthouse"
) -> list[str]:
    """The command line of torchft's lighthouse for a job under Marduk (``LIGHTHOUSE_FLAGS``)."""
    return [binary, "--min_replicas", str(min_replicas), "--bind", bind, *LIGHTHOUSE_FLAGS]


# The trainers' environment under ``marduk torchft-lighthouse``: torchft retries a quorum call
# the front's restart cut, every max(100 ms, quorum_timeout / (retries + 1)) for up to
# ``retries`` tries (torchft 0.2.0's ``_quorum_with_retries``): 600 is 100 ms for a 60 s quorum
# timeout. Without it the call fails and the Manager's quorum waits its whole timeout.
FRONT_ENV: Final = {"TORCHFT_QUORUM_RETRIES": "600"}


def front_command(
    job: str, min_replicas: int, bind: str = "[::]:29510", marduk: str = "marduk"
) -> list[str]:
    """The command line of ``marduk torchft-lighthouse`` for ``job`` (give the trainers
    ``FRONT_ENV``)."""
    return [
        marduk,
        "torchft-lighthouse",
        "--job",
        job,
        "--min-replicas",
        str(min_replicas),
        "--bind",
        bind,
    ]


def attach(
    manager: _Manager,
    pg: Any = None,
    *,
    exit_after: float = EXIT_AFTER_S,
    beat_every: float = BEAT_EVERY_S,
    **connect: Any,
) -> Guard:
    """Register this replica group with Marduk (``agent.connect(**connect)``; under ``marduk
    agent run``, its agent) and return the ``Guard`` whose ``step()`` the loop calls.

    ``pg``: the Manager's process group, aborted when a command comes (optional). The replica
    id defaults to ``replica_id()``; a Manager given another one is an AgentError.
    ``beat_every``: seconds between heartbeats while the Manager waits for a quorum.
    """
    if not callable(getattr(manager, "report_error", None)):
        raise AgentError(f"attach() wants a torchft Manager, not {type(manager).__name__}")
    replica = connect.pop("replica_id", None) or replica_id()
    ft_replica = getattr(manager, "_replica_id", None)
    if ft_replica is not None and ft_replica != replica:
        raise AgentError(
            f"the Manager's replica_id {ft_replica!r} is not Marduk's {replica!r}: "
            "pass replica_id=agent.torchft.replica_id() to Manager"
        )
    guard = Guard(manager, pg, exit_after=exit_after, beat_every=beat_every)
    _watch_quorums(manager, guard)
    connect.setdefault("peer_notices", True)
    guard.client = agent.connect(replica_id=replica, on_command=guard.on_command, **connect)
    guard.start_beats()
    return guard


class _QuorumClient:
    """The Manager's quorum client (torchft 0.2.0: ``Manager._client``), recording the replica
    ids of each quorum it answers and telling the Guard while a call waits; everything else is
    passed through."""

    def __init__(self, inner: Any, guard: Guard) -> None:
        self._inner = inner
        self._guard = guard

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self._guard.waiting_for_quorum(True)
        try:
            result = self._inner._quorum(*args, **kwargs)
        finally:
            self._guard.waiting_for_quorum(False)
        self._guard._answered(result)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _watch_quorums(manager: Any, guard: Guard) -> None:
    inner = getattr(manager, "_client", None)
    if inner is None or not callable(getattr(inner, "_quorum", None)):
        log.info("the Manager's quorums cannot be read: peer notices abort nothing")
        return
    manager._client = _QuorumClient(inner, guard)
    _refuse_configures(getattr(manager, "_pg", None), guard)


def _refuse_configures(pg: Any, guard: Guard) -> None:
    """Make the Manager's process group refuse a configure for a quorum the Guard refused
    (``Guard._answered``): torchft 0.2.0's ``_async_quorum`` catches the error, reports it
    and returns (no heal), the step does not commit, and the next quorum (the failed commit
    bumps its id) configures a new one. Raising from the quorum call instead would reach
    the training loop (``wait_quorum``), and asking again would break the Manager's one
    quorum request per rank and step."""
    configure = getattr(pg, "configure", None)
    if not callable(configure):
        log.info("the Manager's process group cannot be wrapped: a refused quorum configures")
        return

    def configure_unless_refused(*args: Any, **kwargs: Any) -> Any:
        # torchft 0.2.0: configure(store_addr, replica_id, rank, world_size, quorum_id, ...)
        quorum_id = kwargs.get("quorum_id", args[4] if len(args) > 4 else None)
        if guard.refuses(quorum_id):
            raise PeerFailedError(f"quorum {quorum_id} includes a group told failed")
        return configure(*args, **kwargs)

    try:
        pg.configure = configure_unless_refused
    except (AttributeError, TypeError) as e:
        log.info("the Manager's process group cannot be wrapped (%s)", e)


__all__ = [
    "BEAT_EVERY_S",
    "FAIL_EXIT",
    "FRONT_ENV",
    "LIGHTHOUSE_FLAGS",
    "RESTART_EXIT",
    "Guard",
    "MardukCommandError",
    "PeerFailedError",
    "attach",
    "front_command",
    "lighthouse_command",
    "replica_id",
]
