"""The fork server ("zygote"): one process per agent imports the framework once, and every
trainer incarnation is forked from it in milliseconds.

    python -m agent.supervise.zygote --control-fd N --preload torch -- SCRIPT|-m MODULE [ARGS...]

A prestarted trainer (``agent/supervise/prestarted.py``) covers one fault: the next one waits for
a new interpreter to import the framework (seconds; several at once on a busy host). The zygote
is never used up, so the first fault after start and a burst of faults are all warm restarts.

How a trainer is made, and why it is a clean process:

* The zygote imports ``--preload`` and runs nothing else: no device is initialised and no
  thread is started (it checks, and refuses to serve otherwise: the agent then falls back to a
  prestarted trainer). Native library pools (OpenBLAS) are shut down by their own fork handlers,
  which ``os.fork`` runs.
* The agent sends a fork order on the control socket (AF_UNIX, SEQPACKET): the trainer's
  environment, with the write ends of its stdout/stderr pipes attached (SCM_RIGHTS).
* The zygote forks twice and the middle process exits at once: the trainer is orphaned and the
  kernel re-parents it to the agent, which is a child subreaper for that moment. The trainer is
  then the agent's own child, as a cold-started one is: the agent reaps it and reads its exit
  status, PR_SET_PDEATHSIG ties it to the agent, and it outlives the zygote.
* In the trainer, before the script runs: a new session (its process group is its pid), the
  parent-death signal, the agent's pipes on fds 1 and 2 and /dev/null on 0, the zygote's
  socket closed, an empty signal mask and Python's default handlers, the order's environment
  (``MARDUK_WARM_START=zygote``), numpy's global generator reseeded (``random`` is reseeded by
  ``os.fork``). Then it runs as ``python`` would (``runpy``), as a prestarted trainer does.

The framework reads its import-time settings from the zygote's environment: the agent's, the
same for every incarnation but for ``MARDUK_EPOCH`` and ``MARDUK_RESTART_COUNT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any, Protocol

from agent.library.client import AgentError
from agent.supervise import numa
from marduk.transport.children import die_with_parent

MAX_ORDER = 1 << 20  # bytes: the environment travels in the order
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37


class ZygoteError(AgentError):
    """The fork server could not start a trainer (the agent starts it cold instead)."""


class ZygoteUnsafe(ZygoteError):
    """Forking from the zygote would not give a clean process (threads, initialised devices)."""


class TrainerProcess(Protocol):
    """What the supervisor uses of a trainer process (``asyncio.subprocess.Process`` has it)."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    @property
    def stdout(self) -> asyncio.StreamReader | None: ...
    @property
    def stderr(self) -> asyncio.StreamReader | None: ...
    async def wait(self) -> int: ...


# --- the zygote process ----------------------------------------------------------------------


def fork_hazards() -> list[str]:
    """Why forking this process would not give a clean trainer (empty: it would)."""
    out = []
    if threading.active_count() > 1:
        names = ", ".join(t.name for t in threading.enumerate() if t is not threading.main_thread())
        out.append(f"{threading.active_count() - 1} Python thread(s) running: {names}")
    if "jax" in sys.modules:
        bridge = sys.modules.get("jax._src.xla_bridge")
        if getattr(bridge, "_backends", None):
            out.append("jax has initialised its backends")
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(Exception):
            if torch.cuda.is_initialized():
                out.append("torch has initialised CUDA")
    return out


def native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.send(json.dumps(msg).encode())


def serve(sock: socket.socket) -> dict[str, Any] | None:
    """Fork trainers on order until the agent closes the socket (then None). Returns the
    activation order in a forked trainer, whose process is set up: the caller runs the script."""
    while True:
        msg, fds, _flags, _addr = socket.recv_fds(sock, MAX_ORDER, 1)
        if not msg:
            for fd in fds:
                os.close(fd)
            return None
        try:
            order = json.loads(msg)
            if len(fds) != 1:
                raise ZygoteError(f"a fork order needs 1 descriptor, got {len(fds)}")
            if hazards := fork_hazards():
                raise ZygoteUnsafe("; ".join(hazards))
            pid = _fork(int(order["parent"]), sock)
            if pid is None:  # in the trainer: it keeps its end of the agent's socket
                return _await_activation(fds.pop())
        except Exception as e:  # the zygote lives on; the agent starts that trainer cold
            _send(sock, {"op": "error", "error": f"{type(e).__name__}: {e}"})
            continue
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        _send(sock, {"op": "forked", "pid": pid})


