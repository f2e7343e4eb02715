"""``Client``: the synchronous facade a plain training loop uses."""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from agent.channel.requests import Answered
from agent.errors import AgentError
from agent.library.command import Command, OnCommand
from agent.library.inbox import State
from agent.library.nats_client import AsyncClient
from agent.library.options import Options
from agent.library.params import OnParams, ParamsView
from agent.library.transport import AgentClient, open_client

if TYPE_CHECKING:  # numpy is imported only by a trainer that snapshots
    from agent.library.snapshots import Agree, Restored, Snapshots

log = logging.getLogger("agent")


class Client:
    """Synchronous facade: one background thread runs an async client on its own loop.

    ``on_command`` callbacks run on that thread (``marduk-agent``), never on the training thread;
    keep them short and thread-safe, or use ``wait()``/``failed`` from the training loop.
    """

    def __init__(
        self,
        opts: Options,
        on_command: OnCommand | None = None,
        on_params: OnParams | None = None,
    ) -> None:
        self._commands: queue.Queue[Command] = queue.Queue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="marduk-agent")
        self._thread.daemon = True
        self._thread.start()
        self._closed = False
        self._snapshots: Snapshots | None = None
        self._snapshots_made = False

        async def make() -> AgentClient:
            client = open_client(opts, on_command, self._commands.put_nowait)
            client.live.on_params = on_params
            client.on_stop = self._at_notice
            await client.start()
            return client

        try:
            self._async: AgentClient = self._call(make(), timeout=opts.timeout + 5.0)
        except BaseException:
            self._stop_loop()
            raise
        self._perf = self._async.perf
        # Progress of a client registered over NATS is two attributes (nothing watches them
        # but ``last_step``): set here, not through the loop, which costs a cross-thread wake-up
        # per step. Under a supervisor each step is still sent (its hang detection).
        self._progress_here = isinstance(self._async, AsyncClient)
        # A script that ends without close() still deregisters (a crash does not, by design).
        atexit.register(self.close, "exited")

    def _call(self, coro: Any, timeout: float) -> Any:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            fut.cancel()
            raise AgentError(f"no answer from the agent thread within {timeout:g}s") from None

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()

    @property
    def opts(self) -> Options:
        return self._async.opts

    @property
    def state(self) -> State:
        return self._async.state

    @property
    def stats(self) -> Counter[str]:
        return self._async.stats

    @property
    def errors(self) -> list[str]:
        return list(self._async.errors)

    @property
    def failed(self) -> bool:
        return self._async.failed

    @property
    def last_failure(self) -> Command | None:
        return self._async.last_failure

    @property
    def epoch(self) -> int:
        return self._async.epoch

    def wait(self, timeout: float | None = None) -> Command | None:
        """The next command for this replica, or None after ``timeout`` seconds."""
        try:
            return self._commands.get(timeout=timeout)
        except queue.Empty:
            return None

    def poll(self) -> Command | None:
        """The next command if one is waiting, else None; never blocks."""
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def step(self, step: int) -> None:
        """Report training progress (feeds ``marduk agent run``'s hang detection, and the time
        between two steps goes in the window's summary). Never blocks."""
        self._perf.step()
        if self._progress_here:
            self._async.last_step, self._async.last_progress = step, time.time()
        else:
            self._fire(self._async.step(step))

    def heartbeat(self) -> None:
        """Report liveness without a step number. Never blocks."""
        self._fire(self._async.heartbeat())

    def section(self, name: str, timeout: float | None = None) -> _Section:
        """A named part of the loop; open longer than ``timeout`` s, the trainer counts as hung.
        Its time goes in the window's summary: mark the part of a step outside collectives
        (``compute``), where a slow device shows (docs/operations.md, *Stragglers*).

        with client.section("checkpoint", timeout=120):
            save()
        """
        return _Section(self, name, timeout)

    def _fire(self, coro: Any) -> None:
        if self._closed:
            coro.close()
            return
        asyncio.run_coroutine_threadsafe(coro, self._loop)

    @property
    def checkpoint_requested(self) -> bool:
        """The controller asked to checkpoint now (the host is about to go away): save at the
        next safe point, then call ``checkpoint_saved(step)``; keep training."""
        return self._async.checkpoint_requested

    def checkpoint_saved(self, step: int) -> bool:
        """Report the checkpoint saved at ``step``; clears ``checkpoint_requested``."""
        return self._call_recorded(self._async.checkpoint_saved(step))

    def ack(self, command: Command | None = None) -> bool:
        """Acknowledge ``command`` (default: the pending failure): clears ``failed`` and tells
        the controller this worker applied the epoch. False (not confirmed within 5 s) is
        recorded in ``errors``, never raised."""
        return self._call_recorded(self._async.ack(command))

    @property
    def params(self) -> ParamsView:
        """The job's live parameters as this replica runs them (read-only; ``version``). Read
        them at a step boundary; ``marduk monitor set`` changes them."""
        return self._async.params

    @property
    def on_params(self) -> OnParams | None:
        """Called (on the ``marduk-agent`` thread) with the new ``params`` when they change;
        apply them at the next step boundary, then call ``params_applied(version)``. Unset,
        the library acknowledges each version on receipt."""
        return self._async.live.on_params

    @on_params.setter
    def on_params(self, callback: OnParams | None) -> None:
        self._async.live.on_params = callback

    def params_applied(self, version: int, rejected: dict[str, str] | None = None) -> None:
        """Say that this worker runs parameters ``version`` from this step on, except the keys
        in ``rejected`` (key -> why): ``marduk monitor params`` shows it. Never blocks."""
        self._fire(self._async.params_applied(version, dict(rejected or {})))

    def request(
        self,
        kind: str,
        *,
        device: str | None = None,
        reason: str = "",
        timeout: float = 10.0,
    ) -> Answered:
        """Ask the control plane about this trainer (NVRx's workload control requests); waits
        for the answer, ``timeout`` s at most. ``kind``:

        * ``"stop_restarting"``: ``marduk agent run`` restarts this trainer no more: when it
          next ends (it exits, crashes or hangs, or a restart is ordered), the agent ends too,
          with the trainer's exit code (72 when the agent stopped it);
        * ``"exclude_node"``: this node's devices leave service, as ``marduk monitor drain``
          takes them out: the job goes on without this node from the next epoch (a spare takes
          its ranks) and its agent exits 71;
        * ``"device_bad"``: a ``failed`` health event for ``device`` (default: this rank's
          device, if it has one), as a monitor would send it.

        Returns an ``Answered`` (true when done; ``detail`` says what was done or why not).
        Never raises: a bad request (unknown kind, wrong types, a reason over 1,024
        characters), no agent or controller to answer, or a refusal is counted in
        ``stats["requests_refused.<code>"]`` and recorded in ``errors``."""
        if self._closed:
            return Answered(False, "the client is closed", "closed")
        try:
            answer: Answered = self._call(
                self._async.request(kind, device, reason, timeout), timeout=timeout + 2.0
            )
        except AgentError as e:
            self._async._record(str(e))
            return Answered(False, str(e), "no_answer")
        return answer

    # --- snapshots into the local store the agent keeps (agent/library/snapshots.py) -----------

    @property
    def snapshots(self) -> Snapshots | None:
        """This rank's snapshots in the store the agent handed it (``MARDUK_LOCAL_CKPT_DIR``);
        None when it handed none (``client.snapshot`` then does nothing)."""
        if not self._snapshots_made:
            self._snapshots_made = True
            try:
                from agent.library.snapshots import from_env

                self._snapshots = from_env(self.opts.job, self.opts.epoch)
            except (OSError, ValueError) as e:  # an unusable store: counted, training goes on
                self.stats["snapshots.no_store"] += 1
                self._async._record(f"no local checkpoint store: {e}")
        return self._snapshots

    def snapshot(self, step: int, state: Any, *, copy: bool = True) -> bool:
        """Snapshot ``state`` (a torch state_dict, a numpy or JAX pytree) at ``step`` into the
        local store: waits for the host copy only, the write runs in the background. False
        when it was not taken (no store, a type it does not know: ``snapshots.errors``)."""
        s = self.snapshots
        if s is None:
            self.stats["snapshots.no_store"] += 1
            return False
        return s.snapshot(step, state, copy=copy)

    def restore(
        self, like: Any = None, *, agree: Agree | None = None, verify: bool = False
    ) -> Restored | None:
        """The newest snapshot every rank holds (``agree``: the minimum over the ranks,
        ``agent.snapshots.torch_min`` or ``jax_min``), read back; None: none held, start from
        the trainer's own checkpoint or from scratch. See ``Snapshots.restore``."""
        s = self.snapshots
        if s is None:
            return None
        return s.restore(like, agree=agree, verify=verify)

    def _at_notice(self, command: Command) -> int | None:
        """A restart, fail or stop forwarded before the trainer is stopped (on a thread)."""
        s = self._snapshots
        if s is None:
            return None
        return s.at_notice(command.devices, self.opts.devices)

    def _call_recorded(self, coro: Any) -> bool:
        """Run ``coro`` on the client's loop; a failure is recorded in ``errors``, never raised."""
        if self._closed:
            coro.close()
            return False
        try:
            return bool(self._call(coro, timeout=7.0))
        except AgentError as e:
            self._async._record(str(e))
            return False

    def close(self, reason: str = "closed") -> None:
        """Deregister and disconnect. Safe to call twice; never raises."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._snapshots is not None:
            self._snapshots.close()
        try:
            self._call(self._async.close(reason=reason), timeout=6.0)
        except Exception as e:
            log.debug("close: %s", e)
        self._stop_loop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Section:
    """``Client.section``'s context: a class, not a generator (half the cost per use)."""

    __slots__ = ("_client", "_name", "_started", "_timeout")

    def __init__(self, client: Client, name: str, timeout: float | None) -> None:
        self._client, self._name, self._timeout = client, name, timeout
        self._started = 0.0

    def __enter__(self) -> None:
        c = self._client
        if c._progress_here:
            c._async.last_progress = time.time()
        else:
            c._fire(c._async.section(self._name, True, self._timeout))
        self._started = c._perf.enter()

    def __exit__(self, *exc: object) -> None:
        c = self._client
        c._perf.leave(self._name, self._started)
        if c._progress_here:
            c._async.last_progress = time.time()
        else:
            c._fire(c._async.section(self._name, False))
