"""Epoch fencing and delivery of commands to the trainer: what both async clients share."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any, Final, Literal

import msgspec

from agent.channel.fencing import Fence, Verdict
from agent.channel.requests import Answered, Refusal, check, default_device
from agent.library.command import Command, OnCommand
from agent.library.options import Options
from agent.library.params import LiveParams, ParamsView
from agent.library.perf import PerfRecorder
from marduk.aio import TaskSet
from marduk.wire import protocol as wire

log = logging.getLogger("agent")

State = Literal["connecting", "registered", "disconnected", "closed"]

# The commands that stop the trainer: its snapshots are written at them.
STOPS: Final = ("restart", "fail", "stop")
# Failed replicas whose last notice is remembered (the oldest are forgotten past it).
MAX_NOTICED: Final = 4096


class CommandInbox:
    """Epoch fencing and delivery of commands to the trainer, shared by both clients.

    A command whose epoch is not above the last one received is dropped; a ``restart`` or
    ``fail`` sets ``failed`` until acknowledged; commands go to ``deliver`` (the sync client's
    queue) or to ``wait()``; ``on_command`` runs on the client's loop, guarded.
    """

    def __init__(
        self,
        opts: Options,
        on_command: OnCommand | None,
        deliver: Callable[[Command], None] | None,
    ) -> None:
        self.opts = opts
        self.state: State = "connecting"
        self.stats: Counter[str] = Counter()
        self.errors: deque[str] = deque(maxlen=50)
        self._on_command = on_command
        self._deliver = deliver
        self._queue: asyncio.Queue[Command] = asyncio.Queue()
        self.fence = Fence.started_at(opts.epoch)  # which commands are news (channel/fencing.py)
        self._checkpoint: Command | None = None  # a checkpoint asked for, not yet saved
        self._pending_failure: Command | None = None
        self._tasks = TaskSet(self._task_failed, prefix="marduk-agent-")
        self.last_step: int | None = None
        self.last_progress = 0.0
        # Step and section times, taken by the sync facade on the training thread and sent as
        # a summary per window (agent/library/perf.py).
        self.perf = PerfRecorder()
        # ``peer_failed`` notices: the epoch of the last command each failed replica was sent.
        self._noticed: dict[str, int] = {}
        # Live parameters (agent/library/params.py): the view the trainer reads, its fence.
        self.live = LiveParams(opts.replica)
        # Called (on a thread) with a restart, fail or stop before ``on_command``: the trainer's
        # snapshots write the last step taken (agent/library/snapshots.py); returns it.
        self.on_stop: Callable[[Command], int | None] | None = None

    def _verify_by_asking(self) -> None:
        """Ask the controller what is current (AsyncClient re-registers; under a supervisor the
        local channel forwards only what the supervisor vetted, so nothing to do)."""

    def _spawn(self, coro: Any, name: str) -> None:
        """Run ``coro`` in the background, named; if it fails, that is recorded, not lost."""
        self._tasks.spawn(coro, name)

    def _task_failed(self, task: asyncio.Task[Any], e: BaseException) -> None:
        self.stats["errors.task"] += 1
        self._record(f"background task {task.get_name()} failed: {type(e).__name__}: {e}")

    def _record(self, message: str) -> None:
        self.errors.append(f"{time.strftime('%H:%M:%S')} {message}")
        log.warning("%s", message)

    # --- the trainer's requests (client.request) -------------------------------------------------

    async def request(
        self, kind: str, device: str | None = None, reason: str = "", timeout: float = 10.0
    ) -> Answered:
        """Ask about this trainer (agent/channel/requests.py): refused here when malformed,
        else ``_ask``'s answer. Never raises; each refusal is counted and recorded."""
        device = default_device(kind, device, list(self.opts.devices))
        refusal = check(kind, device, reason)
        if refusal is not None:
            return self._refused(refusal)
        answer = await self._ask(kind, device, reason, timeout)
        if answer.accepted:
            self.stats[f"requests.{kind}"] += 1
        else:
            self.stats[f"requests_refused.{answer.code}"] += 1
            self._record(f"request {kind} refused: {answer.detail}")
        return answer

    def _refused(self, refusal: Refusal) -> Answered:
        self.stats[f"requests_refused.{refusal.code}"] += 1
        self._record(f"request refused: {refusal.why}")
        return Answered(False, refusal.why, refusal.code)

    async def _ask(self, kind: str, device: str | None, reason: str, timeout: float) -> Answered:
        raise NotImplementedError

    def _misdirected(self, c: wire.Command, subject: str, expected: str) -> bool:
        """True (counted, recorded) if ``c``, as signed, is not for this replica: another job
        or replica, or not the subject it was sent to. The destination is inside the signed
        bytes, so a valid command moved to another replica's subject is refused here."""
        o = self.opts
        if c.job == o.job and c.replica in (None, o.replica) and subject == expected:
            return False
        self.stats["dropped_misdirected"] += 1
        self._record(
            f"dropped a command for {c.job}/{c.replica or '(whole job)'} (epoch {c.epoch}, "
            f"{c.kind}) that came on {subject}: not for {o.job}/{o.replica}"
        )
        return True

    def _accept(self, c: wire.Command, *, confirmed: bool = False) -> None:
        """Fence and deliver a command. ``confirmed``: it came in the controller's reply."""
        if c.kind == "peer_failed":
            self._accept_notice(c)
            return
        last = self.fence.received
        verdict, self.fence = self.fence.admit(c.epoch, c.devices, c.revision, confirmed=confirmed)
        if verdict is Verdict.IMPLAUSIBLE:
            self.stats["dropped_implausible"] += 1
            self._record(
                f"dropped a command with epoch {c.epoch} (last {last}): "
                "beyond what the controller could have issued; asking it"
            )
            self._verify_by_asking()
            return
        if not verdict.delivers:
            self.stats["dropped_stale"] += 1
            return
        self._deliver_command(c, update=verdict is Verdict.UPDATE)

    def _accept_notice(self, c: wire.Command) -> None:
        """A ``peer_failed`` notice. Outside the restart epochs: the fence is neither consulted
        nor moved (the failed replicas' epochs are theirs, not ours). Each failed replica is
        news once per epoch of its command: a repeat or a replay is dropped."""
        if not self.opts.peer_notices:
            self.stats["dropped_notices.unasked"] += 1
            return
        fresh = [
            p
            for p in c.peers
            if p.replica != self.opts.replica and p.epoch > self._noticed.get(p.replica, 0)
        ]
        if not fresh:
            self.stats["dropped_notices.seen"] += 1
            return
        for p in fresh:
            self._noticed.pop(p.replica, None)  # to the end: the oldest is forgotten first
            self._noticed[p.replica] = p.epoch
        while len(self._noticed) > MAX_NOTICED:
            del self._noticed[next(iter(self._noticed))]
        self._deliver_command(msgspec.structs.replace(c, peers=fresh), update=False)

    def _deliver_command(self, c: wire.Command, *, update: bool) -> None:
        """Hand a command the fence let through to the trainer (queue, ``on_command``)."""
        self.stats["updates" if update else f"commands.{c.kind}"] += 1
        command = Command.from_wire(c, time.time())
        if command.kind == "checkpoint" and not update:
            self._checkpoint = command
        pending = self._pending_failure
        if command.is_failure and (not update or pending is None or pending.epoch == c.epoch):
            self._pending_failure = command
        if self._deliver is not None:
            self._deliver(command)
        else:
            self._queue.put_nowait(command)
        if command.kind in STOPS and not update:
            if self.on_stop is not None:
                # The trainer is about to be stopped: its last step is written first, then
                # ``on_command`` (which may end the process at once) runs.
                self._spawn(self._save_then(command), "snapshot-flush")
                return
            self._nothing_to_save()
        self._call_on_command(command)

    async def _save_then(self, command: Command) -> None:
        assert self.on_stop is not None
        try:
            step = await asyncio.to_thread(self.on_stop, command)
        except Exception as e:
            step = None
            self._record(f"saving at the notice failed: {type(e).__name__}: {e}")
        await self._saved_at_notice(step)
        self._call_on_command(command)

    async def _saved_at_notice(self, step: int | None) -> None:
        """The last step taken is written (``step``, the newest): the supervisor may stop the
        trainer (LocalAsyncClient says so; registered alone there is no one to tell)."""

    def _nothing_to_save(self) -> None:
        """A stop forwarded to a trainer that takes no snapshots (no ``on_stop``): the
        supervisor need not wait (LocalAsyncClient says so)."""

    def _call_on_command(self, command: Command) -> None:
        if self._on_command is not None:
            try:
                result = self._on_command(command)
                if asyncio.iscoroutine(result):
                    self._spawn(self._guard(result), "on-command")
            except Exception as e:  # a callback's bug must not kill the client
                self._record(f"on_command callback raised {type(e).__name__}: {e}")

    async def _guard(self, coro: Any) -> None:
        try:
            await coro
        except Exception as e:
            self._record(f"on_command callback raised {type(e).__name__}: {e}")

    def _clear_failure(self, command: Command | None) -> Command | None:
        command = command or self._pending_failure
        if command is not None:
            self.fence = self.fence.ack(command.epoch)
        pending = self._pending_failure
        if command is not None and pending is not None and command.epoch >= pending.epoch:
            self._pending_failure = None
        return command

    async def wait(self, timeout: float | None = None) -> Command | None:
        """The next command for this replica, or None after ``timeout`` seconds."""
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None

    @property
    def checkpoint_requested(self) -> bool:
        """The controller asked to checkpoint now (the host is about to go away): save at the
        next safe point, then call ``checkpoint_saved(step)``; keep training."""
        return self._checkpoint is not None

    @property
    def failed(self) -> bool:
        """A restart or fail command has arrived and has not been acknowledged."""
        return self._pending_failure is not None

    @property
    def last_failure(self) -> Command | None:
        return self._pending_failure

    @property
    def epoch(self) -> int:
        """The last epoch received."""
        return self.fence.received

    @property
    def params(self) -> ParamsView:
        """The live parameters this replica runs (read-only, with ``version``)."""
        return self.live.view