def _fork(parent: int, sock: socket.socket) -> int | None:
    """In the zygote: the new trainer's pid, once it waits in its own session as the agent's
    child. In the trainer: None."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        middle = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        raise
    if middle == 0:  # the middle process: fork the trainer, then exit to orphan it
        try:
            trainer = os.fork()
        except BaseException:
            os._exit(1)
        if trainer:
            os._exit(0)
        try:
            _detach(parent, sock, r, w)
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        return None
    os.close(w)
    try:
        os.waitpid(middle, 0)
        ready, _, _ = select.select([r], [], [], 30.0)
        data = os.read(r, 32) if ready else b""
    finally:
        os.close(r)
    if not data:
        raise ZygoteError("the forked trainer did not start (not re-parented to the agent?)")
    return int(data)


def _detach(parent: int, sock: socket.socket, r: int, w: int) -> None:
    """In a new trainer: become the agent's child in a session of its own, then say so."""
    os.setsid()  # first: the agent signals the trainer's group as soon as it knows the pid
    deadline = time.monotonic() + 10.0
    while os.getppid() != parent:  # the middle process is exiting; the kernel re-parents us
        if time.monotonic() > deadline:
            os._exit(1)
        time.sleep(0.0002)
    die_with_parent(signal.SIGKILL)  # only now: set earlier, the middle's exit would fire it
    if os.getppid() != parent:  # the agent died in between
        os._exit(1)
    os.close(r)
    sock.close()
    _default_signals()
    os.write(w, str(os.getpid()).encode())
    os.close(w)


def _await_activation(ctl_fd: int) -> dict[str, Any]:
    """In a forked trainer, waiting: the agent's order (environment, stdout and stderr) makes
    it the running trainer; EOF (the agent discarded it) ends it quietly."""
    try:
        ctl = socket.socket(fileno=ctl_fd)
        msg, fds, _flags, _addr = socket.recv_fds(ctl, MAX_ORDER, 2)
        if not msg or len(fds) != 2:
            os._exit(0)
        ctl.close()
        order = json.loads(msg)
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((devnull, 0), (fds[0], 1), (fds[1], 2)):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in order["env"].items()})
        numa.bind_self()  # --numa-bind: this rank's CPUs (agent/supervise/numa.py)
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            with contextlib.suppress(Exception):
                numpy.random.seed()  # fresh entropy, as a fresh import would draw
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    return dict(order)


def _default_signals() -> None:
    """Signal dispositions and mask as a fresh interpreter has them (handlers that native
    libraries installed at import are kept: a fresh process that imported them has them)."""
    for sig in signal.valid_signals():
        handler = signal.getsignal(sig)
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, ())


def main(argv: list[str]) -> None:
    from agent.supervise.prestarted import parse, preload, run_target

    opts, target = parse(argv, "zygote")
    control = int(opts["--control-fd"])
    # Descriptors the agent's event loop let through (duplicates of our stdio): ours to close,
    # so that no trainer holds them.
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else ():
        if int(name) > 2 and int(name) != control:
            with contextlib.suppress(OSError):
                os.close(int(name))
    sock = socket.socket(fileno=control)
    preload(opts.get("--preload", ""), "zygote")
    hazards = fork_hazards()
    _send(
        sock,
        {"op": "ready", "pid": os.getpid(), "hazards": hazards, "native_threads": native_threads()},
    )
    if hazards or serve(sock) is None:
        return
    run_target(target)  # in a forked trainer


# --- the agent's side ------------------------------------------------------------------------


class ForkedProcess:
    """A trainer forked by the zygote, the agent's own child since, waiting until ``activate``
    hands it its environment and output pipes: then the parts of ``asyncio.subprocess.Process``
    the supervisor uses. Its exit is seen through a pidfd."""

    stdin = None

    def __init__(self, pid: int, ctl: socket.socket) -> None:
        self.pid = pid
        self.ctl = ctl
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self.returncode: int | None = None
        self._loop = asyncio.get_running_loop()
        self._exited: asyncio.Future[int] = self._loop.create_future()
        # Our unreaped child: its pid cannot be reused before we reap it, so the pidfd is its.
        self._pidfd = os.pidfd_open(pid)
        self._loop.add_reader(self._pidfd, self._on_exit)

    def _on_exit(self) -> None:
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # reaped by someone else: the status is lost
            pid, code = self.pid, 255
        else:
            if pid == 0:
                return
            code = os.waitstatus_to_exitcode(status)
        self._loop.remove_reader(self._pidfd)
        os.close(self._pidfd)
        self.returncode = code
        self.ctl.close()
        if not self._exited.done():
            self._exited.set_result(code)

    @property
    def waiting(self) -> bool:
        """Forked and not yet activated, and still there."""
        return self.returncode is None and self.ctl.fileno() >= 0

    async def activate(self, env: dict[str, str]) -> None:
        """Make it the running trainer: ``env``, and pipes for its stdout and stderr."""
        if not self.waiting:
            raise ZygoteError("the forked trainer is gone")
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            socket.send_fds(self.ctl, [json.dumps({"env": env}).encode()], [out_w, err_w])
        except OSError as e:
            os.close(out_r)
            os.close(err_r)
            raise ZygoteError(f"the forked trainer is gone: {e}") from None
        finally:
            os.close(out_w)
            os.close(err_w)
            self.ctl.close()
        self.stdout, self.stderr = await _pipe_reader(out_r), await _pipe_reader(err_r)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    async def discard(self) -> None:
        """End it (a waiting trainer exits on EOF; SIGKILL in case) and reap it."""
        self.ctl.close()
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
        await self.wait()


async def _pipe_reader(fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**16, loop=loop)  # asyncio.subprocess's default
    pipe = os.fdopen(fd, "rb", buffering=0)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop), pipe)
    return reader


class Zygote:
    """The agent's handle on its fork server."""

    def __init__(self, proc: asyncio.subprocess.Process, sock: socket.socket) -> None:
        self.proc = proc
        self.sock = sock
        self.native_threads = 0
        self._ready = asyncio.create_task(self._hello(), name="marduk-agent-zygote-hello")
        # Its failure is wait_ready's to raise; retrieved here too, in case none waits.
        self._ready.add_done_callback(lambda t: t.cancelled() or t.exception())
        self._lock = asyncio.Lock()

    @classmethod
    async def start(
        cls, python: str, target: list[str], preload: list[str], env: dict[str, str]
    ) -> Zygote:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = await asyncio.create_subprocess_exec(
                *(python, "-m", "agent.supervise.zygote", "--control-fd", str(theirs.fileno())),
                *("--preload", ",".join(preload), "--", *target),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                env=env,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                # Forked from the event loop's (main) thread: the re-parented trainers' parent
                # thread, whose exit fires their PR_SET_PDEATHSIG, is the agent's main thread.
                preexec_fn=functools.partial(die_with_parent, signal.SIGKILL),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        return cls(proc, ours)

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None and self.sock.fileno() >= 0

    async def _hello(self) -> None:
        msg = await asyncio.get_running_loop().sock_recv(self.sock, MAX_ORDER)
        if not msg:
            raise ZygoteError("the fork server exited while importing")
        hello = json.loads(msg)
        if hello.get("hazards"):
            raise ZygoteUnsafe("; ".join(hello["hazards"]))
        self.native_threads = int(hello.get("native_threads", 0))

    async def wait_ready(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except TimeoutError:
            raise ZygoteError(f"the fork server was not ready within {timeout:g}s") from None

    async def fork(self, timeout: float = 30.0) -> ForkedProcess:
        """A new trainer, forked and waiting for ``activate``; this process's child."""
        async with self._lock:
            return await self._fork(timeout)

    async def _fork(self, timeout: float) -> ForkedProcess:
        if not self.alive:
            raise ZygoteError("the fork server is not running")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The trainer is orphaned when the zygote's middle process exits: a subreaper adopts
        # it. Only for this moment, so that no other orphan is ours to reap.
        libc = ctypes.CDLL(None, use_errno=True)
        was_subreaper = ctypes.c_int(0)
        libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(was_subreaper), 0, 0, 0)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            ours.close()
            theirs.close()
            raise ZygoteError("cannot become a child subreaper (prctl)")
        try:
            try:
                order = json.dumps({"op": "fork", "parent": os.getpid()}).encode()
                socket.send_fds(self.sock, [order], [theirs.fileno()])
            finally:
                theirs.close()
            msg = await asyncio.wait_for(
                asyncio.get_running_loop().sock_recv(self.sock, MAX_ORDER), timeout
            )
        except BaseException as e:
            ours.close()
            await self.close()  # its state is unknown now
            if isinstance(e, OSError | TimeoutError):
                raise ZygoteError(f"the fork server did not answer: {e!r}") from None
            raise
        finally:
            if not was_subreaper.value:
                libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        reply = json.loads(msg) if msg else {"op": "error", "error": "the fork server exited"}
        if reply.get("op") != "forked":
            ours.close()
            error = str(reply.get("error", reply))
            if not msg:
                await self.close()
            raise (ZygoteUnsafe if error.startswith("ZygoteUnsafe") else ZygoteError)(error)
        pid = int(reply["pid"])
        try:
            return ForkedProcess(pid, ours)
        except OSError:  # no pidfd: end the fork, ours to reap
            ours.close()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                await asyncio.to_thread(os.waitpid, pid, 0)
            raise

    async def close(self) -> None:
        """Stop the fork server (its trainers, not its children, live on). Safe to call twice."""
        self._ready.cancel()
        self.sock.close()
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()


if __name__ == "__main__":
    main(sys.argv[1:])
